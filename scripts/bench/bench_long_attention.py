"""Time and peak memory of one encoder layer's forward and backward pass as the input grows, per attention kind.

One pre-norm encoder layer (self-attention + feed-forward; d_model 256, 4 heads, d_ff 1024, fp32, CPU,
batch 1, no dropout) of each `model.transformer.attention` kind: full (in the kernel fp32 training uses:
PyTorch's choice, its flash kernel, which never forms the (S, S) weights), full_math (the same in PyTorch's
math kernel, which does: CPU bf16 training's), local_global (--window, --global-tokens) and linformer
(--linformer-length), at each of --lengths. Each (kind, length) runs in a fresh child process:

- peak memory: the rise of the process's peak resident set size (VmHWM, reset through /proc/self/clear_refs
  just before) over its resident size after building the layer and the input, during the first forward +
  backward pass. glibc is told to serve every allocation of 64 KiB or more by mmap (MALLOC_MMAP_THRESHOLD_),
  so tensors are mapped when made and unmapped when freed, and the RSS follows them; this counts everything
  the pass touches (activations saved for backward, the attention's temporaries, the gradients), not an estimate.
- time: the median of --repeats further forward + backward passes (the first pass is not timed).

Full attention (either kernel) is skipped at a length whose time, extrapolated from the previous length as
S^2, would exceed --max-seconds, or whose peak memory would exceed --max-gb (each "skipped" with the reason).
Writes a markdown table (--table) and a log-log plot (--plot; needs matplotlib, the `recipes` extra).

    .venv/bin/python scripts/bench/bench_long_attention.py --threads 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
KINDS = ("full", "full_math", "local_global", "linformer")
"""full_math: full attention in PyTorch's math kernel (softmax(QK^T)V written out, as CPU bf16 training runs it)."""


def child(args: argparse.Namespace) -> dict[str, Any]:
    """One (kind, length) in this process: the peak memory of the first pass and the median time of the rest."""
    import torch
    from torch.nn.attention import SDPBackend

    from seq2seq.config import TransformerConfig
    from seq2seq.model.attention import kernel_scope, training_kernel
    from seq2seq.model.layers import EncoderLayer, LayerOptions

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    attention = "full" if args.kind == "full_math" else args.kind
    own = {  # each attention's own settings: the config refuses another's
        "full": {},
        "local_global": {"window": args.window, "global_tokens": args.global_tokens},
        "linformer": {"linformer_length": args.linformer_length},
    }
    settings = TransformerConfig(attention=attention, **own[attention])
    d = args.d_model
    layer = EncoderLayer(d, args.heads, 4 * d, 0.0, 0.0, 0.0, "relu", True, LayerOptions(settings, args.length))
    x = torch.randn(1, args.length, d, requires_grad=True)
    mask = torch.ones(1, 1, 1, args.length, dtype=torch.bool)

    kernel = SDPBackend.MATH if args.kind == "full_math" else training_kernel(torch.device("cpu"), "fp32")

    def step() -> None:
        with kernel_scope(kernel):
            layer(x, mask).sum().backward()

    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    before = rss_kb("VmRSS")
    step()
    peak = rss_kb("VmHWM") - before
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return {"seconds": statistics.median(times), "peak_mb": peak / 1024}


def rss_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def measure(kind: str, length: int, args: argparse.Namespace) -> dict[str, Any]:
    """Runs `child` for (kind, length) in a fresh process."""
    argv = [sys.executable, __file__, "--child", "--kind", kind, "--length", str(length)]
    for name in ("threads", "repeats", "window", "global_tokens", "linformer_length", "d_model", "heads"):
        argv += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    env = {
        **os.environ,
        "MALLOC_MMAP_THRESHOLD_": "65536",
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": str(args.threads),
    }
    out = subprocess.run(argv, env=env, capture_output=True, text=True, check=True).stdout
    return dict(json.loads(out.splitlines()[-1]))


def skip_reason(previous: dict[str, Any] | None, length: int, args: argparse.Namespace) -> str | None:
    """Why full attention is not run at `length`, from the previous length's numbers grown as S^2."""
    if previous is None or "seconds" not in previous:
        return None if previous is None else str(previous["skipped"])
    growth = (length / previous["length"]) ** 2
    seconds, gb = previous["seconds"] * growth, previous["peak_mb"] * growth / 1024
    if seconds > args.max_seconds:
        return f"skipped: ~{seconds:.0f} s per pass expected (over {args.max_seconds:.0f} s)"
    if gb > args.max_gb:
        return f"skipped: ~{gb:.1f} GB expected (over {args.max_gb:.0f} GB)"
    return None


def run_all(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for kind in args.kinds:
        previous: dict[str, Any] | None = None
        for length in args.lengths:
            reason = skip_reason(previous, length, args) if kind.startswith("full") else None
            row: dict[str, Any] = {"kind": kind, "length": length}
            row.update({"skipped": reason} if reason else measure(kind, length, args))
            print(json.dumps(row), flush=True)
            rows.append(row)
            previous = row
    return rows


def label(kind: str, args: argparse.Namespace) -> str:
    if kind == "local_global":
        return f"local_global (window {args.window}, {args.global_tokens} global)"
    if kind == "full_math":
        return "full, math kernel"
    return f"linformer (k={args.linformer_length})" if kind == "linformer" else "full (PyTorch's kernel choice)"


def table(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    kinds = list(dict.fromkeys(r["kind"] for r in rows))
    head = "| tokens | " + " | ".join(f"{label(k, args)}: s / MB" for k in kinds) + " |"
    lines = [head, "|---:|" + "---:|" * len(kinds)]
    for length in args.lengths:
        cells = []
        for kind in kinds:
            r = next(r for r in rows if r["kind"] == kind and r["length"] == length)
            cells.append(r["skipped"] if "skipped" in r else f"{r['seconds']:.3f} / {r['peak_mb']:.0f}")
        lines.append(f"| {length} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict[str, Any]], args: argparse.Namespace, path: Path) -> None:
    from matplotlib.figure import Figure  # drawn off screen, without pyplot's GUI backends

    figure = Figure(figsize=(10, 4))
    time_axes, memory_axes = figure.subplots(1, 2)
    for kind in dict.fromkeys(r["kind"] for r in rows):
        done = [r for r in rows if r["kind"] == kind and "seconds" in r]
        lengths = [r["length"] for r in done]
        time_axes.plot(lengths, [r["seconds"] for r in done], marker="o", label=label(kind, args))
        memory_axes.plot(lengths, [r["peak_mb"] for r in done], marker="o", label=label(kind, args))
    for axes, name in ((time_axes, "forward + backward (s)"), (memory_axes, "peak memory (MB, RSS rise)")):
        axes.set_xscale("log", base=2)
        axes.set_yscale("log")
        axes.set_xlabel("input length (tokens)")
        axes.set_ylabel(name)
        axes.grid(True, which="both", alpha=0.3)
    time_axes.legend()
    figure.suptitle(f"one encoder layer, d_model {args.d_model}, {args.heads} heads, fp32, {args.threads} thread(s)")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192, 16384])
    p.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3, help="timed passes after the first (default 3)")
    p.add_argument("--window", type=int, default=64)
    p.add_argument("--global-tokens", type=int, default=4)
    p.add_argument("--linformer-length", type=int, default=256)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--max-seconds", type=float, default=60.0, help="skip full attention beyond this (default 60)")
    p.add_argument("--max-gb", type=float, default=8.0, help="skip full attention beyond this (default 8)")
    p.add_argument("--table", type=Path, default=ROOT / "docs" / "long_attention.md")
    p.add_argument("--plot", type=Path, default=ROOT / "docs" / "long_attention.png")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--kind", choices=KINDS, help=argparse.SUPPRESS)
    p.add_argument("--length", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    rows = run_all(args)
    text = table(rows, args)
    print(text)
    args.table.parent.mkdir(parents=True, exist_ok=True)
    args.table.write_text(text, encoding="utf-8")
    plot(rows, args, args.plot)
    print(f"wrote {args.table} and {args.plot}")


if __name__ == "__main__":
    main()
