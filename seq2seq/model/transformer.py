"""The Transformer encoder-decoder (Vaswani et al., 2017) and its decoding session.

Notation: B batch, S source length, T target length, D d_model, V vocabulary.

Search code uses only `start` and the session it returns (`TransformerSession`:
`step`, `reorder`, `select`, `attention`; seq2seq.model.session); training uses
`forward`. Both run the decoder's one `forward`; a decoding step runs it with
the session's cache, as the session's plan says (seq2seq.model.plan).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from seq2seq.config import ModelConfig
from seq2seq.errors import ConfigError
from seq2seq.model.attention import MultiHeadAttention, Packing, attention_mask
from seq2seq.model.cache import CROSS, DecoderCache, LayerCache, SpareBlocks
from seq2seq.model.embedding import Embedding, output_layer, token_embeddings
from seq2seq.model.embedding import sinusoidal_table as sinusoidal_table  # tests import it from here
from seq2seq.model.layers import DecoderLayer, EncoderLayer, FeedForward, LayerOptions
from seq2seq.model.linear import linear
from seq2seq.model.packed import (
    Linear,
    ParameterKey,
    can_pack,
    int8_available,
    int8_linear,
    onednn_available,
    packed_linear,
    parameter_key,
    plain_linear,
)
from seq2seq.model.plan import CPU_KERNEL, FUSED_KERNEL, StepPlan
from seq2seq.model.positions import PositionBias
from seq2seq.model.record import AttentionRecord

MakeLinear = Callable[[Tensor, Tensor | None, bool], Linear]
"""(weight (out, in), bias, relu) -> a step's linear: `packed_linear` or `int8_linear`."""


def made(module: nn.Linear, make: MakeLinear, relu: bool = False) -> Linear:
    """`module` (then ReLU) as `make` makes it."""
    return make(module.weight, module.bias, relu)


def made_ffn(module: FeedForward, make: MakeLinear) -> Linear:
    """A feed-forward network with both linears made by `make` (a ReLU fused into the first)."""
    relu = module.activation is F.relu
    fc1, fc2 = made(module.fc1, make, relu), made(module.fc2, make)
    if relu:
        return lambda x: fc2(fc1(x))
    return lambda x: fc2(module.activation(fc1(x)))


class Encoder(nn.Module):
    def __init__(
        self,
        embedding: Embedding,
        layers: list[EncoderLayer],
        final_norm: nn.Module,
        position_bias: PositionBias | None = None,
    ) -> None:
        super().__init__()
        self.embedding = embedding
        self.layers = nn.ModuleList(layers)
        self.final_norm = final_norm  # LayerNorm for pre-norm, Identity for post-norm
        self.position_bias = position_bias  # positions: t5_bias, shared by the layers

    def forward(self, src: Tensor, src_pad_mask: Tensor, packing: Packing | None = None) -> Tensor:
        """(B, S) -> (B, S, D); with `packing` (that of src_pad_mask), only the real positions are computed and
        returned, (n, D)."""
        mask = attention_mask(src_pad_mask)  # (B, 1, 1, S)
        if self.position_bias is not None:  # additive (B, H, S, S), once for every layer
            mask = self.position_bias(0, src.shape[1], src.shape[1], mask)
        if packing is None:
            x = self.embedding(src)  # (B, S, D)
        else:  # the real tokens only, each at its position in its sentence
            x = self.embedding.at(packing.pack(src), packing.positions[1], src.shape[1])  # (n, D)
        for layer in self.layers:
            x = layer(x, mask, packing)
        return self.final_norm(x)

    def packed_linears(self, make: MakeLinear) -> dict[nn.Module, Linear]:
        """Copies of the layers' linears made by `make` (`int8_linear`), by the module each replaces, for an
        encoder pass that starts decoding (`Packing.linears`)."""
        packed: dict[nn.Module, Linear] = {}
        for layer in self.layers:
            layer = cast(EncoderLayer, layer)
            for module in (layer.self_attn.in_proj, layer.self_attn.out_proj):
                packed[module] = made(module, make)
            packed[layer.ffn] = made_ffn(layer.ffn, make)
        return packed


class Decoder(nn.Module):
    def __init__(
        self,
        embedding: Embedding,
        layers: list[DecoderLayer],
        final_norm: nn.Module,
        output: nn.Linear,
        position_bias: PositionBias | None = None,
    ) -> None:
        super().__init__()
        self.embedding = embedding
        self.layers = nn.ModuleList(layers)
        self.final_norm = final_norm
        self.output = output  # (V, D) weight, tied to the embedding unless configured otherwise
        self.position_bias = position_bias  # positions: t5_bias, causal, shared by the layers

    def forward(
        self,
        tgt_in: Tensor,
        memory: Tensor | None = None,
        memory_mask: Tensor | None = None,
        select: Tensor | None = None,
        cache: DecoderCache | None = None,
        need_attention: bool = False,
    ) -> tuple[Tensor, list[Tensor]]:
        """Logits and, with `need_attention`, each layer's cross-attention weights, bottom first (else none).

        Without `cache`, a teacher-forced pass over the encoder output `memory` (B, S, D), `memory_mask`
        (B, 1, 1, S) True where allowed: logits (B, T, V), or (N, V) at the `select`ed positions (B, T) bool,
        and weights (B, H, T, S). With `cache`, a decoding step (`memory` goes unused): `tgt_in` (N, T) holds
        the positions after the cached ones, each layer reads and extends its part of the cache and runs as
        the session's plan says (`cache.plan`); logits (N, V) of the last position, weights (N, H, T, S).
        """
        start = 0 if cache is None else cache.step
        x = self.embedding(tgt_in if cache is None else cache.stored(tgt_in), start=start)  # (B, T, D) or (P, T, D)
        caches: list[LayerCache | None] = [None] * len(self.layers) if cache is None else list(cache.layers)
        length = tgt_in.shape[1]  # the step's bias depends on the distance to each cached key
        bias = None if self.position_bias is None else self.position_bias(start, length, start + length)
        weights: list[Tensor] = []
        for layer, layer_cache in zip(self.decoder_layers(), caches):
            x, layer_weights = layer(x, memory, memory_mask, layer_cache, need_attention, bias)
            if layer_weights is not None:
                weights.append(layer_weights)
        x = self.final_norm(x)
        if cache is None:
            if select is not None:
                x = x[select]  # (N, D): project only the positions that are scored
            return linear(x, self.output.weight, self.output.bias), weights  # (B, T, V) or (N, V)
        cache.step += tgt_in.shape[1]
        logits = cache.plan.linear(self.output)(cache.searched(x[:, -1]))  # (N, V)
        return logits, [cache.searched(w) for w in weights]

    def decoder_layers(self) -> list[DecoderLayer]:
        return [cast(DecoderLayer, layer) for layer in self.layers]

    def cross_attentions(self) -> list[MultiHeadAttention]:
        """Each layer's cross-attention module, bottom first."""
        return [layer.cross_attn for layer in self.decoder_layers()]

    def plain_queries(self) -> dict[nn.Module, Linear]:
        """Each cross-attention module's W_Q as a decoding step runs it without packing: views of in_proj."""
        return {attention: plain_linear(*attention.query_weights()) for attention in self.cross_attentions()}

    def packed_linears(self, make: MakeLinear = packed_linear) -> dict[nn.Module, Linear]:
        """Copies of a decoding step's projections made by `make` (weights prepacked for oneDNN,
        seq2seq.model.packed; or `int8_linear`'s int8 ones), by the module each replaces (a cross-attention
        module: its W_Q)."""
        packed: dict[nn.Module, Linear] = {self.output: made(self.output, make)}
        for layer in self.decoder_layers():
            for module in (layer.self_attn.in_proj, layer.self_attn.out_proj, layer.cross_attn.out_proj):
                packed[module] = made(module, make)
            packed[layer.cross_attn] = make(*layer.cross_attn.query_weights(), False)
            packed[layer.ffn] = made_ffn(layer.ffn, make)
        return packed


class DecodingPlan:
    """The plans of a model's decoding sessions; owned by the model (`Seq2SeqTransformer.plan`).

    With `pack`, CPU float32 eval decoding without autograd runs the decoder's
    linears with weights prepacked by oneDNN (seq2seq.model.packed), packed once
    and reused while the parameters stay where and as they were; everything
    else runs the modules themselves. `pack=False` always runs the modules: for
    torch.compile, and to test that both give the same translations.

    `quantize="int8"` (`decode.quantize`, through `Seq2SeqTransformer.quantized`)
    runs the same linears in int8 instead (`int8_linear`: weights quantized per
    output row when the plan is made, inputs at every call), kept the same way,
    and with them the projection of the encoder output to the cross-attention
    keys and values and, given the `encoder`, the encoder pass's linears
    (`encoder_linears`); it decodes on CPU float32 only and refuses anything
    else with one line.
    """

    def __init__(
        self, decoder: Decoder, pack: bool = True, quantize: str = "none", encoder: Encoder | None = None
    ) -> None:
        self.decoder = decoder
        self.encoder = encoder
        self.quantize = quantize
        self.pack = pack and onednn_available()
        self._packed: tuple[ParameterKey, StepPlan] | None = None
        self._encoder: tuple[ParameterKey, dict[nn.Module, Linear]] | None = None
        self.spare = SpareBlocks()  # the caches' memory, kept between CPU sessions

    def encoder_linears(self) -> dict[nn.Module, Linear]:
        """The copies of its linears that an encoder pass starting decoding runs (`Packing.linears`): int8 ones
        with `quantize="int8"` and an encoder, made again when its parameters have changed; else none (the
        modules run themselves)."""
        if self.quantize != "int8" or self.encoder is None:
            return {}
        check_int8_session(self.encoder)
        key = parameter_key(self.encoder)
        if self._encoder is None or self._encoder[0] != key:
            self._encoder = None
            self._encoder = (key, self.encoder.packed_linears(int8_linear))
        return self._encoder[1]

    def session(self, memory: Tensor) -> StepPlan:
        """The plan of the session that starts now, over the encoder output `memory` (..., D)."""
        kernel = CPU_KERNEL if memory.device.type == "cpu" else FUSED_KERNEL
        if self.quantize == "int8":
            return self._int8(kernel)
        if self.pack and can_pack(self.decoder):
            key = parameter_key(self.decoder)
            if self._packed is None or self._packed[0] != key:
                self._packed = None
                try:
                    self._packed = (key, StepPlan(self.decoder.packed_linears(), self.memory(), kernel))
                except RuntimeError:  # oneDNN refused: the modules will do
                    pass
            if self._packed is not None:
                return self._packed[1]
        return StepPlan(self.decoder.plain_queries(), self.memory(), kernel)

    def _int8(self, kernel: str) -> StepPlan:
        """The int8 plan, made again when the parameters have changed."""
        check_int8_session(self.decoder)
        key = parameter_key(self.decoder)
        if self._packed is None or self._packed[0] != key:
            self._packed = None
            linears = self.decoder.packed_linears(int8_linear)
            self._packed = (key, StepPlan(linears, self.memory(int8_linear), kernel))
        return self._packed[1]

    def memory(self, make: MakeLinear | None = None) -> Linear:
        """Every decoder layer's W_K, W_V stacked, with their biases, as one projection of the encoder output
        for all layers instead of one per layer: made by `make` (`int8_linear`), or plain."""
        weights, biases = zip(*(attention.memory_weights() for attention in self.decoder.cross_attentions()))
        weight, bias = torch.cat(weights), torch.cat(biases)
        return plain_linear(weight, bias) if make is None else make(weight, bias, False)

    @property
    def holds_packed(self) -> bool:
        """Whether packed copies of the weights are kept now (the last batch on CPU float32 ran with them)."""
        return self._packed is not None

    def spare_for(self, like: Tensor) -> SpareBlocks | None:
        """Where a session's large tensors come from: the kept blocks on the CPU (`SpareBlocks`); None
        elsewhere (CUDA's caching allocator keeps freed memory already)."""
        return self.spare if like.device.type == "cpu" else None

    def invalidate(self) -> None:
        """Drop the packed copies and the kept memory: the weights may change from now on (fused optimizers
        change them without bumping their versions), and training needs its memory."""
        self._packed = self._encoder = None
        self.spare.clear()

    def __getstate__(self) -> dict[str, object]:
        return {**self.__dict__, "_packed": None, "_encoder": None}  # copies and pickles pack again when they decode


def check_int8(module: nn.Module) -> None:
    """Refuse, with one line, int8 decoding where it cannot run: CUDA, a half-precision model, a PyTorch
    without oneDNN's int8 linear."""
    weight = next(module.parameters())
    if weight.device.type != "cpu":
        raise ConfigError(f"decode.quantize=int8 runs on the CPU only, not {weight.device.type}: use --device cpu")
    if weight.dtype != torch.float32:
        raise ConfigError(f"decode.quantize=int8 quantizes a float32 model, not {weight.dtype}")
    if not int8_available():
        raise ConfigError("decode.quantize=int8 needs PyTorch's int8 matrix multiply on the CPU (_int_mm or FBGEMM)")


def check_int8_session(module: nn.Module) -> None:
    """Refuse, with one line, an int8 session where `module` cannot run one (`check_int8`; training mode or
    autograd)."""
    check_int8(module)
    if not can_pack(module):
        raise ConfigError("decode.quantize=int8 decodes in eval mode without autograd only")


class TransformerSession:
    """A Transformer decoding session (seq2seq.model.session): the decoder, the session's plan (`plan`, fixed when
    it starts) and the cache its steps read and extend (`cache`, which hands the plan to the layers)."""

    def __init__(self, decoder: Decoder, cache: DecoderCache, need_attention: bool = False) -> None:
        self.decoder = decoder
        self.cache = cache
        self.plan = cache.plan
        self.attention = AttentionRecord() if need_attention else None

    def step(self, tokens: Tensor) -> Tensor:
        """Logits (N, V) for the next position, given the tokens (N, T) after those already stepped (T is 1 in
        search); the layers are asked for their cross-attention weights only when the session records them."""
        logits, weights = self.decoder(tokens, cache=self.cache, need_attention=self.attention is not None)
        if self.attention is not None:
            self.attention.end_step(weights)  # (N, L, H, S)
        return logits

    def reorder(self, index: Tensor) -> None:
        self.cache.reorder(index)

    def select(self, index: Tensor) -> None:
        self.cache.select(index)


class Seq2SeqTransformer(nn.Module):
    def __init__(self, encoder: Encoder, decoder: Decoder) -> None:
        super().__init__()
        self.encoder = encoder
        self.decoder = decoder
        self.plan = DecodingPlan(decoder)  # a plain attribute: no weights, nothing in the state dict

    def quantized(self, quantize: str) -> Seq2SeqTransformer:
        """This model decoding with `decode.quantize` (`none`: itself; `int8`: its linears in int8, encoder's too):
        a model sharing its modules and weights, with a decoding plan of its own, so the checkpoint and this
        model stay float32. Refused with one line where int8 cannot run (`check_int8`)."""
        if quantize == "none":
            return self
        check_int8(self)
        view = Seq2SeqTransformer(self.encoder, self.decoder)
        view.plan = DecodingPlan(self.decoder, quantize=quantize, encoder=self.encoder)
        return view.train(self.training)

    def train(self, mode: bool = True) -> Seq2SeqTransformer:
        if mode:
            self.plan.invalidate()  # training changes the weights, not always visibly (see DecodingPlan)
        return super().train(mode)

    def forward(self, src: Tensor, src_pad_mask: Tensor, tgt_in: Tensor, select: Tensor | None = None) -> Tensor:
        """Teacher-forced logits (B, T, V) for target inputs (B, T) given sources (B, S).

        With `select` (B, T) bool, only the selected positions are projected to the
        vocabulary and (N, V) is returned: training skips the padding this way,
        before the most expensive matmul rather than after it.
        """
        memory = self.encoder(src, src_pad_mask)
        return self.decoder(tgt_in, memory, attention_mask(src_pad_mask), select)[0]

    @torch.no_grad()
    def cross_attention(self, src: Tensor, src_pad_mask: Tensor, tgt_in: Tensor) -> Tensor:
        """Teacher-forced cross-attention weights (B, T, L, H, S) of target inputs (B, T), BOS first.

        Row t is the attention while predicting target token t, as a decoding session
        started with `need_attention` records it step by step (`TransformerSession.attention`).
        """
        memory = self.encoder(src, src_pad_mask)
        _, weights = self.decoder(tgt_in, memory, attention_mask(src_pad_mask), need_attention=True)
        return torch.stack(weights, dim=1).permute(0, 3, 1, 2, 4)  # (B, L, H, T, S) -> (B, T, L, H, S)

    # Decoding: a session per batch of sources (seq2seq.model.session).

    def encode(self, src: Tensor, src_pad_mask: Tensor) -> Tensor:
        """The encoder output (B, S, D), computed at the real positions only (zeros at padding), as `start`
        computes it: batches with and without padding take the same path (the same kernels, so a sentence
        encodes alike in any batch)."""
        packing = Packing(src_pad_mask, self.plan.spare_for(src), self.plan.encoder_linears())
        return packing.unpack(self.encoder(src, src_pad_mask, packing))

    def start(self, src: Tensor, src_pad_mask: Tensor, need_attention: bool = False) -> TransformerSession:
        """Start decoding sources (B, S): encode them, take the session's plan (`self.plan`), and project the
        encoder output to every layer's cross-attention keys/values, once, in one matmul (the plan's stacked
        W_K, W_V). With `need_attention` the session records every step's cross-attention weights.

        Only the real positions are encoded and projected; their keys and values are written straight into
        the cache's layout, zeros at padding."""
        spare = self.plan.spare_for(src)
        packing = Packing(src_pad_mask, spare, self.plan.encoder_linears())  # padded or not: one path (see `encode`)
        memory = self.encoder(src, src_pad_mask, packing)  # (n, D)
        plan = self.plan.session(memory)
        kv = plan.memory(memory)  # (n, L * 2D)
        B, S = src.shape
        L, H = len(self.decoder.layers), self.decoder.cross_attentions()[0].n_heads
        Dh = kv.shape[-1] // (2 * L * H)
        block, cross = SpareBlocks.view(spare, CROSS, kv, (L, 2, B, H, S, Dh))
        cross.zero_()
        packing.unpack_into(kv.view(-1, L, 2, H, Dh), cross.permute(2, 4, 0, 1, 3, 5))
        cache = DecoderCache(cross, attention_mask(src_pad_mask), plan, spare, {CROSS: block})
        return TransformerSession(self.decoder, cache, need_attention)

    @property
    def max_positions(self) -> int:
        return self.decoder.embedding.max_positions

    @property
    def attention_layers(self) -> list[int]:
        """The decoder layers with cross-attention: all of them (one number, as for each member of an ensemble)."""
        return [len(self.decoder.layers)]


def build_transformer(cfg: ModelConfig, src_vocab_size: int, tgt_vocab_size: int) -> Seq2SeqTransformer:
    """The Transformer a config describes, with fairseq-style initialisation."""
    d, t = cfg.d_model, cfg.transformer
    if t is None:
        raise ValueError(f"model.arch: {cfg.arch} has no model.transformer settings")
    src_tokens, tgt_tokens = token_embeddings(cfg, src_vocab_size, tgt_vocab_size)
    options = LayerOptions(t, cfg.max_positions)
    layer_args = (
        d,
        t.n_heads,
        t.d_ff,
        cfg.dropout,
        t.attention_dropout,
        t.activation_dropout,
        t.activation,
        t.norm == "pre",
        options,
    )
    encoder_layers = [EncoderLayer(*layer_args) for _ in range(t.encoder_layers)]
    decoder_layers = [DecoderLayer(*layer_args) for _ in range(t.decoder_layers)]
    for module in [*encoder_layers, *decoder_layers]:
        _init_linear(module)
    output = output_layer(cfg, tgt_tokens, tgt_vocab_size)
    if t.output_bias:  # an imported Marian model's final_logits_bias
        output.bias = nn.Parameter(torch.zeros(tgt_vocab_size))

    def final_norm() -> nn.Module:
        return options.norm(d) if t.norm == "pre" else nn.Identity()

    def embedding(tokens: nn.Embedding) -> Embedding:
        embedding = Embedding(tokens, d, cfg.max_positions, t.positions, cfg.dropout)
        if not t.scale_embedding:
            embedding.scale = 1.0
        return embedding

    def position_bias(bidirectional: bool) -> PositionBias | None:
        if t.positions != "t5_bias":
            return None
        return PositionBias(t.n_heads, bidirectional, t.t5_buckets, t.t5_max_distance, d)

    encoder = Encoder(embedding(src_tokens), encoder_layers, final_norm(), position_bias(True))
    decoder = Decoder(embedding(tgt_tokens), decoder_layers, final_norm(), output, position_bias(False))
    return Seq2SeqTransformer(encoder, decoder)


def _init_linear(module: nn.Module) -> None:
    for sub in module.modules():
        if isinstance(sub, nn.Linear):
            nn.init.xavier_uniform_(sub.weight)
            if sub.bias is not None:
                nn.init.zeros_(sub.bias)
