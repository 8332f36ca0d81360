"""A randomly initialised Marian model directory, laid out like a downloaded OPUS-MT one, for tests and the README.

Its SentencePiece models are trained on the given text with SentencePiece's
own special ids (as Marian's are: `<unk>` 0, `<s>` 1, `</s>` 2), and its
vocab.json numbers the pieces as Marian does (`</s>` 0, `<unk>` 1, the pieces,
`<pad>` last); with separate vocabularies each side gets its own, `<pad>`
third. Needs `transformers` (the `hf` extra).
"""

from __future__ import annotations

import io
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import sentencepiece as spm
import torch


@dataclass(frozen=True)
class Shape:
    """The variants the tests cover."""

    d_model: int = 32
    layers: int = 2
    heads: int = 4
    ffn: int = 64
    activation: str = "swish"
    scale_embedding: bool = True
    shared: bool = True  # one vocab.json and one embedding matrix for both sides
    tied_output: bool = True
    vocab_size: int = 60  # SentencePiece pieces per side
    max_positions: int = 128
    init_std: float = 0.1  # larger than transformers' 0.02, so that a random model's choices are far from ties
    eos_bias: float = 0.0  # added to `</s>`'s logits bias: a random model that ends its sentences


def _train_spm(lines: Sequence[str], vocab_size: int) -> bytes:
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter([line for line in lines if line.strip()]),
        model_writer=model,
        vocab_size=vocab_size,
        character_coverage=1.0,
        hard_vocab_limit=False,
        minloglevel=2,
        num_threads=1,
    )
    return model.getvalue()


def _pieces(proto: bytes) -> list[str]:
    processor = spm.SentencePieceProcessor()
    processor.load_from_serialized_proto(proto)
    size = processor.get_piece_size()
    return [processor.id_to_piece(i) for i in range(size) if not (processor.is_control(i) or processor.is_unknown(i))]


def write_random_marian(
    directory: str | Path,
    src_lines: Sequence[str],
    tgt_lines: Sequence[str],
    shape: Shape = Shape(),
    seed: int = 0,
    langs: tuple[str, str] = ("src", "tgt"),
) -> Path:
    """Write the directory (created if needed) and return it."""
    from transformers import MarianConfig, MarianMTModel

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    src_spm, tgt_spm = _train_spm(src_lines, shape.vocab_size), _train_spm(tgt_lines, shape.vocab_size)
    if shape.shared:
        pieces = list(dict.fromkeys(_pieces(src_spm) + _pieces(tgt_spm)))
        vocab = {"</s>": 0, "<unk>": 1, **{p: i + 2 for i, p in enumerate(pieces)}, "<pad>": len(pieces) + 2}
        src_vocab = tgt_vocab = vocab
        pad = vocab["<pad>"]
    else:

        def side(proto: bytes) -> dict[str, int]:
            return {"</s>": 0, "<unk>": 1, "<pad>": 2, **{p: i + 3 for i, p in enumerate(_pieces(proto))}}

        src_vocab, tgt_vocab = side(src_spm), side(tgt_spm)
        pad = 2
    config = MarianConfig(
        vocab_size=len(src_vocab),
        decoder_vocab_size=len(tgt_vocab),
        d_model=shape.d_model,
        encoder_layers=shape.layers,
        decoder_layers=shape.layers,
        encoder_attention_heads=shape.heads,
        decoder_attention_heads=shape.heads,
        encoder_ffn_dim=shape.ffn,
        decoder_ffn_dim=shape.ffn,
        activation_function=shape.activation,
        max_position_embeddings=shape.max_positions,
        scale_embedding=shape.scale_embedding,
        share_encoder_decoder_embeddings=shape.shared,
        tie_word_embeddings=shape.tied_output,
        pad_token_id=pad,
        decoder_start_token_id=pad,
        eos_token_id=0,
        forced_eos_token_id=0,
        init_std=shape.init_std,
        dropout=0.1,
    )
    torch.manual_seed(seed)
    model = MarianMTModel(config)
    with torch.no_grad():  # a real model's logits bias is trained; a random one's would be zeros
        model.final_logits_bias.normal_(0.0, 0.5)
        model.final_logits_bias[0, 0] += shape.eos_bias
    model.generation_config.bad_words_ids = [[pad]]  # as OPUS-MT models have: never emit the pad token
    model.generation_config.num_beams = 4
    model.generation_config.max_length = 64
    model.save_pretrained(out)
    (out / "source.spm").write_bytes(src_spm)
    (out / "target.spm").write_bytes(tgt_spm)
    (out / "vocab.json").write_text(json.dumps(src_vocab, ensure_ascii=False), encoding="utf-8")
    if not shape.shared:
        (out / "target_vocab.json").write_text(json.dumps(tgt_vocab, ensure_ascii=False), encoding="utf-8")
    tokenizer_config = {"source_lang": langs[0], "target_lang": langs[1], "separate_vocabs": not shape.shared}
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config), encoding="utf-8")
    return out
