"""The decoder's linear layers as a decoding step runs them: with weights prepacked by oneDNN on CPU.

A decoding step multiplies a few rows (one per hypothesis) by every weight
matrix. At that size PyTorch's default CPU GEMM spends about as long
rearranging the weight for each call as multiplying; oneDNN can keep the
weight in its own blocked layout, rearranged once, and also applies ReLU in
the same call. On the 3+3-layer d256 model this makes greedy decoding about
a quarter faster (`scripts/bench/bench_decode.py`).

The packed weights are copies, kept between batches by the model's decoding
plan (`seq2seq.model.transformer.DecodingPlan`) and handed to each decoding
session in its `StepPlan`, not by any table in this module. `onednn_available` is the
one check for the private oneDNN ops used here; without them (or where oneDNN
refuses a model) the step uses the modules themselves, and the tests decode
both ways.
"""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Callable

import torch
from torch import Tensor, nn

from seq2seq.model.linear import cpu_fields, linear

Linear = Callable[[Tensor], Tensor]
"""x (..., in) -> (..., out)."""

ROWS_HINT = 64  # the row count oneDNN picks the weight layout for; any row count works with it


def plain_linear(weight: Tensor, bias: Tensor | None) -> Linear:
    """`F.linear` with this weight (out, in) and bias, for a projection that is a slice of a module's weight: as
    `seq2seq.model.linear.linear` runs it (through oneDNN on CPUs where that pays)."""
    return functools.partial(linear, weight=weight, bias=bias)


def packed_linear(weight: Tensor, bias: Tensor | None, relu: bool = False) -> Linear:
    """`F.linear` (then ReLU) with the weight (out, in) rearranged once for oneDNN."""
    packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), ROWS_HINT)
    bias = None if bias is None else bias.detach()
    attr = "relu" if relu else "none"

    def linear(x: Tensor) -> Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, attr, [], "")

    return linear


def int8_linear(weight: Tensor, bias: Tensor | None, relu: bool = False) -> Linear:
    """`F.linear` (then ReLU) in int8, for `decode.quantize: int8`, with row-wise scales on both sides.

    The weight (out, in) is quantized once, per output row (symmetric: scale max|w| / 127; 7 bits, / 63,
    where 8-bit products would saturate, see `has_vnni`); each call quantizes its input per row likewise,
    multiplies in int8 with exact int32 sums and scales the sums back to float32 by the row's and the
    column's scale. Every row is quantized on its own, so a hypothesis's logits do not depend on the other
    rows of its batch: batch invariance and cache == uncached hold as in float32. (PyTorch's
    `quantized.linear_dynamic` quantizes the input per tensor, which couples the rows; `fbgemm_int8_linear`
    uncouples them.)

    The int8 GEMM is oneDNN's (`torch._int_mm`) where the CPU has VNNI or AMX (`int8_gemm`); elsewhere
    PyTorch runs `_int_mm` as a plain loop, and FBGEMM's AVX2 kernel does the work instead.
    """
    if int8_gemm() == "fbgemm" and weight.shape[1] >= 2:
        return fbgemm_int8_linear(weight, bias, relu)
    return onednn_int8_linear(weight, bias, relu)


def onednn_int8_linear(weight: Tensor, bias: Tensor | None, relu: bool = False) -> Linear:
    """`int8_linear` through `torch._int_mm` (oneDNN's int8 GEMM where the CPU has VNNI or AMX)."""
    w = weight.detach().float()
    w_scale = w.abs().amax(dim=1).clamp(min=1e-12) / (127 if has_vnni() else 63)  # (out,)
    w_int8 = torch.round(w / w_scale[:, None]).to(torch.int8).t()  # (in, out)
    b = None if bias is None else bias.detach().float()

    def linear(x: Tensor) -> Tensor:
        rows = x.reshape(-1, x.shape[-1])
        scale = rows.abs().amax(dim=1, keepdim=True).clamp_(min=1e-12).div_(127)  # (N, 1)
        x_int8 = torch.div(rows, scale).round_().to(torch.int8)
        y = torch._int_mm(x_int8, w_int8).float().mul_(scale)  # (N, out): the int32 sums, scaled per row
        y = torch.addcmul(b, y, w_scale, out=y) if b is not None else y.mul_(w_scale)
        if relu:
            y = y.relu_()
        return y.view(*x.shape[:-1], y.shape[-1])

    return linear


def fbgemm_int8_linear(weight: Tensor, bias: Tensor | None, relu: bool = False) -> Linear:
    """`int8_linear` through FBGEMM's dynamic int8 linear, its input still quantized row by row.

    FBGEMM quantizes its whole input with one scale and zero point, taken from the input's minimum and
    maximum. Each call therefore divides every row by its own max|x| (so every value lies in [-1, 1]) and
    appends one row holding 1 and -1: the range is [-1, 1] whatever the batch, so each row is quantized to
    the same 256 levels on its own, and scaled back by its max|x| afterwards. The weight has 7 bits (scale
    max|w| / 63): FBGEMM's AVX2 kernel sums pairs of (0..255) x (int8) products in a saturating int16, which
    2 x 255 x 63 fits. The appended row costs one row of the product.
    """
    w = weight.detach().float()
    w_scale = w.abs().amax(dim=1).clamp(min=1e-12) / 63  # (out,)
    zero = torch.zeros(w.shape[0], dtype=torch.long)
    with warnings.catch_warnings():  # quantized tensors are deprecated in PyTorch; `int8_gemm` checks they exist
        warnings.filterwarnings("ignore", message=".*quantized tensor creation functions.*", category=UserWarning)
        q_weight = torch.quantize_per_channel(w, w_scale.double(), zero, 0, torch.qint8)
        packed = torch.ops.quantized.linear_prepack(q_weight, None)
    b = None if bias is None else bias.detach().float()
    span = torch.zeros(w.shape[1])  # the appended row: fixes the input's range at [-1, 1]
    span[0], span[1] = 1.0, -1.0

    def linear(x: Tensor) -> Tensor:
        rows = x.reshape(-1, x.shape[-1])
        n = rows.shape[0]
        scale = rows.abs().amax(dim=1, keepdim=True).clamp_(min=1e-12)  # (N, 1)
        unit = rows.new_empty(n + 1, rows.shape[1])
        torch.div(rows, scale, out=unit[:n])
        unit[n].copy_(span)
        y = torch.ops.quantized.linear_dynamic(unit, packed, False)[:n]  # (N, out); False: all 8 bits of x
        y = torch.addcmul(b, y, scale, out=y) if b is not None else y.mul_(scale)
        if relu:
            y = y.relu_()
        return y.view(*x.shape[:-1], y.shape[-1])

    return linear


@functools.cache
def int8_gemm() -> str:
    """The int8 GEMM `int8_linear` calls on this CPU: `onednn` (`torch._int_mm`) where the CPU multiplies
    8-bit integers natively (VNNI, AMX: PyTorch's oneDNN path), `fbgemm` on other x86 CPUs (an AVX2-only
    AMD EPYC ran `_int_mm` 30-40x slower than float32, as a plain loop; FBGEMM's AVX2 kernel at about
    float32's speed or better), `onednn` where FBGEMM is missing."""
    if _INT8_FLAGS & cpu_fields() or not _fbgemm_available():
        return "onednn"
    return "fbgemm"


def _fbgemm_available() -> bool:
    if not {"fbgemm", "x86"} & set(torch.backends.quantized.supported_engines):
        return False
    return hasattr(torch.ops.quantized, "linear_dynamic") and hasattr(torch.ops.quantized, "linear_prepack")


@functools.cache
def has_vnni() -> bool:
    """Whether the CPU multiplies 8-bit integers with 32-bit sums (AVX-512 VNNI, AVX-VNNI, AMX): then a weight is
    quantized to the full int8 range; without it, to 7 bits, since oneDNN's AVX2 kernel shifts the input to
    unsigned (0..255) and sums pairs of 8-bit products in a saturating int16: 2 x 255 x 63 fits, 2 x 255 x 127
    does not (measured: sums off by up to 24,768 with 7-bit inputs and 8-bit weights, exact with 8-bit inputs
    and 7-bit weights).

    A process that limits oneDNN below VNNI (`ONEDNN_MAX_CPU_ISA=AVX2`, as `scripts/cpu_kinds.sh` sets it to run
    as an AVX2-only CPU) gets oneDNN's AVX2 kernels, so it counts as a CPU without VNNI.
    """
    if os.environ.get("ONEDNN_MAX_CPU_ISA", "ALL").upper() in _ONEDNN_WITHOUT_VNNI:
        return False
    return bool(_INT8_FLAGS & cpu_fields())


_INT8_FLAGS = frozenset({"avx512_vnni", "avx_vnni", "amx_int8"})  # the CPU flags of native 8-bit products
_ONEDNN_WITHOUT_VNNI = frozenset({"SSE41", "AVX", "AVX2", "AVX512_CORE"})  # oneDNN's instruction sets below VNNI


@functools.cache
def int8_available() -> bool:
    """Whether this PyTorch has the int8 GEMM on the CPU that `int8_linear` calls."""
    return int8_gemm() == "fbgemm" or int_mm_available()


@functools.cache
def int_mm_available() -> bool:
    """Whether this PyTorch runs `torch._int_mm` on the CPU, which `onednn_int8_linear` calls."""
    if not hasattr(torch, "_int_mm"):
        return False
    try:
        torch._int_mm(torch.ones(1, 8, dtype=torch.int8), torch.ones(8, 8, dtype=torch.int8))
    except RuntimeError:
        return False
    return True


def onednn_available() -> bool:
    """Whether this PyTorch has the private oneDNN ops that `packed_linear` calls: the one feature check."""
    ops = torch.ops.mkldnn
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(ops, "_reorder_linear_weight")
        and hasattr(ops, "_linear_pointwise")
    )


def can_pack(module: nn.Module) -> bool:
    """Whether `module`'s decoding may use packed weights now (CPU float32, eval, no autograd)."""
    weight = next(module.parameters())
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and not module.training
        and not torch.is_grad_enabled()
    )


ParameterKey = tuple[tuple[int, int], ...]


def parameter_key(module: nn.Module) -> ParameterKey:
    """Where `module`'s parameters live and their versions: it changes when one is replaced or changed in place
    by autograd-visible ops (a fused optimizer's updates are not, see
    `seq2seq.model.transformer.DecodingPlan.invalidate`)."""
    return tuple((p.data_ptr(), p._version) for p in module.parameters())
