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
  would pick), so some translations may differ;
- hf: the checkpoint exported as a Marian model directory (`seq2seq export
  --format hf`) and decoded by transformers' `MarianMTModel.generate` (float32,
  its default attention), with the same beam, length penalty value (HF divides
  by length ** alpha) and a length limit of the batch's longest a * source + b.

--device cuda runs pytorch, hf and CTranslate2 on the GPU (fp32; peak memory is
then torch's allocator peak, which CTranslate2 does not report). --batch-sentences B
gives every system the same batches: the lines sorted by length, B at a time
(each system decodes a batch as one; without it each batches by its own rules, hf
64 sentences at a time).

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
SYSTEMS = ("before", "pytorch", "ct2-float32", "ct2-int8", "hf")
# The peer benchmark's shapes (common.CONFIGS): post-norm, ReLU, sinusoidal, all embeddings shared.
SHAPES: dict[str, dict[str, int]] = {
    "tiny": {"encoder_layers": 3, "decoder_layers": 3, "d_model": 256, "d_ff": 1024, "n_heads": 4},
    "small": {"encoder_layers": 6, "decoder_layers": 6, "d_model": 512, "d_ff": 1024, "n_heads": 4},
}

UNBOUNDED_TOKENS = 10**9  # decode.max_tokens for a batch that is decoded as given
HF_BATCH = 64  # sentences of an hf batch without --batch-sentences (generate has no batching of its own)

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
    device = device_name(args.device)
    summary: dict[str, Any] = {"args": vars(args), "cpu": cpu_flags(), "device": device, "results": {}}
    batching = f"batches of {args.batch_sentences} sentences" if args.batch_sentences else "each system's own batches"
    print(f"{len(lines)} sentences of {args.src}; {args.threads} threads; CPU flags: {cpu_flags() or 'unknown'}")
    print(f"device: {device}; {batching}")
    note = shared_runtime_note(systems, args.device)
    if note:
        print(f"note: {note}")
        summary["note"] = note
    with tempfile.TemporaryDirectory(prefix="bench-engines-") as tmp:
        for shape in args.shapes.split(","):
            model = checkpoint if shape == "checkpoint" else random_checkpoint(checkpoint, shape, Path(tmp))
            fixed = 0 if shape == "checkpoint" else args.shape_length
            exported = export(model, Path(tmp) / shape, [s for s in systems if s.startswith("ct2-") or s == "hf"])
            here = [s for s in systems if s != "hf" or "hf" in exported]
            for mode in modes:
                results = compare(args, model, exported, before, here, mode, fixed, lines)
                name = f"{shape} {mode if mode == 'greedy' else f'beam{args.beam}'}"
                summary["results"][name] = report(name, results, refs)
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2), encoding="utf-8")


def shared_runtime_note(systems: Sequence[str], device: str) -> str | None:
    """What a run with more than one CTranslate2 engine on the CPU should be read with, else None."""
    engines = [name for name in systems if name.startswith("ct2-")]
    if device != "cpu" or len(engines) < 2:
        return None
    return (
        f"{' and '.join(engines)} share one process: once both have run, CTranslate2's OpenMP runtime counts "
        "more threads than CPUs and throttles them, and each runs about half as fast (docs/results.md, "
        "'The peer table on the AVX512-BF16 EPYC with AVX-VNNI'); run one CTranslate2 system per "
        "invocation for its speed"
    )


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
    if args.batch_sentences:
        settings["max_tokens"] = UNBOUNDED_TOKENS  # a batch given is decoded as one
    results = {name: Result() for name in systems}
    runs: dict[str, Translate] = {}
    for name in systems:
        runs[name] = load(name, model, exported, before, settings, args.threads, args.device)
        size = args.batch_sentences or (HF_BATCH if name == "hf" else 0)
        if size:
            runs[name] = in_batches(runs[name], size)
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
        with peak_memory(args.device) as peak:
            runs[name](lines)
        results[name].memory = peak()
    return results


def in_batches(translate: Translate, size: int) -> Translate:
    """`translate` called on the lines sorted by length (words), `size` at a time; outputs in the input order."""

    def batched(lines: list[str]) -> list[str]:
        order = sorted(range(len(lines)), key=lambda i: len(lines[i].split()))
        outputs = [""] * len(lines)
        for start in range(0, len(order), size):
            chunk = order[start : start + size]
            for i, text in zip(chunk, translate([lines[i] for i in chunk])):
                outputs[i] = text
        return outputs

    return batched


def load(
    name: str,
    model: Path,
    exported: dict[str, Path],
    before: ModuleType | None,
    settings: dict[str, Any],
    threads: int,
    device: str = "cpu",
) -> Translate:
    if name in ("pytorch", "before"):
        from seq2seq.decoding import translate

        module = translate if name == "pytorch" else before
        assert module is not None
        translator = module.Translator.from_checkpoint(model, device=device, **settings)
        return lambda lines: list(translator.translate(lines))
    if name == "hf" and name in exported:
        from seq2seq.decoding.translate import Translator

        translator = Translator.from_checkpoint(model, **settings)  # the checked settings
        return hf_translate(exported[name], translator.decode, device)
    if name in exported and "min_len" in settings and settings["min_len"] == settings["max_len"]:  # equal work
        from seq2seq.decoding.translate import Translator

        translator = Translator.from_checkpoint(model, **settings)  # its tokenizer and checked settings
        return forced_ct2_translate(exported[name], translator.tokenizer, translator.decode, threads, device)
    if name in exported:  # what `seq2seq translate -c DIR` runs
        from seq2seq.deploy.exported import CTranslate2Translator

        engine = CTranslate2Translator.from_directory(exported[name], device=device, threads=threads, **settings)
        return lambda lines: list(engine.translate(lines))
    raise SystemExit(f"bench_decode: unknown system {name!r}; choose from {', '.join(SYSTEMS)}")


def hf_translate(directory: Path, decode: Any, device: str) -> Translate:
    """transformers' `generate` on the Marian export. A forced length L (min_len = max_len) is L tokens that are
    not EOS, then a forced EOS: L + 1 decoder steps, as ours; otherwise at most the batch's longest
    floor(a * source + b) tokens (source: subwords + EOS, capped at max_len), then EOS."""
    try:
        import transformers
    except ImportError:
        raise SystemExit('bench_decode: system "hf" needs transformers: pip install -e ".[hf]"') from None
    transformers.logging.set_verbosity_error()  # not: "max_new_tokens and max_length both set" at every call
    transformers.utils.logging.disable_progress_bar()
    model = transformers.MarianMTModel.from_pretrained(directory).to(device).eval()
    tokenizer = transformers.MarianTokenizer.from_pretrained(directory)
    beam = decode.beam_size if decode.strategy == "beam" else 1
    forced = decode.min_len == decode.max_len

    def translate(lines: list[str]) -> list[str]:
        batch = tokenizer([line.strip() for line in lines], return_tensors="pt", padding=True).to(device)
        longest = int(batch["attention_mask"].sum(1).max())
        limit = decode.max_len if forced else min(int(decode.max_len_a * longest + decode.max_len_b), decode.max_len)
        with torch.inference_mode():
            out = model.generate(
                **batch, num_beams=beam, do_sample=False, length_penalty=decode.length_penalty,
                min_new_tokens=decode.min_len, max_new_tokens=limit + 1, num_return_sequences=1,
            )  # fmt: skip
        return tokenizer.batch_decode(out, skip_special_tokens=True)

    return translate


def forced_ct2_translate(directory: Path, tokenizer: Any, decode: Any, threads: int, device: str = "cpu") -> Translate:
    """CTranslate2 decoding exactly decode.max_len tokens per sentence (a shape's forced length), batched by
    source tokens like the PyTorch path, with as many decoder steps: our tokens + EOS; the last step's
    token is not EOS, so it is dropped."""
    from seq2seq.deploy.exported import import_ctranslate2

    engine = import_ctranslate2().Translator(str(directory), device=device, intra_threads=threads, inter_threads=1)
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
    """The exported directory of each system; a model Marian cannot hold (pre-norm, rotary, ...) has no "hf"."""
    from seq2seq.deploy.export import export_ctranslate2
    from seq2seq.errors import UserError
    from seq2seq.hf.files import export_marian

    exported = {}
    for name in systems:
        if name != "hf":
            exported[name] = export_ctranslate2(model, directory / name, name.removeprefix("ct2-"))
            continue
        try:
            exported[name] = export_marian(model, directory / name)
        except UserError as e:
            print(f"hf: {model.name} is left out: {e}", file=sys.stderr)
    return exported


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
def peak_memory(device: str = "cpu") -> Iterator[Callable[[], float]]:
    """The peak memory (MiB) added while the block runs: resident memory sampled every millisecond from /proc,
    or on CUDA torch's allocator peak (what CTranslate2 allocates is not seen)."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        yield lambda: max(0, torch.cuda.max_memory_allocated() - base) / 2**20
        return
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


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        name = torch.cuda.get_device_name(torch.device(device))
        return f"{name} (torch {torch.__version__}, CUDA {torch.version.cuda})"
    return "cpu"


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
    header = f"{'system':12s} {'sent/s':>8s} {'x pytorch':>9s} {'first call':>10s} {'+mem MiB':>9s} {'same':>6s}"
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
            "peak_memory_added_mib": r.memory,
            "same_as_pytorch": same,
            "bleu": score,
        }
    return table
