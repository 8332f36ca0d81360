"""The Transformer's decoding cache: the data a decoding session carries between steps.

Notation: L decoder layers, N rows search sees, P rows stored, G source
sentences, H heads, S source length, Dh head dim.

A `DecoderCache` holds data only: keys, values, positions and the row map;
plus, as one separate field, the session's `StepPlan` (seq2seq.model.plan),
which says how steps run and is never changed by them: the cache hands it to
the layers. The session (`seq2seq.model.transformer.TransformerSession`) owns
both, and the attention record when one is asked for. Attention itself is
computed by the modules (seq2seq.model.attention), which read and extend this
data.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor, nn

from seq2seq.model.packed import Linear
from seq2seq.model.plan import StepPlan


class SelfAttentionCache(Protocol):
    """What a self-attention decoding step reads and extends: a `LayerCache`, or a decoder-only model's
    (seq2seq.model.decoder_only.PrefixLayerCache)."""

    @property
    def plan(self) -> StepPlan: ...
    @property
    def length(self) -> int: ...
    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]: ...


class LayerCache:
    """One decoder layer's part of a `DecoderCache`: views of the tensors it shares with the other layers.

    The cross-attention keys/values are computed once per sentence; the
    self-attention keys/values grow by one position per decoding step, written
    in place into the cache's preallocated buffer.
    """

    def __init__(self, cache: DecoderCache, index: int) -> None:
        self.cache = cache
        self.index = index
        self.cross_k = cache.cross[index, 0]  # (G, H, S, Dh): one per source sentence, see DecoderCache
        self.cross_v = cache.cross[index, 1]

    @property
    def plan(self) -> StepPlan:
        """How the session's steps run its projections and attention (seq2seq.model.plan)."""
        return self.cache.plan

    def query(self, attention: nn.Module) -> Linear:
        """How the session's steps project a cross-attention module's queries (`StepPlan.query`)."""
        return self.cache.plan.query(attention)

    @property
    def length(self) -> int:
        """Positions cached so far: the absolute position of the next one."""
        return self.cache.step

    @property
    def group(self) -> int:
        """Rows per source sentence: a step's `group` rows of one source attend to its one copy of cross_k/v."""
        return self.cache.group

    @property
    def cross_mask(self) -> Tensor:
        """(G, 1, 1, S) True where cross-attention is allowed."""
        return self.cache.cross_mask

    def cross_bias(self, like: Tensor) -> Tensor:
        """`cross_mask` as an additive bias (G * H, 1, S); see `DecoderCache.cross_bias`."""
        return self.cache.cross_bias(like)

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write this step's keys/values (N, H, T, Dh) after the cached ones; return all of them so far."""
        start, end = self.cache.step, self.cache.step + k.shape[2]
        layer = self.cache.reserve(k, end)[self.index]  # (2, N, H, capacity, Dh)
        layer[0, :, :, start:end] = k
        layer[1, :, :, start:end] = v
        return layer[0, :, :, :end], layer[1, :, :, :end]  # (N, H, end, Dh) each


class DecoderCache:
    """A Transformer decoding session's data: its `plan` (how its steps run, fixed when it starts) and, apart
    from it, the data its steps read and extend, as visible values.

    Each kind of key/value lives in one tensor for all L layers, so that beam
    reordering and dropping finished sentences copy once, not once per layer:
    - `cross` (L, 2, G, H, S, Dh): the encoder output's keys and values, once
      per source sentence: rows r*group .. r*group+group-1 (P = G * group) all
      translate source r, so a beam of K hypotheses reads one copy, not K;
    - `self_kv` (L, 2, P, H, capacity, Dh): the decoded positions' keys and
      values, 0 .. step-1 valid. It is preallocated and written in place, its
      capacity (at first the source length + `CHUNK`) growing by `CHUNK` positions when
      full: a concatenation per step would copy the whole cache at every
      step. Reordering copies, in place, the valid positions of the rows whose
      hypothesis changed (`_move`).

    Rows that search drops (finished sentences) are not always copied away:
    while most rows are alive, `rows` maps the N rows search sees to the P
    rows stored, and a step computes the dropped ones too (but not their
    vocabulary projection), which costs less than compacting the whole cache
    at every step where a sentence ends.
    """

    CHUNK = 16
    KEEP_DROPPED = 0.25  # compact once more than this fraction of the stored rows is dropped

    def __init__(self, cross: Tensor, cross_mask: Tensor, plan: StepPlan) -> None:
        self.plan = plan  # how this session's steps run: not data, and no step changes it
        self.cross = cross  # (L, 2, G, H, S, Dh)
        self.cross_mask = cross_mask  # (G, 1, 1, S) True where attention is allowed
        self.group = 1  # rows per source sentence
        self.step = 0  # position of the next token
        self.rows: Tensor | None = None  # (N,) the stored row of each row search sees; None: the same
        self.self_kv: Tensor | None = None  # (L, 2, P, H, capacity, Dh): the first P rows of _buffer
        self._buffer: Tensor | None = None
        self._cross_bias: Tensor | None = None
        self.layers = [LayerCache(self, i) for i in range(cross.shape[0])]

    @property
    def stored_rows(self) -> int:
        return self.cross_mask.shape[0] * self.group  # P

    @property
    def batch_size(self) -> int:
        return self.stored_rows if self.rows is None else self.rows.shape[0]  # N

    def stored(self, tokens: Tensor) -> Tensor:
        """Search's rows (N, ...) -> the stored rows (P, ...), zeros in dropped ones."""
        if self.rows is None:
            return tokens
        return tokens.new_zeros(self.stored_rows, *tokens.shape[1:]).index_copy_(0, self.rows, tokens)

    def searched(self, x: Tensor) -> Tensor:
        """The stored rows (P, ...) -> search's rows (N, ...)."""
        return x if self.rows is None else x.index_select(0, self.rows)

    def reserve(self, like: Tensor, end: int) -> Tensor:
        """The self-attention keys/values, allocated or grown so that positions up to `end` fit.

        like: a layer's keys (P, H, T, Dh), for the buffer's shape, dtype and device.
        """
        kv = self.self_kv
        if kv is not None and kv.shape[4] >= end:
            return kv
        P, H, _, Dh = like.shape
        # At first the source length and a chunk more: most translations fit, and the cache never grows.
        wanted = end if kv is not None else max(end, self.cross.shape[4] + self.CHUNK)
        capacity = -(-wanted // self.CHUNK) * self.CHUNK  # rounded up to whole chunks
        grown = like.new_empty(len(self.layers), 2, P, H, capacity, Dh)
        if kv is not None:
            grown[:, :, :, :, : self.step] = kv[:, :, :, :, : self.step]
        self.self_kv, self._buffer = grown, grown
        return grown

    def reorder(self, index: Tensor) -> None:
        """Reorder hypotheses *within* each sentence (beam search).

        Only the self-attention keys/values move: the cross-attention ones are the
        same for every hypothesis of a sentence.
        """
        if self.rows is not None:  # rows were dropped since the last copy: copy all at once
            self.select(index)
        else:
            self._move(index)

    def select(self, index: Tensor) -> None:
        """Keep (or repeat) whole rows, cross-attention included: for dropping
        finished sentences or expanding each sentence to its beam."""
        rows = index if self.rows is None else self.rows.index_select(0, index)
        if self._may_skip(rows):
            self.rows = rows
            return
        self.rows = None
        self._move(rows)
        sources, self.group = source_groups(torch.div(rows, self.group, rounding_mode="floor"))
        if not torch.equal(sources, torch.arange(self.cross.shape[2], device=sources.device)):
            self.cross = self.cross.index_select(2, sources)
            self.cross_mask = self.cross_mask.index_select(0, sources)
            self._cross_bias = None
        for layer in self.layers:
            layer.cross_k, layer.cross_v = self.cross[layer.index, 0], self.cross[layer.index, 1]

    def _may_skip(self, rows: Tensor) -> bool:
        """Whether `rows` (stored rows to keep) can stay a map: each row once, in order, and most of them."""
        P = self.stored_rows
        if rows.shape[0] >= P or rows.shape[0] < (1 - self.KEEP_DROPPED) * P:
            return False
        return bool((rows[1:] > rows[:-1]).all())

    def _move(self, index: Tensor) -> None:
        """Stored self-attention rows <- their rows `index`, in place: only the rows whose content changes
        are copied (in a beam, most hypotheses extend their own row), and no second buffer is kept."""
        if self.self_kv is None or self._buffer is None:
            return
        n, (L, _, rows, H, capacity, Dh) = index.shape[0], self._buffer.shape
        valid = self._buffer[:, :, :, :, : self.step]
        if n > rows:  # more rows than ever before: a larger buffer
            grown = self._buffer.new_empty(L, 2, n, H, capacity, Dh)
            torch.index_select(valid, 2, index, out=grown[:, :, :, :, : self.step])
            self._buffer = grown
        else:
            moved = (index != torch.arange(n, device=index.device)).nonzero().squeeze(1)
            if moved.numel():
                sources = index[moved]
                for part in valid.view(-1, *valid.shape[2:]):  # (rows, H, step, Dh) per layer and K/V: whole rows
                    part.index_copy_(0, moved, part.index_select(0, sources))  # gathered before any is written
        self.self_kv = self._buffer[:, :, :n]

    def cross_bias(self, like: Tensor) -> Tensor:
        """cross_mask as an additive bias (G * H, 1, S): 0 where attention is allowed, -inf at padding.

        like: the queries (G, H, Lq, Dh), for the number of heads and the dtype.
        """
        G, H = like.shape[:2]
        if self._cross_bias is None or self._cross_bias.shape[0] != G * H or self._cross_bias.dtype != like.dtype:
            bias = torch.zeros(self.cross_mask.shape, dtype=like.dtype, device=like.device)
            bias.masked_fill_(~self.cross_mask, float("-inf"))  # (G, 1, 1, S)
            self._cross_bias = bias.expand(G, H, 1, -1).reshape(G * H, 1, -1)
        return self._cross_bias


def source_groups(source: Tensor) -> tuple[Tensor, int]:
    """(sources, size) such that source (N,) == sources.repeat_interleave(size), with the largest such size.

    source: the source sentence of each row. Rows of a beam are contiguous and
    equally many per sentence; anything else gets groups of one row.
    """
    N = source.shape[0]
    runs = 1 + int((source[1:] != source[:-1]).sum())
    size = N // runs if N % runs == 0 and N > 0 else 1
    grouped = source.view(-1, size)
    if size > 1 and not bool((grouped == grouped[:, :1]).all()):
        size, grouped = 1, source.view(-1, 1)
    return grouped[:, 0].contiguous(), size
