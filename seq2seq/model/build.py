"""One entry point from `model.arch` to a model; everything above this module sees only `Seq2SeqModel`."""

from __future__ import annotations

from seq2seq.config import ModelConfig
from seq2seq.model.rnn import Seq2SeqRNN, build_rnn
from seq2seq.model.transformer import Seq2SeqTransformer, build_transformer

Seq2SeqModel = Seq2SeqTransformer | Seq2SeqRNN
"""Either offers `forward(src, src_pad_mask, tgt_in, select)` for training, `encode`, `init_cache` and
`decode_step` for search (`seq2seq.search.IncrementalModel`, with a cache that can `reorder` and `select`
and carries an attention record), and `max_positions`."""


def build_model(cfg: ModelConfig, src_vocab_size: int, tgt_vocab_size: int) -> Seq2SeqModel:
    """The model a config describes."""
    if cfg.arch == "rnn":
        return build_rnn(cfg, src_vocab_size, tgt_vocab_size)
    return build_transformer(cfg, src_vocab_size, tgt_vocab_size)
