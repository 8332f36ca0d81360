"""Multi-head attention (Vaswani et al., 2017, section 3.2): one path for a teacher-forced pass and a decoding step.

Notation: B batch, S source length, T target length, D d_model, H heads,
Dh head dim (D / H), V vocabulary.

Masks arrive in one convention everywhere in the package: a boolean
`pad_mask` of shape (B, S), True at padding. It is turned into the form that
`scaled_dot_product_attention` wants (True = may attend) only here.

A decoding step reads and extends the session's cache (seq2seq.model.cache)
and runs its projections and kernel as the session's plan says
(seq2seq.model.plan). Cross-attention returns its weights beside its output
when its caller asks for them (`need_attention`), and None otherwise.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from seq2seq.model.cache import (
    HEADS,
    LayerCache,
    SelfAttentionCache,
    SpareBlocks,
    StepCache,
    StepKeys,
    alike,
    key_padding_bias,
)
from seq2seq.model.linear import linear
from seq2seq.model.long_attention import LongAttention
from seq2seq.model.packed import Linear, plain_linear
from seq2seq.model.plan import CPU_KERNEL
from seq2seq.model.positions import RelativePositions, RotaryPositions

Kernels = SDPBackend | list[SDPBackend] | None
"""One attention kernel, the kernels PyTorch may choose from, or None for PyTorch's whole choice."""

CUDA_KERNELS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
"""Every CUDA kernel but cuDNN's, which builds a graph for each new batch shape (see `training_kernel`)."""


def training_kernel(device: torch.device, precision: str) -> Kernels:
    """The attention kernels for training and validation on `device` in `precision`.

    Without attention dropout PyTorch picks its flash kernel on CPU. In bf16
    autocast its math kernel (matmul, softmax, matmul) trained 1.31x faster on
    an AVX512-BF16 CPU, so bf16 asks for math. In fp32 on an AVX2 CPU the two
    tie (math/flash 0.96 for the quickstart model, 0.98 for 6+6 d512, with
    rounds from 0.73 to 1.21; `scripts/bench/bench_train.py --compare attention`),
    so fp32 keeps PyTorch's choice.
    On CUDA, PyTorch prefers cuDNN's kernel for bf16 and fp16 on recent GPUs,
    and cuDNN builds (compiles) a graph for every new (batch, length) shape.
    Token-bucketed batches bring a new shape almost every update of the first
    epoch: on an H100 the quickstart model's first 200 bf16 updates ran at
    3,800-11,500 tokens/s, against 41,000-69,000 with cuDNN's kernel turned
    off and 52,000-89,000 in fp32 (`scripts/gpu_check.sh`, then the same bf16
    run with `torch.backends.cuda.enable_cudnn_sdp(False)`). So CUDA uses the
    flash, memory-efficient and math kernels only.
    Decoding keeps PyTorch's choice (`scripts/bench/bench_decode.py --compare
    attention`); it runs in fp32, where cuDNN's kernel is not chosen.
    """
    if device.type == "cuda":
        return list(CUDA_KERNELS)
    return SDPBackend.MATH if device.type == "cpu" and precision == "bf16" else None


def kernel_scope(kernel: Kernels) -> contextlib.AbstractContextManager[None]:
    """Run the model's attention with `kernel` inside this scope (None: PyTorch's choice)."""
    return contextlib.nullcontext() if kernel is None else sdpa_kernel(kernel)


def attention_mask(pad_mask: Tensor) -> Tensor:
    """(B, S) True-at-padding -> (B, 1, 1, S) True-where-attention-is-allowed."""
    return ~pad_mask[:, None, None, :]


class Packing:
    """The real (non-padding) positions of a (B, S) batch, for computing position-wise layers on them only.

    A batch of sentences of mixed lengths can be mostly padding; the embedding,
    projections, feed-forward networks and norms then run on the n real
    positions (n, ...) and only attention sees the padded (B, S, ...) layout.

    Decoding starts with an encoder pass of this kind; its layers' head-major
    queries, keys and values (`heads`) then share one tensor, from `spare`
    (the model's kept memory, `SpareBlocks`) when given.
    """

    def __init__(
        self, pad_mask: Tensor, spare: SpareBlocks | None = None, linears: Mapping[nn.Module, Linear] | None = None
    ) -> None:
        self.batch, self.length = pad_mask.shape
        self.pad_mask = pad_mask  # (B, S) True at padding
        self.rows = (~pad_mask).flatten().nonzero().squeeze(1)  # (n,) indices into the B * S positions
        sentence = self.rows.div(self.length, rounding_mode="floor")
        self.positions = (sentence, self.rows - sentence * self.length)  # each real position's (sentence, position)
        self.spare = spare
        self.linears = linears or {}  # the pass's own copies of the layers' linears (int8), by module
        self._heads: Tensor | None = None

    def projection(self, module: nn.Linear) -> Linear:
        """How the pass runs `module`: its own copy (`linears`), or the module's weights as `linear` runs them."""
        own = self.linears.get(module)
        return own if own is not None else plain_linear(module.weight, module.bias)

    def pack(self, x: Tensor) -> Tensor:
        """(B, S, ...) -> (n, ...)."""
        return x.reshape(self.batch * self.length, *x.shape[2:]).index_select(0, self.rows)

    def unpack(self, x: Tensor) -> Tensor:
        """(n, ...) -> (B, S, ...), zeros at padding."""
        full = x.new_zeros(self.batch * self.length, *x.shape[1:]).index_copy_(0, self.rows, x)
        return full.view(self.batch, self.length, *x.shape[1:])

    def unpack_into(self, x: Tensor, out: Tensor) -> None:
        """Write x (n, ...) at the real positions of `out` (B, S, ...), a view in any layout (padding untouched)."""
        out.index_put_(self.positions, x)

    def pack_from(self, x: Tensor) -> Tensor:
        """(B, S, ...), a view in any layout -> (n, ...), contiguous."""
        return x[self.positions]

    def heads(self, like: Tensor, n_heads: int, head_dim: int) -> Tensor:
        """A (3, B, H, S, Dh) tensor of like's dtype and device for a layer's queries, keys and values, zeros at
        padding (`unpack_into` writes the real positions).

        Without autograd, every layer of the pass gets the same one: a layer's are dead once it has attended,
        and the padding stays zero because only real positions are ever written. It comes from `spare` and
        goes back to it when this packing is gone; the first tensor of 8 MB that a 64-sentence batch of the
        3+3-layer d256 model allocated afresh cost 2,000 page faults, and every layer zeroed its own. With
        autograd (which keeps each layer's for backward), each gets a new one.
        """
        shape = (3, self.batch, n_heads, self.length, head_dim)
        kept = self._heads
        if torch.is_grad_enabled() or (kept is not None and (kept.shape != shape or not alike(kept, like))):
            return like.new_zeros(shape)
        if kept is None:
            block, kept = SpareBlocks.view(self.spare, HEADS, like, shape)
            kept.zero_()
            self._heads = kept
            if self.spare is not None:
                weakref.finalize(self, self.spare.give, HEADS, block)
        return kept

    def key_bias(self, n_heads: int, dtype: torch.dtype) -> Tensor:
        """The padding as an additive bias (B * H, 1, S): 0 at real positions, -inf at padding."""
        return key_padding_bias(~self.pad_mask, n_heads, dtype)


def _is_additive(mask: Tensor | None) -> bool:
    return mask is not None and mask.is_floating_point()


def attention_weights(q: Tensor, k: Tensor, mask: Tensor) -> Tensor:
    """softmax(Q K^T / sqrt(Dh)) written out: (B, H, T, Dh), (B, H, S, Dh) -> (B, H, T, S), 0 where `mask` forbids."""
    return (q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])).masked_fill(~mask, float("-inf")).softmax(dim=-1)


def concat_heads(out: Tensor) -> Tensor:
    """(B, H, T, Dh) -> (B, T, H * Dh)."""
    B, H, T, Dh = out.shape
    return out.transpose(1, 2).reshape(B, T, H * Dh)


class MultiHeadAttention(nn.Module):
    """Self- or cross-attention with a fused input projection, in a teacher-forced pass or a decoding step.

    One (3D, D) weight holds W_Q, W_K and W_V: self-attention projects all three
    in one matmul; cross-attention projects queries from the decoder and keys
    and values from the encoder output (once per sentence when decoding).

    Both take an optional `cache` (seq2seq.model.cache.LayerCache): without it
    they attend over the whole input at once; with it they are a decoding step,
    which reads and extends the cache and runs its projections and kernel as
    the session's plan says (`cache.plan`). Cross-attention returns its weights
    beside its output when asked (`need_attention`).

    Self-attention may carry positions of its own (`positions`: "rope" or
    "relative", seq2seq.model.positions). Rotary ones go through PyTorch's
    attention kernels like the plain ones; relative ones add a term to the
    values, which no fused kernel computes, so they run the math here. T5's
    bias arrives in `mask`, an additive one that its stack computed once.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        dropout: float,
        positions: str = "",
        max_positions: int = 0,
        max_relative_distance: int = 0,
        long: LongAttention | None = None,
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
        self.long = long  # the encoder's `attention: local_global` or `linformer` (seq2seq.model.long_attention)

    def self_attention(
        self,
        x: Tensor,
        mask: Tensor | None = None,
        causal: bool = False,
        packing: Packing | None = None,
        cache: LayerCache | SelfAttentionCache | None = None,
    ) -> Tensor:
        """Self-attention of x (B, L, D) at positions 0..L-1 -> (B, L, D).

        With `packing`, x (n, D) holds the real positions only, and so does the result.
        With `cache`, x (N, T, D) holds the positions after the cached ones, whose keys
        and values it appends to the cache; a step of one position sees every key.
        """
        start = 0 if cache is None else cache.length
        q, k, v = self.project_self(x, packing, cache)
        if self.rotary is not None:
            q, k = self.rotary(q, start), self.rotary(k, start)
        if isinstance(cache, LayerCache):  # a Transformer's decoding step
            heads = grouped_step_attention(q, cache.extend(k, v), cache.plan.kernel, mask, self.relative)
            return self.merge_heads(heads, cache=cache)
        if cache is not None:
            k, v = cache.append(k, v)  # (N, H, start + T, Dh): the cached keys/values and this step's
        dropout = self.dropout if self.training else 0.0
        if self.long is not None:  # an encoder's: mask (B, 1, 1, S), no cache
            assert mask is not None and not mask.is_floating_point() and cache is None
            heads = self.long(q, k, v, mask[:, 0, 0, :], dropout, self.relative)
        elif self.relative is not None:  # Shaw et al.'s attention, spelled out
            heads = self.relative.attend(q, k, v, start, mask, causal, dropout)
        elif (
            packing is not None and not causal and dropout == 0.0 and q.device.type == "cpu" and not _is_additive(mask)
        ):
            # an encoder pass for decoding on the CPU: two batched matmuls, as a decoding step's, beat the
            # fused kernel at a sentence's few dozen queries (about 1.9 ms against 1.1 a layer, 64 sentences)
            heads = decode_attention(q, k, v, packing.key_bias(self.n_heads, q.dtype))
        else:
            heads = attention_heads(q, k, v, mask, causal, dropout, cache)
        return self.merge_heads(heads, packing, cache)

    def cross_attention(
        self,
        x: Tensor,
        memory: Tensor | None,
        memory_mask: Tensor | None,
        cache: LayerCache | None = None,
        need_attention: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """Cross-attention of x (N, T, D) over the encoder output -> (N, T, D), and with `need_attention` the
        weights (N, H, T, S), spelled out (the fused kernels never form them); else None.

        Without `cache`, keys and values are projected from `memory` (B, S, D) and
        `memory_mask` (B, 1, 1, S) is True where attention is allowed. With it,
        they are the cache's, projected once when decoding started, and `memory`
        goes unused: the `group` rows of one source (a sentence's beam) attend to
        its single copy of them together, as `group` query positions.
        """
        N, T, D = x.shape
        if cache is None:
            assert memory is not None and memory_mask is not None
            k, v = self.project_memory(memory)
            mask, group, query = memory_mask, 1, plain_linear(*self.query_weights())
        else:
            k, v, mask, group, query = cache.cross_k, cache.cross_v, cache.cross_mask, cache.group, cache.query(self)
        q = self.split_heads(query(x).view(-1, group * T, D))  # (G, H, group*T, Dh)
        weights = None
        if need_attention:
            grouped = attention_weights(q, k, mask)  # (G, H, group*T, S)
            G, H, _, S = grouped.shape
            weights = grouped.view(G, H, group, T, S).transpose(1, 2).reshape(N, H, T, S)
            heads = grouped @ v
        else:
            bias = None if cache is None else cache.cross_bias
            heads = attention_heads(q, k, v, mask, False, self.dropout if self.training else 0.0, cache, bias)
        return self.merge_heads(heads, cache=cache).view(N, T, D), weights

    def split_heads(self, x: Tensor) -> Tensor:
        B, L, _ = x.shape
        return x.view(B, L, self.n_heads, -1).transpose(1, 2)  # (B, H, L, Dh)

    def project_self(
        self, x: Tensor, packing: Packing | None = None, cache: StepCache | None = None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Queries, keys and values of `x` (B, L, D), or of its real positions (n, D), each (B, H, L, Dh); from
        real positions, written straight into head-major tensors, zeros at padding."""
        if cache is not None:
            qkv = cache.plan.linear(self.in_proj)(x)
        elif packing is not None:
            qkv = packing.projection(self.in_proj)(x)
        else:
            qkv = linear(x, self.in_proj.weight, self.in_proj.bias)
        if packing is None:
            q, k, v = qkv.chunk(3, dim=-1)
            return self.split_heads(q), self.split_heads(k), self.split_heads(v)
        H = self.n_heads
        heads = packing.heads(qkv, H, self.d_model // H)  # (3, B, H, L, Dh)
        packing.unpack_into(qkv.view(-1, 3, H, self.d_model // H), heads.permute(1, 3, 0, 2, 4))
        q, k, v = heads.unbind(0)
        return q, k, v

    def query_weights(self) -> tuple[Tensor, Tensor]:
        """W_Q (D, D) and b_Q (D,): views of in_proj."""
        return self.in_proj.weight[: self.d_model], self.in_proj.bias[: self.d_model]

    def memory_weights(self) -> tuple[Tensor, Tensor]:
        """W_K and W_V stacked (2D, D), and their biases (2D,): views of in_proj."""
        return self.in_proj.weight[self.d_model :], self.in_proj.bias[self.d_model :]

    def project_memory(self, memory: Tensor) -> tuple[Tensor, Tensor]:
        """Keys and values of the encoder output (B, S, D), each (B, H, S, Dh)."""
        k, v = linear(memory, *self.memory_weights()).chunk(2, dim=-1)
        return self.split_heads(k), self.split_heads(v)

    def merge_heads(self, out: Tensor, packing: Packing | None = None, cache: StepCache | None = None) -> Tensor:
        """(B, H, T, Dh) -> W_O applied to the concatenated heads, (B, T, D), or (n, D) at the packed positions;
        in a decoding step, W_O as the session's plan runs it."""
        if packing is None:
            heads = concat_heads(out)
        else:
            heads = packing.pack_from(out.transpose(1, 2)).flatten(1)  # (n, H * Dh)
        if cache is not None:
            return cache.plan.linear(self.out_proj)(heads)
        if packing is not None:
            return packing.projection(self.out_proj)(heads)
        return linear(heads, self.out_proj.weight, self.out_proj.bias)

    def scores(self, q: Tensor, k: Tensor, q_start: int, k_start: int = 0) -> Tensor:
        """Pre-softmax scores (B, H, Lq, Lk) of queries at q_start.. against keys at k_start.. (queries and keys
        arrive rotated already when positions are rotary)."""
        if self.relative is not None:
            return self.relative.scores(q, k, q_start, k_start)
        return q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])


def attention_heads(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None,
    causal: bool,
    dropout: float,
    cache: StepCache | None = None,
    bias: Callable[[Tensor], Tensor] | None = None,
) -> Tensor:
    """softmax(Q K^T / sqrt(Dh)) V per head, (B, H, Lq, Dh): PyTorch's fused kernel (with attention dropout,
    0 outside training), or in a decoding step (a `cache`) the kernel of the session's plan (`step_attention`).

    mask: (B, 1, 1, Lk) True where allowed, or an additive float mask (1 or B, H, Lq, Lk) that holds a position
    bias and -inf where not allowed (`positions: t5_bias`, seq2seq.model.positions.PositionBias)."""
    if mask is not None and mask.is_floating_point():
        mask = mask.to(q.dtype)
        bias = head_bias(mask) if bias is None else bias
    if cache is not None:
        if causal and mask is None and q.shape[2] > 1:  # several new positions: none may see those after it
            mask = step_causal_mask(q.shape[2], k.shape[2], q)
            bias = head_bias(mask)
        return step_attention(q, k, v, cache.plan.kernel, mask, bias)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=causal)


def step_causal_mask(queries: int, keys: int, like: Tensor) -> Tensor:
    """An additive mask (1, 1, queries, keys) for the last `queries` of `keys` positions: each sees itself and
    every key before it, -inf after it."""
    later = torch.ones(queries, keys, dtype=torch.bool, device=like.device).triu(keys - queries + 1)
    return torch.zeros(1, 1, queries, keys, dtype=like.dtype, device=like.device).masked_fill(later, float("-inf"))


def head_bias(mask: Tensor) -> Callable[[Tensor], Tensor]:
    """An additive mask (1 or B, H, Lq, Lk) as `decode_attention`'s bias (B * H, Lq, Lk) for queries q."""

    def bias(q: Tensor) -> Tensor:
        B, H, Lq, _ = q.shape
        return mask.expand(B, H, Lq, -1).reshape(B * H, Lq, -1)

    return bias


def step_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    kernel: str,
    mask: Tensor | None = None,
    bias: Callable[[Tensor], Tensor] | None = None,
) -> Tensor:
    """A decoding step's attention heads (B, H, Lq, Dh) with the kernel of the session's plan.

    mask: (B, 1, 1, Lk) True where allowed, or additive, for the fused kernel; bias: the
    same as an additive bias (B * H, 1 or Lq, Lk) made for the queries, for the CPU one.
    """
    if kernel == CPU_KERNEL:
        return decode_attention(q, k, v, None if bias is None else bias(q))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def grouped_step_attention(
    q: Tensor,
    step: StepKeys,
    kernel: str,
    mask: Tensor | None = None,
    relative: RelativePositions | None = None,
) -> Tensor:
    """A decoding step's self-attention heads (P, H, T, Dh) over keys grouped by source (`StepKeys`): the
    `group` rows of a source attend to its keys as one matrix of group * T queries, each seeing its own
    hypothesis's keys only (`step.bias`), with the kernel of the session's plan, or spelled out with
    Shaw et al.'s terms when the model has `relative` positions.

    q: (P, H, T, Dh), rows of a source contiguous; mask: None, or an additive (1, H, T, Lk) bias that is the
    same for every row (`positions: t5_bias`, with its causal part).
    """
    P, H, T, Dh = q.shape
    K = step.group
    G = P // K
    # (G, H, K * T, Dh): a source's queries together; with one row per source, q itself
    queries = q if K == 1 else q.view(G, K, H, T, Dh).transpose(1, 2).reshape(G, H, K * T, Dh)
    bias = step.bias  # (G, 1, K * T, Lk * K) or None
    if mask is not None:
        assert mask.is_floating_point() and mask.shape[0] == 1
        Lk = mask.shape[-1]
        spread = mask.to(q.dtype)[:, :, None, :, :, None].expand(1, H, K, T, Lk, K).reshape(1, H, K * T, Lk * K)
        bias = spread if bias is None else bias + spread
    if relative is not None:  # query row (j, t) at position start + t, key column (s, r) at position s
        end = step.keys.shape[2] // K
        index = relative.distances(end - T, T, 0, end, q.device)  # (T, end)
        index = index[None, :, :, None].expand(K, T, end, K).reshape(K * T, end * K)
        heads = relative.attend(queries, step.keys, step.values, end - T, bias, False, 0.0, index)
    elif kernel == CPU_KERNEL:
        flat = None if bias is None else bias.expand(G, H, -1, -1).reshape(G * H, K * T, -1)
        heads = decode_attention(queries, step.keys, step.values, flat)
    else:
        heads = F.scaled_dot_product_attention(queries, step.keys, step.values, attn_mask=bias)
    return heads if K == 1 else heads.view(G, H, K, T, Dh).transpose(1, 2).reshape(P, H, T, Dh)


def decode_attention(q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None = None) -> Tensor:
    """softmax(Q K^T / sqrt(Dh) + bias) V as two batched matmuls: (B, H, Lq, Dh) -> (B, H, Lq, Dh).

    k, v: (B, H, Lk, Dh) whose B and H dims merge without a copy (the cache's
    layouts); bias: (B * H, 1 or Lq, Lk) or None. For the few queries of a decoding
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
