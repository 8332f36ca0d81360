"""Export a checkpoint to CTranslate2, the C++ inference engine most MT deployments use.

The model is rebuilt with CTranslate2's own converter specs (`TransformerSpec`),
layer by layer from this project's modules, so CTranslate2 validates every
shape and applies the quantization itself (int8, int16, float16, bfloat16...).
The output directory holds the CTranslate2 model, its vocabularies, the
SentencePiece model(s) that turn text into the pieces it expects, and the
experiment config (`seq2seq.yaml`: languages, test set, decode defaults), so
that `seq2seq translate -c DIR` and `seq2seq evaluate -c DIR` run it
(seq2seq.deploy.exported). Outside this project:

    import ctranslate2, sentencepiece as spm
    sp = spm.SentencePieceProcessor(model_file="DIR/spm.model")
    translator = ctranslate2.Translator("DIR")
    pieces = translator.translate_batch([sp.encode("Ein Hund.", out_type=str)])[0].hypotheses[0]
    print(sp.decode(pieces))

The source EOS is appended by CTranslate2 (`add_source_eos`), as `translate` does.
`seq2seq-manifest.json` records the sizes and sha256 of the files, checked when
the directory is loaded (seq2seq.deploy.exported). The export is built in a temporary
directory beside the output and moved in place: an existing output is replaced
only when it is empty or an earlier export (its manifest and only its files).

`ctranslate2` is an optional extra (`pip install -e ".[export]"`), imported only here.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import numpy as np
from torch import Tensor, nn

from seq2seq.config import save_config
from seq2seq.deploy.exported import CONFIG, MANIFEST, import_ctranslate2, write_manifest
from seq2seq.errors import UserError
from seq2seq.model import Seq2SeqTransformer
from seq2seq.model.attention import MultiHeadAttention
from seq2seq.model.layers import DecoderLayer, EncoderLayer, FeedForward
from seq2seq.model.positions import PositionBias
from seq2seq.model.transformer import Decoder, Encoder
from seq2seq.runs.checkpoint import Checkpoint, read
from seq2seq.runs.owned import check_replaceable, make_temporary, remove_temporary, replace_directory
from seq2seq.text.tokenizer import Tokenizer
from seq2seq.text.vocab import BOS, EOS, UNK

OWN_FILES = re.compile(
    r"model\.bin|config\.json|(shared|source|target)_vocabulary\.(json|txt)|spm(\.src|\.tgt)?\.model"
    r"|seq2seq\.yaml|seq2seq-manifest\.json"
)
QUANTIZATIONS = ("int8", "int8_float32", "int8_float16", "int8_bfloat16", "int16", "float16", "bfloat16", "float32")


class ExportError(UserError):
    """A checkpoint that cannot be exported as asked."""


def export_ctranslate2(checkpoint: str | Path, output: str | Path, quantization: str = "float32") -> Path:
    """Write the checkpoint's model as a CTranslate2 model directory; returns it."""
    ctranslate2 = import_ctranslate2()
    if quantization not in QUANTIZATIONS:
        raise ExportError(f"--quantization must be one of {', '.join(QUANTIZATIONS)}; got {quantization!r}")
    output = Path(os.path.abspath(output))
    check_replaceable(output, MANIFEST, OWN_FILES, "--output", ExportError)
    stored = read(checkpoint)
    _check_exportable(stored)
    model = stored.build_model("cpu")
    assert isinstance(model, Seq2SeqTransformer)  # _check_exportable refused the other architectures
    spec = _spec(ctranslate2.specs, stored, model)
    tmp = make_temporary(output)
    try:
        _write(ctranslate2, spec, stored, tmp, quantization)
        check_replaceable(output, MANIFEST, OWN_FILES, "--output", ExportError)  # again: still ours?
        replace_directory(output, tmp)
    finally:
        remove_temporary(tmp)
    return output


def _write(ctranslate2: Any, spec: Any, stored: Checkpoint, out: Path, quantization: str) -> None:
    """The CTranslate2 model, the tokenizer, the config and the manifest, into the (temporary) directory `out`."""
    engine = out / "ctranslate2"  # CTranslate2 replaces the directory it writes: a subdirectory of its own
    try:
        _converter(ctranslate2, spec).convert(str(engine), quantization=_ct2_quantization(quantization), force=True)
    except (ValueError, RuntimeError) as e:  # CTranslate2's own checks of shapes and types
        raise ExportError(f"CTranslate2 refused the model: {str(e).splitlines()[0]}") from None
    for file in engine.iterdir():
        file.rename(out / file.name)
    engine.rmdir()
    stored.tokenizer.save(out)  # spm.model, or spm.src.model and spm.tgt.model
    save_config(stored.config, out / CONFIG)  # languages, test set and decode defaults for translate/evaluate
    write_manifest(out, stored.config)


def _check_exportable(stored: Checkpoint) -> None:
    """CTranslate2's Transformer spec takes every Transformer variant with full attention; it has no recurrent
    model, and a decoder-only model would be its TransformerDecoderModelSpec, which attends causally only (no
    prefix LM) and runs as a ctranslate2.Generator, which the exported model's translator
    (seq2seq.deploy.exported) is not."""
    arch, decoder_only = stored.config.model.arch, stored.config.model.decoder_only
    if decoder_only is not None and decoder_only.prefix == "bidirectional":
        raise ExportError(
            "model.arch=decoder_only with model.decoder_only.prefix: bidirectional does not export to CTranslate2: "
            "its decoder-only specification attends causally only, and a prefix LM's source attends both ways"
        )
    if decoder_only is not None:
        raise ExportError(
            "model.arch=decoder_only does not export to CTranslate2: its decoder-only specification runs as a "
            "ctranslate2.Generator, which the exported translator does not drive (decode it with PyTorch)"
        )
    if arch != "transformer":
        raise ExportError(
            f"model.arch={arch} does not export to CTranslate2: it has no specification for recurrent models "
            "(every Transformer variant exports but the encoder's long attention)"
        )
    t = stored.config.model.transformer
    if t is not None and t.attention != "full":
        raise ExportError(
            f"model.transformer.attention={t.attention} does not export to CTranslate2, whose encoder attends "
            "to every position (full attention only)"
        )


def _ct2_quantization(name: str) -> str | None:
    return None if name == "float32" else name


def _converter(ctranslate2: Any, spec: Any) -> Any:
    """A CTranslate2 converter of a ready spec: its `convert` validates, quantizes and saves."""

    class Loaded(ctranslate2.converters.Converter):  # type: ignore[misc]
        def _load(self) -> Any:
            return spec

    return Loaded()


def _spec(specs: Any, stored: Checkpoint, model: Seq2SeqTransformer) -> Any:
    t = stored.config.model.transformer
    assert t is not None, "_check_exportable refuses other architectures"
    activations = specs.common_spec.Activation
    options = {
        "pre_norm": t.norm == "pre",
        "activation": {"gelu": activations.GELU, "swish": activations.SWISH}.get(t.activation, activations.RELU),
        "rms_norm": t.norm_type == "rmsnorm",
        **_position_options(model),
    }
    encoder = specs.TransformerEncoderSpec(t.encoder_layers, t.n_heads, **options)
    decoder = specs.TransformerDecoderSpec(t.decoder_layers, t.n_heads, **options)
    if "rotary_dim" in options:  # the encoder spec keeps a table for absolute encodings; rotary ones need none
        del encoder.position_encodings
    spec = specs.TransformerSpec(encoder, decoder)
    _set_encoder(spec.encoder, model.encoder)
    _set_decoder(spec.decoder, model.decoder)
    spec.register_source_vocabulary(_pieces(stored.tokenizer, source=True))
    spec.register_target_vocabulary(_pieces(stored.tokenizer, source=False))
    spec.config.add_source_eos = True  # sources end with EOS, as in training
    target = stored.tokenizer.tgt  # the special pieces by id: an imported Marian model's BOS is named <pad>
    spec.config.unk_token, spec.config.eos_token = target.id_to_piece(UNK), target.id_to_piece(EOS)
    spec.config.bos_token = spec.config.decoder_start_token = target.id_to_piece(BOS)
    spec.config.layer_norm_epsilon = _norm_epsilon(model)  # CTranslate2's default (1e-6) is not ours (1e-5)
    return spec


def _position_options(model: Seq2SeqTransformer) -> dict[str, Any]:
    """CTranslate2's names for positions inside self-attention (seq2seq.model.positions), set explicitly.

    Rope: every dimension of a head rotates (`rotary_dim` 0), in pairs (m, m + Dh/2), i.e. the halves
    layout rather than the interleaved one, with our base. Relative: Shaw et al.'s keys and values,
    whose clipping distance CTranslate2 reads from their table's size (2k + 1 rows). T5's bias:
    CTranslate2's relative attention bias, T5's buckets (bidirectional in the encoder, causal in the
    decoder), their number read from the table's rows.
    """
    attentions = [m for m in model.modules() if isinstance(m, MultiHeadAttention)]
    bases = {m.rotary.base for m in attentions if m.rotary is not None}
    if bases:
        (base,) = bases  # one value in every layer
        return {"rotary_dim": 0, "rotary_interleave": False, "rotary_base": base}
    if model.encoder.position_bias is not None:
        return {"relative_attention_bias": True}
    return {"relative_position": any(m.relative is not None for m in attentions)}


def _norm_epsilon(model: Seq2SeqTransformer) -> float:
    (eps,) = {m.eps for m in model.modules() if isinstance(m, NORMS)}  # one value in every layer
    assert eps is not None, "an explicit epsilon (RMSNorm's would otherwise depend on the dtype)"
    return float(eps)


def _pieces(tokenizer: Tokenizer, source: bool) -> list[str]:
    processor = tokenizer.src if source else tokenizer.tgt
    return [processor.id_to_piece(i) for i in range(processor.get_piece_size())]


# Module by module: this project's layers onto CTranslate2's layer specs.


def _array(t: Tensor) -> np.ndarray:
    return t.detach().float().cpu().numpy()


def _set_linear(spec: Any, weight: Tensor, bias: Tensor | None) -> None:
    spec.weight = _array(weight)
    if bias is not None:
        spec.bias = _array(bias)


NORMS = (nn.LayerNorm, nn.RMSNorm)


def _set_norm(spec: Any, norm: nn.Module) -> None:
    """LayerNorm's scale and shift; RMSNorm's scale alone (the spec was made with rms_norm: it has no beta)."""
    if isinstance(norm, nn.RMSNorm):
        assert norm.weight is not None, "RMSNorm with a learnt scale"
        spec.gamma = _array(norm.weight)
        return
    assert isinstance(norm, nn.LayerNorm), "LayerNorm or RMSNorm"
    spec.gamma, spec.beta = _array(norm.weight), _array(norm.bias)


def _set_embedding(spec: Any, module: Encoder | Decoder) -> None:
    embedding = module.embedding
    embeddings = spec.embeddings[0] if isinstance(spec.embeddings, list) else spec.embeddings  # the encoder: a list
    embeddings.weight = _array(embedding.tokens.weight)
    spec.scale_embeddings = embedding.scale != 1.0  # sqrt(d_model), as Embedding does (unless told not to)
    table = embedding.positions.weight if embedding.positions is not None else embedding.table
    if table is not None:  # rope and relative positions live in self-attention instead
        spec.position_encodings.encodings = _array(table)
    elif hasattr(spec, "position_encodings"):  # none: a stack without positions in self-attention gets
        # sinusoidal encodings from CTranslate2 unless given a table, so it gets a table of zeros
        spec.position_encodings.encodings = np.zeros((embedding.max_positions, embedding.tokens.embedding_dim), "f")


def _set_self_attention(spec: Any, attention: MultiHeadAttention, norm: nn.Module) -> None:
    _set_linear(spec.linear[0], attention.in_proj.weight, attention.in_proj.bias)  # fused Q, K, V
    _set_linear(spec.linear[1], attention.out_proj.weight, attention.out_proj.bias)
    _set_norm(spec.layer_norm, norm)
    if attention.relative is not None:  # (2k + 1, Dh) each, rows for the distances -k .. k
        spec.relative_position_keys = _array(attention.relative.keys.weight)
        spec.relative_position_values = _array(attention.relative.values.weight)


def _set_position_bias(spec: Any, bias: PositionBias | None) -> None:
    """A stack's T5 bias, the same in every layer's self-attention (as CTranslate2's T5 converter sets it)."""
    if bias is not None:  # (buckets, H)
        spec.relative_attention_bias = _array(bias.bias.weight)
        spec.relative_attention_max_distance = np.dtype("int32").type(bias.max_distance)


def _set_cross_attention(spec: Any, attention: MultiHeadAttention, norm: nn.Module) -> None:
    d, w, b = attention.d_model, attention.in_proj.weight, attention.in_proj.bias
    _set_linear(spec.linear[0], w[:d], b[:d])  # queries from the decoder
    _set_linear(spec.linear[1], w[d:], b[d:])  # fused keys and values of the encoder output
    _set_linear(spec.linear[2], attention.out_proj.weight, attention.out_proj.bias)
    _set_norm(spec.layer_norm, norm)


def _set_ffn(spec: Any, ffn: FeedForward, norm: nn.Module) -> None:
    _set_linear(spec.linear_0, ffn.fc1.weight, ffn.fc1.bias)
    _set_linear(spec.linear_1, ffn.fc2.weight, ffn.fc2.bias)
    _set_norm(spec.layer_norm, norm)


def _set_encoder(spec: Any, encoder: Encoder) -> None:
    _set_embedding(spec, encoder)
    for layer_spec, layer in zip(spec.layer, encoder.layers):
        assert isinstance(layer, EncoderLayer)
        _set_self_attention(layer_spec.self_attention, layer.self_attn, layer.attn_block.norm)
        _set_position_bias(layer_spec.self_attention, encoder.position_bias)
        _set_ffn(layer_spec.ffn, layer.ffn, layer.ffn_block.norm)
    if isinstance(encoder.final_norm, NORMS):
        _set_norm(spec.layer_norm, encoder.final_norm)


def _set_decoder(spec: Any, decoder: Decoder) -> None:
    _set_embedding(spec, decoder)
    for layer_spec, layer in zip(spec.layer, decoder.layers):
        assert isinstance(layer, DecoderLayer)
        _set_self_attention(layer_spec.self_attention, layer.self_attn, layer.self_block.norm)
        _set_position_bias(layer_spec.self_attention, decoder.position_bias)
        _set_cross_attention(layer_spec.attention, layer.cross_attn, layer.cross_block.norm)
        _set_ffn(layer_spec.ffn, layer.ffn, layer.ffn_block.norm)
    if isinstance(decoder.final_norm, NORMS):
        _set_norm(spec.layer_norm, decoder.final_norm)
    _set_linear(spec.projection, decoder.output.weight, decoder.output.bias)
