"""Linear layers with the bias, and the ReLU after them, inside the matmul (CPU, float32).

PyTorch's CPU `addmm` copies the bias into every row of the output before it
accumulates the product onto it, and a ReLU after it is one more pass over
the (wide) feed-forward activations. oneDNN's matmul adds the bias and
applies the ReLU in its epilogue instead, while the numbers stay those of
`F.linear`. The backward is the usual three products; a fused ReLU's
gradient is masked by the output, which is positive exactly where the
pre-activation was.

Only float32 on CPU outside autocast takes this path: bf16 autocast casts
the inputs of `F.linear`, which a custom function would bypass, and GPUs
fuse what they need themselves. Modules keep their `nn.Linear` parameters,
so checkpoints do not change.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

# False: F.linear everywhere (`scripts/bench_train.py --compare linear` times the two)
ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def linear(x: Tensor, weight: Tensor, bias: Tensor | None, relu: bool = False) -> Tensor:
    """F.linear(x, weight, bias), followed by ReLU if `relu`: (..., D_in) -> (..., D_out)."""
    if ONEDNN and x.device.type == "cpu" and x.dtype == weight.dtype == torch.float32:
        if not torch.is_autocast_enabled("cpu"):
            return _FusedLinear.apply(x, weight, bias, relu)
    y = F.linear(x, weight, bias)
    return F.relu(y) if relu else y


class _FusedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Tensor | None, relu: bool) -> Tensor:
        y = torch.ops.mkldnn._linear_pointwise(x, weight, bias, "relu" if relu else "none", [], "")
        ctx.save_for_backward(x, weight, y if relu else None)
        ctx.relu, ctx.has_bias = relu, bias is not None
        return y

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None, Tensor | None, None]:
        x, weight, y = ctx.saved_tensors
        if ctx.relu:
            grad = torch.ops.aten.threshold_backward(grad, y, 0)
        grad2d = grad.reshape(-1, grad.shape[-1])  # (N, D_out)
        need_x, need_w, need_b, _ = ctx.needs_input_grad
        grad_x = (grad2d @ weight).view(x.shape) if need_x else None
        grad_w = grad2d.t() @ x.reshape(-1, x.shape[-1]) if need_w else None
        grad_b = grad2d.sum(0) if need_b and ctx.has_bias else None
        return grad_x, grad_w, grad_b, None
