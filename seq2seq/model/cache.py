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

import math
import threading
import weakref
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor, nn

from seq2seq.model.packed import Linear
from seq2seq.model.plan import StepPlan


class StepCache(Protocol):
    """What every decoding step's cache tells the layers: the session's plan and the positions cached so far."""

    @property
    def plan(self) -> StepPlan: ...
    @property
    def length(self) -> int: ...


class SelfAttentionCache(StepCache, Protocol):
    """A cache that hands a self-attention step each row's keys and values by position: a decoder-only model's
    (seq2seq.model.decoder_only.PrefixLayerCache). A Transformer's `LayerCache` hands them grouped by source
    (`LayerCache.extend`)."""

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]: ...


@dataclass(frozen=True)
class StepKeys:
    """A decoding step's self-attention keys and values, grouped by source sentence (`LayerCache.extend`).

    The `group` rows of one source (a sentence's beam) attend to the keys of all its rows together: `keys`
    and `values` (G, H, Lk * group, Dh) hold position 0 of each of its rows, then position 1 of each, and
    so on; `bias` (G, 1, group * T, Lk * group), additive, lets the step's query row j (position t) see
    only the keys its own hypothesis wrote (its ancestors' rows, `DecoderCache.ancestry`) up to position t,
    and is None where that is every key (one row per source, one position per step).
    """

    keys: Tensor
    values: Tensor
    group: int
    bias: Tensor | None


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

    def extend(self, k: Tensor, v: Tensor) -> StepKeys:
        """Write this step's keys/values (P, H, T, Dh), row r at its own slot, after the cached ones; return all
        of them so far, grouped by source (`StepKeys`): a view of the buffer, nothing copied."""
        P, H, T, Dh = k.shape
        start, end, K = self.cache.step, self.cache.step + T, self.cache.group
        layer = self.cache.reserve(k, end)[self.index]  # (2, G, H, capacity, K, Dh)
        G = P // K
        layer[0, :, :, start:end] = k.view(G, K, H, T, Dh).permute(0, 2, 3, 1, 4)
        layer[1, :, :, start:end] = v.view(G, K, H, T, Dh).permute(0, 2, 3, 1, 4)
        keys = layer[0, :, :, :end].reshape(G, H, end * K, Dh)
        values = layer[1, :, :, :end].reshape(G, H, end * K, Dh)
        return StepKeys(keys, values, K, self.cache.self_bias(T, k))


class DecoderCache:
    """A Transformer decoding session's data: its `plan` (how its steps run, fixed when it starts) and, apart
    from it, the data its steps read and extend, as visible values.

    Each kind of key/value lives in one tensor for all L layers, so that
    dropping finished sentences copies once, not once per layer:
    - `cross` (L, 2, G, H, S, Dh): the encoder output's keys and values, once
      per source sentence: rows r*group .. r*group+group-1 (P = G * group) all
      translate source r, so a beam of K hypotheses reads one copy, not K;
    - `self_kv` (L, 2, G, H, capacity, group, Dh): the decoded positions' keys
      and values, 0 .. step-1 valid, position-major within a source, so that a
      source's rows attend to all of its keys in one matmul (`StepKeys`). It is
      preallocated and written in place, its capacity (at first the source
      length + `CHUNK`) growing by `CHUNK` positions when full: a
      concatenation per step would copy the whole cache at every step. With
      one row per source (greedy, sampling) it is stored position-major as a
      whole, (L, 2, capacity, G, H, 1, Dh) in memory (`_new_buffer`), so that
      the keys a step reads lie in one block rather than in G * H slices
      `capacity` apart: a decoder step's cache is rarely still in the CPU's
      caches, and one block streams from memory about twice as fast.

    Beam search reorders hypotheses within a sentence at every step; nothing is
    copied for it: a row writes its keys in its own slot, and `ancestry`
    (G, group, n) says, for each row and position, whose slot holds its
    hypothesis's keys (positions from n on: its own). A step's attention masks
    the others out (`self_bias`). Copies happen only when rows are selected
    (`select`: expanding to a beam, dropping sentences).

    Rows that search drops (finished sentences) are not always copied away:
    while most rows are alive, `rows` maps the N rows search sees to the P
    rows stored, and a step computes the dropped ones too (but not their
    vocabulary projection), which costs less than compacting the whole cache
    at every step where a sentence ends.
    """

    CHUNK = 16
    KEEP_DROPPED = 0.25  # compact once more than this fraction of the stored rows is dropped

    def __init__(
        self,
        cross: Tensor,
        cross_mask: Tensor,
        plan: StepPlan,
        spare: SpareBlocks | None = None,
        held: dict[str, Tensor] | None = None,
    ) -> None:
        """`spare`: where this session's large tensors come from and go back to (None: fresh memory each);
        `held`: the blocks of it that `cross` views already, by use."""
        self.plan = plan  # how this session's steps run: not data, and no step changes it
        self.cross = cross  # (L, 2, G, H, S, Dh)
        self.cross_mask = cross_mask  # (G, 1, 1, S) True where attention is allowed
        self.group = 1  # rows per source sentence
        self.step = 0  # position of the next token
        self.rows: Tensor | None = None  # (N,) the stored row of each row search sees; None: the same
        self.self_kv: Tensor | None = None  # (L, 2, G, H, capacity, group, Dh)
        self.ancestry: Tensor | None = None  # (G, group, n) slot of each row's keys per position; None: its own
        self._self_bias: tuple[tuple[int, int, torch.dtype], Tensor | None] | None = None
        self._cross_bias: Tensor | None = None
        self.spare = spare
        self._held = dict(held or {})  # the blocks cross and self_kv view, by use, given back when this cache ends
        if spare is not None:
            weakref.finalize(self, spare.give_all, self._held)

    @property
    def layers(self) -> list[LayerCache]:
        """Each layer's part, made for the step that asks (a layer's part refers to this cache, and this cache
        keeps none: no reference cycle, so a session's buffers are freed as soon as its search is done)."""
        return [LayerCache(self, i) for i in range(self.cross.shape[0])]

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
        block, grown = self._new_buffer(like, (self.cross.shape[0], 2, P // self.group, H, capacity, self.group, Dh))
        if kv is not None:
            grown[:, :, :, :, : self.step] = kv[:, :, :, :, : self.step]
        self.self_kv = grown
        self._hold(SELF, block)
        return grown

    def full_ancestry(self, end: int) -> Tensor:
        """(G, group, end): the slot holding each row's keys at positions 0 .. end-1 (its own from n on)."""
        G, K = self.cross_mask.shape[0], self.group
        own = torch.arange(K, device=self.cross_mask.device)
        known = self.ancestry if self.ancestry is not None else own.new_empty(G, K, 0)
        later = own[None, :, None].expand(G, K, max(end - known.shape[2], 0))
        return torch.cat([known[:, :, :end], later], dim=2) if later.shape[2] else known[:, :, :end]

    def self_bias(self, T: int, like: Tensor) -> Tensor | None:
        """The step's additive self-attention bias (G, 1, group * T, end * group) for `StepKeys`: query row j at
        position step + t sees key slot r at position s only when s <= step + t and r holds its hypothesis's
        key there (`ancestry`); None when every key may be seen (a row per source, one position). Made once
        per step, for every layer."""
        K = self.group
        if K == 1 and T == 1:
            return None
        key = (self.step, T, like.dtype)
        if self._self_bias is not None and self._self_bias[0] == key:
            return self._self_bias[1]
        end = self.step + T
        slots = torch.arange(K, device=like.device)
        sees = self.full_ancestry(end)[:, :, None, :, None] == slots  # (G, K, 1, end, K)
        if T > 1:  # several new positions: none may see those after it
            later = torch.arange(end, device=like.device) > torch.arange(self.step, end, device=like.device)[:, None]
            sees = sees & ~later[None, None, :, :, None]  # (G, K, T, end, K)
        G = sees.shape[0]
        shape = (G, K * T, end * K)
        bias = torch.zeros(shape, dtype=like.dtype, device=like.device)
        bias.masked_fill_(~sees.expand(G, K, T, end, K).reshape(shape), float("-inf"))
        self._self_bias = (key, bias[:, None])
        return bias[:, None]

    def reorder(self, index: Tensor) -> None:
        """Reorder hypotheses *within* each sentence (beam search): search's row i takes row index[i]'s.

        Nothing moves: each stored row's `ancestry` follows its new hypothesis's (dropped rows, still
        stored while `rows` maps search's rows, keep theirs). Rows taken across sentences are selected.
        """
        targets = self._stored(torch.arange(index.shape[0], device=index.device))
        sources = self._stored(index)
        K = self.group
        if index.shape[0] != self.batch_size or not torch.equal(
            torch.div(sources, K, rounding_mode="floor"), torch.div(targets, K, rounding_mode="floor")
        ):
            self.select(index)
            return
        self._follow(targets, sources)

    def select(self, index: Tensor) -> None:
        """Keep (or repeat) whole rows, cross-attention included: for dropping finished sentences or expanding
        each sentence to its beam. Search's row i takes row index[i]'s hypothesis.

        Beam search drops sentences and reorders the hypotheses of the others in one call: when each block of
        `group` new rows comes from one sentence, sentences in order, the kept sentences' rows follow their
        new hypotheses (as in `reorder`), and only the dropped sentences' rows leave."""
        sources = self._stored(index)
        K = self.group
        if K > 1 and index.shape[0] % K == 0:
            blocks = torch.div(sources, K, rounding_mode="floor").view(-1, K)  # (G', K) each new row's sentence
            sentences = blocks[:, 0]
            if bool((blocks == sentences[:, None]).all()) and bool((sentences[1:] > sentences[:-1]).all()):
                targets = (sentences[:, None] * K + torch.arange(K, device=index.device)).flatten()
                self._follow(targets, sources)
                sources = targets
        self._keep(sources)

    def _stored(self, index: Tensor) -> Tensor:
        """Search's rows (N',) -> the stored rows that hold them."""
        return index if self.rows is None else self.rows.index_select(0, index)

    def _follow(self, targets: Tensor, sources: Tensor) -> None:
        """Stored rows `targets` take the hypotheses of stored rows `sources` of their own sentences: their
        ancestry becomes those rows' (nothing copied but the (G, group, step) table)."""
        K, step = self.group, self.step
        if K == 1 or torch.equal(targets, sources):
            return
        ancestry = self.full_ancestry(step).view(-1, step)  # (P, step)
        followed = ancestry.clone()
        followed[targets] = ancestry.index_select(0, sources)
        self.ancestry = followed.view(-1, K, step)
        self._self_bias = None

    def _keep(self, rows: Tensor) -> None:
        """Keep (or repeat) stored rows `rows` (N',): mapped while `_may_skip` allows, else copied."""
        if self._may_skip(rows):
            self.rows = rows
            return
        self.rows = None
        K = self.group
        sources, group = source_groups(torch.div(rows, K, rounding_mode="floor"))
        whole = (sources[:, None] * K + torch.arange(K, device=rows.device)).flatten()
        if group == K and torch.equal(rows, whole) and bool((sources[1:] > sources[:-1]).all()):
            self._compact(sources)  # whole sentences kept in order: they move up in place
        else:
            self._copy(rows, group)
        self.group = group
        if not torch.equal(sources, torch.arange(self.cross.shape[2], device=sources.device)):
            self.cross = self.cross.index_select(2, sources)
            self.cross_mask = self.cross_mask.index_select(0, sources)
            self._cross_bias = None
            self._hold(CROSS, None)

    def _may_skip(self, rows: Tensor) -> bool:
        """Whether `rows` (stored rows to keep) can stay a map: each row once, in order, and most of them."""
        P = self.stored_rows
        if rows.shape[0] >= P or rows.shape[0] < (1 - self.KEEP_DROPPED) * P:
            return False
        return bool((rows[1:] > rows[:-1]).all())

    def _compact(self, sources: Tensor) -> None:
        """Keep the sentences `sources` (G',), increasing: each moves, whole (its rows, their ancestry), to its
        new place in the same buffer; only the sentences whose place changes are copied."""
        if self.ancestry is not None:
            self.ancestry = self.ancestry.index_select(0, sources)
        self._self_bias = None
        if self.self_kv is None:
            return
        n = sources.shape[0]
        valid = self.self_kv[:, :, :, :, : self.step]  # (L, 2, G, H, step, K, Dh)
        moved = (sources != torch.arange(n, device=sources.device)).nonzero().squeeze(1)
        if moved.numel():
            for part in valid.flatten(0, 1):  # (G, H, step, K, Dh) per layer and K/V: whole sentences
                part.index_copy_(0, moved, part.index_select(0, sources[moved]))  # gathered before any is written
        self.self_kv = self.self_kv[:, :, :n]

    def _copy(self, rows: Tensor, group: int) -> None:
        """A new buffer whose row i (of N, `group` per source) holds stored row rows[i]'s hypothesis, each of its
        positions gathered from the slot its ancestry names."""
        kv, ancestry = self.self_kv, self.full_ancestry(self.step)
        self.ancestry, self._self_bias = None, None
        if kv is None:
            return
        L, _, G, H, capacity, K, Dh = kv.shape
        n, step = rows.shape[0], self.step
        block, copied = self._new_buffer(kv, (L, 2, n // group, H, capacity, group, Dh))
        if step:
            source = torch.div(rows, K, rounding_mode="floor")  # (N,)
            slot = ancestry[source, rows % K]  # (N, step): the slot of row i's hypothesis at each position
            # each new (source, head, position, row)'s Dh values, indexed in kv's (G, H, capacity, K) dims
            sources = source.view(-1, 1, 1, group)
            heads = torch.arange(H, device=rows.device)[None, :, None, None]
            positions = torch.arange(step, device=rows.device)[None, None, :, None]
            slots = slot.view(-1, group, step).transpose(1, 2)[:, None]  # (N / group, 1, step, group)
            # (L, 2, N / group, H, step, group, Dh)
            copied[:, :, :, :, :step] = kv[:, :, sources, heads, positions, slots]
        self.self_kv = copied
        self._hold(SELF, block)

    def _new_buffer(self, like: Tensor, shape: tuple[int, ...]) -> tuple[Tensor, Tensor]:
        """An uninitialised tensor of `shape` (L, 2, G, H, capacity, group, Dh) for self_kv, and the block of
        memory it views (`SpareBlocks.view`): laid out as its shape says, or with one row per source, as
        (L, 2, capacity, G, H, 1, Dh) (see the class)."""
        if shape[5] != 1:
            return SpareBlocks.view(self.spare, SELF, like, shape)
        L, two, G, H, capacity, one, Dh = shape
        block, stored = SpareBlocks.view(self.spare, SELF, like, (L, two, capacity, G, H, one, Dh))
        return block, stored.permute(0, 1, 3, 4, 2, 5, 6)

    def _hold(self, use: str, block: Tensor | None) -> None:
        """The tensor of `use` now views `block` (None: memory of its own); the block it viewed until now goes
        back to `spare`."""
        old = self._held.pop(use, None)
        if block is not None:
            self._held[use] = block
        if self.spare is not None and old is not None:
            self.spare.give(use, old)

    def cross_bias(self, like: Tensor) -> Tensor:
        """cross_mask as an additive bias (G * H, 1, S): 0 where attention is allowed, -inf at padding.

        like: the queries (G, H, Lq, Dh), for the number of heads and the dtype.
        """
        G, H = like.shape[:2]
        if self._cross_bias is None or self._cross_bias.shape[0] != G * H or self._cross_bias.dtype != like.dtype:
            self._cross_bias = key_padding_bias(self.cross_mask[:, 0, 0], H, like.dtype)
        return self._cross_bias


def key_padding_bias(allowed: Tensor, n_heads: int, dtype: torch.dtype) -> Tensor:
    """A key mask (B, S), True where attention is allowed, as an additive bias (B * H, 1, S) for every head's
    queries: 0 where allowed, -inf at padding."""
    B, S = allowed.shape
    bias = torch.zeros(B, 1, S, dtype=dtype, device=allowed.device).masked_fill_(~allowed[:, None], float("-inf"))
    return bias.expand(B, n_heads, S).reshape(B * n_heads, 1, S)


SELF, CROSS, HEADS = "self", "cross", "heads"  # the uses of kept blocks: self_kv, cross, `Packing.heads`


class SpareBlocks:
    """Blocks of CPU memory kept between a model's decoding sessions: one for the self-attention keys/values
    (`SELF`), one for the cross-attention ones (`CROSS`), one for the encoder pass's head-major queries, keys
    and values (`HEADS`, `seq2seq.model.attention.Packing.heads`).

    PyTorch's CPU tensors come from malloc, which maps a block of more than
    32 MB afresh for each allocation and unmaps it when it is freed, and
    often returns smaller ones to the system too: every 4 KB page a session
    then writes costs a page fault. A Transformer's cache is written a
    position at a time in every (sentence, head) slice, so each step that
    crossed into a new page paid for a page per slice (1,536 faults, about
    2 ms, at steps 0, 16 and 32 of a 64-sentence batch of the 3+3-layer d256
    model; 20,000 faults in a beam-5 batch). A session takes a spare block (no
    other session can hold it meanwhile), and its cache gives back each block
    it held when it replaces it or ends (`DecoderCache`). One block a use is
    kept, the largest given back; `DecodingPlan` owns them and drops them with
    the packed weights.
    """

    def __init__(self) -> None:
        self._blocks: dict[str, Tensor] = {}
        self._lock = threading.Lock()

    def take(self, use: str, like: Tensor, numel: int) -> Tensor:
        """A flat block of at least `numel` elements of like's dtype and device: the spare one of `use` if it
        fits and is at most twice that (a beam's first step, one row per sentence, leaves the spare to its
        expansion), else a new one."""
        with self._lock:
            block = self._blocks.get(use)
            if block is not None and numel <= block.numel() <= 2 * numel and alike(block, like):
                return self._blocks.pop(use)
        return like.new_empty(numel)

    @staticmethod
    def view(spare: SpareBlocks | None, use: str, like: Tensor, shape: tuple[int, ...]) -> tuple[Tensor, Tensor]:
        """A block for `use` (`take`; fresh memory without `spare`) and an uninitialised tensor of `shape`
        viewing it."""
        numel = math.prod(shape)
        block = like.new_empty(numel) if spare is None else spare.take(use, like, numel)
        return block, block[:numel].view(shape)

    def give(self, use: str, block: Tensor) -> None:
        """Keep `block` as the spare of `use`, unless the spare now is larger."""
        with self._lock:
            kept = self._blocks.get(use)
            if kept is None or kept.numel() < block.numel():
                self._blocks[use] = block

    def give_all(self, held: dict[str, Tensor]) -> None:
        """Give back every block of `held` (a finished cache's), emptying it."""
        while held:
            self.give(*held.popitem())

    def clear(self) -> None:
        with self._lock:
            self._blocks.clear()

    def __reduce__(self) -> tuple[type[SpareBlocks], tuple[()]]:
        return SpareBlocks, ()  # a copy or a pickle keeps memory of its own: none to begin with


def alike(block: Tensor, like: Tensor) -> bool:
    """Whether `block` may hold like's data now: same dtype and device, and writable here (a block made in
    inference mode can be written only in inference mode)."""
    writable = not block.is_inference() or torch.is_inference_mode_enabled()
    return block.dtype == like.dtype and block.device == like.device and writable


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
