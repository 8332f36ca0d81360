"""Search without the key/value cache: the reference the cache is tested against, and its benchmark baseline.

`UncachedModel` offers the incremental API that `seq2seq.search` drives, but
each step reruns `Decoder.forward` over the whole prefix (quadratic in the
length), the way training computes it. Used by tests/test_search.py and
scripts/bench_decode.py; nothing else should decode this way.
"""

from __future__ import annotations

import torch
from torch import Tensor

from seq2seq.config import DecodeConfig
from seq2seq.model import Seq2SeqModel, Seq2SeqTransformer
from seq2seq.model.attention import attention_mask
from seq2seq.model.record import AttentionRecord
from seq2seq.search import Hypothesis, search


class PrefixState:
    """What an uncached decoder carries between steps: the encoder output and the whole prefix."""

    def __init__(self, memory: Tensor, src_pad_mask: Tensor) -> None:
        self.memory = memory  # (N, S, D)
        self.memory_mask = attention_mask(src_pad_mask)  # (N, 1, 1, S)
        self.tokens = torch.zeros(memory.shape[0], 0, dtype=torch.long, device=memory.device)  # (N, t)
        self.attention: AttentionRecord | None = None  # as DecoderCache's: one (N, L, H, S) entry per step

    def reorder(self, index: Tensor) -> None:
        self.tokens = self.tokens.index_select(0, index)

    def select(self, index: Tensor) -> None:
        self.reorder(index)
        self.memory = self.memory.index_select(0, index)
        self.memory_mask = self.memory_mask.index_select(0, index)


class UncachedModel:
    """The incremental API without a cache. The encoder still runs once per batch,
    and only the last position is projected to the vocabulary, so the baseline
    pays just for the recomputed decoder layers."""

    def __init__(self, model: Seq2SeqModel) -> None:
        if not isinstance(model, Seq2SeqTransformer):  # an RNN's state *is* its cache: there is nothing to drop
            raise ValueError("uncached decoding is a Transformer baseline; this model is not a Transformer")
        self.model = model

    def encode(self, src: Tensor, src_pad_mask: Tensor) -> Tensor:
        return self.model.encode(src, src_pad_mask)

    def init_cache(self, memory: Tensor, src_pad_mask: Tensor) -> PrefixState:
        return PrefixState(memory, src_pad_mask)

    def decode_step(self, tokens: Tensor, state: PrefixState) -> Tensor:
        state.tokens = torch.cat([state.tokens, tokens], dim=1)  # (N, t)
        last = torch.zeros_like(state.tokens, dtype=torch.bool)
        last[:, -1] = True  # one selected position per row: (N, V) in row order
        record = state.attention
        logits, weights = self.model.decoder.run(
            state.tokens, state.memory, state.memory_mask, last, need_weights=record is not None
        )
        if record is not None:
            record.end_step(weights)  # the last position's weights
        return logits


def uncached_search(
    model: Seq2SeqModel,
    src: Tensor,
    src_pad_mask: Tensor,
    cfg: DecodeConfig,
    limit: int,
    prefix: Tensor | None = None,
) -> list[list[Hypothesis]]:
    """`seq2seq.search.search` without the key/value cache."""
    return search(UncachedModel(model), src, src_pad_mask, cfg, limit, prefix)
