"""Training throughput on real Multi30k batches: two settings side by side, in one process.

Measures target tokens per second of whole training updates (forward,
backward, clipping, Adam step) through the trainer's `UpdateStep`, the code
path `seq2seq train` runs, with the setting under test replaced in it.
`--compare precision` (the default) sets fp32 against
bf16 autocast; `--compare attention` sets PyTorch's two CPU attention kernels
against each other in the precision `train.precision=auto` picks on this
CPU (bf16 with native bf16 instructions, else fp32): flash, which `scaled_dot_product_attention`
picks by itself when attention dropout is 0, and math (matmul, softmax,
matmul), which the trainer asks for on CPU (`seq2seq.model.training_kernel`);
`--compare rdrop` sets plain updates against R-Drop's (`optim.rdrop_alpha`),
also in the `auto` precision; `--compare compile` sets the eager model against
`torch.compile(model, dynamic=True)` (batches differ in shape), and prints the
compiled model's first update (the compilation) and its number of graphs;
`--compare linear` sets float32 linears in MKL (PyTorch's default GEMM) against oneDNN's
(`seq2seq.model.linear`, the path on AMD CPUs with AVX-512);
`--compare batching` sets batches cut from pairs sorted by their longer side
only against the trainer's, whose pairs of equal longer side are also sorted
by target and source length (`seq2seq.text.corpus.bucket`): the same update on
batches of the same token budget with less padding. Its batches differ, so it
times the first `--rounds x --steps` batches of each epoch order and also
prints the padding of each order over the whole epoch.
`--compare trainer` sets the whole `seq2seq train` loop of `--config` (data loading with its
subword sampling and workers, the update, logging, the progress bar, the stop checks; no
validation) against its isolated `UpdateStep` on the very batches the loop fed it, round by
round: the loop runs `--steps` updates, then the update step alone runs those batches again.
Its last line is the loop's share of the update's speed ("ratio"); `--set KEY=VALUE ...`
overrides the config (e.g. `--set data.sampling_alpha=0 train.num_workers=2`).
With `--device cuda`, `--compare gpu-precision` sets fp32 against bf16
autocast and `--compare gpu-attention` sets the trainer's attention kernels
in bf16 (every CUDA kernel but cuDNN's) against PyTorch's whole choice, which
includes cuDNN's: each round's batches are new to it, so the graph cuDNN
builds for each new shape is timed, as in a first epoch.
Models:

- quickstart: configs/quickstart.yaml (3+3 layers, d_model 256, d_ff 512 on every machine, its fp32 width;
  1024 when the figures below were measured)
- tiny: 4+4 layers, d_model 128, d_ff 256 (the shape of fairseq's transformer_tiny)
- big: 6+6 layers, d_model 512, 8 heads, d_ff 2048
- small: 6+6 layers, d_model 512, 4 heads, d_ff 1024 (the peer suite's iwslt-small); not in the default list
- rope, relative, rmsnorm: the quickstart shape with that position or norm variant
- rnn, rnn_attention: the RNNs of configs/m30k_de_en_rnn*.yaml (LSTM 2+2, hidden 512); not in the default list

This machine's speed drifts by up to 3x within minutes, so the settings are
interleaved round by round (the order alternating) on the same batches, and
each round yields a ratio (second setting over first); the report gives medians. Compare
numbers only within one run.

    .venv/bin/python scripts/bench/bench_train.py --rounds 5 --steps 2
    .venv/bin/python scripts/bench/bench_train.py --spm runs/quickstart/spm.model --models big

What it found on the development machine (AMD EPYC, 2 cores, torch 2.13 CPU,
avx512_bf16 but no AMX; `--rounds 5 --steps 2`, batches of 3,686 target
tokens, medians) decides `train.precision=auto` on CPU, see
`seq2seq.device.resolve_precision`:

    matmul 4096x512 @ 512x2048: fp32 154 GFLOP/s, bf16 822 GFLOP/s (5.33x)
    quickstart (7.6M): fp32 1,994 tok/s, bf16 3,305 tok/s, ratio 1.66 (1.50-1.77)
    big (48.2M):       fp32   428 tok/s, bf16 1,061 tok/s, ratio 2.36 (2.13-2.57)
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import logging
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple, cast

import numpy as np
import torch
from torch.nn.attention import SDPBackend

from seq2seq.config import ExperimentConfig, load_config
from seq2seq.device import resolve_precision
from seq2seq.errors import run_script
from seq2seq.model import Kernels, training_kernel
from seq2seq.model import linear as linear_module
from seq2seq.text.corpus import Batch, bucket, collate_pairs, read_parallel
from seq2seq.text.tokenizer import Tokenizer, train_tokenizer
from seq2seq.training.assembly import TrainingRun, assemble
from seq2seq.training.epochs import epoch_seed
from seq2seq.training.trainer import Trainer
from seq2seq.training.update import Launched, UpdateStats, UpdateStep

ROOT = Path(__file__).resolve().parents[2]


MODELS = {
    "quickstart": ["model.transformer.d_ff=512"],  # on every machine: the file's bf16 block would widen it
    "tiny": [
        "model.d_model=128",
        "model.transformer.n_heads=4",
        "model.transformer.d_ff=256",
        "model.transformer.encoder_layers=4",
        "model.transformer.decoder_layers=4",
    ],
    "big": [
        "model.d_model=512",
        "model.transformer.n_heads=8",
        "model.transformer.d_ff=2048",
        "model.transformer.encoder_layers=6",
        "model.transformer.decoder_layers=6",
    ],
    "small": [  # the peer suite's iwslt-small (../shared/bench-peers)
        "model.d_model=512",
        "model.transformer.n_heads=4",
        "model.transformer.d_ff=1024",
        "model.transformer.encoder_layers=6",
        "model.transformer.decoder_layers=6",
    ],
    # the quickstart shape with the other positions and norms, and the RNNs of configs/m30k_de_en_rnn*.yaml
    "rope": ["model.transformer.positions=rope"],
    "relative": ["model.transformer.positions=relative"],
    "rmsnorm": ["model.transformer.norm_type=rmsnorm"],
    "rnn": ["model.arch=rnn", "model.transformer=null", "model.rnn.attention=none"],
    "rnn_attention": ["model.arch=rnn", "model.transformer=null", "model.rnn.attention=general"],
}
TRAINERS = "trainer's"  # the attention kernel the trainer picks (seq2seq.model.training_kernel)


class Setting(NamedTuple):
    precision: str = "auto"
    kernel: Kernels | str = TRAINERS  # None: PyTorch's choice
    rdrop: float = 0.0  # optim.rdrop_alpha
    compiled: bool = False  # torch.compile the model
    onednn: bool | None = None  # float32 linears through oneDNN (True), MKL (False), or the CPU's rule (None)


SETTINGS: dict[str, dict[str, Setting]] = {
    "precision": {"fp32": Setting("fp32", SDPBackend.MATH), "bf16": Setting("bf16", SDPBackend.MATH)},
    "attention": {"flash": Setting(kernel=SDPBackend.FLASH_ATTENTION), "math": Setting(kernel=SDPBackend.MATH)},
    "rdrop": {"plain": Setting(), "rdrop": Setting(rdrop=5.0)},
    "compile": {"eager": Setting(), "compiled": Setting(compiled=True)},
    "batching": {"longer-side": Setting(), "both-sides": Setting()},
    "gpu-precision": {"fp32": Setting("fp32"), "bf16": Setting("bf16")},
    "gpu-attention": {"trainer's": Setting("bf16"), "pytorch": Setting("bf16", None)},
    "trainer": {"update step": Setting(), "seq2seq train": Setting()},
    "linear": {"mkl": Setting("fp32", onednn=False), "onednn": Setting("fp32", onednn=True)},
}


def main() -> None:
    args = _parse()
    torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger().handlers[0].setLevel(logging.WARNING)  # the run log goes to the temporary run dir
    device = torch.device(args.device)
    where = f", GPU: {torch.cuda.get_device_name(device)}" if device.type == "cuda" else ""
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU: {_cpu()}{where}")
    if args.compare == "precision":
        _bench_matmul(args.rounds)
    if args.compare == "trainer":
        _bench_trainer(args)
        return
    tokenizer = _tokenizer(args)
    for name in args.models:
        with tempfile.TemporaryDirectory() as run_dir:
            parts = assemble(_config(args, name, run_dir), tokenizer)  # the parts `seq2seq train` would run
            try:
                _bench(parts, name, args)
            finally:
                parts.close()


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default=str(ROOT / "data/multi30k"), help="Multi30k directory (train.de/en[.gz])")
    p.add_argument("--langs", default="de,en", help="source and target file suffixes (default: de,en)")
    p.add_argument("--spm", help="a shared SentencePiece model (e.g. RUN/spm.model); default: train one")
    p.add_argument("--models", nargs="+", default=["quickstart", "tiny", "big"], choices=list(MODELS))
    p.add_argument("--max-tokens", type=int, default=4096, help="batch token budget (padded, larger side)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds per model")
    p.add_argument("--steps", type=int, default=3, help="timed updates per setting per round")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--compare", choices=list(SETTINGS), default="precision")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument(
        "--config", default=str(ROOT / "configs/quickstart.yaml"), help="--compare trainer: the run's config"
    )
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="--compare trainer: config overrides")
    p.add_argument("--warmup", type=int, default=5, help="--compare trainer: untimed updates first")
    args = p.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here")
    if args.compare.startswith("gpu-") and args.device != "cuda":
        p.error(f"--compare {args.compare} needs --device cuda")
    return args


def _cpu() -> str:
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown"
    model = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "?")
    flags = set(next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), []))
    wanted = ["avx512f", "avx512_bf16", "amx_bf16", "amx_tile"]
    return f"{model}; " + ", ".join(f"{f}={'yes' if f in flags else 'no'}" for f in wanted)


def _tokenizer(args: argparse.Namespace) -> Tokenizer:
    if args.spm:
        return Tokenizer(Path(args.spm).read_bytes())
    t0 = time.perf_counter()
    src_lang, tgt_lang = args.langs.split(",")
    src, tgt = read_parallel(args.data, "train", src_lang, tgt_lang)
    tokenizer = train_tokenizer(src, tgt, 8000, shared=True)
    print(f"trained an 8000-piece SentencePiece model in {time.perf_counter() - t0:.0f} s")
    return tokenizer


def _config(args: argparse.Namespace, name: str, run_dir: str) -> ExperimentConfig:
    overrides = [
        f"data.dir={args.data}",
        f"data.src_lang={args.langs.split(',')[0]}",
        f"data.tgt_lang={args.langs.split(',')[1]}",
        f"train.run_dir={run_dir}",
        f"train.device={args.device}",
        "validation.bleu=false",
        f"train.max_tokens={args.max_tokens}",
        f"train.threads={args.threads}",
        *MODELS[name],
    ]
    return load_config(ROOT / "configs/quickstart.yaml", overrides)


def _bench(parts: TrainingRun, name: str, args: argparse.Namespace) -> None:
    """Interleave the two settings round by round on the same batches; print per-round rates and medians."""
    settings = SETTINGS[args.compare]
    first, second = settings
    n = args.steps * args.rounds
    if args.compare == "batching":
        batches_of = {s: _epoch_batches(parts, ties=s == "both-sides", n=n) for s in settings}
    else:
        batches_of = dict.fromkeys(settings, [parts.epochs.batch(1, j) for j in range(n)])
    n_params = sum(p.numel() for p in parts.model.parameters()) / 1e6
    mean_tokens = statistics.mean(b.n_tokens for b in batches_of[first])
    print(f"\n{name}: {n_params:.1f}M parameters, batches of {mean_tokens:.0f} target tokens on average")
    updates = {s: _with_linears(settings[s].onednn, _update_step(parts, settings[s])) for s in settings}
    steps = itertools.count(1)
    for s in settings:  # warm-up: kernel selection, allocator, compilation
        start = time.perf_counter()
        _rate(updates[s], parts, steps, batches_of[s][:1])
        print(f"  first update, {s}: {time.perf_counter() - start:.1f} s")
    rates: dict[str, list[float]] = {s: [] for s in settings}
    ratios = []
    for r in range(args.rounds):
        chunk = slice(r * args.steps, (r + 1) * args.steps)
        order = [first, second] if r % 2 == 0 else [second, first]
        now = {s: _rate(updates[s], parts, steps, batches_of[s][chunk]) for s in order}
        for s in settings:
            rates[s].append(now[s])
        ratios.append(now[second] / now[first])
        print(
            f"  round {r + 1}: "
            + ", ".join(f"{s} {now[s]:.0f} tok/s" for s in settings)
            + f", {second}/{first} {ratios[-1]:.2f}"
        )
    medians = ", ".join(f"{s} {statistics.median(rates[s]):.0f} tok/s" for s in settings)
    print(
        f"  median: {medians}; {second}/{first} ratio median {statistics.median(ratios):.2f} "
        f"(min {min(ratios):.2f}, max {max(ratios):.2f})"
    )
    if args.compare == "compile":
        from torch._dynamo.utils import counters

        graphs, breaks = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
        print(f"  compiled graphs: {graphs}, graph breaks: {breaks}")


class _RoundDone(Exception):
    """Raised from inside the loop once every round is measured: the run ends there, unvalidated."""


class _TimedLoop:
    """Stands in for the run's `UpdateStep`: lets the loop run `steps` updates a round, timing them from
    the first update's launch to the launch after the last one (so the loop's fetch of each batch is inside),
    then runs the same batches through the update step alone, outside the loop's timeline."""

    def __init__(self, update: UpdateStep, parts: TrainingRun, args: argparse.Namespace) -> None:
        self.update, self.parts, self.args = update, parts, args
        self.sync = torch.cuda.synchronize if parts.device.type == "cuda" else lambda: None
        self.calls, self.round_start = 0, 0.0
        self.batches: list[tuple[list[Batch], int, float]] = []
        self.loop: list[float] = []
        self.alone: list[float] = []

    def __getattr__(self, name: str) -> object:  # optimizer, scaler, ... for the run's checkpoints
        return getattr(self.update, name)

    def launch(self, batches: list[Batch], step: int, lr: float) -> Launched:
        a = self.args
        self.calls += 1
        if self.calls > a.warmup and len(self.batches) == a.steps:  # a round of the loop has ended
            self.sync()
            seconds = time.perf_counter() - self.round_start
            tokens = sum(b.n_tokens for group, _, _ in self.batches for b in group)
            self.loop.append(tokens / seconds)
            self.alone.append(self._alone(tokens))
            r = len(self.loop)
            print(
                f"  round {r}: update step {self.alone[-1]:.0f} tok/s, seq2seq train {self.loop[-1]:.0f} tok/s, "
                f"ratio {self.loop[-1] / self.alone[-1]:.2f}",
                flush=True,
            )
            self.batches = []
            if r == a.rounds:
                raise _RoundDone
        if self.calls == a.warmup + 1 or (self.calls > a.warmup and not self.batches):
            self.sync()
            self.round_start = time.perf_counter()
        if self.calls > a.warmup:
            self.batches.append((batches, step, lr))
        return self.update.launch(batches, step, lr)

    def _alone(self, tokens: int) -> float:
        self.sync()
        start = time.perf_counter()
        for group, step, lr in self.batches:
            self.update(group, step, lr)
        self.sync()
        return tokens / (time.perf_counter() - start)


def _bench_trainer(args: argparse.Namespace) -> None:
    """`seq2seq train`'s loop against its own update step on the same batches, interleaved round by round."""
    with tempfile.TemporaryDirectory() as run_dir:
        overrides = [
            f"data.dir={args.data}",
            f"train.run_dir={run_dir}",
            f"train.device={args.device}",
            f"train.threads={args.threads}",
            "validation.every=1000000000",  # no validation inside the measured updates
            "checkpoint.every=0",
            *args.set,
        ]
        cfg = load_config(args.config, overrides)
        t0 = time.perf_counter()
        parts = assemble(cfg)
        d, t = cfg.data, cfg.train
        params = sum(p.numel() for p in parts.model.parameters())
        print(f"\n{args.config} {' '.join(args.set)}: set up in {time.perf_counter() - t0:.0f} s")
        print(
            f"  {params / 1e6:.1f}M parameters, "
            f"{parts.update.precision}, max_tokens {t.max_tokens}, update_freq {t.update_freq}, "
            f"sampling_alpha {d.sampling_alpha}, num_workers {t.num_workers}"
        )
        timed = _TimedLoop(parts.update, parts, args)
        parts.update = timed  # type: ignore[assignment]
        trainer = Trainer(parts)
        try:
            trainer.fit()
        except _RoundDone:
            pass
        finally:
            trainer.close()
    if len(timed.loop) < args.rounds:
        raise SystemExit(f"the run ended after {len(timed.loop)} of {args.rounds} rounds: raise its limits")
    ratios = [loop / alone for loop, alone in zip(timed.loop, timed.alone)]
    print(
        f"  median: update step {statistics.median(timed.alone):.0f} tok/s, "
        f"seq2seq train {statistics.median(timed.loop):.0f} tok/s"
    )
    _utilisation(params, statistics.median(timed.loop), timed.update.precision, timed.parts.device)
    print(
        f"ratio (seq2seq train / its update step): {statistics.median(ratios):.2f} median of {len(ratios)} rounds "
        f"(min {min(ratios):.2f}, max {max(ratios):.2f})"
    )


def _utilisation(params: int, tokens_per_s: float, precision: str, device: torch.device) -> None:
    """Model FLOPs utilisation: 6 x parameters x target tokens/s (forward and backward) against a large
    matmul of the run's precision measured here (8192^3 on CUDA; 4096x512 @ 512x2048 on the CPU)."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32)
    m, k, n = (8192, 8192, 8192) if device.type == "cuda" else (4096, 512, 2048)
    a, b = torch.randn(m, k, device=device, dtype=dtype), torch.randn(k, n, device=device, dtype=dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    best = 0.0
    for _ in range(3):
        a @ b
        sync()
        start, reps = time.perf_counter(), 10
        for _ in range(reps):
            a @ b
        sync()
        best = max(best, 2 * m * k * n * reps / (time.perf_counter() - start))
    model = 6 * params * tokens_per_s
    print(
        f"  model FLOPs utilisation: {model / best:.1%} (6 x {params / 1e6:.1f}M parameters x {tokens_per_s:.0f} "
        f"tok/s = {model / 1e12:.2f} TFLOP/s; a {m}x{k} @ {k}x{n} {precision} matmul: {best / 1e12:.2f} TFLOP/s)"
    )


def _epoch_batches(parts: TrainingRun, ties: bool, n: int) -> list[Batch]:
    """n batches (a random sample) of epoch 1: the trainer's, or (ties=False) cut from the same shuffle sorted by
    the longer side only; prints the padding share of each side over the whole epoch."""
    epochs, corpus = parts.epochs, parts.epochs.corpus
    if ties:
        order, bounds = epochs.batches(1).order, epochs.batches(1).bounds
    else:
        order, bounds = bucket(corpus.lengths, epochs.max_tokens, epoch_seed(epochs.seed, 1))
    sizes = np.diff(bounds)
    shares = []
    for side in (corpus.side_lengths[1], corpus.side_lengths[0]):  # source, target
        longest = np.maximum.reduceat(side[order], bounds[:-1])  # per batch
        shares.append(1 - int(side.sum()) / int((longest.astype(np.int64) * sizes).sum()))
    label = "trainer's (both sides)" if ties else "longer side only"
    print(f"  {label}: {len(sizes)} batches, padding {shares[0]:.1%} of the source positions and")
    print(f"    {shares[1]:.1%} of the target positions over the whole epoch (EOS counted)")
    sample = np.random.default_rng(0).permutation(len(sizes))[:n]
    pairs = ([corpus.ids(int(i)) for i in order[bounds[b] : bounds[b + 1]]] for b in sample)
    return [collate_pairs([s for s, _ in p], [t for _, t in p]) for p in pairs]


def _bench_matmul(rounds: int) -> None:
    """GFLOP/s of one feed-forward-sized matmul (4096 x 512 @ 512 x 2048) in fp32 and bf16, interleaved."""
    a, b = torch.randn(4096, 512), torch.randn(512, 2048)
    speeds: dict[str, list[float]] = {"fp32": [], "bf16": []}
    for _ in range(rounds):
        for name, (x, y) in (("fp32", (a, b)), ("bf16", (a.bfloat16(), b.bfloat16()))):
            x @ y  # warm-up
            start, n = time.perf_counter(), 5
            for _ in range(n):
                x @ y
            speeds[name].append(2 * 4096 * 512 * 2048 * n / (time.perf_counter() - start) / 1e9)
    fp32, bf16 = statistics.median(speeds["fp32"]), statistics.median(speeds["bf16"])
    print(f"matmul 4096x512 @ 512x2048: fp32 {fp32:.0f} GFLOP/s, bf16 {bf16:.0f} GFLOP/s ({bf16 / fp32:.2f}x)")


def _update_step(parts: TrainingRun, setting: Setting) -> UpdateStep:
    """The run's update (same model and optimizer) with one setting changed; `auto` is this device's choice."""
    precision = resolve_precision(setting.precision, parts.device)
    kernel = setting.kernel
    if kernel == TRAINERS:
        kernel = training_kernel(parts.device, precision)
    assert not isinstance(kernel, str)
    model = torch.compile(parts.model, dynamic=True) if setting.compiled else parts.model  # the same parameters
    return dataclasses.replace(
        parts.update, model=model, precision=precision, attention_kernel=kernel, rdrop_alpha=setting.rdrop
    )


def _rate(update: UpdateStep, parts: TrainingRun, steps: Iterator[int], batches: list[Batch]) -> float:
    """Target tokens per second of full training updates, one batch per update."""
    synchronize = torch.cuda.synchronize if parts.device.type == "cuda" else lambda: None
    synchronize()
    start = time.perf_counter()
    for batch in batches:
        step = next(steps)
        update([batch], step, parts.lr(step))
    synchronize()
    return sum(b.n_tokens for b in batches) / (time.perf_counter() - start)


def _with_linears(onednn: bool | None, update: UpdateStep) -> UpdateStep:
    """The update with float32 linears forced through oneDNN or MKL (`seq2seq.model.linear.USE_ONEDNN`)."""
    if onednn is None:
        return update

    def run(batches: list[Batch], step: int, lr: float) -> UpdateStats | None:
        saved, linear_module.USE_ONEDNN = linear_module.USE_ONEDNN, onednn
        try:
            return update(batches, step, lr)
        finally:
            linear_module.USE_ONEDNN = saved

    return cast(UpdateStep, run)


if __name__ == "__main__":
    run_script("bench_train", main)
