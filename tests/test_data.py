"""Reading, filtering, batching and collating parallel text; the tokenizer's fixed special ids."""

from __future__ import annotations

import gzip
import random
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import reversal_pairs

from seq2seq.errors import DataError
from seq2seq.text.corpus import (
    EMPTY,
    TOO_LONG,
    EncodedCorpus,
    bucket,
    collate,
    dropped_as,
    encode_corpus,
    find_file,
    make_batches,
    read_lines,
    read_parallel,
)
from seq2seq.text.tokenizer import Sampling, Tokenizer, train_tokenizer
from seq2seq.text.vocab import BOS, EOS, PAD, UNK

LINES = ["ein Hund", "", "zwei Katzen  laufen", "Grüße, 東京!"]


def write_plain(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def write_gz(path: Path, data: bytes) -> Path:
    with gzip.open(path, "wb") as f:
        f.write(data)
    return path


# Reading files.


def test_gzipped_and_plain_files_read_the_same(tmp_path: Path) -> None:
    data = ("\n".join(LINES) + "\n").encode("utf-8")
    assert read_lines(write_plain(tmp_path / "a.de", data)) == LINES
    assert read_lines(write_gz(tmp_path / "a.de.gz", data)) == LINES


def test_windows_line_endings_are_stripped(tmp_path: Path) -> None:
    assert read_lines(write_plain(tmp_path / "a.de", b"one\r\ntwo\r\n")) == ["one", "two"]


def test_a_byte_order_mark_before_the_first_line_is_not_text(tmp_path: Path) -> None:
    bom = b"\xef\xbb\xbf"
    data = bom + ("\n".join(LINES) + "\n").encode("utf-8")
    assert read_lines(write_plain(tmp_path / "a.de", data)) == LINES
    assert read_lines(write_gz(tmp_path / "a.de.gz", data)) == LINES
    assert read_lines(write_plain(tmp_path / "empty.de", bom)) == []  # as an empty file
    assert read_lines(write_plain(tmp_path / "blank.de", bom + b"\n")) == [""]
    later = b"one\n" + bom + b"two\n"  # U+FEFF after the start is a character of the text (a zero-width space)
    assert read_lines(write_plain(tmp_path / "later.de", later)) == ["one", "\ufefftwo"]


def test_find_file_falls_back_to_gz(tmp_path: Path) -> None:
    write_gz(tmp_path / "train.de.gz", b"x\n")
    assert find_file(tmp_path, "train", "de") == tmp_path / "train.de.gz"
    write_plain(tmp_path / "train.de", b"x\n")
    assert find_file(tmp_path, "train", "de") == tmp_path / "train.de"  # plain wins when both exist


def test_read_parallel_mixes_plain_and_gz(tmp_path: Path) -> None:
    write_plain(tmp_path / "val.de", b"a\nb\n")
    write_gz(tmp_path / "val.en.gz", b"A\nB\n")
    assert read_parallel(tmp_path, "val", "de", "en") == (["a", "b"], ["A", "B"])


def test_misaligned_corpus_names_both_files_and_counts(tmp_path: Path) -> None:
    src = write_plain(tmp_path / "train.de", b"a\nb\nc\n")
    tgt = write_gz(tmp_path / "train.en.gz", b"A\nB\n")
    with pytest.raises(DataError) as info:
        read_parallel(tmp_path, "train", "de", "en")
    message = str(info.value)
    assert str(src) in message and str(tgt) in message
    assert "3 lines" in message and "has 2" in message


@pytest.mark.parametrize("writer", [write_plain, write_gz], ids=["plain", "gz"])
def test_invalid_utf8_names_file_and_line(tmp_path: Path, writer: object) -> None:
    name = "bad.de.gz" if writer is write_gz else "bad.de"
    path = writer(tmp_path / name, b"fine\nalso fine\nbroken \xff\xfe here\n")  # type: ignore[operator]
    with pytest.raises(DataError, match="invalid UTF-8") as info:
        read_lines(path)
    assert f"{path}:3:" in str(info.value)


def test_missing_file_is_a_clear_data_error(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"missing data file: .*test\.de \(or .*test\.de\.gz\)"):
        read_parallel(tmp_path, "test", "de", "en")
    with pytest.raises(DataError, match="missing data file"):
        read_lines(tmp_path / "nope.txt")


def test_fake_gz_is_a_data_error_not_a_traceback(tmp_path: Path) -> None:
    path = write_plain(tmp_path / "train.de.gz", b"this is not gzip\n")
    with pytest.raises(DataError, match="cannot read"):
        read_lines(path)


# Encoding and filtering.


class WordTokenizer:
    """One id per whitespace word (ids from 10 up), so lengths are known exactly."""

    def encode_src(self, lines: Sequence[str], sampling: Sampling | None = None) -> list[list[int]]:
        return [[10 + len(w) for w in line.split()] for line in lines]

    encode_tgt = encode_src


def test_empty_and_over_long_pairs_are_dropped() -> None:
    src = ["a b", "", "a b c", "a", "a b c d", "x"]
    tgt = ["b a", "x", "c b a", " ", "d c b a", "a b c"]
    corpus = encode_corpus(WordTokenizer(), src, tgt, max_len=3, name="toy")  # type: ignore[arg-type]
    # kept: "a b", "a b c" and "x"/"a b c" (exactly max_len subwords); dropped: an empty side, 4 subwords
    assert len(corpus) == 3
    assert [len(s) for s in corpus.src] == [3, 4, 2]  # EOS appended
    assert all(s[-1] == EOS and t[-1] == EOS for s, t in zip(corpus.src, corpus.tgt))
    assert corpus.lengths() == [3, 4, 4]  # the larger side of each pair


def test_nothing_left_after_filtering_is_an_error() -> None:
    with pytest.raises(DataError, match="toy: no sentence pairs left"):
        encode_corpus(WordTokenizer(), ["a b c d"], ["a"], max_len=2, name="toy")  # type: ignore[arg-type]


# Token-budget batching.


def random_lengths(n: int = 500, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(1, 60) for _ in range(n)]


@pytest.mark.parametrize("seed", [None, 0, 7])
def test_batches_respect_the_token_budget_and_cover_every_index_once(seed: int | None) -> None:
    lengths = random_lengths()
    max_tokens = 200
    batches = make_batches(lengths, max_tokens, seed=seed)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for batch in batches:
        assert max(lengths[i] for i in batch) * len(batch) <= max_tokens
    # Batches are filled: merging two neighbours of sorted length would break the budget.
    assert len(batches) <= 2 * sum(lengths) // max_tokens + 60


def test_a_sentence_longer_than_the_budget_gets_its_own_batch() -> None:
    lengths = [5, 300, 5, 5]
    batches = make_batches(lengths, 20)
    assert [1] in batches
    assert sorted(i for b in batches for i in b) == [0, 1, 2, 3]
    assert all(max(lengths[i] for i in b) * len(b) <= 20 for b in batches if b != [1])


def test_batches_are_deterministic_per_seed_and_differ_across_seeds() -> None:
    lengths = random_lengths()
    assert make_batches(lengths, 200, seed=3) == make_batches(lengths, 200, seed=3)
    assert make_batches(lengths, 200, seed=3) != make_batches(lengths, 200, seed=4)
    assert make_batches(lengths, 200) == make_batches(lengths, 200)


def padded_positions(batches: Sequence[Sequence[int]], lengths: np.ndarray) -> int:
    return sum(int(lengths[list(b)].max()) * len(b) for b in batches)


def test_pairs_of_equal_length_are_ordered_by_the_ties_so_batches_pad_less() -> None:
    rng = np.random.default_rng(0)
    longer = rng.integers(5, 40, 2000)
    tgt = np.where(rng.random(2000) < 0.5, longer, rng.integers(1, 6, 2000))  # the shorter side is very short
    src = np.where(tgt == longer, rng.integers(1, 6, 2000), longer)
    plain, bounds = bucket(longer, 300, seed=3)
    tied, tied_bounds = bucket(longer, 300, seed=3, ties=(tgt, src))
    assert np.array_equal(bounds, tied_bounds)  # the same budget cuts the same batches of longer sides
    assert sorted(tied.tolist()) == list(range(2000)) and np.array_equal(longer[plain], longer[tied])
    batches = [[order[a:b] for a, b in zip(bounds[:-1], bounds[1:])] for order in (plain, tied)]
    for side in (src, tgt):
        assert padded_positions(batches[1], side) < 0.8 * padded_positions(batches[0], side)
    for a, b in zip(tied_bounds[:-1], tied_bounds[1:]):  # inside a length, by target and then source length
        keys = list(zip(longer[tied[a:b]].tolist(), tgt[tied[a:b]].tolist(), src[tied[a:b]].tolist()))
        assert keys == sorted(keys)
    assert not np.array_equal(tied, bucket(longer, 300, seed=4, ties=(tgt, src))[0])  # the seed still shuffles


def test_unseeded_batches_are_sorted_by_length() -> None:
    """Translation relies on this: similar lengths share a batch, so little padding."""
    lengths = random_lengths()
    flat = [lengths[i] for b in make_batches(lengths, 200) for i in b]
    assert flat == sorted(flat)


# Collating.


def test_collate_adds_bos_eos_and_padding() -> None:
    corpus = EncodedCorpus(src=[[5, 6, EOS], [7, EOS]], tgt=[[8, EOS], [9, 10, 11, EOS]])
    batch = collate(corpus, [0, 1])
    assert batch.src.tolist() == [[5, 6, EOS], [7, EOS, PAD]]
    assert batch.src_pad_mask.tolist() == [[False, False, False], [False, False, True]]
    assert batch.tgt_in.tolist() == [[BOS, 8, PAD, PAD], [BOS, 9, 10, 11]]
    assert batch.tgt_out.tolist() == [[8, EOS, PAD, PAD], [9, 10, 11, EOS]]
    assert batch.n_tokens == 6
    assert batch.src.dtype == torch.long
    # Teacher forcing: the input is the output shifted right by one (EOS is predicted, never fed).
    fed = (batch.tgt_out[:, :-1] != PAD) & (batch.tgt_out[:, :-1] != EOS)
    assert torch.equal(batch.tgt_in[:, 1:][fed], batch.tgt_out[:, :-1][fed])


def test_collate_follows_the_given_order() -> None:
    corpus = EncodedCorpus(src=[[5, EOS], [6, EOS]], tgt=[[7, EOS], [8, EOS]])
    assert collate(corpus, [1, 0]).src[:, 0].tolist() == [6, 5]


# Tokenizer.


@pytest.fixture(scope="module")
def shared_tokenizer() -> Tokenizer:
    src, tgt = reversal_pairs(300, seed=5)
    return train_tokenizer(src, tgt, vocab_size=40, shared=True)


def test_tokenizer_round_trip_and_special_ids(shared_tokenizer: Tokenizer) -> None:
    tok = shared_tokenizer
    assert [tok.src.pad_id(), tok.src.unk_id(), tok.src.bos_id(), tok.src.eos_id()] == [PAD, UNK, BOS, EOS]
    lines = ["red cat sun", "moon  bird"]
    ids = tok.encode_src(lines)
    assert all(i > EOS for seq in ids for i in seq)  # ordinary text never encodes to a special id
    assert [tok.decode_tgt(seq + [EOS, PAD]) for seq in ids] == ["red cat sun", "moon bird"]


@pytest.mark.parametrize("model_type, alpha, nbest", [("unigram", 0.2, -1), ("unigram", 0.1, 8), ("bpe", 0.3, -1)])
def test_sampled_segmentations_spell_the_same_text_and_follow_the_seed(
    model_type: str, alpha: float, nbest: int
) -> None:
    src, tgt = reversal_pairs(300, seed=5)
    tok = train_tokenizer(src, tgt, vocab_size=40, shared=True, model_type=model_type)
    lines = src[:50]
    best = tok.encode_src(lines)
    first = tok.encode_src(lines, Sampling(alpha, nbest, seed=7))
    assert first == tok.encode_src(lines, Sampling(alpha, nbest, seed=7))  # a resume re-draws the same epoch
    assert first != tok.encode_src(lines, Sampling(alpha, nbest, seed=8))
    assert first != best and sum(map(len, first)) > sum(map(len, best))  # samples are mostly finer than the best
    assert [tok.decode_tgt(ids) for ids in first] == [tok.decode_tgt(ids) for ids in best]
    assert tok.encode_src(lines) == best  # sampling leaves the deterministic encoding alone


def test_tokenizer_state_round_trip(shared_tokenizer: Tokenizer, tmp_path: Path) -> None:
    again = Tokenizer.from_state(shared_tokenizer.state())
    assert again.shared and again.encode_src(["green tree"]) == shared_tokenizer.encode_src(["green tree"])
    again.save(tmp_path)
    assert (tmp_path / "spm.model").read_bytes() == shared_tokenizer.src_proto


def test_separate_vocabularies() -> None:
    src = ["aaa bbb ccc"] * 50
    tgt = ["xxx yyy zzz"] * 50
    tok = train_tokenizer(src, tgt, vocab_size=20, shared=False)
    assert not tok.shared
    assert tok.decode_tgt(tok.encode_tgt(["zzz xxx"])[0]) == "zzz xxx"
    assert tok.src.piece_to_id("▁xxx") in (UNK, tok.src.unk_id())  # target words are not in the source model


def test_one_rule_drops_empty_and_over_long_pairs() -> None:
    """The rule the in-memory corpus, `seq2seq prepare` and sampled segmentations share (EOS not counted)."""
    assert dropped_as([5, 6], [6, 7], 2) == ""
    assert dropped_as([], [6], 2) == EMPTY and dropped_as([5], [], 2) == EMPTY and dropped_as([], [], 0) == EMPTY
    assert dropped_as([5, 6, 7], [6], 2) == TOO_LONG and dropped_as([5], [6, 7, 8], 2) == TOO_LONG
