"""Search without the key/value cache: the reference the cache is tested against, and its benchmark baseline.

`UncachedModel` starts decoding sessions (seq2seq.model.session) that search
drives like any model's, but each step reruns the decoder's teacher-forced
`forward` over the whole prefix (quadratic in the length), the way training
computes it. Used by tests/test_search.py and scripts/bench/bench_decode.py; nothing
else should decode this way.
"""

from __future__ import annotations

import torch
from torch import Tensor

from seq2seq.config import DecodeConfig
from seq2seq.decoding.search import Hypothesis, search
from seq2seq.model import Seq2SeqTransformer
from seq2seq.model.attention import attention_mask
from seq2seq.model.record import AttentionRecord
from seq2seq.model.session import Decodable
from seq2seq.model.transformer import Decoder


class UncachedSession:
    """What an uncached decoder carries between steps: the encoder output and the whole prefix."""

    def __init__(self, decoder: Decoder, memory: Tensor, src_pad_mask: Tensor, need_attention: bool = False) -> None:
        self.decoder = decoder
        self.memory = memory  # (N, S, D)
        self.memory_mask = attention_mask(src_pad_mask)  # (N, 1, 1, S)
        self.tokens = torch.zeros(memory.shape[0], 0, dtype=torch.long, device=memory.device)  # (N, t)
        self.attention = AttentionRecord() if need_attention else None  # as a cached session's: (N, L, H, S) a step

    def step(self, tokens: Tensor) -> Tensor:
        self.tokens = torch.cat([self.tokens, tokens], dim=1)  # (N, t)
        last = torch.zeros_like(self.tokens, dtype=torch.bool)
        last[:, -1] = True  # one selected position per row: (N, V) in row order
        logits, weights = self.decoder(
            self.tokens, self.memory, self.memory_mask, last, need_attention=self.attention is not None
        )
        if self.attention is not None:
            self.attention.end_step(weights)  # the last position's weights
        return logits

    def reorder(self, index: Tensor) -> None:
        self.tokens = self.tokens.index_select(0, index)

    def select(self, index: Tensor) -> None:
        self.reorder(index)
        self.memory = self.memory.index_select(0, index)
        self.memory_mask = self.memory_mask.index_select(0, index)


class UncachedModel:
    """Decoding sessions without a cache. The encoder still runs once per batch,
    and only the last position is projected to the vocabulary, so the baseline
    pays just for the recomputed decoder layers."""

    def __init__(self, model: Decodable) -> None:
        if not isinstance(model, Seq2SeqTransformer):  # an RNN's state *is* its cache: there is nothing to drop
            raise ValueError("uncached decoding is a Transformer baseline; this model is not a Transformer")
        self.model = model

    def start(self, src: Tensor, src_pad_mask: Tensor, need_attention: bool = False) -> UncachedSession:
        return UncachedSession(self.model.decoder, self.model.encode(src, src_pad_mask), src_pad_mask, need_attention)


def uncached_search(
    model: Decodable,
    src: Tensor,
    src_pad_mask: Tensor,
    cfg: DecodeConfig,
    limit: int,
    prefix: Tensor | None = None,
) -> list[list[Hypothesis]]:
    """`seq2seq.decoding.search.search` without the key/value cache."""
    return search(UncachedModel(model), src, src_pad_mask, cfg, limit, prefix)
