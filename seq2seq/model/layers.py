"""Encoder and decoder layers with post-norm or pre-norm residual connections.

Notation: B batch, S source length, T target length, D d_model.

post-norm (the 2017 paper): x = LN(x + Dropout(F(x)))
pre-norm (Xiong et al., 2020): x = x + Dropout(F(LN(x))), with a final LN after the stack.
LN is LayerNorm, or RMSNorm (Zhang and Sennrich, 2019: no centring, no bias) with `norm_type: rmsnorm`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch.nn.functional as F
from torch import Tensor, nn

from seq2seq.config import TransformerConfig
from seq2seq.model.attention import MultiHeadAttention, Packing
from seq2seq.model.cache import LayerCache
from seq2seq.model.dropout import Dropout, add_dropout
from seq2seq.model.linear import linear
from seq2seq.model.long_attention import long_attention


@dataclass(frozen=True)
class LayerOptions:
    """A layer's variants besides its sizes: model.transformer's norm_type, positions and max_relative_distance
    (rope or relative positions live inside self-attention, up to `max_positions`)."""

    settings: TransformerConfig = TransformerConfig()
    max_positions: int = 0

    def norm(self, d_model: int) -> nn.Module:
        return nn.RMSNorm(d_model, eps=1e-5) if self.settings.norm_type == "rmsnorm" else nn.LayerNorm(d_model)

    def self_attention(self, d_model: int, n_heads: int, dropout: float, encoder: bool = False) -> MultiHeadAttention:
        """A layer's self-attention; an encoder's is `attention: local_global` or `linformer` when configured."""
        s = self.settings
        long = long_attention(s, self.max_positions) if encoder else None
        return MultiHeadAttention(
            d_model, n_heads, dropout, s.positions, self.max_positions, s.max_relative_distance, long
        )


class FeedForward(nn.Module):
    """Position-wise D -> d_ff -> D network."""

    def __init__(self, d_model: int, d_ff: int, dropout: float, activation: str) -> None:
        """`dropout` applies to the d_ff-wide hidden activations (fairseq's activation_dropout)."""
        super().__init__()
        self.fc1 = nn.Linear(d_model, d_ff)
        self.fc2 = nn.Linear(d_ff, d_model)
        self.activation: Callable[..., Tensor] = F.relu
        if activation in ("gelu", "swish"):  # swish: x * sigmoid(x), SiLU (Marian's)
            self.activation = F.gelu if activation == "gelu" else F.silu
        self.dropout = Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        if self.activation is F.relu:
            hidden = linear(x, self.fc1.weight, self.fc1.bias, relu=True)
        else:
            hidden = self.activation(linear(x, self.fc1.weight, self.fc1.bias))
        return linear(self.dropout(hidden), self.fc2.weight, self.fc2.bias)


class Residual(nn.Module):
    """A sub-layer wrapped in dropout, a residual connection and LayerNorm (or RMSNorm)."""

    def __init__(self, d_model: int, dropout: float, norm_first: bool, norm: nn.Module | None = None) -> None:
        super().__init__()
        self.norm = norm if norm is not None else nn.LayerNorm(d_model)
        self.dropout = Dropout(dropout)
        self.norm_first = norm_first

    def forward(self, x: Tensor, sublayer: Callable[[Tensor], Tensor]) -> Tensor:
        return self.leave(x, sublayer(self.enter(x)))

    def enter(self, x: Tensor) -> Tensor:
        """What the sub-layer reads: LN(x) for pre-norm, x for post-norm."""
        return self.norm(x) if self.norm_first else x

    def leave(self, x: Tensor, out: Tensor) -> Tensor:
        """The sub-layer's output `out` added to x, with dropout, then LN for post-norm."""
        added = add_dropout(x, out, self.dropout.p, self.training)
        return added if self.norm_first else self.norm(added)


class EncoderLayer(nn.Module):
    def __init__(
        self,
        d_model: int,
        n_heads: int,
        d_ff: int,
        dropout: float,
        attention_dropout: float,
        activation_dropout: float,
        activation: str,
        norm_first: bool,
        options: LayerOptions = LayerOptions(),
    ) -> None:
        super().__init__()
        self.self_attn = options.self_attention(d_model, n_heads, attention_dropout, encoder=True)
        self.ffn = FeedForward(d_model, d_ff, activation_dropout, activation)
        self.attn_block = Residual(d_model, dropout, norm_first, options.norm(d_model))
        self.ffn_block = Residual(d_model, dropout, norm_first, options.norm(d_model))

    def forward(self, x: Tensor, mask: Tensor, packing: Packing | None = None) -> Tensor:
        """x: (B, S, D), or (n, D) at the real positions of `packing`; mask: (B, 1, 1, S) True where allowed, or
        with `positions: t5_bias` additive (B, H, S, S): T5's position bias, -inf at padding."""
        x = self.attn_block(x, lambda h: self.self_attn.self_attention(h, mask=mask, packing=packing))
        return self.ffn_block(x, self.ffn if packing is None else packing.linears.get(self.ffn, self.ffn))


class DecoderLayer(nn.Module):
    def __init__(
        self,
        d_model: int,
        n_heads: int,
        d_ff: int,
        dropout: float,
        attention_dropout: float,
        activation_dropout: float,
        activation: str,
        norm_first: bool,
        options: LayerOptions = LayerOptions(),
    ) -> None:
        super().__init__()
        self.self_attn = options.self_attention(d_model, n_heads, attention_dropout)
        self.cross_attn = MultiHeadAttention(d_model, n_heads, attention_dropout)
        self.ffn = FeedForward(d_model, d_ff, activation_dropout, activation)
        self.self_block = Residual(d_model, dropout, norm_first, options.norm(d_model))
        self.cross_block = Residual(d_model, dropout, norm_first, options.norm(d_model))
        self.ffn_block = Residual(d_model, dropout, norm_first, options.norm(d_model))

    def forward(
        self,
        x: Tensor,
        memory: Tensor | None,
        memory_mask: Tensor | None,
        cache: LayerCache | None = None,
        need_attention: bool = False,
        self_mask: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """x (B, T, D) through the layer -> (B, T, D) and, with `need_attention`, the cross-attention weights
        (B, H, T, S); else None.

        Without `cache`, a teacher-forced pass over the encoder output `memory` (B, S, D),
        `memory_mask` (B, 1, 1, S) True where allowed. With it, a decoding step: x holds the
        positions after the cached ones, whose keys/values are appended to `cache`, the
        encoder's keys/values are the cache's (`memory` goes unused), and every projection
        runs as the session's plan says (`cache.plan`, seq2seq.model.plan). `self_mask`: the self-attention's
        additive causal mask with T5's position bias (`positions: t5_bias`), else None.
        """
        causal = self_mask is None
        x = self.self_block(x, lambda h: self.self_attn.self_attention(h, self_mask, causal, cache=cache))
        out, weights = self.cross_attn.cross_attention(
            self.cross_block.enter(x), memory, memory_mask, cache, need_attention
        )
        x = self.cross_block.leave(x, out)
        return self.ffn_block(x, self.ffn if cache is None else cache.plan.linear(self.ffn)), weights
