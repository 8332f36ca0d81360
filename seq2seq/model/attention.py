"""Multi-head attention (Vaswani et al., 2017, section 3.2) and its key/value cache.

Notation: B batch, S source length, T target length, D d_model, H heads,
Dh head dim (D / H), V vocabulary.

Masks arrive in one convention everywhere in the package: a boolean
`pad_mask` of shape (B, S), True at padding. It is turned into the form that
`scaled_dot_product_attention` wants (True = may attend) only here.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from seq2seq.model.positions import RelativePositions, RotaryPositions


def training_kernel(device: torch.device, precision: str = "fp32") -> SDPBackend | None:
    """The attention kernel for training updates on `device` in `precision`; None leaves the choice to PyTorch.

    Without attention dropout PyTorch picks its flash kernel on CPU. In fp32
    that is the faster one for training (1.16x tokens/s over the math kernel's
    whole update on an AVX2 CPU, docs/results.md); in bf16 autocast its math
    kernel (matmul, softmax, matmul) trained 1.31x faster on an AVX512-BF16 CPU
    (`scripts/bench_train.py --compare attention`), so bf16 asks for math.
    Decoding keeps PyTorch's choice (`scripts/bench_decode.py --compare
    attention`), as does CUDA, where the fused kernels win.
    """
    return SDPBackend.MATH if device.type == "cpu" and precision == "bf16" else None


def kernel_scope(kernel: SDPBackend | None) -> contextlib.AbstractContextManager[None]:
    """Run the model's attention with `kernel` inside this scope (None: PyTorch's choice)."""
    return contextlib.nullcontext() if kernel is None else sdpa_kernel(kernel)


def attention_mask(pad_mask: Tensor) -> Tensor:
    """(B, S) True-at-padding -> (B, 1, 1, S) True-where-attention-is-allowed."""
    return ~pad_mask[:, None, None, :]


class MultiHeadAttention(nn.Module):
    """Self- or cross-attention with a fused input projection.

    One (3D, D) weight holds W_Q, W_K and W_V: self-attention projects all three
    in one matmul; cross-attention projects queries from the decoder and keys
    and values from the encoder output (once per sentence when decoding).

    Self-attention may carry positions of its own (`positions`: "rope" or
    "relative", seq2seq.model.positions). Rotary ones go through PyTorch's
    attention kernels like the plain ones; relative ones add a term to the
    values, which no fused kernel computes, so they run the math here.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        dropout: float,
        positions: str = "",
        max_positions: int = 0,
        max_relative_distance: int = 0,
    ) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.d_model = d_model
        self.dropout = dropout
        self.in_proj = nn.Linear(d_model, 3 * d_model)
        self.out_proj = nn.Linear(d_model, d_model)
        head_dim = d_model // n_heads
        self.rotary = RotaryPositions(head_dim, max_positions) if positions == "rope" else None
        self.relative = RelativePositions(head_dim, max_relative_distance) if positions == "relative" else None

    def split_heads(self, x: Tensor) -> Tensor:
        B, L, _ = x.shape
        return x.view(B, L, self.n_heads, -1).transpose(1, 2)  # (B, H, L, Dh)

    def project_self(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Queries, keys and values of `x` (B, L, D), each (B, H, L, Dh)."""
        q, k, v = self.in_proj(x).chunk(3, dim=-1)
        return self.split_heads(q), self.split_heads(k), self.split_heads(v)

    def project_query(self, x: Tensor) -> Tensor:
        w, b = self.in_proj.weight[: self.d_model], self.in_proj.bias[: self.d_model]
        return self.split_heads(F.linear(x, w, b))  # (B, H, T, Dh)

    def project_memory(self, memory: Tensor) -> tuple[Tensor, Tensor]:
        """Keys and values of the encoder output (B, S, D), each (B, H, S, Dh)."""
        w, b = self.in_proj.weight[self.d_model :], self.in_proj.bias[self.d_model :]
        k, v = F.linear(memory, w, b).chunk(2, dim=-1)
        return self.split_heads(k), self.split_heads(v)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, causal: bool = False) -> Tensor:
        """softmax(Q K^T / sqrt(Dh)) V over heads, then W_O: (B, H, T, Dh) -> (B, T, D)."""
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=self.dropout if self.training else 0.0, is_causal=causal
        )  # (B, H, T, Dh)
        return self.merge_heads(out)

    def merge_heads(self, out: Tensor) -> Tensor:
        """(B, H, T, Dh) -> W_O applied to the concatenated heads, (B, T, D)."""
        B, _, T, _ = out.shape
        return self.out_proj(out.transpose(1, 2).reshape(B, T, self.d_model))

    def self_attention(
        self, x: Tensor, mask: Tensor | None = None, causal: bool = False, cache: LayerCache | None = None
    ) -> Tensor:
        """Self-attention of x (B, L, D) at positions 0..L-1, or, with `cache`, of the next positions
        after the cached ones, which it appends to the cache (then every cached key is visible)."""
        start = 0 if cache is None else cache.length
        q, k, v = self.project_self(x)
        if self.rotary is not None:
            q, k = self.rotary(q, start), self.rotary(k, start)
        if cache is not None:
            k, v = cache.append(k, v)
        if self.relative is None:
            return self.attend(q, k, v, mask, causal)
        return self.attend_relative(q, k, v, start, mask, causal)

    def scores(self, q: Tensor, k: Tensor, q_start: int, k_start: int = 0) -> Tensor:
        """Pre-softmax scores (B, H, Lq, Lk) of queries at q_start.. against keys at k_start..

        Queries and keys arrive rotated already when positions are rotary.
        """
        scores = q @ k.transpose(-2, -1)
        if self.relative is not None:
            index = self.relative.distances(q_start, q.shape[2], k_start, k.shape[2], q.device)
            scores = scores + self.relative.score_bias(q, index)
        return scores / math.sqrt(q.shape[-1])

    def attend_relative(self, q: Tensor, k: Tensor, v: Tensor, start: int, mask: Tensor | None, causal: bool) -> Tensor:
        """Shaw et al.'s attention for queries at start.. over keys at 0..: (B, H, Lq, Dh) -> (B, Lq, D)."""
        assert self.relative is not None
        scores = self.scores(q, k, start)  # (B, H, Lq, Lk)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        if causal:
            i = torch.arange(start, start + q.shape[2], device=q.device)[:, None]
            scores = scores.masked_fill(torch.arange(k.shape[2], device=q.device)[None, :] > i, float("-inf"))
        weights = F.dropout(scores.softmax(dim=-1), self.dropout, self.training)
        index = self.relative.distances(start, q.shape[2], 0, k.shape[2], q.device)
        return self.merge_heads(weights @ v + self.relative.value_term(weights, index))


class LayerCache:
    """One decoder layer's cached keys/values.

    The cross-attention keys/values are computed once per sentence; the
    self-attention keys/values grow by one position per decoding step.
    """

    def __init__(self, cross_k: Tensor, cross_v: Tensor) -> None:
        self.cross_k = cross_k  # (B, H, S, Dh)
        self.cross_v = cross_v
        self.self_k: Tensor | None = None  # (B, H, t, Dh)
        self.self_v: Tensor | None = None

    @property
    def length(self) -> int:
        """Positions cached so far: the absolute position of the next one."""
        return 0 if self.self_k is None else self.self_k.shape[2]

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Add this step's keys/values (B, H, 1, Dh); return all of them so far."""
        if self.self_k is None or self.self_v is None:
            self.self_k, self.self_v = k, v
        else:
            self.self_k = torch.cat([self.self_k, k], dim=2)
            self.self_v = torch.cat([self.self_v, v], dim=2)
        return self.self_k, self.self_v


class DecoderCache:
    """Everything incremental decoding carries between steps, as a visible value."""

    def __init__(self, layers: list[LayerCache], cross_mask: Tensor) -> None:
        self.layers = layers
        self.cross_mask = cross_mask  # (B, 1, 1, S) True where attention is allowed
        self.step = 0  # position of the next token

    @property
    def batch_size(self) -> int:
        return self.cross_mask.shape[0]

    def reorder(self, index: Tensor) -> None:
        """Reorder hypotheses *within* each sentence (beam search).

        Only the self-attention keys/values move: the cross-attention ones are the
        same for every hypothesis of a sentence, so reordering them would copy
        for nothing.
        """
        for layer in self.layers:
            if layer.self_k is not None and layer.self_v is not None:
                layer.self_k = layer.self_k.index_select(0, index)
                layer.self_v = layer.self_v.index_select(0, index)

    def select(self, index: Tensor) -> None:
        """Keep (or repeat) whole rows, cross-attention included: for dropping
        finished sentences or expanding each sentence to its beam."""
        self.reorder(index)
        for layer in self.layers:
            layer.cross_k = layer.cross_k.index_select(0, index)
            layer.cross_v = layer.cross_v.index_select(0, index)
        self.cross_mask = self.cross_mask.index_select(0, index)
