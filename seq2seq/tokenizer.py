"""SentencePiece subword tokenization with fixed special ids.

The trained SentencePiece models travel inside every checkpoint as bytes, so a
checkpoint alone is enough to translate.
"""

from __future__ import annotations

import io
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import sentencepiece as spm

from seq2seq.errors import UserError
from seq2seq.owned import is_regular_file
from seq2seq.vocab import BOS, EOS, PAD, UNK


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


TOKENIZER_FILES = (("spm.model",), ("spm.src.model", "spm.tgt.model"))  # Tokenizer.save's: shared, or per side


def tokenizer_files(directory: Path, remedy: str, error: type[UserError] = UserError) -> list[Path]:
    """The SentencePiece model files `Tokenizer.save` wrote into a directory (present, perhaps as links)."""
    for names in TOKENIZER_FILES:
        if all((directory / name).exists() or (directory / name).is_symlink() for name in names):
            return [directory / name for name in names]
    raise error(f"{directory} has no SentencePiece model (spm.model, or spm.src.model and spm.tgt.model); {remedy}")


def read_tokenizer(directory: Path, remedy: str, error: type[UserError] = UserError) -> Tokenizer:
    """The tokenizer `Tokenizer.save` wrote into a directory; each error names the file and ends with `remedy`."""
    files = tokenizer_files(directory, remedy, error)
    for file in files:
        if not is_regular_file(file):
            raise error(f"{file} is not a regular file (a symbolic link?); {remedy}")
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
) -> Tokenizer:
    """Train one joint model, or one per side, on the training text.

    `source` names that text (e.g. its files) in the error raised when it is empty.
    """
    if shared:
        return Tokenizer(_train(list(src_lines) + list(tgt_lines), vocab_size, model_type, source))
    return Tokenizer(
        _train(src_lines, vocab_size, model_type, f"the source side of {source}"),
        _train(tgt_lines, vocab_size, model_type, f"the target side of {source}"),
    )


def _train(lines: Iterable[str], vocab_size: int, model_type: str, source: str) -> bytes:
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


def _load(proto: bytes) -> spm.SentencePieceProcessor:
    processor = spm.SentencePieceProcessor()
    processor.load_from_serialized_proto(proto)
    return processor
