"""Where a training update's time goes: matmul, attention, dropout, normalisation, loss, optimizer, the rest.

Runs the update `seq2seq train` runs (`UpdateStep`: forward, the closed-form
label-smoothed loss, backward, clipping, fused Adam) on random batches of a
fixed shape under `torch.profiler`, and sorts the self CPU time of every
operator into a few buckets, so that each speed change can be justified by
the share it attacks. Shapes: the quickstart's before its feed-forward width
was halved (3+3, d256, ffn 1024) and a 6+6 d512 one; the batch is about 4,000 target tokens, as in the recipes.

    .venv/bin/python scripts/bench/profile_train.py --models quickstart big --steps 5 --threads 2

Prints, per model, the share of each bucket, the ten costliest operators and
the rate of the matmuls (their floating-point operations over their time)
against a plain matmul of a feed-forward layer's size timed alone: where the
two are close, matmul runs at the hardware's rate, and only the other
buckets can still be made faster. Buckets go by operator name, so "rest"
holds the elementwise work whose purpose the name does not tell (residual
adds, dropout's mask multiply, the activation, gradient accumulation
copies; `addmm` copies its bias into the output first, which shows as
`copy_`). Profiling adds overhead per operator, so the shares of small
operators are upper bounds.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from seq2seq.config import ExperimentConfig, ModelConfig, OptimConfig, TrainConfig, TransformerConfig
from seq2seq.device import resolve_precision
from seq2seq.errors import run_script
from seq2seq.model import build_model
from seq2seq.text.corpus import Batch
from seq2seq.text.vocab import BOS, EOS, PAD
from seq2seq.training.optim import build_optimizer, lr_schedule
from seq2seq.training.update import UpdateStep

ROOT = Path(__file__).resolve().parents[2]


MODELS = {
    "quickstart": ModelConfig(d_model=256, transformer=TransformerConfig(n_heads=4, d_ff=1024, encoder_layers=3)),
    "big": ModelConfig(
        d_model=512, transformer=TransformerConfig(n_heads=8, d_ff=1024, encoder_layers=6, decoder_layers=6)
    ),
}
# operator-name fragments -> bucket, first match wins (names as torch.profiler reports them)
BUCKETS = [
    ("loss", ("logsumexp", "log_softmax", "gather", "scatter", "_SmoothedCrossEntropy", "SymmetricKL")),
    ("attention", ("scaled_dot_product", "_flash_attention", "_efficient_attention", "softmax", "baddbmm", "bmm")),
    ("matmul", ("addmm", "mm", "matmul", "linear")),
    ("dropout", ("dropout", "bernoulli", "native_dropout", "rand", "uniform_")),  # random_: seq2seq.model.dropout
    ("normalisation", ("layer_norm", "rms_norm")),
    ("optimizer", ("adam", "_fused", "foreach", "clip_grad", "norm", "zero_")),
    ("embedding", ("embedding",)),
]


def bucket(name: str) -> str:
    lowered = name.lower()
    for label, fragments in BUCKETS:
        if any(f in lowered for f in fragments):
            return label
    return "rest"


def random_batch(vocab: int, sentences: int, length: int, generator: torch.Generator) -> Batch:
    """A padded batch of random sentences of lengths up to `length` (both sides EOS-terminated)."""
    lengths = torch.randint(length // 2, length + 1, (sentences,), generator=generator)
    src = torch.full((sentences, length + 1), PAD)
    tgt_out = torch.full((sentences, length + 1), PAD)
    for row, n in enumerate(lengths.tolist()):
        src[row, :n] = torch.randint(4, vocab, (n,), generator=generator)
        src[row, n] = EOS
        tgt_out[row, :n] = torch.randint(4, vocab, (n,), generator=generator)
        tgt_out[row, n] = EOS
    tgt_in = torch.cat([torch.full((sentences, 1), BOS), tgt_out[:, :-1]], dim=1).masked_fill(tgt_out == PAD, PAD)
    return Batch(src, src == PAD, tgt_in, tgt_out, int((tgt_out != PAD).sum()))


def profile_model(name: str, args: argparse.Namespace) -> None:
    train, optim = TrainConfig(device="cpu", precision=args.precision), OptimConfig(clip_norm=1.0)
    cfg = ExperimentConfig(model=MODELS[name], train=train, optim=optim)
    device, precision = torch.device("cpu"), resolve_precision(args.precision, torch.device("cpu"))
    torch.manual_seed(0)
    model = build_model(cfg.model, args.vocab, args.vocab).train()
    optimizer = build_optimizer(model, optim)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    update = UpdateStep.from_config(train, optim, model, optimizer, scaler, device, precision)
    lr = lr_schedule(optim, train, cfg.model.d_model, updates_per_epoch=1000)
    generator = torch.Generator().manual_seed(0)
    batches = [random_batch(args.vocab, args.sentences, args.length, generator) for _ in range(args.steps + 2)]
    for step, batch in enumerate(batches[:2], start=1):  # warm-up: allocator, kernel choice
        update([batch], step, lr(step))
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for step, batch in enumerate(batches[2:], start=3):
            update([batch], step, lr(step))
    report(name, precision, prof, batches[2:])


def report(name: str, precision: str, prof: profile, batches: list[Batch]) -> None:
    per_bucket: dict[str, float] = defaultdict(float)
    per_op: dict[str, float] = defaultdict(float)
    for event in prof.key_averages():
        per_bucket[bucket(event.key)] += event.self_cpu_time_total
        per_op[event.key] += event.self_cpu_time_total
    total = sum(per_bucket.values()) or 1.0
    tokens = sum(b.n_tokens for b in batches)
    print(
        f"\n{name} ({precision}): {len(batches)} updates of {tokens / len(batches):.0f} target tokens, "
        f"{total / 1e6:.2f} s of operator time ({tokens / (total / 1e6):.0f} tokens/s under the profiler)"
    )
    for label, micros in sorted(per_bucket.items(), key=lambda kv: -kv[1]):
        print(f"  {label:14s} {100 * micros / total:5.1f}%")
    print("  costliest operators:")
    for op, micros in sorted(per_op.items(), key=lambda kv: -kv[1])[:10]:
        print(f"    {op:40s} {100 * micros / total:5.1f}%  ({bucket(op)})")
    flops, micros = matmul_work(prof)
    print(
        f"  matmul rate: {flops / micros / 1e3:.0f} GFLOP/s in the model's matmuls; "
        f"a 4096x512 @ 512x1024 matmul alone: {plain_matmul_rate():.0f} GFLOP/s"
    )


def matmul_work(prof: profile) -> tuple[float, float]:
    """(floating-point operations, microseconds) of the 2-D matmuls (mm, addmm) the profile recorded."""
    flops = micros = 0.0
    for event in prof.key_averages(group_by_input_shape=True):
        shapes = event.input_shapes
        if event.key == "aten::mm" and len(shapes) >= 2:
            (m, k), n = shapes[0], shapes[1][-1]
        elif event.key == "aten::addmm" and len(shapes) >= 3:
            (m, k), n = shapes[1], shapes[2][-1]
        else:
            continue
        flops += 2.0 * m * k * n * event.count
        micros += event.self_cpu_time_total
    return flops, max(micros, 1.0)


def plain_matmul_rate(rounds: int = 5) -> float:
    """GFLOP/s of a feed-forward-sized fp32 matmul, best of `rounds` (the machine's speed drifts)."""
    a, b = torch.randn(4096, 512), torch.randn(512, 1024)
    a @ b
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(5):
            a @ b
        best = min(best, (time.perf_counter() - start) / 5)
    return 2 * 4096 * 512 * 1024 / best / 1e9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--steps", type=int, default=5, help="profiled updates per model")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16"])
    p.add_argument("--vocab", type=int, default=8000)
    p.add_argument("--sentences", type=int, default=160, help="sentences per batch")
    p.add_argument("--length", type=int, default=32, help="longest sentence per batch (subwords)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, precision {args.precision}")
    for name in args.models:
        profile_model(name, args)


if __name__ == "__main__":
    run_script("profile_train", main)
