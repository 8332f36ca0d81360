"""A Marian model's config and weights as our Transformer's, and back.

The architecture is ours with `model.transformer.norm: post`, LayerNorm,
sinusoidal positions; what differs is mapped exactly:

- Positions. Marian's sinusoids put the sines in the first half of the
  width and the cosines in the second, ours interleave them (sin, cos, sin,
  ...), at the same frequencies. Nothing in the model but the position table
  cares which coordinate is which, so the import permutes the model's width
  (every weight that reads or writes it, and the LayerNorms) so that Marian's
  halves land where our table has them: the same function, exactly, and the
  same training (Adam is per coordinate).
- Token ids: see seq2seq.hf.tokenizer (our PAD is a new row; Marian's
  decoder start, its pad token, is our BOS).
- `scale_embedding` and `final_logits_bias` are `model.transformer.scale_embedding`
  and `model.transformer.output_bias`; swish (SiLU) is `activation: swish`.
- Separate Q, K, V projections are our fused `in_proj` rows, stacked.

A setting Marian has that we do not model is one error naming it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from seq2seq.config import ExperimentConfig, from_dict
from seq2seq.errors import ConfigError, UserError
from seq2seq.model.embedding import sinusoidal_table
from seq2seq.text.vocab import PAD

ACTIVATIONS = {"relu": "relu", "gelu": "gelu", "swish": "swish", "silu": "swish"}  # Marian's name -> ours
OURS_TO_MARIAN_ACTIVATION = {"relu": "relu", "gelu": "gelu", "swish": "swish"}
# Keys of related architectures (BART, mBART, old Marian configs) that would change the model if set.
FOREIGN_KEYS = ("normalize_before", "add_final_layer_norm", "normalize_embedding", "layernorm_embedding")
PAD_LOGIT_BIAS = -50.0  # our PAD's output bias: exp(-50) adds nothing to a softmax, so log-probs are Marian's


def layer_modules(encoder_layers: int, decoder_layers: int) -> list[tuple[str, str, str]]:
    """(kind, our name, Marian's name) of every sub-module of the layers, encoder first: kind is attention
    (Q, K, V and output projections), norm (a LayerNorm) or ffn (fc1 and fc2). Import and export both walk
    this one list, each in its own direction."""
    modules = []
    for side, layers in (("encoder", encoder_layers), ("decoder", decoder_layers)):
        for i in range(layers):
            ours, marian = f"{side}.layers.{i}", f"model.{side}.layers.{i}"
            self_norm = "self_block" if side == "decoder" else "attn_block"
            modules += [("attention", f"{ours}.self_attn", f"{marian}.self_attn")]
            modules += [("norm", f"{ours}.{self_norm}.norm", f"{marian}.self_attn_layer_norm")]
            if side == "decoder":
                modules += [("attention", f"{ours}.cross_attn", f"{marian}.encoder_attn")]
                modules += [("norm", f"{ours}.cross_block.norm", f"{marian}.encoder_attn_layer_norm")]
            modules += [("ffn", ours, marian), ("norm", f"{ours}.ffn_block.norm", f"{marian}.final_layer_norm")]
    return modules


@dataclass(frozen=True)
class MarianSettings:
    """What of a Marian config.json the conversion uses, checked."""

    d_model: int
    encoder_layers: int
    decoder_layers: int
    heads: int
    ffn: int
    activation: str  # ours
    max_positions: int
    scale_embedding: bool
    shared_embeddings: bool  # share_encoder_decoder_embeddings: one vocabulary, one matrix
    tied_output: bool  # tie_word_embeddings
    vocab_size: int
    decoder_vocab_size: int
    pad_id: int
    eos_id: int
    start_id: int  # decoder_start_token_id
    dropout: float
    attention_dropout: float
    activation_dropout: float
    num_beams: int
    max_length: int

    @classmethod
    def read(cls, config: Mapping[str, Any], generation: Mapping[str, Any], what: str) -> MarianSettings:
        """Check a config.json (and generation_config.json) of a Marian model; one line naming what is not."""
        kind = config.get("model_type")
        if kind != "marian":
            raise UserError(f"{what}: model_type is {kind!r}; only Marian (model_type 'marian') models import")
        for key in FOREIGN_KEYS:
            if config.get(key):
                raise UserError(f"{what}: {key} is {config[key]!r}; Marian models are post-norm without it")
        if config.get("static_position_embeddings") is False:
            raise UserError(f"{what}: static_position_embeddings is false; Marian models have sinusoidal positions")

        def number(key: str, default: Any = None, kind: type = int) -> Any:
            value = config.get(key, default)
            ok = isinstance(value, int) if kind is int else isinstance(value, (int, float))
            if isinstance(value, bool) or not ok or value < 0:
                raise UserError(f"{what}: {key} must be a {'whole ' if kind is int else ''}number; got {value!r}")
            return value

        def same(a: str, b: str) -> Any:
            if number(a) != number(b):
                raise UserError(f"{what}: {a} ({config[a]}) differs from {b} ({config[b]}); ours are one setting")
            return config[a]

        activation = config.get("activation_function", "gelu")
        if activation not in ACTIVATIONS:
            raise UserError(f"{what}: activation_function {activation!r} is not one of {', '.join(ACTIVATIONS)}")
        d_model = number("d_model")
        if d_model % 2:
            raise UserError(f"{what}: d_model ({d_model}) is odd; the sinusoids need an even width")
        heads = same("encoder_attention_heads", "decoder_attention_heads")
        if heads == 0 or d_model % heads:
            raise UserError(f"{what}: d_model ({d_model}) is not divisible by the {heads} attention heads")
        vocab_size = number("vocab_size")
        shared = bool(config.get("share_encoder_decoder_embeddings", True))
        decoder_vocab = vocab_size if shared else number("decoder_vocab_size", vocab_size) or vocab_size
        pad = number("pad_token_id")
        eos = config.get("eos_token_id")
        if isinstance(eos, list) and len(eos) == 1:
            eos = eos[0]
        if not isinstance(eos, int):
            raise UserError(f"{what}: eos_token_id must be one id; got {eos!r}")
        start = number("decoder_start_token_id", pad)
        for key, value in (("pad_token_id", pad), ("eos_token_id", eos), ("decoder_start_token_id", start)):
            if not 0 <= value < min(vocab_size, decoder_vocab):
                raise UserError(f"{what}: {key} ({value}) is outside the vocabulary of {vocab_size}")
        max_length = generation.get("max_length", config.get("max_length", 512))
        return cls(
            d_model=d_model,
            encoder_layers=number("encoder_layers"),
            decoder_layers=number("decoder_layers"),
            heads=heads,
            ffn=same("encoder_ffn_dim", "decoder_ffn_dim"),
            activation=ACTIVATIONS[activation],
            max_positions=number("max_position_embeddings"),
            scale_embedding=bool(config.get("scale_embedding", False)),
            shared_embeddings=shared,
            tied_output=bool(config.get("tie_word_embeddings", True)),
            vocab_size=vocab_size,
            decoder_vocab_size=decoder_vocab,
            pad_id=pad,
            eos_id=eos,
            start_id=start,
            dropout=float(number("dropout", 0.1, float)),
            attention_dropout=float(number("attention_dropout", 0.0, float)),
            activation_dropout=float(number("activation_dropout", 0.0, float)),
            num_beams=int(generation.get("num_beams", config.get("num_beams", 1)) or 1),
            max_length=int(max_length) if isinstance(max_length, int) and max_length > 1 else 512,
        )

    def experiment(self, src_lang: str, tgt_lang: str, src_size: int) -> ExperimentConfig:
        """Our config of this model: the model, its vocabulary, and decode settings from its generation config."""
        positions = self.max_positions
        raw = {
            "data": {
                "src_lang": src_lang,
                "tgt_lang": tgt_lang,
                "shared_vocab": self.shared_embeddings,
                "vocab_size": src_size,
                "max_len": min(128, positions - 1),
            },
            "model": {
                "arch": "transformer",
                "d_model": self.d_model,
                "dropout": self.dropout,
                "max_positions": positions,
                "share_decoder_embeddings": self.tied_output,
                "share_all_embeddings": self.shared_embeddings,
                "transformer": {
                    "n_heads": self.heads,
                    "d_ff": self.ffn,
                    "encoder_layers": self.encoder_layers,
                    "decoder_layers": self.decoder_layers,
                    "attention_dropout": self.attention_dropout,
                    "activation_dropout": self.activation_dropout,
                    "activation": self.activation,
                    "norm": "post",
                    "norm_type": "layernorm",
                    "positions": "sinusoidal",
                    "scale_embedding": self.scale_embedding,
                    "output_bias": True,
                },
            },
            "decode": {
                "beam_size": max(1, self.num_beams),
                "max_len": max(1, min(self.max_length - 1, 256, positions - 1)),
            },
        }
        try:
            return from_dict(raw, source="the imported Marian config")
        except ConfigError as e:
            raise UserError(str(e)) from None


def halves_to_interleaved(d_model: int) -> Tensor:
    """perm such that ours[..., j] = marian[..., perm[j]]: (sin_0, cos_0, sin_1, ...) from (sin_0.., cos_0..)."""
    half = d_model // 2
    return torch.stack([torch.arange(half), torch.arange(half) + half], dim=1).flatten()


def check_positions(state: Mapping[str, Tensor], d_model: int, what: str) -> None:
    """Stored position tables (optional in Marian files) must be the sinusoids, halves layout."""
    perm = halves_to_interleaved(d_model)
    for key in ("model.encoder.embed_positions.weight", "model.decoder.embed_positions.weight"):
        table = state.get(key)
        if table is None:
            continue
        ours = sinusoidal_table(table.shape[0], d_model)[:, torch.argsort(perm)]
        if table.shape[1] != d_model or not torch.allclose(table.float(), ours, atol=1e-4):
            raise UserError(f"{what}: {key} is not the sinusoidal table; learned positions do not import")


class _Weights:
    """The Marian tensors by name, each asked for once, with one line for a missing or misshapen one."""

    def __init__(self, state: Mapping[str, Tensor], what: str) -> None:
        self.state, self.what = state, what

    def get(self, *names: str, shape: tuple[int, ...]) -> Tensor:
        for name in names:
            tensor = self.state.get(name)
            if tensor is None:
                continue
            if tuple(tensor.shape) != shape:
                raise UserError(f"{self.what}: {name} has shape {tuple(tensor.shape)}, the config says {shape}")
            return tensor.detach().to(torch.float32)
        raise UserError(f"{self.what}: the weights have no {names[0]}")


def import_weights(
    state: Mapping[str, Tensor], s: MarianSettings, src_order: list[int], tgt_order: list[int], what: str
) -> dict[str, Tensor]:
    """Our state dict of a Marian model's weights; `*_order`: the Marian id of each of our ids (tokenizer)."""
    d, f = s.d_model, s.ffn
    perm = halves_to_interleaved(d)
    w = _Weights(state, what)
    check_positions(state, d, what)

    def vec(name: str) -> Tensor:  # a residual-width vector: LayerNorm, an output bias
        return w.get(name, shape=(d,))[perm]

    def reads(name: str, rows: int) -> Tensor:  # a weight that reads the residual stream
        return w.get(name, shape=(rows, d))[:, perm]

    def linear_in(prefix: str, rows: int) -> tuple[Tensor, Tensor]:
        return reads(f"{prefix}.weight", rows), w.get(f"{prefix}.bias", shape=(rows,))

    def writes(prefix: str, cols: int) -> tuple[Tensor, Tensor]:  # a projection into the residual stream
        return w.get(f"{prefix}.weight", shape=(d, cols))[perm], vec(f"{prefix}.bias")

    def vocab_rows(table: Tensor, order: list[int], fill: float = 0.0) -> Tensor:
        index = torch.tensor([max(i, 0) for i in order])
        rows = table.index_select(0, index)
        rows[PAD] = fill
        return rows

    out: dict[str, Tensor] = {}

    def attention(ours: str, marian: str) -> None:
        q, k, v = (linear_in(f"{marian}.{p}_proj", d) for p in "qkv")
        out[f"{ours}.in_proj.weight"] = torch.cat([q[0], k[0], v[0]])
        out[f"{ours}.in_proj.bias"] = torch.cat([q[1], k[1], v[1]])
        out[f"{ours}.out_proj.weight"], out[f"{ours}.out_proj.bias"] = writes(f"{marian}.out_proj", d)

    def norm(ours: str, marian: str) -> None:
        out[f"{ours}.weight"], out[f"{ours}.bias"] = vec(f"{marian}.weight"), vec(f"{marian}.bias")

    def ffn(ours: str, marian: str) -> None:
        out[f"{ours}.ffn.fc1.weight"], out[f"{ours}.ffn.fc1.bias"] = linear_in(f"{marian}.fc1", f)
        out[f"{ours}.ffn.fc2.weight"], out[f"{ours}.ffn.fc2.bias"] = writes(f"{marian}.fc2", f)

    src_name, tgt_name = "model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight"
    if s.shared_embeddings:  # save_pretrained may keep any one of the tied names
        src_embedding = w.get("model.shared.weight", src_name, tgt_name, shape=(s.vocab_size, d))[:, perm]
        tgt_embedding = src_embedding
    else:
        src_embedding = w.get(src_name, shape=(s.vocab_size, d))[:, perm]
        tgt_embedding = w.get(tgt_name, shape=(s.decoder_vocab_size, d))[:, perm]
    out["encoder.embedding.tokens.weight"] = vocab_rows(src_embedding, src_order)
    out["decoder.embedding.tokens.weight"] = vocab_rows(tgt_embedding, tgt_order)
    mappers = {"attention": attention, "norm": norm, "ffn": ffn}
    for kind, ours, marian in layer_modules(s.encoder_layers, s.decoder_layers):
        mappers[kind](ours, marian)
    if s.tied_output:
        out["decoder.output.weight"] = out["decoder.embedding.tokens.weight"]
    else:
        out["decoder.output.weight"] = vocab_rows(reads("lm_head.weight", s.decoder_vocab_size), tgt_order)
    bias = state.get("final_logits_bias")
    if bias is None:
        bias = torch.zeros(1, s.decoder_vocab_size)
    if tuple(bias.shape) != (1, s.decoder_vocab_size):
        raise UserError(f"{what}: final_logits_bias has shape {tuple(bias.shape)}, not (1, {s.decoder_vocab_size})")
    out["decoder.output.bias"] = vocab_rows(bias.detach().float().T, tgt_order, PAD_LOGIT_BIAS).flatten()
    if s.shared_embeddings:
        out["decoder.embedding.tokens.weight"] = out["encoder.embedding.tokens.weight"]
        if s.tied_output:
            out["decoder.output.weight"] = out["encoder.embedding.tokens.weight"]
    for name, tensor in out.items():
        if not torch.isfinite(tensor).all() and name != "decoder.output.bias":
            raise UserError(f"{what}: the weights of {name} are not all finite")
    return out


def exportable(cfg: ExperimentConfig) -> None:
    """Refuse, in one line naming the setting, a model Marian cannot express."""
    m, t = cfg.model, cfg.model.transformer
    if m.arch != "transformer" or t is None:
        raise UserError(f"model.arch={m.arch} does not export to Marian (a Transformer only)")
    for key, value, needed in (
        ("attention", t.attention, "full"),  # the encoder's long attention first: nothing else could express it
        ("norm", t.norm, "post"),
        ("norm_type", t.norm_type, "layernorm"),
        ("positions", t.positions, "sinusoidal"),
    ):
        if value != needed:
            raise UserError(f"model.transformer.{key}={value} does not export to Marian, which has {needed} only")
    if m.d_model % 2:
        raise UserError(f"model.d_model={m.d_model} is odd; Marian's sinusoids need an even width")


def export_weights(model: Mapping[str, Tensor], cfg: ExperimentConfig) -> dict[str, Tensor]:
    """A Marian state dict of our weights: our id i > 0 is Marian id i - 1 (seq2seq.hf.tokenizer)."""
    m, t = cfg.model, cfg.model.transformer
    assert t is not None, "exportable() refuses other architectures"
    back = torch.argsort(halves_to_interleaved(m.d_model))  # marian[..., j] = ours[..., back[j]]
    out: dict[str, Tensor] = {}

    def put(name: str, tensor: Tensor) -> None:
        out[name] = tensor.detach().float().contiguous().clone()

    def vec(name: str) -> Tensor:
        return model[name][back]

    def attention(marian: str, ours: str) -> None:
        weight, bias = model[f"{ours}.in_proj.weight"][:, back], model[f"{ours}.in_proj.bias"]
        for index, p in enumerate("qkv"):
            rows = slice(index * m.d_model, (index + 1) * m.d_model)
            put(f"{marian}.{p}_proj.weight", weight[rows])
            put(f"{marian}.{p}_proj.bias", bias[rows])
        put(f"{marian}.out_proj.weight", model[f"{ours}.out_proj.weight"][back])
        put(f"{marian}.out_proj.bias", vec(f"{ours}.out_proj.bias"))

    def norm(marian: str, ours: str) -> None:
        put(f"{marian}.weight", vec(f"{ours}.weight"))
        put(f"{marian}.bias", vec(f"{ours}.bias"))

    def ffn(marian: str, ours: str) -> None:
        put(f"{marian}.fc1.weight", model[f"{ours}.ffn.fc1.weight"][:, back])
        put(f"{marian}.fc1.bias", model[f"{ours}.ffn.fc1.bias"])
        put(f"{marian}.fc2.weight", model[f"{ours}.ffn.fc2.weight"][back])
        put(f"{marian}.fc2.bias", vec(f"{ours}.ffn.fc2.bias"))

    def vocab(name: str) -> Tensor:
        return model[name][1:, back]  # our PAD row goes

    src, tgt = vocab("encoder.embedding.tokens.weight"), vocab("decoder.embedding.tokens.weight")
    if m.share_all_embeddings:
        put("model.shared.weight", src)
    put("model.encoder.embed_tokens.weight", src)
    put("model.decoder.embed_tokens.weight", tgt)
    mappers = {"attention": attention, "norm": norm, "ffn": ffn}
    for kind, ours, marian in layer_modules(t.encoder_layers, t.decoder_layers):
        mappers[kind](marian, ours)
    put("lm_head.weight", vocab("decoder.output.weight"))
    bias = model.get("decoder.output.bias")
    put("final_logits_bias", (bias[1:] if bias is not None else torch.zeros(tgt.shape[0]))[None, :])
    return out


def marian_config(cfg: ExperimentConfig, src_size: int, tgt_size: int) -> dict[str, Any]:
    """config.json of our model (vocabulary sizes: ours, less our PAD)."""
    m, t = cfg.model, cfg.model.transformer
    assert t is not None
    pad, eos = 1, 2  # Marian ids of our BOS (its decoder start and pad) and EOS
    return {
        "architectures": ["MarianMTModel"],
        "model_type": "marian",
        "vocab_size": src_size - 1,
        "decoder_vocab_size": tgt_size - 1,
        "share_encoder_decoder_embeddings": m.share_all_embeddings,
        "tie_word_embeddings": m.share_decoder_embeddings,
        "d_model": m.d_model,
        "encoder_layers": t.encoder_layers,
        "decoder_layers": t.decoder_layers,
        "encoder_attention_heads": t.n_heads,
        "decoder_attention_heads": t.n_heads,
        "encoder_ffn_dim": t.d_ff,
        "decoder_ffn_dim": t.d_ff,
        "activation_function": OURS_TO_MARIAN_ACTIVATION[t.activation],
        "dropout": m.dropout,
        "attention_dropout": t.attention_dropout,
        "activation_dropout": t.activation_dropout,
        "max_position_embeddings": m.max_positions,
        "scale_embedding": t.scale_embedding,
        "pad_token_id": pad,
        "decoder_start_token_id": pad,
        "eos_token_id": eos,
        "forced_eos_token_id": eos,
        "is_encoder_decoder": True,
    }


def generation_config(cfg: ExperimentConfig) -> dict[str, Any]:
    """generation_config.json: our search's bans (the pad/decoder start is our BOS) and beam size."""
    d = cfg.decode
    return {
        "decoder_start_token_id": 1,
        "pad_token_id": 1,
        "eos_token_id": 2,
        "forced_eos_token_id": 2,
        "bad_words_ids": [[1]],
        "num_beams": d.beam_size if d.strategy == "beam" else 1,
        "max_length": min(d.max_len + 1, cfg.model.max_positions),
    }


def fresh_table(d_model: int, positions: int) -> Tensor:
    """Marian's position table (halves layout) of our sinusoids, for a test or a file that wants it stored."""
    return sinusoidal_table(positions, d_model)[:, torch.argsort(halves_to_interleaved(d_model))]
