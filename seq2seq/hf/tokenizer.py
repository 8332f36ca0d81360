"""A Marian tokenizer (a SentencePiece model per side, ids from vocab.json) as the SentencePiece models we carry.

Marian segments a sentence with `source.spm` (or `target.spm`), then looks each
piece up in `vocab.json` (`target_vocab.json` for the target side of a model
with separate vocabularies), so its ids are not the SentencePiece model's.
Ours are: a checkpoint carries SentencePiece models whose piece ids are the
model's token ids, with PAD, UNK, BOS, EOS = 0, 1, 2, 3. So each side's model
is rewritten: the same normalizer and the same segmenting pieces with their
scores (so it segments exactly as before), laid out in our id order:

    our id:    0 (PAD)  1 (UNK)   2 (BOS)                 3 (EOS)   4, 5, ...
    Marian id: none     <unk>'s   decoder_start_token_id  eos's     the others, ascending

Marian starts decoding with its pad token, so that row becomes our BOS; our
PAD is a new row that search never emits. A vocabulary entry the side's
SentencePiece model cannot produce (the other language's pieces in a shared
vocabulary) stays, as an unused piece: the model may still emit it. A piece
of the SentencePiece model the vocabulary lacks (its text never produced it)
is left out, with a warning: Marian maps it to <unk>, this segmentation uses
smaller pieces instead; most pieces lacking is an error. Export
goes the other way (`marian_vocab`): our id i > 0 is Marian id i - 1, with
pad (the decoder start) = 1.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from seq2seq.errors import UserError
from seq2seq.text.tokenizer import Tokenizer
from seq2seq.text.vocab import BOS, EOS, PAD, UNK

log = logging.getLogger("seq2seq")

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, BYTE, UNUSED = 1, 2, 3, 4, 6, 5  # SentencePiece's piece types
SEGMENTING = (NORMAL, USER_DEFINED, BYTE)  # the pieces a segmentation can produce
MARIAN_SPECIALS = {UNK: "<unk>", BOS: "<pad>", EOS: "</s>"}  # MarianTokenizer's default names


def _model_proto() -> Any:
    from sentencepiece import sentencepiece_model_pb2

    return sentencepiece_model_pb2.ModelProto()  # type: ignore[attr-defined]


def parse_spm(data: bytes, what: str) -> Any:
    """The ModelProto of a SentencePiece model file; one line if it is not one."""
    model = _model_proto()
    try:
        model.ParseFromString(data)
    except Exception:  # protobuf's DecodeError, whichever implementation raises it
        raise UserError(f"{what}: not a SentencePiece model") from None
    if not model.pieces:
        raise UserError(f"{what}: not a SentencePiece model (no pieces)")
    return model


def our_order(size: int, unk: int, start: int, eos: int) -> list[int]:
    """The Marian id of each of our ids (-1 for PAD, which Marian has not), for a side of `size` ids."""
    specials = (unk, start, eos)
    return [-1, *specials, *(i for i in range(size) if i not in specials)]


def rewrite_spm(spm: bytes, pieces: Sequence[str], order: Sequence[int], what: str) -> bytes:
    """`spm`'s model with `pieces` (the vocabulary, by Marian id) laid out as `order` says (our_order)."""
    model = parse_spm(spm, what)
    original = {p.piece: p for p in model.pieces}
    known = set(pieces)
    missing = [p.piece for p in model.pieces if p.type in SEGMENTING and p.piece not in known]
    segmenting = sum(p.type in SEGMENTING for p in model.pieces)
    if len(missing) * 2 > segmenting:  # most of them: the files do not belong together
        raise UserError(
            f"{what}: {len(missing)} of its {segmenting} pieces are not in the vocabulary (e.g. {missing[0]!r}); "
            "the SentencePiece model and the vocabulary do not belong together"
        )
    if missing:  # a few (pieces the vocabulary's text never produced): Marian maps them to <unk>, we leave them out
        log.warning(
            "%s: %d of its pieces are not in the vocabulary (e.g. %r): MarianTokenizer gives <unk> for them, "
            "here they are segmented into smaller pieces",
            what,
            len(missing),
            missing[0],
        )
    pad_name = next(name for name in ("<pad>", "<pad0>", "<seq2seq-pad>") if name not in known)
    del model.pieces[:]
    for ours, marian in enumerate(order):
        piece = model.pieces.add()
        if ours == PAD:
            piece.piece, piece.score, piece.type = pad_name, 0.0, CONTROL
            continue
        piece.piece = pieces[marian]
        if ours == UNK:
            piece.score, piece.type = 0.0, UNKNOWN
        elif ours in (BOS, EOS):
            piece.score, piece.type = 0.0, CONTROL
        else:
            old = original.get(piece.piece)
            if old is not None and old.type in SEGMENTING:
                piece.score, piece.type = old.score, old.type
            else:
                piece.score, piece.type = 0.0, UNUSED
    spec = model.trainer_spec
    spec.pad_id, spec.unk_id, spec.bos_id, spec.eos_id = PAD, UNK, BOS, EOS
    spec.pad_piece, spec.unk_piece = pad_name, pieces[order[UNK]]
    spec.bos_piece, spec.eos_piece = pieces[order[BOS]], pieces[order[EOS]]
    spec.vocab_size = len(order)
    return bytes(model.SerializeToString())


def build_tokenizer(src_proto: bytes, tgt_proto: bytes, what: str) -> Tokenizer:
    """Our tokenizer of the two rewritten models (one, when they are the same)."""
    try:
        return Tokenizer(src_proto) if src_proto == tgt_proto else Tokenizer(src_proto, tgt_proto)
    except RuntimeError as e:
        raise UserError(f"{what}: SentencePiece refused the rewritten model ({str(e).strip()[:120]})") from None


def spm_pieces(proto: bytes) -> list[str]:
    """The pieces of one of our SentencePiece models, by id."""
    return [p.piece for p in parse_spm(proto, "the checkpoint's SentencePiece model").pieces]


def marian_vocab(proto: bytes) -> dict[str, int]:
    """vocab.json for one of our sides: our id i > 0 is Marian id i - 1, specials under Marian's names."""
    pieces = spm_pieces(proto)
    vocab: dict[str, int] = {}
    for ours, piece in enumerate(pieces):
        if ours == PAD:
            continue
        name = MARIAN_SPECIALS.get(ours, piece)
        if name in vocab:
            raise UserError(f"the piece {name!r} would have two ids in vocab.json; this tokenizer does not export")
        vocab[name] = ours - 1
    return vocab


def marian_spm(proto: bytes) -> bytes:
    """The SentencePiece model Marian segments with: ours, its special pieces renamed as in vocab.json."""
    model = parse_spm(proto, "the checkpoint's SentencePiece model")
    for ours, name in MARIAN_SPECIALS.items():
        model.pieces[ours].piece = name
    model.pieces[PAD].piece = next(n for n in ("<s>", "<pad0>", "<seq2seq-pad>") if n not in MARIAN_SPECIALS.values())
    names = [p.piece for p in model.pieces]
    if len(set(names)) != len(names):
        raise UserError("a special piece's Marian name is also an ordinary piece; this tokenizer does not export")
    spec = model.trainer_spec
    spec.unk_piece, spec.bos_piece, spec.eos_piece, spec.pad_piece = "<unk>", "<pad>", "</s>", names[PAD]
    return bytes(model.SerializeToString())
