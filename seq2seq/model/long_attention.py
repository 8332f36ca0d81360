"""The encoder's self-attention for long inputs: local + global (BigBird-style) and Linformer.

Notation: B batch, H heads, S length, Dh head dim, W window, G global tokens, R random links, C chunk,
n chunks, k Linformer's projected length. `real` (B, S) is True at the real (non-padding) positions.

`local_global` (Beltagy et al., 2020; Zaheer et al., 2020). Query i may attend to key j when
  - |i - j| <= W (the window), or
  - i < G or j < G (the first G positions are global: they attend to and are attended by all), or
  - j is one of i's R random links (`random_links`: a fixed hash of (i, t) scaled to the sentence's length,
    so a model is deterministic and a sentence's links do not depend on the padding around it),
and never when j is padding. A query also always attends to itself, so that no row of padding is empty
(a softmax over nothing is NaN, and NaN reaches the gradients even of rows that are thrown away).
One rule, two computations: a dense (B, 1, S, S) mask for short inputs (`dense`), and for inputs longer
than DENSE_UP_TO a blocked one whose memory grows linearly with S (`blocked`): chunks of C queries attend
to their chunk +-W, to the G global keys and to their random links; the G global queries attend to every key.

`linformer` (Wang et al., 2020): keys and values are projected along the sequence axis to a fixed length k
by learned E, F (max_positions, k) of each layer, so attention costs S * k instead of S * S. Padding keys
and values are zeroed before the projection: a sentence gets the same result alone as in a padded batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from seq2seq.config import TransformerConfig
from seq2seq.errors import ConfigError
from seq2seq.model.positions import RelativePositions

DENSE_UP_TO = 512
"""local_global computes inputs up to this length with a dense (S, S) mask, longer ones blocked."""

MIN_CHUNK = 16
"""local_global's blocked path takes queries in chunks of max(window, MIN_CHUNK)."""


class LongAttention(nn.Module):
    """An encoder self-attention that is not full: (q, k, v (B, H, S, Dh), real (B, S), dropout, the layer's
    relative positions or None) -> (B, H, S, Dh)."""

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, real: Tensor, dropout: float, relative: RelativePositions | None = None
    ) -> Tensor:
        raise NotImplementedError


def long_attention(settings: TransformerConfig, max_positions: int) -> LongAttention | None:
    """The encoder self-attention `model.transformer.attention` asks for; None for full attention."""
    if settings.attention == "local_global":
        return LocalGlobalAttention(settings.window, settings.global_tokens, settings.random_links)
    if settings.attention == "linformer":
        return LinformerAttention(max_positions, settings.linformer_length)
    return None


def random_links(lengths: Tensor, length: int, links: int) -> Tensor:
    """(B, S, R) key positions: link t of query i in a sentence of n real positions is floor(u(i, t) * n), u a
    fixed integer hash (uniform on [0, 1)) of i and t; every link is a real position of its sentence."""
    i = torch.arange(length, device=lengths.device)[:, None]
    t = torch.arange(links, device=lengths.device)[None, :]
    h = (i * 73856093 + t * 19349663 + 83492791) & 0xFFFFFFFF  # (S, R), 32 bits in int64
    for _ in range(2):  # a 32-bit integer mix (two rounds of xorshift-multiply)
        h = ((h ^ (h >> 16)) * 0x45D9F3B) & 0xFFFFFFFF
    h = h ^ (h >> 16)
    return (h[None] * lengths[:, None, None]) >> 32


class LocalGlobalAttention(LongAttention):
    """Windowed attention with global tokens and random links (see the module's docstring); no weights."""

    def __init__(self, window: int, global_tokens: int, links: int) -> None:
        super().__init__()
        self.window = window
        self.global_tokens = global_tokens
        self.links = links

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, real: Tensor, dropout: float, relative: RelativePositions | None = None
    ) -> Tensor:
        if q.shape[2] <= DENSE_UP_TO:
            return self.dense(q, k, v, real, dropout, relative)
        return self.blocked(q, k, v, real, dropout, relative)

    def dense(
        self, q: Tensor, k: Tensor, v: Tensor, real: Tensor, dropout: float, relative: RelativePositions | None = None
    ) -> Tensor:
        """Attention with the dense mask: memory grows with S * S."""
        return attend(q, k, v, self.mask(real), dropout, relative)

    def mask(self, real: Tensor) -> Tensor:
        """(B, S) -> (B, 1, S, S), True where query i may attend to key j."""
        B, S = real.shape
        i = torch.arange(S, device=real.device)[:, None]
        j = torch.arange(S, device=real.device)[None, :]
        G = self.global_tokens
        allowed = (((i - j).abs() <= self.window) | (i < G) | (j < G))[None] & real[:, None, :]  # (B, S, S)
        if self.links:
            links, valid = self.random_keys(real, S)
            hits = torch.zeros(B, S, S, dtype=torch.long, device=real.device)
            allowed = allowed | (hits.scatter_add_(2, links, valid.long()) > 0)
        return (allowed | (i == j))[:, None]

    def random_keys(self, real: Tensor, length: int) -> tuple[Tensor, Tensor]:
        """The random links (B, L, R) of queries 0..length-1 and whether each adds a key (B, L, R): not one
        of the window's or the global ones, nor a repeat of an earlier link of the same query."""
        links = random_links(real.sum(dim=1), length, self.links)
        i = torch.arange(length, device=real.device)[None, :, None]
        valid = ((links - i).abs() > self.window) & (links >= self.global_tokens)
        earlier = torch.ones(self.links, self.links, dtype=torch.bool, device=real.device).tril(-1)  # (R, R)
        repeated = ((links[..., :, None] == links[..., None, :]) & earlier).any(dim=-1)
        at_real = real.gather(1, links.flatten(1)).view_as(links)  # padding sits after the sentence: always
        return links, valid & ~repeated & at_real

    def blocked(
        self, q: Tensor, k: Tensor, v: Tensor, real: Tensor, dropout: float, relative: RelativePositions | None = None
    ) -> Tensor:
        """The same attention in chunks of C queries: memory grows with S * (C + 2W + G + R).

        Each query's keys come in three parts, scored together in one softmax: its chunk's band (the chunk and W
        keys either side, shared by the chunk's queries), the G global keys, and its R random links."""
        B, H, S, Dh = q.shape
        W, G, C = self.window, min(self.global_tokens, S), max(self.window, MIN_CHUNK)
        n = math.ceil(S / C)
        P = n * C  # S padded to whole chunks
        at = torch.arange(P, device=q.device).view(n, C, 1)  # each query's position
        qb = F.pad(q, (0, 0, 0, P - S)).view(B, H, n, C, Dh)
        band = (C + 2 * W, C)  # each chunk's keys: its own and W either side (unfold's size, step)
        kb = F.pad(k, (0, 0, W, P - S + W)).unfold(2, *band).transpose(-1, -2)  # (B, H, n, C + 2W, Dh)
        vb = F.pad(v, (0, 0, W, P - S + W)).unfold(2, *band).transpose(-1, -2)
        key_real = F.pad(real, (W, P - S + W)).unfold(1, *band)  # (B, n, C + 2W)
        offset = torch.arange(C + 2 * W, device=q.device)[None, :] - W - torch.arange(C, device=q.device)[:, None]
        in_band = (offset.abs() <= W) & (at + offset >= G)  # (n, C, C + 2W): global keys come separately
        parts = [
            Part(kb, vb, (in_band[None] & key_real[:, :, None, :]) | (offset == 0), offset),  # (C, C + 2W) apart
            Part(k[:, :, None, :G], v[:, :, None, :G], real[:, None, None, :G], torch.arange(G, device=q.device) - at),
        ]
        if self.links:
            links, valid = self.random_keys(real, P)  # (B, P, R)
            chunked = links.view(B, n, C, -1)
            parts.append(Part(gather_rows(k, chunked), gather_rows(v, chunked), valid.view(B, n, C, -1), chunked - at))
        scores = [part.scores(qb, relative) for part in parts]  # (B, H, n, C, *)
        allowed = torch.cat([part.allowed[:, None].expand(B, 1, n, C, -1) for part in parts], -1)
        weights = torch.cat(scores, -1).masked_fill(~allowed, float("-inf")).softmax(dim=-1)
        weights = F.dropout(weights, dropout, dropout > 0)
        out = sum(part.read(w, relative) for part, w in zip(parts, weights.split([s.shape[-1] for s in scores], -1)))
        out = cast(Tensor, out).reshape(B, H, P, Dh)[:, :, :S]
        if G == 0:
            return out
        everything = real[:, None, None, :] | torch.eye(G, S, dtype=torch.bool, device=q.device)  # (B, 1, G, S)
        heads = attend(q[:, :, :G], k, v, everything, dropout, relative)
        return torch.cat([heads, out[:, :, G:]], dim=2)


def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, dropout: float, relative: RelativePositions | None) -> Tensor:
    """Attention of queries at 0.. over keys at 0.., mask (B, 1, Lq or 1, Lk) True where allowed."""
    if relative is not None:
        return relative.attend(q, k, v, 0, mask, False, dropout)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout)


@dataclass
class Part:
    """One part of the keys of each chunk's queries in `LocalGlobalAttention.blocked`.

    keys, values: (B, H, n or 1, K, Dh) shared by a chunk's queries, or (B, H, n, C, K, Dh) each query's own;
    allowed: (B or 1, n or 1, C, K); distance: j - i of each query and key, (C, K), (n, C, K) or (B, n, C, K)
    (only Shaw et al.'s relative positions read it: their vectors are looked up per distance, never per head)."""

    keys: Tensor
    values: Tensor
    allowed: Tensor
    distance: Tensor

    def scores(self, q: Tensor, relative: RelativePositions | None) -> Tensor:
        """q (B, H, n, C, Dh) -> scaled scores (B, H, n, C, K), with Shaw et al.'s key term."""
        if self.keys.dim() == 5:
            scores = q @ self.keys.transpose(-1, -2)
        else:
            scores = torch.einsum("bhnqd,bhnqkd->bhnqk", q, self.keys)
        if relative is not None:
            scores = scores + torch.einsum(f"bhnqd,{self.subscripts()}->bhnqk", q, self.vectors(relative.keys))
        return scores / math.sqrt(q.shape[-1])

    def read(self, weights: Tensor, relative: RelativePositions | None) -> Tensor:
        """weights (B, H, n, C, K) -> (B, H, n, C, Dh), with Shaw et al.'s value term."""
        if self.values.dim() == 5:
            out = weights @ self.values
        else:
            out = torch.einsum("bhnqk,bhnqkd->bhnqd", weights, self.values)
        if relative is not None:
            out = out + torch.einsum(f"bhnqk,{self.subscripts()}->bhnqd", weights, self.vectors(relative.values))
        return out

    def subscripts(self) -> str:
        return {2: "qkd", 3: "nqkd", 4: "bnqkd"}[self.distance.dim()]

    def vectors(self, table: nn.Embedding) -> Tensor:
        """The vectors of the clipped distances, (..., C, K, Dh)."""
        clip = (table.num_embeddings - 1) // 2
        return table(self.distance.clamp(-clip, clip) + clip)


def gather_rows(x: Tensor, index: Tensor) -> Tensor:
    """x (B, H, S, Dh) at positions index (B, ...) -> (B, H, ..., Dh)."""
    B, H, _, Dh = x.shape
    flat = index.reshape(B, 1, -1, 1).expand(B, H, -1, Dh)
    return x.gather(2, flat).view(B, H, *index.shape[1:], Dh)


class LinformerAttention(LongAttention):
    """Linformer's attention (Wang et al., 2020): keys and values projected along the sequence axis to length k
    by E and F (max_positions, k), shared by the heads of a layer ("headwise sharing")."""

    def __init__(self, max_positions: int, length: int) -> None:
        super().__init__()
        self.key_projection = nn.Parameter(torch.empty(max_positions, length))  # E
        self.value_projection = nn.Parameter(torch.empty(max_positions, length))  # F
        nn.init.xavier_normal_(self.key_projection)
        nn.init.xavier_normal_(self.value_projection)

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, real: Tensor, dropout: float, relative: RelativePositions | None = None
    ) -> Tensor:
        """`relative` is always None: the config refuses relative positions with linformer."""
        S, limit = k.shape[2], self.key_projection.shape[0]
        if S > limit:
            raise ConfigError(
                f"model.transformer.attention=linformer: an input of {S} positions is longer than the {limit} "
                "its projection was built for (model.max_positions)"
            )
        padding = ~real[:, None, :, None]  # (B, 1, S, 1): zeroed BEFORE the projection
        E, F_ = self.key_projection[:S].to(k.dtype), self.value_projection[:S].to(v.dtype)  # (S, k)
        keys = E.t() @ k.masked_fill(padding, 0.0)  # (k, S) @ (B, H, S, Dh) -> (B, H, k, Dh)
        values = F_.t() @ v.masked_fill(padding, 0.0)
        return F.scaled_dot_product_attention(q, keys, values, dropout_p=dropout)
