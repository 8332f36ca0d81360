"""A Transformer encoder with a masked-language-model head (Devlin et al., 2019): what `seq2seq pretrain` trains.

Notation: B batch, S source length, D d_model, V vocabulary (the tokenizer's pieces).

The encoder is the translation model's own (`build_transformer`'s, same module names), so its weights load into a
translation model's encoder (`train.init_encoder_from`). The one difference is the token embedding: it has V + 1
rows, the last being the mask token, id V (`mask_id`). The tokenizer never produces that id, so no SentencePiece
model changes and every existing tokenizer and checkpoint stays as it was; loading into a translation model drops
the row. The head is BERT's: a dense layer, GELU and LayerNorm, then the output projection tied to the first V
rows of the embedding (the mask token is never predicted), plus a bias.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from seq2seq.config import ModelConfig
from seq2seq.errors import ConfigError
from seq2seq.model.transformer import Encoder, build_transformer


def mask_id(vocab_size: int) -> int:
    """The mask token's id for a vocabulary of `vocab_size` pieces: the embedding row after them."""
    return vocab_size


class MaskedLM(nn.Module):
    """The encoder and its prediction head; `forward` matches a translation model's, so the training loop's
    loss (`seq2seq.training.loss.batch_loss`) scores it unchanged: the targets are the selected positions."""

    def __init__(self, encoder: Encoder, d_model: int, vocab_size: int) -> None:
        super().__init__()
        self.encoder = encoder
        self.vocab_size = vocab_size
        self.transform = nn.Linear(d_model, d_model)
        self.norm = nn.LayerNorm(d_model)
        self.bias = nn.Parameter(torch.zeros(vocab_size))
        nn.init.xavier_uniform_(self.transform.weight)
        nn.init.zeros_(self.transform.bias)

    def forward(
        self, src: Tensor, src_pad_mask: Tensor, tgt_in: Tensor | None = None, select: Tensor | None = None
    ) -> Tensor:
        """Logits (B, S, V) over the vocabulary at every position of the (masked) sources (B, S), or (N, V) at
        the `select`ed positions (B, S) bool. `tgt_in` is not read: there is no decoder."""
        h = self.encoder(src, src_pad_mask)  # (B, S, D)
        if select is not None:
            h = h[select]  # (N, D): only the positions that are scored
        h = self.norm(F.gelu(self.transform(h)))
        return F.linear(h, self.encoder.embedding.tokens.weight[: self.vocab_size], self.bias)  # (..., V)

    @property
    def max_positions(self) -> int:
        return self.encoder.embedding.max_positions


def require_transformer(cfg: ModelConfig) -> None:
    """A masked LM is a Transformer encoder: one line for another model.arch."""
    if cfg.arch != "transformer" or cfg.transformer is None:
        raise ConfigError(f"model.arch: seq2seq pretrain trains a Transformer encoder, not {cfg.arch}")


def build_masked_lm(cfg: ModelConfig, vocab_size: int) -> MaskedLM:
    """The encoder `cfg` describes, over `vocab_size` pieces and the mask token, with its head.

    It is built as the translation model's encoder is, with one decoder layer that is dropped at once."""
    require_transformer(cfg)
    assert cfg.transformer is not None
    one_layer = dataclasses.replace(cfg, transformer=dataclasses.replace(cfg.transformer, decoder_layers=1))
    encoder = build_transformer(one_layer, vocab_size + 1, vocab_size + 1).encoder
    return MaskedLM(encoder, cfg.d_model, vocab_size)
