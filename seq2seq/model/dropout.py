"""Dropout with cheap masks, and dropout fused with the residual connection it precedes.

PyTorch's CPU dropout draws a float Bernoulli mask (one 32-bit draw and a
conversion per element), divides it by 1 - p in a second pass and multiplies
in a third; the residual connection adds in a fourth. Here one draw of the
generator masks two elements, the mask carries the 1/(1 - p) scale, and
x + dropout(y) is one `addcmul`, whose backward is one multiply as before.

The drop probability is rounded to a multiple of 2^-15 (0.1 becomes
0.1000061); the scale is exact for the rounded probability, so every
element's expectation is unchanged. Masks come from PyTorch's default
generator, so `torch.manual_seed` fixes them as it fixed the old ones.
GPUs, and a model compiled by `torch.compile` (which generates its own
random-number code), draw PyTorch's Bernoulli masks instead.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

_LEVELS = 1 << 15  # a 15-bit uniform number per element decides it


def keep_mask(shape: torch.Size, p: float, dtype: torch.dtype, device: torch.device) -> Tensor:
    """0 with probability p, else 1/(1 - p), per element of `shape` (in `dtype`)."""
    if device.type != "cpu" or torch.compiler.is_compiling():  # GPUs (and compiled graphs) draw masks fast
        return torch.empty(shape, dtype=dtype, device=device).bernoulli_(1 - p).div_(1 - p)
    drop = min(round(p * _LEVELS), _LEVELS - 1)
    n = shape.numel()
    # A draw gives 31 random bits (bit 31 is 0). Shifted left by one, a word's high 16 bits are all random
    # and its low 16 bits are 15 random ones over a 0: both halves, read as int16, fall below 2 * drop - 2^15
    # with probability drop / 2^15, so one comparison with one threshold decides both elements. It writes
    # 0s and 1s in `dtype` at once, and scaling them in place is cheaper than `where` from a bool mask.
    words = torch.empty(((n + 1) // 2,), dtype=torch.int32).random_().bitwise_left_shift_(1)
    mask = torch.empty(shape, dtype=dtype)
    torch.ge(words.view(torch.int16)[:n].view(shape), torch.tensor(2 * drop - _LEVELS, dtype=torch.int16), out=mask)
    return mask.mul_(_LEVELS / (_LEVELS - drop))


def dropout(x: Tensor, p: float, training: bool) -> Tensor:
    """x with each element zeroed with probability p and the rest scaled by 1/(1 - p), in training."""
    if not training or p == 0:
        return x
    return x * keep_mask(x.shape, p, x.dtype, x.device)


def add_dropout(x: Tensor, y: Tensor, p: float, training: bool) -> Tensor:
    """x + dropout(y) in one pass (the residual connection)."""
    if not training or p == 0:
        return x + y
    dtype = torch.promote_types(x.dtype, y.dtype)
    return torch.addcmul(x, y, keep_mask(y.shape, p, dtype, y.device))


class Dropout(nn.Module):
    """nn.Dropout with `keep_mask`'s masks (no parameters or buffers, so checkpoints are unchanged)."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p

    def forward(self, x: Tensor) -> Tensor:
        return dropout(x, self.p, self.training)

    def extra_repr(self) -> str:
        return f"p={self.p}"
