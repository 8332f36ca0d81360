"""The one hook for looking at cross-attention weights: an `AttentionRecord` that attention modules write into.

Decoding and training never form the weights (the fused attention kernels
skip them). To see them, a caller makes a record active for a while
(`with recording(record):`); every cross-attention module that runs inside
then computes its attention spelled out and appends the weights to the
record, and nothing else changes. Outside such a scope, and inside
`recording(None)`, modules compute and keep nothing more.

Two callers use it: a decoding session whose cache carries a record (each step
runs inside `recording(cache.attention)` and keeps one entry per step, see
`end_step`), and the models' teacher-forced `cross_attention`, which records
one full pass. The active record is a context variable, so decoding in another
thread never writes into it.

Shapes: N rows (hypotheses), L decoder layers, H heads, T target positions,
S source positions. An RNN's attention is one layer with one head.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextvars import ContextVar

import torch
from torch import Tensor


class AttentionRecord:
    """Cross-attention weights as the attention modules computed them, while this record was active."""

    def __init__(self) -> None:
        self.written: list[Tensor] = []  # this pass so far: (N, H, T, S) per cross-attention call, in call order
        self.steps: list[Tensor] = []  # a decoding session's steps: (N, L, H, S) each, rows as search saw them

    def add(self, weights: Tensor) -> None:
        """Called by an attention module: its weights (N, H, T, S), 0 where attention is not allowed."""
        self.written.append(weights)

    def take(self) -> list[Tensor]:
        """What the modules have written since the last `take`, oldest first; the record forgets it."""
        written, self.written = self.written, []
        return written

    def end_step(self, rows: Callable[[Tensor], Tensor] | None = None) -> None:
        """Keep the decoding step just run as one entry of `steps`: the layers written, in order, at the
        step's last position, (N, L, H, S); `rows` maps the rows computed to those search sees."""
        layers = self.take()
        if not layers:  # a model without attention writes nothing
            return
        weights = torch.stack(layers, dim=1)[:, :, :, -1]  # (N, L, H, T, S) -> (N, L, H, S)
        self.steps.append(weights if rows is None else rows(weights))


_ACTIVE: ContextVar[AttentionRecord | None] = ContextVar("seq2seq_attention_record", default=None)


@contextlib.contextmanager
def recording(record: AttentionRecord | None) -> Iterator[None]:
    """Make `record` the one attention modules write into inside this scope (None: none, whatever is outside)."""
    token = _ACTIVE.set(record)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def active_record() -> AttentionRecord | None:
    """The record an attention module should write its weights into now, or None (compute none)."""
    return _ACTIVE.get()
