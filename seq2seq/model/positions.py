"""Positions inside self-attention: rotary embeddings, relative position representations and T5's bias.

Notation: B batch, H heads, L length, Dh head dim.

All three make a self-attention score depend on the distance j - i between query i
and key j, never on i or j themselves, so shifting every position by a constant
changes nothing (tests/test_model.py proves it). Absolute positions still have to
be right when decoding incrementally: the query of step t sits at position t.
Cross-attention gets no positions: its queries and keys live in different sentences.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class RotaryPositions(nn.Module):
    """RoPE (Su et al., 2021): rotate each pair (x_m, x_m+Dh/2) of a query or key by position * theta_m.

    q(i) . k(j) after rotation is a function of q, k and j - i only, and it
    leaves the vectors' norms alone; it works with every attention kernel
    because it only changes Q and K before they get there.
    """

    cos: Tensor  # (max_positions, Dh): buffers, recomputed at build time, not saved in checkpoints
    sin: Tensor

    def __init__(self, head_dim: int, max_positions: int, base: float = 10000.0) -> None:
        super().__init__()
        self.base = base  # theta_m = base ** (-2m / Dh); an exporter must set the same
        if torch.get_default_device().type == "meta":  # built for its shapes only (seq2seq.model.build.on_meta)
            self.register_buffer("cos", torch.empty(max_positions, head_dim), persistent=False)
            self.register_buffer("sin", torch.empty(max_positions, head_dim), persistent=False)
            return
        inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)  # (Dh/2,)
        angles = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq  # (P, Dh/2)
        angles = torch.cat([angles, angles], dim=-1)  # (P, Dh): pair m with m + Dh/2
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, x: Tensor, start: int) -> Tensor:
        """x: (B, H, L, Dh) at positions start .. start+L-1 -> rotated, same shape."""
        length, half = x.shape[2], x.shape[3] // 2
        cos, sin = self.cos[start : start + length].to(x.dtype), self.sin[start : start + length].to(x.dtype)
        rotated_half = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated_half * sin


class RelativePositions(nn.Module):
    """Shaw et al. (2018): learned vectors for the clipped distance clip(j - i, -k, k), added to keys and values.

    e_ij = q_i . (k_j + a^K_ij) / sqrt(Dh) and z_i = sum_j alpha_ij (v_j + a^V_ij),
    with a^K, a^V shared by the heads of a layer (as in the paper). Clipping
    lets a model trained on short sentences read longer ones.
    """

    def __init__(self, head_dim: int, max_distance: int) -> None:
        super().__init__()
        self.max_distance = max_distance
        self.keys = nn.Embedding(2 * max_distance + 1, head_dim)
        self.values = nn.Embedding(2 * max_distance + 1, head_dim)
        nn.init.normal_(self.keys.weight, std=head_dim**-0.5)
        nn.init.normal_(self.values.weight, std=head_dim**-0.5)

    def distances(self, q_start: int, q_len: int, k_start: int, k_len: int, device: torch.device) -> Tensor:
        """Indices (Lq, Lk) of clip(j - i) for queries at q_start.. and keys at k_start.."""
        i = torch.arange(q_start, q_start + q_len, device=device)[:, None]
        j = torch.arange(k_start, k_start + k_len, device=device)[None, :]
        return (j - i).clamp(-self.max_distance, self.max_distance) + self.max_distance

    def score_bias(self, q: Tensor, index: Tensor) -> Tensor:
        """q . a^K_ij for q (B, H, Lq, Dh) -> (B, H, Lq, Lk); scaled like the content scores by the caller."""
        return torch.einsum("bhqd,qkd->bhqk", q, self.keys(index).to(q.dtype))

    def value_term(self, weights: Tensor, index: Tensor) -> Tensor:
        """sum_j alpha_ij a^V_ij for weights (B, H, Lq, Lk) -> (B, H, Lq, Dh)."""
        return torch.einsum("bhqk,qkd->bhqd", weights, self.values(index).to(weights.dtype))

    def scores(self, q: Tensor, k: Tensor, q_start: int, k_start: int = 0) -> Tensor:
        """e_ij (B, H, Lq, Lk) for queries q (B, H, Lq, Dh) at q_start.. and keys k (B, H, Lk, Dh) at k_start.."""
        index = self.distances(q_start, q.shape[2], k_start, k.shape[2], q.device)
        return (q @ k.transpose(-2, -1) + self.score_bias(q, index)) / math.sqrt(q.shape[-1])

    def attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        start: int,
        mask: Tensor | None,
        causal: bool,
        dropout: float,
        index: Tensor | None = None,
    ) -> Tensor:
        """z_i for queries at start.. over keys at 0.., before W_O: (B, H, Lq, Dh). mask: (B, 1, 1, Lk) True where
        allowed, an additive one (B, 1 or H, Lq, Lk) with -inf where not, or None; `causal` hides later keys;
        `dropout`: on the weights (0 outside training). `index` (Lq, Lk): each query-key pair's clipped
        distance (`distances`), for queries and keys in another order (a decoding step's grouped keys)."""
        if index is None:
            index = self.distances(start, q.shape[2], 0, k.shape[2], q.device)
        scores = (q @ k.transpose(-2, -1) + self.score_bias(q, index)) / math.sqrt(q.shape[-1])  # (B, H, Lq, Lk)
        if mask is not None and mask.is_floating_point():
            scores = scores + mask.to(scores.dtype)
        elif mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        if causal:
            i = torch.arange(start, start + q.shape[2], device=q.device)[:, None]
            scores = scores.masked_fill(torch.arange(k.shape[2], device=q.device)[None, :] > i, float("-inf"))
        weights = F.dropout(scores.softmax(dim=-1), dropout, dropout > 0)
        return weights @ v + self.value_term(weights, index)


class PositionBias(nn.Module):
    """T5's relative position bias (Raffel et al., 2020): a learned scalar per head for each bucket of the distance
    j - i between query i and key j, added to the self-attention logits.

    One module per stack (Encoder, Decoder), as in T5: its bias is computed once per pass and every layer adds the
    same. Buckets (`bucket`): in the encoder (bidirectional) half of them for keys after the query, half for the
    others; in the decoder (causal) all of them for keys at or before the query. Of a direction's n buckets, the
    first n/2 are the exact distances 0 .. n/2 - 1, the rest grow logarithmically up to `max_distance`; farther
    distances share the last. The logits are those of scaled dot-product attention, q . k / sqrt(Dh) + b.
    """

    def __init__(self, n_heads: int, bidirectional: bool, buckets: int, max_distance: int, d_model: int) -> None:
        super().__init__()
        self.bidirectional = bidirectional
        self.max_distance = max_distance
        self.bias = nn.Embedding(buckets, n_heads)  # (buckets, H): CTranslate2's relative_attention_bias
        nn.init.normal_(self.bias.weight, std=d_model**-0.5)

    def bucket(self, distance: Tensor) -> Tensor:
        """The bucket of each distance j - i (integer tensor, any shape), as T5 computes it."""
        n = self.bias.num_embeddings
        if self.bidirectional:
            n //= 2
            offset = (distance > 0).long() * n  # keys after the query: the upper half
            distance = distance.abs()
        else:
            offset = torch.zeros_like(distance)
            distance = (-distance).clamp(min=0)  # keys after the query are masked anyway
        exact = n // 2
        growth = torch.log(distance.float().clamp(min=1) / exact) / math.log(self.max_distance / exact)
        wide = exact + (growth * (n - exact)).long()  # floor, for the distances from `exact` on
        return offset + torch.where(distance < exact, distance, wide.clamp(max=n - 1))

    def forward(self, q_start: int, q_len: int, k_len: int, allowed: Tensor | None = None) -> Tensor:
        """The additive mask (1 or B, H, Lq, Lk) of queries at q_start.. over keys at 0..: the bias, -inf where
        `allowed` (B, 1, 1, Lk) is False and, in a causal stack, at keys after the query."""
        device = self.bias.weight.device
        i = torch.arange(q_start, q_start + q_len, device=device)[:, None]
        j = torch.arange(k_len, device=device)[None, :]
        mask = self.bias(self.bucket(j - i)).permute(2, 0, 1)[None]  # (1, H, Lq, Lk)
        if not self.bidirectional:
            mask = mask.masked_fill(j > i, float("-inf"))
        if allowed is not None:
            mask = mask.masked_fill(~allowed, float("-inf"))
        return mask
