"""Encoder and decoder layers with post-norm or pre-norm residual connections.

Notation: B batch, S source length, T target length, D d_model.

post-norm (the 2017 paper): x = LN(x + Dropout(F(x)))
pre-norm (Xiong et al., 2020): x = x + Dropout(F(LN(x))), with a final LN after the stack.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.nn.functional as F
from torch import Tensor, nn

from seq2seq.model.attention import LayerCache, MultiHeadAttention


class FeedForward(nn.Module):
    """Position-wise D -> d_ff -> D network."""

    def __init__(self, d_model: int, d_ff: int, dropout: float, activation: str) -> None:
        """`dropout` applies to the d_ff-wide hidden activations (fairseq's activation_dropout)."""
        super().__init__()
        self.fc1 = nn.Linear(d_model, d_ff)
        self.fc2 = nn.Linear(d_ff, d_model)
        self.activation = F.gelu if activation == "gelu" else F.relu
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.dropout(self.activation(self.fc1(x))))


class Residual(nn.Module):
    """A sub-layer wrapped in dropout, a residual connection and LayerNorm."""

    def __init__(self, d_model: int, dropout: float, norm_first: bool) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d_model)
        self.dropout = nn.Dropout(dropout)
        self.norm_first = norm_first

    def forward(self, x: Tensor, sublayer: Callable[[Tensor], Tensor]) -> Tensor:
        if self.norm_first:
            return x + self.dropout(sublayer(self.norm(x)))
        return self.norm(x + self.dropout(sublayer(x)))


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
    ) -> None:
        super().__init__()
        self.self_attn = MultiHeadAttention(d_model, n_heads, attention_dropout)
        self.ffn = FeedForward(d_model, d_ff, activation_dropout, activation)
        self.attn_block = Residual(d_model, dropout, norm_first)
        self.ffn_block = Residual(d_model, dropout, norm_first)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        """x: (B, S, D); mask: (B, 1, 1, S) True where attention is allowed."""
        x = self.attn_block(x, lambda h: self.self_attn.attend(*self.self_attn.project_self(h), mask=mask))
        return self.ffn_block(x, self.ffn)


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
    ) -> None:
        super().__init__()
        self.self_attn = MultiHeadAttention(d_model, n_heads, attention_dropout)
        self.cross_attn = MultiHeadAttention(d_model, n_heads, attention_dropout)
        self.ffn = FeedForward(d_model, d_ff, activation_dropout, activation)
        self.self_block = Residual(d_model, dropout, norm_first)
        self.cross_block = Residual(d_model, dropout, norm_first)
        self.ffn_block = Residual(d_model, dropout, norm_first)

    def forward(self, x: Tensor, memory: Tensor, memory_mask: Tensor) -> Tensor:
        """Teacher-forced pass. x: (B, T, D); memory: (B, S, D); memory_mask: (B, 1, 1, S)."""
        x = self.self_block(x, lambda h: self.self_attn.attend(*self.self_attn.project_self(h), causal=True))
        k, v = self.cross_attn.project_memory(memory)
        x = self.cross_block(x, lambda h: self.cross_attn.attend(self.cross_attn.project_query(h), k, v, memory_mask))
        return self.ffn_block(x, self.ffn)

    def step(self, x: Tensor, cache: LayerCache, memory_mask: Tensor) -> Tensor:
        """One incremental position. x: (B, 1, D); appends this step's keys/values to `cache`."""

        def self_attention(h: Tensor) -> Tensor:
            q, k, v = self.self_attn.project_self(h)
            k, v = cache.append(k, v)
            return self.self_attn.attend(q, k, v)  # a single query may see every cached position

        x = self.self_block(x, self_attention)
        x = self.cross_block(
            x,
            lambda h: self.cross_attn.attend(
                self.cross_attn.project_query(h), cache.cross_k, cache.cross_v, memory_mask
            ),
        )
        return self.ffn_block(x, self.ffn)
