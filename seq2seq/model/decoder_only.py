"""A decoder-only translator (model.arch: decoder_only): one Transformer stack over `source target`.

Notation: B batch, S source length (the batch's longest), T target length, D d_model, V vocabulary,
H heads, Dh head dim, N rows search sees.

A pair's sequence is its source as the encoder-decoders read it (EOS last) followed by its target input as
their decoder reads it (BOS first): BOS separates the two parts, so the vocabulary needs no token of its own
and every tokenizer and checkpoint stays as it was. Source and target share one embedding (and one
vocabulary, `model.share_all_embeddings`).

The sources of a batch have lengths of their own. The model right-aligns them (their padding moves to the
left), so that every row's target starts at slot S, the target logits are the slots S.. of every row, and a
decoding step writes one slot, the same for all rows. Each token still sits at its true position in its
row: the slot minus the row's left padding (its `offset`). Absolute position encodings read that position
(`Embedding(positions=...)`); the positions inside attention (rope, relative, T5's bias) see distances only,
which the shift leaves as they were.

`model.decoder_only.prefix`: `bidirectional` makes a prefix LM (Raffel et al., 2020; Wang et al., 2022): the
source attends to all of itself, the target to the whole source and causally to itself; `causal` makes a plain
language model over the whole sequence. Every mask is additive (0 or -inf, plus T5's bias), one form for
training, the source prefix and the decoding steps.

Decoding (seq2seq.model.session): `start` runs the source once, filling a key/value cache
(`PrefixCache`); each `step` appends one target token. With `need_attention` a step records, for each layer,
the attention of the target position over the source part, renormalised over it and in the source's own
order: what alignment and the attention explorer read as cross-attention.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from seq2seq.config import ModelConfig
from seq2seq.errors import ConfigError
from seq2seq.model.embedding import Embedding, output_layer, token_embeddings
from seq2seq.model.layers import FeedForward, LayerOptions, Residual
from seq2seq.model.packed import plain_linear
from seq2seq.model.plan import CPU_KERNEL, FUSED_KERNEL, StepPlan
from seq2seq.model.positions import PositionBias
from seq2seq.model.record import AttentionRecord
from seq2seq.model.transformer import _init_linear


class StackLayer(nn.Module):
    """Self-attention and a feed-forward network, each a residual block: an encoder layer whose mask makes it
    causal or a prefix LM, and which a decoding step runs over its part of a `PrefixCache`."""

    def __init__(self, d_model: int, n_heads: int, d_ff: int, cfg: ModelConfig, options: LayerOptions) -> None:
        super().__init__()
        t = options.settings
        self.self_attn = options.self_attention(d_model, n_heads, t.attention_dropout)
        self.ffn = FeedForward(d_model, d_ff, t.activation_dropout, t.activation)
        self.attn_block = Residual(d_model, cfg.dropout, t.norm == "pre", options.norm(d_model))
        self.ffn_block = Residual(d_model, cfg.dropout, t.norm == "pre", options.norm(d_model))

    def forward(
        self, x: Tensor, mask: Tensor, cache: PrefixLayerCache | None = None, source: int = 0
    ) -> tuple[Tensor, Tensor | None]:
        """x (B, L, D) -> (B, L, D); mask (B, 1 or H, L, all keys) additive. With `cache`, x holds the slots
        after the cached ones. With `source` > 0 (a cached step), also the attention (B, H, L, source) over the
        first `source` slots, renormalised over them; else None."""
        h = self.attn_block.enter(x)
        out = self.self_attn.self_attention(h, mask, cache=cache)
        weights = None if cache is None or not source else self.source_attention(h, mask, cache, source)
        x = self.ffn_block(self.attn_block.leave(x, out), self.ffn)
        return x, weights

    def source_attention(self, h: Tensor, mask: Tensor, cache: PrefixLayerCache, source: int) -> Tensor:
        """The step's attention weights over the source slots, spelled out (the kernels never form them)."""
        attention, start = self.self_attn, cache.length
        q = attention.split_heads(F.linear(h, *attention.query_weights()))  # (N, H, T, Dh)
        if attention.rotary is not None:
            q = attention.rotary(q, start)
        scores = attention.scores(q, cache.keys(), start) + mask.to(q.dtype)  # (N, H, T, start + T)
        return scores[..., :source].softmax(dim=-1)


class PrefixLayerCache:
    """One layer's part of a `PrefixCache` (seq2seq.model.cache.SelfAttentionCache)."""

    def __init__(self, cache: PrefixCache, index: int) -> None:
        self.cache = cache
        self.index = index
        self.end = 0

    @property
    def plan(self) -> StepPlan:
        return self.cache.plan

    @property
    def length(self) -> int:
        return self.cache.length

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write keys/values (N, H, T, Dh) after the cached ones; return all of them so far."""
        start, self.end = self.cache.length, self.cache.length + k.shape[2]
        layer = self.cache.reserve(k, self.end)[self.index]  # (2, N, H, capacity, Dh)
        layer[0, :, :, start : self.end] = k
        layer[1, :, :, start : self.end] = v
        return layer[0, :, :, : self.end], layer[1, :, :, : self.end]

    def keys(self) -> Tensor:
        """Every key so far, the step's included: (N, H, end, Dh)."""
        assert self.cache.kv is not None
        return self.cache.kv[self.index, 0, :, :, : self.end]


class PrefixCache:
    """A decoder-only session's data: every layer's keys and values, source slots first, in one tensor
    (L, 2, N, H, capacity, Dh) grown by `CHUNK` slots; and per row its source padding (N, S), its offset (N,)
    (slot minus position) and the index that puts source slots back in the source's order (N, S)."""

    CHUNK = 16

    def __init__(self, plan: StepPlan, layers: int, aligned: Aligned) -> None:
        self.plan = plan  # the modules themselves, with the kernel of the device
        self.pad, self.offsets, self.order = aligned.pad, aligned.offsets, aligned.order
        self.length = 0  # slots cached so far
        self.kv: Tensor | None = None
        self.layers = [PrefixLayerCache(self, i) for i in range(layers)]

    def reserve(self, like: Tensor, end: int) -> Tensor:
        """The keys/values, grown so that slots up to `end` fit; like: a layer's keys (N, H, T, Dh)."""
        if self.kv is not None and self.kv.shape[4] >= end:
            return self.kv
        N, H, _, Dh = like.shape
        grown = like.new_empty(len(self.layers), 2, N, H, -(-end // self.CHUNK) * self.CHUNK, Dh)
        if self.kv is not None:
            grown[:, :, :, :, : self.length] = self.kv[:, :, :, :, : self.length]
        self.kv = grown
        return grown

    def select(self, index: Tensor) -> None:
        """Keep, repeat or reorder rows (N,): beams, hypotheses within them, finished sentences leaving."""
        if self.kv is not None:
            self.kv = self.kv.index_select(2, index)
        self.pad, self.offsets, self.order = (t.index_select(0, index) for t in (self.pad, self.offsets, self.order))


class Aligned:
    """A batch of sources (B, S), right-aligned: `src` and its `pad` (B, S) with the padding on the left,
    `offsets` (B,) the padding of each row, and `order` (B, S) the slot of each source position (gather)."""

    def __init__(self, src: Tensor, src_pad_mask: Tensor) -> None:
        S = src.shape[1]
        lengths = (~src_pad_mask).sum(dim=1)  # (B,)
        slots = torch.arange(S, device=src.device)[None, :]
        index = (slots + lengths[:, None]) % S  # slot j holds position j - offset: padding rolled to the left
        self.src, self.pad = src.gather(1, index), src_pad_mask.gather(1, index)
        self.offsets = S - lengths
        self.order = (slots - lengths[:, None]) % S  # position p sits at slot p + offset


class DecoderOnlySession:
    """A decoder-only decoding session (seq2seq.model.session): the model, and the cache its steps extend."""

    def __init__(self, model: DecoderOnlyTransformer, cache: PrefixCache, need_attention: bool) -> None:
        self.model = model
        self.cache = cache
        self.source = cache.pad.shape[1]  # S: the source slots
        self.attention = AttentionRecord() if need_attention else None

    def step(self, tokens: Tensor) -> Tensor:
        """Logits (N, V) for the next position, given the last tokens (N, 1)."""
        cache = self.cache
        source = self.source if self.attention is not None else 0
        h, weights = self.model.run(tokens, cache.length, cache.offsets, cache.pad, cache, source)
        cache.length += tokens.shape[1]
        if self.attention is not None:  # each (N, H, T, S) in the source's order
            order = cache.order[:, None, None, :].expand(*weights[0].shape[:3], -1)
            self.attention.end_step([w.gather(3, order) for w in weights])
        return cast(Tensor, self.model.output(h[:, -1]))

    def reorder(self, index: Tensor) -> None:
        self.cache.select(index)

    def select(self, index: Tensor) -> None:
        self.cache.select(index)


class DecoderOnlyTransformer(nn.Module):
    def __init__(
        self,
        embedding: Embedding,
        layers: list[StackLayer],
        final_norm: nn.Module,
        output: nn.Linear,
        position_bias: PositionBias | None,
        bidirectional: bool,
    ) -> None:
        super().__init__()
        self.embedding = embedding
        self.layers = nn.ModuleList(layers)
        self.final_norm = final_norm
        self.output = output  # (V, D), tied to the embedding unless configured otherwise
        self.position_bias = position_bias  # positions: t5_bias, shared by the layers
        self.bidirectional = bidirectional  # the source part attends to all of itself (a prefix LM)

    def forward(
        self, src: Tensor, src_pad_mask: Tensor, tgt_in: Tensor, select: Tensor | None = None, with_source: bool = False
    ) -> Tensor:
        """Teacher-forced target logits (B, T, V) for target inputs (B, T) given sources (B, S), or (N, V) at
        the `select`ed (B, T) positions. `with_source` (needs `select`): then the source part's logits follow,
        (N + M, V), one for each source token after its row's first, in the order of
        `seq2seq.training.loss.source_part_loss`."""
        aligned = Aligned(src, src_pad_mask)
        S = src.shape[1]
        h, _ = self.run(torch.cat([aligned.src, tgt_in], dim=1), 0, aligned.offsets, aligned.pad)  # (B, S + T, D)
        target = h[:, S:] if select is None else h[:, S:][select]
        if not with_source:
            return cast(Tensor, self.output(target))
        assert select is not None, "the source part's logits follow the selected target positions"
        predicts = ~aligned.pad[:, :-1] & ~aligned.pad[:, 1:]  # (B, S - 1): slots whose next token is source
        return cast(Tensor, self.output(torch.cat([target, h[:, : S - 1][predicts]])))

    def run(
        self,
        tokens: Tensor,
        start: int,
        offsets: Tensor,
        pad: Tensor,
        cache: PrefixCache | None = None,
        source: int = 0,
    ) -> tuple[Tensor, list[Tensor]]:
        """The stack over tokens (B, T) at slots start.. -> (B, T, D), and with `source` each layer's attention
        over the source slots (B, H, T, source); pad (B, S): the source slots' padding."""
        T = tokens.shape[1]
        positions = (torch.arange(start, start + T, device=tokens.device)[None, :] - offsets[:, None]).clamp(min=0)
        x = self.embedding(tokens, start, positions)
        mask = self.mask(pad, start, T)
        caches: list[PrefixLayerCache | None] = [None] * len(self.layers) if cache is None else list(cache.layers)
        weights = []
        for layer, layer_cache in zip(self.layers, caches):
            x, w = layer(x, mask, layer_cache, source)
            if w is not None:
                weights.append(w)
        return self.final_norm(x), weights

    def mask(self, pad: Tensor, start: int, length: int) -> Tensor:
        """The additive mask (B, 1 or H, length, start + length) of slots start.. over every slot so far:
        0 (or T5's bias) where allowed, -inf elsewhere; a padding slot sees itself only (no empty rows)."""
        S, device = pad.shape[1], pad.device
        i = torch.arange(start, start + length, device=device)[:, None]
        j = torch.arange(start + length, device=device)[None, :]
        rule = j <= i
        if self.bidirectional:
            rule = rule | ((i < S) & (j < S))
        keys = F.pad(pad, (0, start + length - S))[:, None, None, :]  # (B, 1, 1, Lk): target slots are real
        allowed = (rule & ~keys) | (i == j)  # (B, 1, length, Lk)
        if self.position_bias is not None:
            return self.position_bias(start, length, start + length, allowed)
        return torch.zeros(allowed.shape, device=device).masked_fill_(~allowed, float("-inf"))

    def start(self, src: Tensor, src_pad_mask: Tensor, need_attention: bool = False) -> DecoderOnlySession:
        """Start decoding sources (B, S): run them once, filling the cache the steps extend."""
        aligned = Aligned(src, src_pad_mask)
        kernel = CPU_KERNEL if src.device.type == "cpu" else FUSED_KERNEL
        empty = src.new_zeros(0, dtype=torch.float32)
        cache = PrefixCache(StepPlan({}, plain_linear(empty, empty), kernel), len(self.layers), aligned)  # no memory
        self.run(aligned.src, 0, aligned.offsets, aligned.pad, cache)
        cache.length = src.shape[1]
        return DecoderOnlySession(self, cache, need_attention)

    def quantized(self, quantize: str) -> DecoderOnlyTransformer:
        """Itself: int8 decoding (`decode.quantize`) is the encoder-decoder Transformer's only."""
        if quantize != "none":
            raise ConfigError(f"decode.quantize={quantize} is not available for model.arch: decoder_only")
        return self

    @property
    def max_positions(self) -> int:
        """The longest source, and the longest target with BOS: half the sequence each."""
        return self.embedding.max_positions // 2

    @property
    def attention_layers(self) -> list[int]:
        """The layers whose attention over the source a session records: all of them."""
        return [len(self.layers)]


def build_decoder_only(cfg: ModelConfig, src_vocab_size: int, tgt_vocab_size: int) -> DecoderOnlyTransformer:
    """The decoder-only model a config describes: `encoder_layers + decoder_layers` layers of
    model.transformer's kind, fairseq-style initialisation."""
    t, d = cfg.transformer, cfg.decoder_only
    if t is None or d is None:
        raise ValueError(f"model.arch: {cfg.arch} has no model.decoder_only settings")
    if src_vocab_size != tgt_vocab_size:
        raise ValueError("model.arch: decoder_only needs one vocabulary for both languages (data.shared_vocab)")
    _, tokens = token_embeddings(cfg, src_vocab_size, tgt_vocab_size)
    options = LayerOptions(t, cfg.max_positions)
    layers = [
        StackLayer(cfg.d_model, t.n_heads, t.d_ff, cfg, options) for _ in range(t.encoder_layers + t.decoder_layers)
    ]
    for layer in layers:
        _init_linear(layer)
    output = output_layer(cfg, tokens, tgt_vocab_size)
    if t.output_bias:
        output.bias = nn.Parameter(torch.zeros(tgt_vocab_size))
    embedding = Embedding(tokens, cfg.d_model, cfg.max_positions, t.positions, cfg.dropout)
    if not t.scale_embedding:
        embedding.scale = 1.0
    bidirectional = d.prefix == "bidirectional"
    position_bias = None
    if t.positions == "t5_bias":  # a prefix LM's source looks both ways: T5's encoder's buckets
        position_bias = PositionBias(t.n_heads, bidirectional, t.t5_buckets, t.t5_max_distance, cfg.d_model)
    final_norm = options.norm(cfg.d_model) if t.norm == "pre" else nn.Identity()
    return DecoderOnlyTransformer(embedding, layers, final_norm, output, position_bias, bidirectional)
