"""`bench_decode.py --compare engines`: this code, an earlier commit's and CTranslate2, side by side in one process.

Systems (each a function from source lines to translations):
- pytorch: `Translator` from the working tree;
- before: `Translator` from the package as it was at --baseline-rev, extracted
  with `git archive` and imported under the same name next to the working
  tree's (its modules keep references to each other, so both run in one process);
- ct2-float32, ct2-int8: the checkpoint exported with `seq2seq.deploy.export` and
  decoded by CTranslate2 with the closest settings it has. Its length penalty
  is not GNMT's (it divides by length ** alpha), it has no max_len_a, and it
  does not forbid PAD and BOS as search.py does (which only an untrained model
  would pick), so some translations may differ.

Models: the checkpoint, and random-weight models of the peer benchmark's
shapes (../shared/bench-peers) with the checkpoint's tokenizer, whose every
hypothesis is forced to --shape-length tokens (CTranslate2: the same number of
decoder steps).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import io
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
BASELINE_REV = "82e8be1"  # the last commit before the preallocated cache and the rest of the decoding work
SYSTEMS = ("before", "pytorch", "ct2-float32", "ct2-int8")
# The peer benchmark's shapes (common.CONFIGS): post-norm, ReLU, sinusoidal, all embeddings shared.
SHAPES: dict[str, dict[str, int]] = {
    "tiny": {"encoder_layers": 3, "decoder_layers": 3, "d_model": 256, "d_ff": 1024, "n_heads": 4},
    "small": {"encoder_layers": 6, "decoder_layers": 6, "d_model": 512, "d_ff": 1024, "n_heads": 4},
}

Translate = Callable[[list[str]], list[str]]


@dataclasses.dataclass
class Result:
    first_call: float = 0.0  # seconds
    speeds: list[float] = dataclasses.field(default_factory=list)  # sentences/s, one per round
    memory: float = 0.0  # MiB of resident memory a run adds at its peak
    outputs: list[str] = dataclasses.field(default_factory=list)


def compare_engines(args: argparse.Namespace, checkpoint: Path) -> None:
    from seq2seq.text.corpus import read_lines

    lines = [line for line in read_lines(args.src) if line.strip()][: args.n]
    refs = [r for s, r in zip(read_lines(args.src), read_lines(args.ref)) if s.strip()][: args.n] if args.ref else []
    systems = args.systems.split(",")
    modes = args.modes.split(",")
    before = import_package_at(args.baseline_rev) if "before" in systems else None
    summary: dict[str, Any] = {"args": vars(args), "cpu": cpu_flags(), "results": {}}
    print(f"{len(lines)} sentences of {args.src}; {args.threads} threads; CPU flags: {cpu_flags() or 'unknown'}")
    with tempfile.TemporaryDirectory(prefix="bench-engines-") as tmp:
        for shape in args.shapes.split(","):
            model = checkpoint if shape == "checkpoint" else random_checkpoint(checkpoint, shape, Path(tmp))
            fixed = 0 if shape == "checkpoint" else args.shape_length
            exported = export(model, Path(tmp) / shape, [s for s in systems if s.startswith("ct2-")])
            for mode in modes:
                results = compare(args, model, exported, before, systems, mode, fixed, lines)
                name = f"{shape} {mode if mode == 'greedy' else f'beam{args.beam}'}"
                summary["results"][name] = report(name, results, refs)
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2), encoding="utf-8")


def compare(
    args: argparse.Namespace,
    model: Path,
    exported: dict[str, Path],
    before: ModuleType | None,
    systems: Sequence[str],
    mode: str,
    fixed: int,
    lines: list[str],
) -> dict[str, Result]:
    """Load every system, time its first call, then `args.rounds` interleaved rounds and one run for memory."""
    settings: dict[str, Any] = {"strategy": mode, "beam_size": args.beam, "nbest": 1}
    if args.max_tokens:
        settings["max_tokens"] = args.max_tokens
    if fixed:
        settings.update(min_len=fixed, max_len=fixed, max_len_a=0.0, max_len_b=fixed)
    results = {name: Result() for name in systems}
    runs: dict[str, Translate] = {}
    for name in systems:
        runs[name] = load(name, model, exported, before, settings, args.threads)
        start = time.perf_counter()
        runs[name](lines[:1])
        results[name].first_call = time.perf_counter() - start
    for round_ in range(args.rounds):
        shift = round_ % len(systems)
        for name in [*systems[shift:], *systems[:shift]]:
            idle()
            start = time.perf_counter()
            outputs = runs[name](lines)
            results[name].speeds.append(len(lines) / (time.perf_counter() - start))
            results[name].outputs = outputs
            print(f"  {mode} round {round_ + 1}: {name:12s} {results[name].speeds[-1]:8.1f} sent/s", file=sys.stderr)
    for name in systems:
        idle()
        with peak_memory() as peak:
            runs[name](lines)
        results[name].memory = peak()
    return results


def load(
    name: str,
    model: Path,
    exported: dict[str, Path],
    before: ModuleType | None,
    settings: dict[str, Any],
    threads: int,
) -> Translate:
    if name in ("pytorch", "before"):
        from seq2seq.decoding import translate

        module = translate if name == "pytorch" else before
        assert module is not None
        translator = module.Translator.from_checkpoint(model, **settings)
        return lambda lines: list(translator.translate(lines))
    if name in exported and "min_len" in settings and settings["min_len"] == settings["max_len"]:  # equal work
        from seq2seq.decoding.translate import Translator

        translator = Translator.from_checkpoint(model, **settings)  # its tokenizer and checked settings
        return forced_ct2_translate(exported[name], translator.tokenizer, translator.decode, threads)
    if name in exported:  # what `seq2seq translate -c DIR` runs
        from seq2seq.deploy.exported import CTranslate2Translator

        engine = CTranslate2Translator.from_directory(exported[name], threads=threads, **settings)
        return lambda lines: list(engine.translate(lines))
    raise SystemExit(f"bench_decode: unknown system {name!r}; choose from {', '.join(SYSTEMS)}")


def forced_ct2_translate(directory: Path, tokenizer: Any, decode: Any, threads: int) -> Translate:
    """CTranslate2 decoding exactly decode.max_len tokens per sentence (a shape's forced length), batched by
    source tokens like the PyTorch path, with as many decoder steps: our tokens + EOS; the last step's
    token is not EOS, so it is dropped."""
    from seq2seq.deploy.exported import import_ctranslate2

    engine = import_ctranslate2().Translator(str(directory), device="cpu", intra_threads=threads, inter_threads=1)
    options = {
        "beam_size": decode.beam_size if decode.strategy == "beam" else 1,
        "length_penalty": decode.length_penalty,
        "min_decoding_length": decode.max_len + 1,
        "max_decoding_length": decode.max_len + 1,
        "max_batch_size": decode.max_tokens,
        "batch_type": "tokens",
    }

    def translate(lines: list[str]) -> list[str]:
        pieces = [tokenizer.src.encode(line.strip(), out_type=str) for line in lines]
        results = engine.translate_batch(pieces, **options)
        return [tokenizer.tgt.decode(r.hypotheses[0][: decode.max_len]) for r in results]

    return translate


def export(model: Path, directory: Path, systems: Sequence[str]) -> dict[str, Path]:
    from seq2seq.deploy.export import export_ctranslate2

    return {name: export_ctranslate2(model, directory / name, name.removeprefix("ct2-")) for name in systems}


def random_checkpoint(checkpoint: Path, shape: str, directory: Path) -> Path:
    """A checkpoint with the checkpoint's tokenizer and a random-weight (seed 0) model of the peer shape."""
    from seq2seq.config import TransformerConfig
    from seq2seq.model import build_model
    from seq2seq.runs.checkpoint import Checkpoint, read, save

    if shape not in SHAPES:
        raise SystemExit(f"bench_decode: unknown shape {shape!r}; choose from checkpoint, {', '.join(SHAPES)}")
    stored = read(checkpoint)
    sizes = dict(SHAPES[shape])
    model_cfg = dataclasses.replace(
        stored.config.model,
        d_model=sizes.pop("d_model"),
        arch="transformer",
        transformer=TransformerConfig(
            **sizes, norm="post", activation="relu", positions="sinusoidal", norm_type="layernorm"
        ),
        rnn=None,
        share_all_embeddings=stored.tokenizer.shared,
        share_decoder_embeddings=True,
    )
    config = dataclasses.replace(stored.config, model=model_cfg)
    torch.manual_seed(0)
    model = build_model(model_cfg, stored.tokenizer.src_vocab_size, stored.tokenizer.tgt_vocab_size)
    path = directory / f"{shape}.pt"
    save(path, Checkpoint(config, stored.tokenizer, model.state_dict()))
    return path


def import_package_at(rev: str) -> ModuleType:
    """`seq2seq.decoding.translate` as it was at git revision `rev`, loaded next to the working tree's package.

    The old modules are imported under their own names while the current ones
    are set aside, then set aside in turn: each package's functions keep
    references to their own modules.
    """
    try:
        archive = subprocess.run(
            ["git", "-C", str(ROOT), "archive", rev, "seq2seq"], check=True, capture_output=True
        ).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        raise SystemExit(f"bench_decode: cannot read seq2seq at {rev!r} from git: {e}") from None
    directory = tempfile.mkdtemp(prefix=f"seq2seq-{rev}-")
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        if hasattr(tarfile, "data_filter"):
            tar.extractall(directory, filter="data")
        else:  # Python before 3.10.12 / 3.11.4
            tar.extractall(directory)
    current = {name: module for name, module in sys.modules.items() if name.split(".")[0] == "seq2seq"}
    for name in current:
        del sys.modules[name]
    sys.path.insert(0, directory)
    try:
        return importlib.import_module("seq2seq.decoding.translate")
    finally:
        sys.path.remove(directory)
        for name in [name for name in sys.modules if name.split(".")[0] == "seq2seq"]:
            del sys.modules[name]
        sys.modules.update(current)


def idle() -> None:
    """Let the other engine's spinning worker threads go to sleep before a run (CTranslate2's and torch's)."""
    time.sleep(0.3)


@contextmanager
def peak_memory() -> Iterator[Callable[[], float]]:
    """The peak resident memory (MiB) added while the block runs, sampled every millisecond from /proc."""
    base, peak, done = resident(), [0], threading.Event()

    def sample() -> None:
        while not done.wait(0.001):
            peak[0] = max(peak[0], resident())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        yield lambda: max(0, peak[0] - base) / 2**20
    finally:
        done.set()
        sampler.join()


def resident() -> int:
    """Resident memory in bytes (0 where /proc is missing)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def cpu_flags() -> str:
    """The vector instruction sets of this CPU that matter for matmuls."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return ""
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
    return " ".join(flag for flag in wanted if flag in flags)


def report(name: str, results: dict[str, Result], refs: list[str]) -> dict[str, Any]:
    from seq2seq.metrics import bleu

    reference = results.get("pytorch")
    print(f"\n{name}")
    header = f"{'system':12s} {'sent/s':>8s} {'x pytorch':>9s} {'first call':>10s} {'+RSS MiB':>9s} {'same':>6s}"
    print(header + (f" {'BLEU':>6s}" if refs else ""))
    table = {}
    for system, r in results.items():
        speed = statistics.median(r.speeds)
        ratio = statistics.median(a / b for a, b in zip(r.speeds, reference.speeds)) if reference else float("nan")
        same = sum(a == b for a, b in zip(r.outputs, reference.outputs)) / len(r.outputs) if reference else 1.0
        score = bleu(r.outputs, refs).score if refs else None
        row = f"{system:12s} {speed:8.1f} {ratio:9.2f} {r.first_call:9.2f}s {r.memory:9.0f} {100 * same:5.1f}%"
        print(row + (f" {score:6.2f}" if score is not None else ""))
        table[system] = {
            "sent_per_s": r.speeds,
            "ratio_to_pytorch": ratio,
            "first_call_s": r.first_call,
            "peak_rss_added_mib": r.memory,
            "same_as_pytorch": same,
            "bleu": score,
        }
    return table
