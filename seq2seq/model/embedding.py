"""Token embeddings and the position encodings added to them, shared by the Transformer and the RNNs.

Notation: B batch, L length, D d_model, V vocabulary.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from seq2seq.config import ModelConfig
from seq2seq.model.dropout import Dropout
from seq2seq.text.vocab import PAD


def sinusoidal_table(n_positions: int, d_model: int) -> Tensor:
    """PE(pos, 2i) = sin(pos / 10000^(2i/D)), PE(pos, 2i+1) = cos(...)  (Vaswani et al., 2017, section 3.5)."""
    if torch.get_default_device().type == "meta":  # a model built for its shapes only (seq2seq.model.build.on_meta)
        return torch.empty(n_positions, d_model)
    position = torch.arange(n_positions, dtype=torch.float32)[:, None]
    inv_freq = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float32) * (-math.log(10000.0) / d_model))
    table = torch.zeros(n_positions, d_model)
    table[:, 0::2] = torch.sin(position * inv_freq)
    table[:, 1::2] = torch.cos(position * inv_freq)[:, : d_model // 2]
    return table  # (n_positions, D)


class Embedding(nn.Module):
    """Token embedding scaled by sqrt(D), plus a position encoding, then dropout.

    `positions`: sinusoidal or learned are added here; relative and rope live in
    self-attention instead (seq2seq.model.positions), and an RNN ("none") needs
    none, so nothing is added for them. The length check holds for all.
    """

    table: Tensor | None  # (max_positions, D) sinusoidal encodings: a buffer, not saved in checkpoints

    def __init__(self, tokens: nn.Embedding, d_model: int, max_positions: int, positions: str, dropout: float) -> None:
        super().__init__()
        self.tokens = tokens
        self.scale = math.sqrt(d_model)
        self.max_positions = max_positions
        self.positions: nn.Embedding | None = None
        if positions == "learned":
            self.positions = nn.Embedding(max_positions, d_model)
            nn.init.normal_(self.positions.weight, std=d_model**-0.5)
        table = sinusoidal_table(max_positions, d_model) if positions == "sinusoidal" else None
        self.register_buffer("table", table, persistent=False)
        self.dropout = Dropout(dropout)

    def forward(self, ids: Tensor, start: int = 0, positions: Tensor | None = None) -> Tensor:
        """ids: (B, L) at positions start .. start+L-1 -> (B, L, D); or at each row's own `positions` (B, L),
        none beyond start+L-1 (a decoder-only model's right-aligned sources, seq2seq.model.decoder_only)."""
        length = ids.shape[1]
        self.check_length(start + length)
        return self.embed(ids, slice(start, start + length) if positions is None else positions)

    def at(self, ids: Tensor, positions: Tensor, length: int) -> Tensor:
        """ids (n,), the real tokens of sequences of `length` positions, each at its own position (n,) ->
        (n, D): a packed batch's (seq2seq.model.attention.Packing), the same values as its padded one's."""
        self.check_length(length)
        return self.embed(ids, positions)

    def check_length(self, length: int) -> None:
        if length > self.max_positions:
            raise ValueError(f"sequence of {length} positions exceeds model.max_positions={self.max_positions}")

    def embed(self, ids: Tensor, where: slice | Tensor) -> Tensor:
        """The embeddings of ids (...) at positions `where` (a slice or an index tensor of ids' shape)."""
        x = self.tokens(ids) * self.scale
        if self.positions is not None:
            x = x + self.positions.weight[where]
        elif self.table is not None:
            x = x + self.table[where]
        return self.dropout(x)


def token_embeddings(cfg: ModelConfig, src_vocab_size: int, tgt_vocab_size: int) -> tuple[nn.Embedding, nn.Embedding]:
    """Source and target token embeddings: one matrix with model.share_all_embeddings."""
    if cfg.share_all_embeddings and src_vocab_size != tgt_vocab_size:
        raise ValueError("model.share_all_embeddings needs one vocabulary for both languages")
    tgt_tokens = _token_embedding(tgt_vocab_size, cfg.d_model)
    src_tokens = tgt_tokens if cfg.share_all_embeddings else _token_embedding(src_vocab_size, cfg.d_model)
    return src_tokens, tgt_tokens


def output_layer(cfg: ModelConfig, tgt_tokens: nn.Embedding, tgt_vocab_size: int) -> nn.Linear:
    """The (V, D) output projection, tied to the target embedding with model.share_decoder_embeddings."""
    output = nn.Linear(cfg.d_model, tgt_vocab_size, bias=False)
    if cfg.share_decoder_embeddings:
        output.weight = tgt_tokens.weight
    else:
        nn.init.normal_(output.weight, std=cfg.d_model**-0.5)
    return output


def _token_embedding(vocab_size: int, d_model: int) -> nn.Embedding:
    embedding = nn.Embedding(vocab_size, d_model, padding_idx=PAD)
    nn.init.normal_(embedding.weight, std=d_model**-0.5)
    with torch.no_grad():
        embedding.weight[PAD].zero_()
    return embedding
