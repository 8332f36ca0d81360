"""What search, ensembles, prefixes, alignment and the server drive: a model's decoding session.

Notation: B sentences, N hypothesis rows search sees, V vocabulary, L decoder
layers, H heads, S source length.

`model.start(src, src_pad_mask, need_attention)` encodes a batch of sources
once and returns a `DecodingSession`: it holds the encoder output, the cache
its steps read and extend and, for a Transformer, the plan its steps run
(seq2seq.model.plan). Nothing else of a model is needed to decode it:
- `step(tokens)`: the last tokens (N, 1) in, next-token logits (N, V) out,
  unnormalised (search takes their log-softmax; an ensemble returns its mean
  log-probabilities, which are such logits too); the session advances by one;
- `reorder(index)`: moves hypotheses within their sentences (beam search);
- `select(index)`: keeps or repeats whole rows (a beam's expansion, finished
  sentences leaving);
- `attention`: None unless the session was started with `need_attention`;
  then an `AttentionRecord` that keeps one (N, L, H, S) entry per step, rows
  as they were at that step (`reorder` and `select` leave entries alone).

This module imports only the record, so every model module may import it.
"""

from __future__ import annotations

from typing import Protocol

from torch import Tensor

from seq2seq.model.record import AttentionRecord


class DecodingSession(Protocol):
    """One batch being decoded: the encoder output, the cache and the plan of its steps (see the module)."""

    @property
    def attention(self) -> AttentionRecord | None: ...

    def step(self, tokens: Tensor) -> Tensor:
        """Logits (N, V) of the position after `tokens` (N, T), the positions after those already stepped."""
        ...

    def reorder(self, index: Tensor) -> None: ...
    def select(self, index: Tensor) -> None: ...


class Decodable(Protocol):
    """A model as search drives it: `start` a session for a batch of sources (B, S), then step it."""

    def start(self, src: Tensor, src_pad_mask: Tensor, need_attention: bool = False) -> DecodingSession: ...
