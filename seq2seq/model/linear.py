"""Float32 linear layers on the CPU through oneDNN where PyTorch's default GEMM runs at half speed.

PyTorch's CPU `F.linear`/`addmm` in float32 calls MKL's sgemm. On AMD CPUs with
AVX-512 MKL takes a slower path than the CPU offers: on a 2-core AMD EPYC with
`avx512f`, a (4000 x 256) @ (256 x 1024) product runs at about 200 GFLOP/s in
MKL and 410-490 in oneDNN's matmul, which PyTorch also ships; the two input
gradients alike (docs/results.md, "Float32 matmuls through oneDNN on AMD
CPUs"). So on such a CPU the Transformer's linears run as oneDNN's linear
(`torch.ops.mkldnn._linear_pointwise`, the ReLU of a ReLU feed-forward network
fused in), forward and backward, with the numbers of `F.linear` up to rounding.
Elsewhere nothing changes: on Intel CPUs MKL is at least as fast, on AVX2-only
AMD CPUs the two measured level; bf16 autocast, `torch.compile` and GPUs keep `F.linear`.
Modules keep their `nn.Linear` parameters, so checkpoints do not change.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

USE_ONEDNN: bool | None = None
"""None: the CPU's rule (`onednn_pays`); True/False forces a path (benchmarks compare the two)."""

_ONEDNN_BELOW_AVX512 = frozenset({"SSE41", "AVX", "AVX2"})  # a process capped there gets oneDNN's AVX2 kernels


@functools.cache
def onednn_pays() -> bool:
    """Whether float32 linears on this CPU run faster in oneDNN than in MKL: an AMD CPU with AVX-512, in a
    process that does not cap oneDNN below AVX-512 (`ONEDNN_MAX_CPU_ISA`, as `scripts/cpu_kinds.sh` does
    to run as an AVX2-only CPU)."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    if os.environ.get("ONEDNN_MAX_CPU_ISA", "ALL").upper() in _ONEDNN_BELOW_AVX512:
        return False
    fields = cpu_fields()
    return "AuthenticAMD" in fields and "avx512f" in fields


@functools.cache
def cpu_fields() -> frozenset[str]:
    """The first CPU's vendor and flags as /proc/cpuinfo lists them (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [line for line in f if line.startswith(("vendor_id", "flags"))][:2]
    except OSError:
        return frozenset()
    return frozenset(" ".join(lines).split())


def uses_onednn(x: Tensor) -> bool:
    """Whether `linear` runs `x` through oneDNN: float32 on the CPU, outside autocast and `torch.compile` (whose
    graphs take `F.linear`), where it pays."""
    if torch.compiler.is_compiling() or x.device.type != "cpu" or x.dtype != torch.float32:
        return False
    wanted = onednn_pays() if USE_ONEDNN is None else USE_ONEDNN
    return wanted and not torch.is_autocast_enabled("cpu")


def linear(x: Tensor, weight: Tensor, bias: Tensor | None, relu: bool = False) -> Tensor:
    """F.linear(x, weight, bias), then ReLU if `relu`: (..., D_in) -> (..., D_out)."""
    if weight.dtype == torch.float32 and uses_onednn(x):
        return _OneDNNLinear.apply(x, weight, bias, relu)
    y = F.linear(x, weight, bias)
    return F.relu(y) if relu else y


def _onednn(x: Tensor, weight: Tensor, bias: Tensor | None = None, relu: bool = False) -> Tensor:
    """oneDNN's x (N, D_in) @ weight (D_out, D_in)^T + bias, then ReLU if `relu`; either may be a transposed view."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "relu" if relu else "none", [], "")


class _OneDNNLinear(torch.autograd.Function):
    """The three products of a linear layer in oneDNN; a weight gradient much wider than deep (the vocabulary
    projection: 8,000 x 256) is MKL's, where oneDNN's transposed product measured slower."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Tensor | None, relu: bool) -> Tensor:
        rows = x.reshape(-1, x.shape[-1])  # (N, D_in)
        y = _onednn(rows, weight, bias, relu)  # (N, D_out)
        ctx.save_for_backward(rows, weight, y if relu else None)
        ctx.shape, ctx.relu, ctx.has_bias = x.shape, relu, bias is not None
        return y.view(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None, Tensor | None, None]:
        rows, weight, y = ctx.saved_tensors
        grad = grad.reshape(-1, grad.shape[-1])  # (N, D_out)
        if ctx.relu:  # the fused ReLU's gradient: its output is positive exactly where its input was
            grad = torch.ops.aten.threshold_backward(grad, y, 0)
        need_x, need_w, need_b, _ = ctx.needs_input_grad
        grad_x = _onednn(grad, weight.t()).view(ctx.shape) if need_x else None  # (N, D_in)
        grad_w = None
        if need_w:
            wide = weight.shape[0] > 4 * weight.shape[1]
            grad_w = grad.t() @ rows if wide else _onednn(grad.t(), rows.t())  # (D_out, D_in)
        grad_b = grad.sum(0) if need_b and ctx.has_bias else None
        return grad_x, grad_w, grad_b, None
