"""One entry point from `model.arch` to a model; everything above this module sees only `Seq2SeqModel`."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch.overrides import TorchFunctionMode

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


@contextmanager
def on_meta() -> Iterator[None]:
    """Build modules on the meta device: the parameters' names and shapes, no memory, and no initial values.

    The initializers are skipped, not run on the meta tensors: there they compute nothing, and a meta `normal_`
    runs through Python code that first imports torch._dynamo (as do most meta operations: the position tables
    skip their arithmetic on meta too), seconds of every command that checks a checkpoint.
    """
    with torch.device("meta"), _SkipInitOnMeta():
        yield


class _SkipInitOnMeta(TorchFunctionMode):
    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        # torch.nn.init's functions; and Tensor.normal_, which those without a torch-function hook call (xavier_normal_)
        initializer = getattr(func, "__module__", None) == "torch.nn.init" or func is torch.Tensor.normal_
        tensor = args[0] if args else kwargs.get("tensor")  # torch.nn.init passes its tensor by keyword
        if initializer and isinstance(tensor, torch.Tensor) and tensor.is_meta:
            return tensor
        return func(*args, **kwargs)


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
