"""One entry point from `model.arch` to a model; everything above this module sees only `Seq2SeqModel`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from seq2seq.config import ModelConfig
from seq2seq.model.decoder_only import DecoderOnlySession, DecoderOnlyTransformer, build_decoder_only
from seq2seq.model.rnn import RNNSession, Seq2SeqRNN, build_rnn
from seq2seq.model.transformer import Seq2SeqTransformer, TransformerSession, build_transformer

if TYPE_CHECKING:
    from seq2seq.model.session import Decodable, DecodingSession

Seq2SeqModel = Seq2SeqTransformer | Seq2SeqRNN | DecoderOnlyTransformer
"""Each offers `forward(src, src_pad_mask, tgt_in, select)` for training, `start(src, src_pad_mask,
need_attention)` for search (`seq2seq.model.session.Decodable`: a session that steps, can `reorder` and
`select`, and records attention when asked), and `max_positions`."""


def build_model(cfg: ModelConfig, src_vocab_size: int, tgt_vocab_size: int) -> Seq2SeqModel:
    """The model a config describes."""
    if cfg.arch == "rnn":
        return build_rnn(cfg, src_vocab_size, tgt_vocab_size)
    if cfg.arch == "decoder_only":
        return build_decoder_only(cfg, src_vocab_size, tgt_vocab_size)
    return build_transformer(cfg, src_vocab_size, tgt_vocab_size)


if TYPE_CHECKING:  # for mypy only: each model starts sessions that search can drive

    def _sessions(
        transformer: Seq2SeqTransformer,
        rnn: Seq2SeqRNN,
        decoder_only: DecoderOnlyTransformer,
        steps: TransformerSession,
        recurrent: RNNSession,
        prefixed: DecoderOnlySession,
    ) -> tuple[Decodable, Decodable, Decodable, DecodingSession, DecodingSession, DecodingSession]:
        return transformer, rnn, decoder_only, steps, recurrent, prefixed
