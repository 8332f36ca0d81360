"""One linear, the ways this PyTorch can run it on the CPU, side by side in one process: float32 (MKL's
`F.linear`, MKL's packed GEMM, oneDNN's prepacked weights) and int8 (`torch._int_mm`, FBGEMM through
`fbgemm_int8_linear`).

    .venv/bin/python scripts/bench/bench_int8_linear.py --rows 64 320 --shapes 256x8000 256x1024 256x256 1024x256

Prints microseconds per call (median of the rounds) and each way's speed against oneDNN's packed float32,
the path a float32 decoding step takes. Which int8 GEMM `decode.quantize: int8` picks here is
`seq2seq.model.packed.int8_gemm()`; the other one is timed too, so a CPU where it would be the wrong pick shows.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from seq2seq.model import packed  # noqa: E402


def median_us(fn: Callable[[], object], rounds: int, calls: int) -> float:
    for _ in range(2):
        fn()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(times)


def ways(weight: torch.Tensor, bias: torch.Tensor, rows: int) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    out: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        "float32 MKL": lambda x: F.linear(x, weight, bias),
        "float32 oneDNN packed": packed.packed_linear(weight, bias),
    }
    if torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear"):  # packed for `rows` rows
        mkl_weight = torch.ops.mkl._mkl_reorder_linear_weight(weight, rows)
        out["float32 MKL packed"] = lambda x: torch.ops.mkl._mkl_linear(x, mkl_weight, weight, bias, rows)
    if packed.int_mm_available():
        w_scale = weight.abs().amax(dim=1) / 63
        w_int8 = torch.round(weight / w_scale[:, None]).to(torch.int8).t().contiguous()
        out["int8 _int_mm (product only)"] = lambda x: torch._int_mm(x.to(torch.int8), w_int8)
    if packed._fbgemm_available():
        out["int8 FBGEMM row-wise"] = packed.fbgemm_int8_linear(weight, bias)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[64, 320], help="rows a call (hypotheses of a step)")
    ap.add_argument("--shapes", nargs="+", default=["256x8000", "256x1024", "256x256", "1024x256"], help="INxOUT")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=10, help="calls a round (the slow `_int_mm` loop: 1 is enough)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {args.threads} threads, int8 GEMM picked here: {packed.int8_gemm()}")
    for rows in args.rows:
        for shape in args.shapes:
            n_in, n_out = (int(n) for n in shape.split("x"))
            weight, bias = torch.randn(n_out, n_in) * 0.05, torch.randn(n_out)
            x = torch.randn(rows, n_in)
            with torch.no_grad():
                calls = {name: functools.partial(f, x) for name, f in ways(weight, bias, rows).items()}
                for name, call in calls.items():  # the float32 ways compute the same product
                    if name.startswith("float32"):
                        torch.testing.assert_close(call(), F.linear(x, weight, bias), rtol=1e-4, atol=1e-3)
                times = {name: median_us(call, args.rounds, args.calls) for name, call in calls.items()}
            base = times["float32 oneDNN packed"]
            cells = ", ".join(f"{name} {us:,.0f} us ({base / us:.2f}x)" for name, us in times.items())
            print(f"{rows} x {n_in} -> {n_out}: {cells}")


if __name__ == "__main__":
    main()
