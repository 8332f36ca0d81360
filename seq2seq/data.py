"""Parallel text: reading, checking, encoding, and token-budget batching."""

from __future__ import annotations

import gzip
import logging
import random
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from seq2seq.errors import DataError
from seq2seq.tokenizer import Sampling, Tokenizer
from seq2seq.vocab import BOS, EOS, PAD

if TYPE_CHECKING:  # torch is imported where a tensor is made: the CLI starts (and takes Ctrl-C) before it loads
    import torch

log = logging.getLogger(__name__)


def find_file(directory: str | Path, split: str, lang: str) -> Path:
    """`{directory}/{split}.{lang}`, or the same with `.gz`."""
    base = Path(directory) / f"{split}.{lang}"
    for path in (base, base.with_name(base.name + ".gz")):
        if path.is_file():
            return path
    raise DataError(f"missing data file: {base} (or {base}.gz)")


def read_lines(path: str | Path) -> list[str]:
    """All lines of a UTF-8 text file, plain or gzipped, without line endings."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"missing data file: {path}")
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as f:
            return list(decode_lines(f, str(path)))
    except (OSError, EOFError) as e:  # e.g. a truncated or fake .gz
        raise DataError(f"{path}: cannot read ({e})") from None


def decode_lines(raw_lines: Iterable[bytes], name: str) -> Iterator[str]:
    """The UTF-8 lines of a binary stream without their line ending, each as soon as it arrives.

    Only a newline byte ends a line: a carriage return, U+2028 or U+0085 inside a line
    stays there (text mode and `str.splitlines` would split it and shift every later line).
    """
    for number, raw in enumerate(raw_lines, start=1):
        try:
            yield raw.decode("utf-8").rstrip("\r\n")
        except UnicodeDecodeError:
            raise DataError(f"{name}:{number}: invalid UTF-8") from None


def read_parallel(directory: str | Path, split: str, src_lang: str, tgt_lang: str) -> tuple[list[str], list[str]]:
    """The source and target lines of one split, checked to be aligned and to hold at least one pair."""
    src_path = find_file(directory, split, src_lang)
    tgt_path = find_file(directory, split, tgt_lang)
    src, tgt = read_lines(src_path), read_lines(tgt_path)
    if len(src) != len(tgt):
        raise DataError(f"misaligned corpus: {src_path} has {len(src)} lines but {tgt_path} has {len(tgt)}")
    if not any(s.strip() and t.strip() for s, t in zip(src, tgt)):
        blank = not any(line.strip() for line in src + tgt)
        what = "have no non-empty lines" if blank else "have no line pair with text on both sides"
        raise DataError(f"no sentence pairs: {src_path} and {tgt_path} {what}")
    return src, tgt


@dataclass
class EncodedCorpus:
    """Subword ids of aligned sentences; both sides end with EOS, the target has no BOS."""

    src: list[list[int]]
    tgt: list[list[int]]

    def __len__(self) -> int:
        return len(self.src)

    def lengths(self) -> list[int]:
        """The larger side of each pair, which is what a padded batch pays for."""
        return [max(len(s), len(t)) for s, t in zip(self.src, self.tgt)]


def encode_corpus(
    tokenizer: Tokenizer,
    src_lines: Sequence[str],
    tgt_lines: Sequence[str],
    max_len: int,
    name: str,
    sampling: Sampling | None = None,
) -> EncodedCorpus:
    """Encode and drop empty or over-long pairs (logging how many)."""
    src_ids = tokenizer.encode_src(src_lines, sampling)
    tgt_ids = tokenizer.encode_tgt(tgt_lines, sampling)
    kept_src, kept_tgt = [], []
    empty = too_long = 0
    for s, t in zip(src_ids, tgt_ids):
        if not s or not t:
            empty += 1
        elif len(s) > max_len or len(t) > max_len:  # max_len counts subwords, EOS not included
            too_long += 1
        else:
            kept_src.append(s + [EOS])
            kept_tgt.append(t + [EOS])
    if empty or too_long:
        level = logging.DEBUG if sampling else logging.INFO  # a sampled corpus is encoded every epoch
        log.log(level, "%s: dropped %d empty and %d over-long (> %d subwords) pairs", name, empty, too_long, max_len)
    if not kept_src:
        raise DataError(f"{name}: no sentence pairs left after filtering")
    return EncodedCorpus(kept_src, kept_tgt)


def make_batches(lengths: Sequence[int], max_tokens: int, seed: int | None = None) -> list[list[int]]:
    """Group indices of similar length into batches of at most `max_tokens` padded tokens.

    With a seed, ties in length are broken at random and the batch order is
    shuffled; the result is a pure function of (lengths, max_tokens, seed), which
    is what makes resuming mid-epoch exact.
    """
    order = list(range(len(lengths)))
    if seed is not None:
        random.Random(seed).shuffle(order)
    order.sort(key=lambda i: lengths[i])  # stable: the shuffle breaks ties
    batches: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i in order:
        longest_if_added = max(longest, lengths[i])
        if current and longest_if_added * (len(current) + 1) > max_tokens:
            batches.append(current)
            current, longest_if_added = [], lengths[i]
        current.append(i)
        longest = longest_if_added
    if current:
        batches.append(current)
    if seed is not None:
        random.Random(seed + 1).shuffle(batches)
    return batches


@dataclass
class Batch:
    src: torch.Tensor  # (B, S) source ids, EOS-terminated, PAD-padded
    src_pad_mask: torch.Tensor  # (B, S) True at padding
    tgt_in: torch.Tensor  # (B, T) BOS + target
    tgt_out: torch.Tensor  # (B, T) target + EOS, PAD-padded
    n_tokens: int  # real target tokens (the loss normaliser)

    def to(self, device: torch.device) -> Batch:
        return Batch(
            self.src.to(device, non_blocking=True),
            self.src_pad_mask.to(device, non_blocking=True),
            self.tgt_in.to(device, non_blocking=True),
            self.tgt_out.to(device, non_blocking=True),
            self.n_tokens,
        )


def pad(sequences: Sequence[Sequence[int]]) -> torch.Tensor:
    """(B, max length) long tensor, right-padded with PAD."""
    import torch

    out = torch.full((len(sequences), max(len(s) for s in sequences)), PAD, dtype=torch.long)
    for row, seq in enumerate(sequences):
        out[row, : len(seq)] = torch.as_tensor(seq, dtype=torch.long)
    return out


def collate(corpus: EncodedCorpus, indices: Sequence[int]) -> Batch:
    src = pad([corpus.src[i] for i in indices])
    tgt_out = pad([corpus.tgt[i] for i in indices])
    tgt_in = pad([[BOS] + corpus.tgt[i][:-1] for i in indices])
    return Batch(src, src == PAD, tgt_in, tgt_out, int((tgt_out != PAD).sum()))
