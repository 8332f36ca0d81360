"""Multi-head attention (Vaswani et al., 2017, section 3.2) and its key/value cache.

Notation: B batch, S source length, T target length, D d_model, H heads,
Dh head dim (D / H), V vocabulary.

Masks arrive in one convention everywhere in the package: a boolean
`pad_mask` of shape (B, S), True at padding. It is turned into the form that
`scaled_dot_product_attention` wants (True = may attend) only here.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from seq2seq.model.packed import DecoderLinears, StepLinears
from seq2seq.model.positions import RelativePositions, RotaryPositions


def training_kernel(device: torch.device, precision: str) -> SDPBackend | None:
    """The attention kernel for training updates on `device` in `precision`; None leaves the choice to PyTorch.

    Without attention dropout PyTorch picks its flash kernel on CPU. In bf16
    autocast its math kernel (matmul, softmax, matmul) trained 1.31x faster on
    an AVX512-BF16 CPU, so bf16 asks for math. In fp32 on an AVX2 CPU the two
    tie (math/flash 0.96 for the quickstart model, 0.98 for 6+6 d512, with
    rounds from 0.73 to 1.21; `scripts/bench_train.py --compare attention`),
    so fp32 keeps PyTorch's choice.
    Decoding keeps PyTorch's choice (`scripts/bench_decode.py --compare
    attention`), as does CUDA, where the fused kernels win.
    """
    return SDPBackend.MATH if device.type == "cpu" and precision == "bf16" else None


def kernel_scope(kernel: SDPBackend | None) -> contextlib.AbstractContextManager[None]:
    """Run the model's attention with `kernel` inside this scope (None: PyTorch's choice)."""
    return contextlib.nullcontext() if kernel is None else sdpa_kernel(kernel)


def attention_mask(pad_mask: Tensor) -> Tensor:
    """(B, S) True-at-padding -> (B, 1, 1, S) True-where-attention-is-allowed."""
    return ~pad_mask[:, None, None, :]


class Packing:
    """The real (non-padding) positions of a (B, S) batch, for computing position-wise layers on them only.

    A batch of sentences of mixed lengths can be mostly padding; the projections,
    feed-forward networks and norms then run on the n real positions (n, ...)
    and only attention sees the padded (B, S, ...) layout.
    """

    def __init__(self, pad_mask: Tensor) -> None:
        self.batch, self.length = pad_mask.shape
        self.rows = (~pad_mask).flatten().nonzero().squeeze(1)  # (n,) indices into the B * S positions

    @staticmethod
    def of(pad_mask: Tensor) -> Packing | None:
        """The packing of a batch with padding; None when there is none to skip."""
        return Packing(pad_mask) if bool(pad_mask.any()) else None

    def pack(self, x: Tensor) -> Tensor:
        """(B, S, ...) -> (n, ...)."""
        return x.reshape(self.batch * self.length, *x.shape[2:]).index_select(0, self.rows)

    def unpack(self, x: Tensor) -> Tensor:
        """(n, ...) -> (B, S, ...), zeros at padding."""
        full = x.new_zeros(self.batch * self.length, *x.shape[1:]).index_copy_(0, self.rows, x)
        return full.view(self.batch, self.length, *x.shape[1:])


def attention_weights(q: Tensor, k: Tensor, mask: Tensor) -> Tensor:
    """softmax(Q K^T / sqrt(Dh)) written out: (B, H, T, Dh), (B, H, S, Dh) -> (B, H, T, S), 0 where `mask` forbids."""
    return (q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])).masked_fill(~mask, float("-inf")).softmax(dim=-1)


def concat_heads(out: Tensor) -> Tensor:
    """(B, H, T, Dh) -> (B, T, H * Dh)."""
    B, H, T, Dh = out.shape
    return out.transpose(1, 2).reshape(B, T, H * Dh)


class MultiHeadAttention(nn.Module):
    """Self- or cross-attention with a fused input projection.

    One (3D, D) weight holds W_Q, W_K and W_V: self-attention projects all three
    in one matmul; cross-attention projects queries from the decoder and keys
    and values from the encoder output (once per sentence when decoding).

    Self-attention may carry positions of its own (`positions`: "rope" or
    "relative", seq2seq.model.positions). Rotary ones go through PyTorch's
    attention kernels like the plain ones; relative ones add a term to the
    values, which no fused kernel computes, so they run the math here.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        dropout: float,
        positions: str = "",
        max_positions: int = 0,
        max_relative_distance: int = 0,
    ) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.d_model = d_model
        self.dropout = dropout
        self.in_proj = nn.Linear(d_model, 3 * d_model)
        self.out_proj = nn.Linear(d_model, d_model)
        head_dim = d_model // n_heads
        self.rotary = RotaryPositions(head_dim, max_positions) if positions == "rope" else None
        self.relative = RelativePositions(head_dim, max_relative_distance) if positions == "relative" else None

    def split_heads(self, x: Tensor) -> Tensor:
        B, L, _ = x.shape
        return x.view(B, L, self.n_heads, -1).transpose(1, 2)  # (B, H, L, Dh)

    def project_self(self, x: Tensor, packing: Packing | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """Queries, keys and values of `x` (B, L, D), or of its real positions (n, D), each (B, H, L, Dh)."""
        qkv = self.in_proj(x)
        q, k, v = (qkv if packing is None else packing.unpack(qkv)).chunk(3, dim=-1)
        return self.split_heads(q), self.split_heads(k), self.split_heads(v)

    def query_weights(self) -> tuple[Tensor, Tensor]:
        """W_Q (D, D) and b_Q (D,): views of in_proj."""
        return self.in_proj.weight[: self.d_model], self.in_proj.bias[: self.d_model]

    def memory_weights(self) -> tuple[Tensor, Tensor]:
        """W_K and W_V stacked (2D, D), and their biases (2D,): views of in_proj."""
        return self.in_proj.weight[self.d_model :], self.in_proj.bias[self.d_model :]

    def project_query(self, x: Tensor) -> Tensor:
        return self.split_heads(F.linear(x, *self.query_weights()))  # (B, H, T, Dh)

    def project_memory(self, memory: Tensor) -> tuple[Tensor, Tensor]:
        """Keys and values of the encoder output (B, S, D), each (B, H, S, Dh)."""
        k, v = F.linear(memory, *self.memory_weights()).chunk(2, dim=-1)
        return self.split_heads(k), self.split_heads(v)

    def attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        mask: Tensor | None = None,
        causal: bool = False,
        packing: Packing | None = None,
    ) -> Tensor:
        """softmax(Q K^T / sqrt(Dh)) V over heads, then W_O: (B, H, T, Dh) -> (B, T, D), or (n, D) with `packing`."""
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=self.dropout if self.training else 0.0, is_causal=causal
        )  # (B, H, T, Dh)
        return self.merge_heads(out, packing)

    def attend_with_weights(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        """`attend` spelled out, also returning the weights (B, H, T, S), 0 where `mask` forbids.

        Only for looking at the attention (pictures, alignments): the fused kernel
        never materialises the weights, so decoding and training keep `attend`.
        """
        weights = attention_weights(q, k, mask)
        return self.merge_heads(weights @ v), weights

    def merge_heads(self, out: Tensor, packing: Packing | None = None) -> Tensor:
        """(B, H, T, Dh) -> W_O applied to the concatenated heads, (B, T, D), or (n, D) at the packed positions."""
        heads = concat_heads(out)
        return self.out_proj(heads if packing is None else packing.pack(heads))

    def self_attention(
        self,
        x: Tensor,
        mask: Tensor | None = None,
        causal: bool = False,
        cache: LayerCache | None = None,
        packing: Packing | None = None,
    ) -> Tensor:
        """Self-attention of x (B, L, D) at positions 0..L-1, or, with `cache`, of the next positions
        after the cached ones, which it appends to the cache (then every cached key is visible).

        With `packing`, x (n, D) holds the real positions only, and so does the result.
        """
        if cache is not None:
            return self.cached_self_attention(x, cache)
        q, k, v = self.project_self(x, packing)
        if self.rotary is not None:
            q, k = self.rotary(q, 0), self.rotary(k, 0)
        if self.relative is None:
            return self.attend(q, k, v, mask, causal, packing)
        return self.attend_relative(q, k, v, 0, mask, causal, packing)

    def cached_self_attention(self, x: Tensor, cache: LayerCache) -> Tensor:
        """A decoding step: x (N, T, D) at the positions after the cached ones, which it appends to the
        cache; every cached key is visible. The projections are the cache's (seq2seq.model.packed)."""
        start = cache.length
        q, k, v = (self.split_heads(t) for t in cache.linears.self_in(x).chunk(3, dim=-1))  # (N, H, T, Dh)
        if self.rotary is not None:
            q, k = self.rotary(q, start), self.rotary(k, start)
        k, v = cache.append(k, v)
        if self.relative is not None:
            heads = self.relative_heads(q, k, v, start, None, False)
        elif x.device.type == "cpu":
            heads = decode_attention(q, k, v)
        else:
            heads = F.scaled_dot_product_attention(q, k, v)
        return cache.linears.self_out(concat_heads(heads))

    def scores(self, q: Tensor, k: Tensor, q_start: int, k_start: int = 0) -> Tensor:
        """Pre-softmax scores (B, H, Lq, Lk) of queries at q_start.. against keys at k_start..

        Queries and keys arrive rotated already when positions are rotary.
        """
        scores = q @ k.transpose(-2, -1)
        if self.relative is not None:
            index = self.relative.distances(q_start, q.shape[2], k_start, k.shape[2], q.device)
            scores = scores + self.relative.score_bias(q, index)
        return scores / math.sqrt(q.shape[-1])

    def attend_relative(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        start: int,
        mask: Tensor | None,
        causal: bool,
        packing: Packing | None = None,
    ) -> Tensor:
        """Shaw et al.'s attention for queries at start.. over keys at 0..: (B, H, Lq, Dh) -> (B, Lq, D)."""
        return self.merge_heads(self.relative_heads(q, k, v, start, mask, causal), packing)

    def relative_heads(self, q: Tensor, k: Tensor, v: Tensor, start: int, mask: Tensor | None, causal: bool) -> Tensor:
        """attend_relative before W_O: the heads' outputs (B, H, Lq, Dh)."""
        assert self.relative is not None
        scores = self.scores(q, k, start)  # (B, H, Lq, Lk)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        if causal:
            i = torch.arange(start, start + q.shape[2], device=q.device)[:, None]
            scores = scores.masked_fill(torch.arange(k.shape[2], device=q.device)[None, :] > i, float("-inf"))
        weights = F.dropout(scores.softmax(dim=-1), self.dropout, self.training)
        index = self.relative.distances(start, q.shape[2], 0, k.shape[2], q.device)
        return weights @ v + self.relative.value_term(weights, index)


class LayerCache:
    """One decoder layer's part of a `DecoderCache`: views of the tensors it shares with the other layers.

    The cross-attention keys/values are computed once per sentence; the
    self-attention keys/values grow by one position per decoding step, written
    in place into the cache's preallocated buffer.
    """

    def __init__(self, cache: DecoderCache, index: int, linears: StepLinears) -> None:
        self.cache = cache
        self.index = index
        self.linears = linears  # this layer's projections, prepared once per batch
        self.cross_k = cache.cross[index, 0]  # (G, H, S, Dh): one per source sentence, see DecoderCache
        self.cross_v = cache.cross[index, 1]

    @property
    def length(self) -> int:
        """Positions cached so far: the absolute position of the next one."""
        return self.cache.step

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write this step's keys/values (N, H, T, Dh) after the cached ones; return all of them so far."""
        start, end = self.cache.step, self.cache.step + k.shape[2]
        layer = self.cache.reserve(k, end)[self.index]  # (2, N, H, capacity, Dh)
        layer[0, :, :, start:end] = k
        layer[1, :, :, start:end] = v
        return layer[0, :, :, :end], layer[1, :, :, :end]  # (N, H, end, Dh) each

    def cross_attention(
        self, attention: MultiHeadAttention, x: Tensor, mask: Tensor, weights: list[Tensor] | None = None
    ) -> Tensor:
        """Cross-attention of x (N, T, D) over the cached encoder keys/values -> (N, T, D).

        mask: the cache's cross_mask (G, 1, 1, S). With a `weights` list, the
        attention weights (N, H, T, S) are appended to it.

        The `group` rows of one source (a sentence's beam) attend to its single
        copy of the keys/values together, as `group` query positions.
        """
        N, T, D = x.shape
        q = attention.split_heads(self.linears.cross_query(x).view(-1, self.cache.group * T, D))  # (G, H, group*T, Dh)
        if weights is not None:
            w = attention_weights(q, self.cross_k, mask)  # (G, H, group*T, S)
            G, H, _, S = w.shape
            weights.append(w.view(G, H, self.cache.group, T, S).transpose(1, 2).reshape(N, H, T, S))
            heads = w @ self.cross_v
        elif x.device.type == "cpu":
            heads = decode_attention(q, self.cross_k, self.cross_v, self.cache.cross_bias(q))
        else:
            heads = F.scaled_dot_product_attention(q, self.cross_k, self.cross_v, attn_mask=mask)
        return self.linears.cross_out(concat_heads(heads)).view(N, T, D)


class DecoderCache:
    """Everything incremental decoding carries between steps, as a visible value.

    Each kind of key/value lives in one tensor for all L layers, so that beam
    reordering and dropping finished sentences copy once, not once per layer:
    - `cross` (L, 2, G, H, S, Dh): the encoder output's keys and values, once
      per source sentence: rows r*group .. r*group+group-1 (P = G * group) all
      translate source r, so a beam of K hypotheses reads one copy, not K;
    - `self_kv` (L, 2, P, H, capacity, Dh): the decoded positions' keys and
      values, 0 .. step-1 valid. It is preallocated and written in place, its
      capacity (at first the source length) growing by `CHUNK` positions when
      full: a concatenation per step would copy the whole cache at every
      step. Reordering copies the valid positions into a second buffer of the
      same size, and the two swap, so that a step allocates nothing.

    Rows that search drops (finished sentences) are not always copied away:
    while most rows are alive, `rows` maps the N rows search sees to the P
    rows stored, and a step computes the dropped ones too (but not their
    vocabulary projection), which costs less than compacting the whole cache
    at every step where a sentence ends.
    """

    CHUNK = 16
    KEEP_DROPPED = 0.25  # compact once more than this fraction of the stored rows is dropped

    def __init__(self, cross: Tensor, cross_mask: Tensor, linears: DecoderLinears) -> None:
        self.cross = cross  # (L, 2, G, H, S, Dh)
        self.cross_mask = cross_mask  # (G, 1, 1, S) True where attention is allowed
        self.group = 1  # rows per source sentence
        self.step = 0  # position of the next token
        self.rows: Tensor | None = None  # (N,) the stored row of each row search sees; None: the same
        self.self_kv: Tensor | None = None  # (L, 2, P, H, capacity, Dh): the first P rows of _buffer
        self._buffer: Tensor | None = None
        self._spare: Tensor | None = None  # as large as _buffer, once a reorder has needed it
        self._cross_bias: Tensor | None = None
        # None: nothing recorded. A list: each step appends its cross-attention weights (B, L, H, S),
        # rows as they are at that step (reorder and select leave what was recorded alone).
        self.attention: list[Tensor] | None = None
        self.output = linears.output  # the vocabulary projection
        self.layers = [LayerCache(self, i, layer) for i, layer in enumerate(linears.layers)]

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
        wanted = end if kv is not None else max(end, self.cross.shape[4])  # at first: the source length
        capacity = -(-wanted // self.CHUNK) * self.CHUNK  # rounded up to whole chunks
        grown = like.new_empty(len(self.layers), 2, P, H, capacity, Dh)
        if kv is not None:
            grown[:, :, :, :, : self.step] = kv[:, :, :, :, : self.step]
        self.self_kv, self._buffer, self._spare = grown, grown, None
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
        """Stored self-attention rows <- their rows `index`."""
        if self.self_kv is None or self._buffer is None:
            return
        n, (L, _, rows, H, capacity, Dh) = index.shape[0], self._buffer.shape
        if n > rows:  # more rows than ever before: a larger buffer
            target, spare = self._buffer.new_empty(L, 2, n, H, capacity, Dh), None
        else:
            target = self._spare if self._spare is not None else torch.empty_like(self._buffer)
            spare = self._buffer
        valid = (slice(None), slice(None), slice(None), slice(None), slice(0, self.step))
        torch.index_select(self.self_kv[valid], 2, index, out=target[:, :, :n][valid])
        self.self_kv, self._buffer, self._spare = target[:, :, :n], target, spare

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


def decode_attention(q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None = None) -> Tensor:
    """softmax(Q K^T / sqrt(Dh) + bias) V as two batched matmuls: (B, H, Lq, Dh) -> (B, H, Lq, Dh).

    k, v: (B, H, Lk, Dh) whose B and H dims merge without a copy (the cache's
    layouts); bias: (B * H, 1, Lk) or None. For the few queries of a decoding
    step this is faster on CPU than PyTorch's fused attention kernels, which
    are built for many queries (one query per row, 320 rows, 4 heads of 64, 16
    keys, one thread: 0.94 ms against the flash kernel's 1.6 ms).
    """
    B, H, Lq, Dh = q.shape
    Lk = k.shape[2]
    keys = k.reshape(B * H, Lk, Dh).transpose(1, 2)  # (BH, Dh, Lk)
    queries = q.reshape(B * H, Lq, Dh)
    scale = 1.0 / math.sqrt(Dh)
    if bias is None:
        scores = torch.bmm(queries, keys).mul_(scale)
    else:
        scores = torch.baddbmm(bias, queries, keys, alpha=scale)  # (BH, Lq, Lk)
    return torch.bmm(scores.softmax(dim=-1), v.reshape(B * H, Lk, Dh)).view(B, H, Lq, Dh)


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
