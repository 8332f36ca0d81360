"""Decoding speed: sentences/s for greedy and beam search, one setting against its baseline, or engines side by side.

`--compare cache` (the default) times the key/value cache against no cache;
`--compare beam-stop` times beam search's exact stopping rule against stopping
once K hypotheses have finished (`decode.beam_stop`), and counts the sentences
whose best hypothesis differs;
`--compare compile` times the decoding step compiled with `torch.compile`
(dynamic shapes) against the eager step, and prints each one's first call;
`--compare attention` times PyTorch's math attention kernel, which training
asks for on CPU (`seq2seq.model.training_kernel`), against its flash kernel,
which `scaled_dot_product_attention` picks by itself elsewhere;
`--compare quantize` times `decode.quantize: int8` (the decoder's linears in
int8) against float32 on the same loaded model, and counts the sentences whose
best hypothesis differs.
The no-cache baseline (`seq2seq.decoding.uncached.uncached_search`) runs the same search
code but recomputes the decoder over the whole prefix at every step. The
machine's speed drifts (it may be shared), so the runs are interleaved, each
round in mirrored order (A B B A), and the setting/baseline ratios are taken
within each round; the report gives their medians.

    .venv/bin/python scripts/bench/bench_decode.py --checkpoint runs/bench/checkpoint_best.pt -n 1000 --rounds 3

With --fixed-length L every hypothesis is exactly L tokens long (min_len = max_len = L),
which measures the cache at a controlled length whatever the checkpoint's quality.
Without a checkpoint, --train-minutes M first trains one with configs/quickstart.yaml.

`--compare engines` puts side by side, in one process and interleaved round by
round (the order rotating): this code ("pytorch"), the code of an earlier
commit ("before", --baseline-rev, imported from git next to the working
tree's), and the checkpoint exported to CTranslate2 (seq2seq.deploy.export) in
float32 and int8. For each it reports sentences/s, the first call's latency
(one short sentence, right after loading), the peak resident memory a run adds,
the share of lines translated exactly as "pytorch" does and, given --ref,
BLEU. --shapes adds random-weight models of the peer benchmark's shapes (with
the checkpoint's vocabulary, every hypothesis forced to --shape-length tokens):

    .venv/bin/python scripts/bench/bench_decode.py --compare engines -c CKPT --src test.de.gz --ref test.en.gz \\
        --shapes checkpoint,tiny,small --rounds 3
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from bench_engines import BASELINE_REV, SHAPES, SYSTEMS
from torch.nn.attention import SDPBackend

from seq2seq.decoding.search import search
from seq2seq.decoding.translate import SearchFn, Translation, Translator, quantized
from seq2seq.decoding.uncached import uncached_search
from seq2seq.errors import run_script
from seq2seq.model import kernel_scope
from seq2seq.text.corpus import read_lines

ROOT = Path(__file__).resolve().parents[2]


# --compare -> the setting, then its baseline: (name, search function, attention kernel; None: PyTorch's choice)
Setting = tuple[str, SearchFn, SDPBackend | None]


class CompiledSteps:
    """A Transformer whose decoding sessions run the decoder through `torch.compile` (dynamic shapes: the row
    count and the cache length change from step to step), for `--compare compile`; one compiled decoder per
    model, shared by its sessions.

    Inductor cannot lower oneDNN's prepacked linears (seq2seq.model.packed), so the
    compiled step runs the modules' own weights and lets Inductor choose.
    """

    def __init__(self, model: Any) -> None:
        from seq2seq.model.transformer import DecodingPlan, Seq2SeqTransformer

        if not isinstance(model, Seq2SeqTransformer):
            raise SystemExit("bench_decode: --compare compile times a Transformer checkpoint")
        self.model = model
        self.max_positions = model.max_positions
        self.plan = DecodingPlan(model.decoder, pack=False)
        self.decoder = torch.compile(model.decoder, dynamic=True)

    def start(self, src: torch.Tensor, src_pad_mask: torch.Tensor, need_attention: bool = False) -> Any:
        plan, self.model.plan = self.model.plan, self.plan
        try:
            session = self.model.start(src, src_pad_mask, need_attention)
        finally:
            self.model.plan = plan
        session.decoder = self.decoder  # the same forward, compiled
        return session

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)


_compiled: dict[int, CompiledSteps] = {}


def compiled_search(model: Any, *args: Any, **kwargs: Any) -> Any:
    """`search` with the model's decoding step compiled (compiled once per model, on first use)."""
    if id(model) not in _compiled:
        _compiled[id(model)] = CompiledSteps(model)
    return search(_compiled[id(model)], *args, **kwargs)


_int8: dict[int, Any] = {}


def int8_search(model: Any, *args: Any, **kwargs: Any) -> Any:
    """`search` with the model as `decode.quantize: int8` decodes it (quantized once per model, on first use)."""
    if id(model) not in _int8:
        _int8[id(model)] = quantized(model, "int8")
    return search(_int8[id(model)], *args, **kwargs)


def stopping(rule: str) -> SearchFn:
    """`search` with `decode.beam_stop` set to `rule`, for `--compare beam-stop`."""

    def search_with(model: Any, src: torch.Tensor, src_pad_mask: torch.Tensor, cfg: Any, *args: Any) -> Any:
        return search(model, src, src_pad_mask, dataclasses.replace(cfg, beam_stop=rule), *args)

    return search_with


COMPARISONS: dict[str, tuple[Setting, Setting]] = {
    "beam-stop": (("exact", stopping("exact"), None), ("first_k", stopping("first_k"), None)),
    "cache": (("cached", search, None), ("uncached", uncached_search, None)),
    "attention": (("math", search, SDPBackend.MATH), ("flash", search, SDPBackend.FLASH_ATTENTION)),
    "compile": (("compiled", compiled_search, None), ("eager", search, None)),
    "quantize": (("int8", int8_search, None), ("fp32", search, None)),
}


@dataclass
class Run:
    name: str  # e.g. "beam5 cached"
    seconds: float
    sentences: int
    tokens: int  # output tokens of the best hypotheses, EOS included
    outputs: list[list[int]]

    @property
    def speed(self) -> float:
        return self.sentences / self.seconds


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", "-c", default="runs/bench/checkpoint_best.pt")
    p.add_argument("--src", default="data/multi30k/test_2016_flickr.de.gz", help="source sentences, one per line")
    p.add_argument("-n", type=int, default=1000, help="sentences to translate (the first n)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds; ratios are medians over rounds")
    p.add_argument("--beam", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=0, help="decoding batch budget in source tokens (0: checkpoint's)")
    p.add_argument("--fixed-length", type=int, default=0, help="force outputs of exactly this many tokens")
    p.add_argument("--modes", default="greedy,beam", help="comma-separated: greedy, beam")
    p.add_argument("--train-minutes", type=float, default=0, help="train a quickstart checkpoint first if missing")
    p.add_argument("--json", help="also write the results here")
    p.add_argument("--compare", choices=[*COMPARISONS, "engines"], default="cache")
    engines = p.add_argument_group("--compare engines")
    engines.add_argument("--ref", help="references of --src, for BLEU")
    engines.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated, of {', '.join(SYSTEMS)}")
    engines.add_argument("--baseline-rev", default=BASELINE_REV, help="the git revision of the 'before' system")
    engines.add_argument(
        "--shapes", default="checkpoint", help=f"comma-separated: checkpoint (the real model), {', '.join(SHAPES)}"
    )
    engines.add_argument("--shape-length", type=int, default=32, help="tokens of every hypothesis of a shape")
    engines.add_argument("--device", default="cpu", help="cpu or cuda: where pytorch, hf and CTranslate2 decode")
    engines.add_argument(
        "--batch-sentences", type=int, default=0, help="the same batches for every system: B sentences sorted by length"
    )
    return p.parse_args()


def ensure_checkpoint(path: Path, minutes: float) -> None:
    """Train a short quickstart run when the checkpoint is missing and --train-minutes allows it."""
    if path.is_file():
        return
    if minutes <= 0:
        sys.exit(f"bench_decode: no checkpoint at {path}; give --checkpoint or --train-minutes")
    command = [
        sys.executable,
        "-m",
        "seq2seq",
        "train",
        "--config",
        str(ROOT / "configs/quickstart.yaml"),
        f"train.run_dir={path.parent}",
        f"train.max_minutes={minutes}",
        "validation.bleu=false",
    ]
    print("training:", " ".join(command), file=sys.stderr)
    subprocess.run(command, check=True)


def timed(
    translator: Translator, lines: list[str], strategy: str, fn: SearchFn, kernel: SDPBackend | None, name: str
) -> Run:
    translator = translator.with_decode(strategy=strategy)
    translator.search_fn = fn
    start = time.perf_counter()
    with kernel_scope(kernel):
        results: list[Translation] = translator.translate_full(lines)
    seconds = time.perf_counter() - start
    outputs = [t.hypotheses[0].tokens if t.hypotheses else [] for t in results]
    return Run(name, seconds, len(lines), sum(len(o) for o in outputs), outputs)


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    checkpoint = Path(args.checkpoint)
    ensure_checkpoint(checkpoint, args.train_minutes)
    if args.compare == "engines":
        from bench_engines import compare_engines

        compare_engines(args, checkpoint)
        return
    settings: dict[str, Any] = {"beam_size": args.beam, "nbest": 1}
    if args.max_tokens:
        settings["max_tokens"] = args.max_tokens
    if args.fixed_length:
        L = args.fixed_length
        settings.update(min_len=L, max_len=L, max_len_a=0.0, max_len_b=L)
    translator = Translator.from_checkpoint(checkpoint, **settings)
    lines = [line for line in read_lines(args.src) if line.strip()][: args.n]
    modes = args.modes.split(",")
    setting, baseline = COMPARISONS[args.compare]
    for label, fn, kernel in (setting, baseline):
        for mode in modes:  # the first call (for "compiled": compilation) is timed apart
            first = timed(translator, lines[:1], mode, fn, kernel, "first call")
            print(f"first call, {mode}, {label}: {first.seconds:.2f} s", file=sys.stderr)
        timed(translator, lines[:8], "greedy", fn, kernel, "warm-up")

    runs: dict[str, list[Run]] = {}
    ratios: dict[str, list[float]] = {m: [] for m in modes}
    for round_ in range(args.rounds):
        for mode in modes:
            order = [setting, baseline] if round_ % 2 == 0 else [baseline, setting]  # A B, then B A: drift cancels
            this_round = {}
            for label, fn, kernel in order:
                name = f"{mode if mode == 'greedy' else f'beam{args.beam}'} {label}"
                run = timed(translator, lines, mode, fn, kernel, name)
                this_round[label] = run
                runs.setdefault(name, []).append(run)
                print(f"round {round_ + 1}: {name:18s} {run.speed:8.1f} sent/s  ({run.seconds:.1f} s)", file=sys.stderr)
            ours, base = this_round[setting[0]], this_round[baseline[0]]
            ratios[mode].append(ours.speed / base.speed)
            mismatched = sum(a != b for a, b in zip(ours.outputs, base.outputs))
            if mismatched:
                print(
                    f"warning: {mode}: {mismatched} sentences differ between {setting[0]} and {baseline[0]}",
                    file=sys.stderr,
                )
    report(args, lines, runs, ratios)


def report(
    args: argparse.Namespace, lines: list[str], runs: dict[str, list[Run]], ratios: dict[str, list[float]]
) -> None:
    fixed = f", fixed length {args.fixed_length}" if args.fixed_length else ""
    print(f"{len(lines)} sentences of {args.src}, {args.rounds} rounds, {args.threads} threads")
    print(f"checkpoint {args.checkpoint}{fixed}")
    print(f"{'run':18s} {'sent/s (median)':>16s} {'mean output tokens (+EOS)':>26s}")
    for name, group in runs.items():
        speed = statistics.median(r.speed for r in group)
        print(f"{name:18s} {speed:16.1f} {group[0].tokens / group[0].sentences:26.1f}")
    (setting, *_), (baseline, *_) = COMPARISONS[args.compare]
    for mode, values in ratios.items():
        shown = ", ".join(f"{v:.2f}" for v in values)
        print(f"{mode}: {setting} / {baseline} speed = {statistics.median(values):.2f}x (median; rounds: {shown})")
    if args.json:
        summary = {
            "args": vars(args),
            "runs": {
                name: {"sent_per_s": [r.speed for r in group], "mean_tokens": group[0].tokens / group[0].sentences}
                for name, group in runs.items()
            },
            "ratios": ratios,
        }
        Path(args.json).write_text(json.dumps(summary, indent=2), encoding="utf-8")


if __name__ == "__main__":
    run_script("bench_decode", main)
