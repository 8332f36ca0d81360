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
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

Linear = Callable[[Tensor], Tensor]
"""x (..., in) -> (..., out)."""

ROWS_HINT = 64  # the row count oneDNN picks the weight layout for; any row count works with it


def plain_linear(weight: Tensor, bias: Tensor | None) -> Linear:
    """`F.linear` with this weight (out, in) and bias: for a projection that is a slice of a module's weight."""
    return functools.partial(F.linear, weight=weight, bias=bias)


def packed_linear(weight: Tensor, bias: Tensor | None, relu: bool = False) -> Linear:
    """`F.linear` (then ReLU) with the weight (out, in) rearranged once for oneDNN."""
    packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), ROWS_HINT)
    bias = None if bias is None else bias.detach()
    attr = "relu" if relu else "none"

    def linear(x: Tensor) -> Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, attr, [], "")

    return linear


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
