"""SentencePiece subword tokenization with fixed special ids.

The trained SentencePiece models travel inside every checkpoint as bytes, so a
checkpoint alone is enough to translate. A model of several language pairs
(data.pairs) has one user-defined piece per target language, `<2xx>`, put
before each source sentence (`tag_line`), so its tags travel with it too.
"""

from __future__ import annotations

import io
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import sentencepiece as spm

from seq2seq.errors import UserError
from seq2seq.text.vocab import BOS, EOS, PAD, UNK

TAG = re.compile(r"<2(.+)>")


def tag_piece(lang: str) -> str:
    """The piece that asks for a translation into `lang`."""
    return f"<2{lang}>"


def tag_line(line: str, lang: str) -> str:
    """The source line with the tag of target language `lang` before it, the one way a tag is added;
    a blank line stays blank (an empty input, not a sentence)."""
    return f"{tag_piece(lang)} {line}" if line.strip() else line


@dataclass(frozen=True)
class Sampling:
    """Subword regularisation (Kudo, 2018): a random segmentation instead of the best one.

    For a unigram model, `alpha` smooths the distribution over the `nbest` best
    segmentations (-1: all of them; smaller alpha samples more aggressively); for
    BPE it is the BPE-dropout probability and `nbest` is ignored. One `seed` gives
    one segmentation, so a training epoch can be encoded again after a resume.
    """

    alpha: float
    nbest: int
    seed: int


class Tokenizer:
    """A source and a target SentencePiece model (the same one when the vocabulary is shared)."""

    def __init__(self, src_proto: bytes, tgt_proto: bytes | None = None) -> None:
        self.src_proto = src_proto
        self.tgt_proto = tgt_proto
        self.src = _load(src_proto)
        self.tgt = self.src if tgt_proto is None else _load(tgt_proto)
        self.target_langs = _target_langs(self.src)

    @property
    def shared(self) -> bool:
        return self.tgt_proto is None

    @property
    def src_vocab_size(self) -> int:
        return self.src.get_piece_size()

    @property
    def tgt_vocab_size(self) -> int:
        return self.tgt.get_piece_size()

    def encode_src(self, lines: Sequence[str], sampling: Sampling | None = None) -> list[list[int]]:
        return _encode(self.src, lines, sampling)

    def encode_tgt(self, lines: Sequence[str], sampling: Sampling | None = None) -> list[list[int]]:
        return _encode(self.tgt, lines, sampling)

    def decode_tgt(self, ids: Sequence[int]) -> str:
        return self.tgt.decode([i for i in ids if i > EOS])

    def tgt_pieces(self, ids: Sequence[int]) -> list[str]:
        return [self.tgt.id_to_piece(int(i)) for i in ids]

    def src_pieces(self, ids: Sequence[int]) -> list[str]:
        return [self.src.id_to_piece(int(i)) for i in ids]

    def state(self) -> dict[str, bytes | None]:
        return {"src": self.src_proto, "tgt": self.tgt_proto}

    @classmethod
    def from_state(cls, state: dict[str, bytes | None]) -> Tokenizer:
        assert state["src"] is not None
        return cls(state["src"], state["tgt"])

    def save(self, run_dir: str | Path) -> None:
        """Write the .model files beside a run, for use by other tools."""
        run_dir = Path(run_dir)
        if self.shared:
            (run_dir / "spm.model").write_bytes(self.src_proto)
        else:
            (run_dir / "spm.src.model").write_bytes(self.src_proto)
            assert self.tgt_proto is not None
            (run_dir / "spm.tgt.model").write_bytes(self.tgt_proto)


def read_spm_models(paths: Sequence[str | Path]) -> Tokenizer:
    """An existing SentencePiece model (one path) or one per side (two), checked to use this project's special ids."""
    protos = []
    for path in paths:
        if not Path(path).is_file():  # not /dev/zero, not a directory
            raise UserError(f"{path}: SentencePiece model not found (or not a regular file)")
        try:
            proto = Path(path).read_bytes()
            processor = _load(proto)
        except OSError as e:
            raise UserError(f"{path}: cannot read the SentencePiece model ({e.strerror})") from None
        except RuntimeError:
            raise UserError(f"{path}: not a SentencePiece model") from None
        found = (processor.pad_id(), processor.unk_id(), processor.bos_id(), processor.eos_id())
        if found != (PAD, UNK, BOS, EOS):
            raise UserError(
                f"{path}: its special ids are pad={found[0]} unk={found[1]} bos={found[2]} eos={found[3]}; seq2seq "
                f"needs pad={PAD} unk={UNK} bos={BOS} eos={EOS} (spm_train --pad_id={PAD} --unk_id={UNK} "
                f"--bos_id={BOS} --eos_id={EOS})"
            )
        protos.append(proto)
    return Tokenizer(*protos)


TOKENIZER_FILES = (("spm.model",), ("spm.src.model", "spm.tgt.model"))  # Tokenizer.save's: shared, or per side


def tokenizer_files(directory: Path, remedy: str, error: type[UserError] = UserError) -> list[Path]:
    """The SentencePiece model files `Tokenizer.save` wrote into a directory (present, perhaps as links)."""
    for names in TOKENIZER_FILES:
        if all((directory / name).exists() or (directory / name).is_symlink() for name in names):
            return [directory / name for name in names]
    raise error(f"{directory} has no SentencePiece model (spm.model, or spm.src.model and spm.tgt.model); {remedy}")


def read_tokenizer(directory: Path, remedy: str, error: type[UserError] = UserError) -> Tokenizer:
    """The tokenizer `Tokenizer.save` wrote into a directory; each error names the file and ends with `remedy`.
    A file may be a link to one (a model store's blob): the callers check the content against a hash."""
    files = tokenizer_files(directory, remedy, error)
    for file in files:
        if not file.is_file():  # a directory, a device, a link to neither file
            what = "a link to nothing" if file.is_symlink() and not file.exists() else "not a regular file"
            raise error(f"{file} is {what}; {remedy}")
    try:
        return Tokenizer(*(file.read_bytes() for file in files))
    except (RuntimeError, OSError) as e:
        raise error(f"{files[0]}: not a readable SentencePiece model ({str(e)[:80]}); {remedy}") from None


def train_tokenizer(
    src_lines: Sequence[str],
    tgt_lines: Sequence[str],
    vocab_size: int,
    shared: bool,
    model_type: str = "unigram",
    source: str = "the training text",
    target_langs: Sequence[str] = (),
) -> Tokenizer:
    """Train one joint model, or one per side, on the training text.

    `source` names that text (e.g. its files) in the error raised when it is empty;
    `target_langs` get their tag pieces (a joint model only: data.pairs requires one).
    """
    if shared:
        tags = [tag_piece(lang) for lang in target_langs]
        return Tokenizer(_train(list(src_lines) + list(tgt_lines), vocab_size, model_type, source, tags))
    assert not target_langs, "tags need a joint model"
    return Tokenizer(
        _train(src_lines, vocab_size, model_type, f"the source side of {source}"),
        _train(tgt_lines, vocab_size, model_type, f"the target side of {source}"),
    )


def _train(lines: Iterable[str], vocab_size: int, model_type: str, source: str, tags: Sequence[str] = ()) -> bytes:
    lines = [line for line in lines if line.strip()]
    if not lines:  # SentencePiece would only say `[!sentences_.empty()]`
        raise UserError(f"no text to train the SentencePiece vocabulary on: no non-empty line in {source}")
    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(lines),
            model_writer=model,
            vocab_size=vocab_size,
            model_type=model_type,
            character_coverage=1.0,
            pad_id=PAD,
            unk_id=UNK,
            bos_id=BOS,
            eos_id=EOS,
            input_sentence_size=2_000_000,
            shuffle_input_sentence=True,
            num_threads=2,
            hard_vocab_limit=False,  # small corpora get a smaller vocabulary, not an error
            minloglevel=2,
            user_defined_symbols=",".join(tags),
        )
    except RuntimeError as e:
        # SentencePiece refuses a vocabulary larger than the text supports; say so plainly.
        raise UserError(f"could not train the SentencePiece vocabulary on {source}: {str(e).strip()}") from None
    return model.getvalue()


def _encode(processor: spm.SentencePieceProcessor, lines: Sequence[str], sampling: Sampling | None) -> list[list[int]]:
    if sampling is None:
        return processor.encode(list(lines))
    # SentencePiece's sampler draws from a global seed; on one thread the sample is a function of it.
    spm.set_random_generator_seed(sampling.seed)
    return processor.encode(
        list(lines), enable_sampling=True, alpha=sampling.alpha, nbest_size=sampling.nbest, num_threads=1
    )


def _target_langs(processor: spm.SentencePieceProcessor) -> tuple[str, ...]:
    """The languages of the tag pieces, which SentencePiece numbers right after the special ids."""
    langs = []
    for i in range(EOS + 1, processor.get_piece_size()):
        match = TAG.fullmatch(processor.id_to_piece(i))
        if match is None:
            break
        langs.append(match.group(1))
    return tuple(langs)


def _load(proto: bytes) -> spm.SentencePieceProcessor:
    processor = spm.SentencePieceProcessor()
    processor.load_from_serialized_proto(proto)
    return processor
