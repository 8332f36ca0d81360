"""Prepared training data: shards that match the tokenizer, reuse until a source or a setting changes, errors."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import TINY, tiny_overrides, write_corpus

from seq2seq.cli import main
from seq2seq.config import DataConfig, load_config
from seq2seq.errors import DataError
from seq2seq.text.prepare import PreparedCorpus, ensure_prepared, prepare, stale_reason
from seq2seq.text.vocab import EOS
from seq2seq.training.epochs import EpochSource


def data_config(corpus: Path, *extra: str) -> DataConfig:
    return load_config(TINY, tiny_overrides(corpus, corpus / "unused", *extra)).data


def test_worker_processes_and_shards_give_the_same_pairs_as_one_process(tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "corpus", n_train=1200)
    d = data_config(corpus, "data.max_len=5")  # drops the longest pairs
    one = prepare(d, tmp_path / "one")
    many = prepare(d, tmp_path / "many", workers=2, shard_lines=500, pool_min_lines=0, tokenizer=None)
    assert one["tokenizer"] == many["tokenizer"] and one["pairs"] == many["pairs"] < 1200
    assert len(many["shards"]) == 3 and one["dropped"] == many["dropped"] and one["dropped"]["too_long"] > 0
    a, b = PreparedCorpus(tmp_path / "one"), PreparedCorpus(tmp_path / "many")
    assert np.array_equal(a.lengths, b.lengths) and a.lengths.dtype == np.uint16
    src_lines = (corpus / "train.src").read_text().splitlines()
    kept = [i for i, line in enumerate(src_lines) if len(a.tokenizer.encode_src([line])[0]) <= 5]
    for i in (0, 1, 499, 500, len(b) - 1):
        assert a.ids(i) == b.ids(i) and a.text(i) == b.text(i)
        src, tgt = b.text(i)
        assert src == src_lines[kept[i]]
        assert b.ids(i) == (b.tokenizer.encode_src([src])[0] + [EOS], b.tokenizer.encode_tgt([tgt])[0] + [EOS])
        assert b.lengths[i] == max(len(side) for side in b.ids(i))
        assert (b.side_lengths[1][i], b.side_lengths[0][i]) == tuple(len(side) for side in b.ids(i))  # src, tgt


def test_the_sentencepiece_sample_is_capped(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    corpus = write_corpus(tmp_path / "corpus", n_train=1200)
    with caplog.at_level("INFO", logger="seq2seq"):
        manifest = prepare(data_config(corpus, "data.spm_sample=400"), tmp_path / "p")
    assert "on 200 sampled pairs" in caplog.text and manifest["pairs"] == 1200


def test_prepared_data_is_reused_until_a_file_or_a_setting_changes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    corpus = write_corpus(tmp_path / "corpus", n_train=300)
    d, out = data_config(corpus), tmp_path / "p"
    assert stale_reason(out, d, None) == "no prepared data"
    prepare(d, out)
    assert stale_reason(out, d, None) == ""
    assert stale_reason(out, data_config(corpus, "data.max_len=20"), None) == "changed: data.max_len 64 -> 20"
    both = data_config(corpus, "data.vocab_size=60", "data.max_len=20")
    assert stale_reason(out, both, None) == "changed: data.vocab_size 64 -> 60, data.max_len 64 -> 20"
    with caplog.at_level("INFO", logger="seq2seq"):
        ensure_prepared(both, tmp_path / "rebuilt")
        assert "again" not in caplog.text  # a first preparation needs no reason
        ensure_prepared(data_config(corpus, "data.vocab_size=60"), tmp_path / "rebuilt")
    assert f"preparing {tmp_path / 'rebuilt'} again: changed: data.max_len 20 -> 64" in caplog.text
    other = write_corpus(tmp_path / "other", n_train=300, seed=5)
    assert stale_reason(out, d, PreparedCorpus(out).tokenizer) == ""
    prepare(data_config(other), tmp_path / "other_prepared")
    assert stale_reason(out, d, PreparedCorpus(tmp_path / "other_prepared").tokenizer) == "the tokenizer differs"
    target = corpus / "train.tgt"
    text = target.read_bytes()
    target.write_bytes(text.replace(b"red", b"dog", 1))  # same size, same mtime: the fingerprint sees it
    os.utime(target, ns=(os.stat(target).st_atime_ns, os.stat(target).st_mtime_ns))
    assert stale_reason(out, d, None) == "the training files changed"


@pytest.mark.trains
def test_train_prepares_once_and_the_next_run_reuses_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    corpus = write_corpus(tmp_path / "corpus", n_train=300)
    args = ["--config", str(TINY), *tiny_overrides(corpus, tmp_path / "run", "train.threads=1")]
    assert main(["prepare", *args]) == 0
    assert "preparing 300 lines" in capsys.readouterr().err
    assert main(["prepare", *args]) == 0
    assert "using the prepared data" in capsys.readouterr().err
    assert main(["train", *args, "train.max_steps=2", "validation.bleu=false", "train.num_workers=1"]) == 0
    err = capsys.readouterr().err
    assert "using the prepared data" in err and "preparing" not in err


@pytest.mark.parametrize(
    "files, message",
    [
        ({"train.src": b"a\nb\nc\n", "train.tgt": b"a\n"}, "train.src has 3 lines but .*train.tgt has 1"),
        ({"train.src": b"a\nb\n", "train.tgt.gz": b"a\n\xff\n"}, r"train.tgt.gz:2: invalid UTF-8"),
        ({"train.src": b"a\n\n", "train.tgt": b"\nb\n"}, "no line pair with text on both sides"),
        ({"train.src": b"a b c d e f g h i j\n", "train.tgt": b"x\n"}, "no sentence pairs left after filtering"),
    ],
)
def test_bad_training_files_are_one_line(tmp_path: Path, files: dict[str, bytes], message: str) -> None:
    corpus = write_corpus(tmp_path / "corpus", n_train=10)
    (corpus / "train.src").unlink()
    (corpus / "train.tgt").unlink()
    for name, data in files.items():
        (corpus / name).write_bytes(gzip.compress(data) if name.endswith(".gz") else data)
    with pytest.raises(DataError, match=message):
        prepare(data_config(corpus, "data.max_len=3", "data.vocab_size=20"), tmp_path / "p")
    assert not list(tmp_path.glob("p*"))  # nothing half-written is left


@pytest.mark.parametrize("name", ["train.tgt", "train.src.gz"])
def test_a_line_longer_than_1_mib_drops_its_pair_and_the_rest_is_prepared(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str
) -> None:
    """One 10 MB line among 400 pairs (plain or gzipped, either side): that pair is dropped and counted, with a
    warning naming FILE:LINE; every other pair is prepared, still aligned."""
    corpus = write_corpus(tmp_path / "corpus", n_train=400)
    src, tgt = ((corpus / f"train.{side}").read_text(encoding="utf-8").splitlines() for side in ("src", "tgt"))
    plain, path = corpus / name.removesuffix(".gz"), corpus / name
    lines = plain.read_bytes().splitlines(keepends=True)
    lines[199] = b"blue " * (2 << 20) + b"\n"  # line 200: 10 MiB of words
    plain.unlink()
    path.write_bytes(gzip.compress(b"".join(lines)) if name.endswith(".gz") else b"".join(lines))
    run = tmp_path / "run"
    assert main(["prepare", "--config", str(TINY), *tiny_overrides(corpus, run, "train.threads=1")]) == 0
    assert f"{path}:200: line longer than 1 MiB; its pair is dropped" in capsys.readouterr().err
    manifest = json.loads((run / "prepared" / "manifest.json").read_text())
    assert (manifest["lines"], manifest["pairs"], manifest["dropped"]["too_long"]) == (400, 399, 1)
    prepared = PreparedCorpus(run / "prepared")
    for i, line in ((198, 198), (199, 200), (398, 399)):  # pairs before and after the dropped one, aligned
        assert prepared.text(i) == (src[line], tgt[line])


def test_several_training_sets_are_prepared_together_and_upsampled_by_weight(tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "corpus", n_train=300)
    extra = write_corpus(tmp_path / "extra", n_train=200, seed=9)
    for side in ("src", "tgt"):
        (corpus / f"extra.{side}").write_bytes((extra / f"train.{side}").read_bytes())
    cfg = load_config(TINY, tiny_overrides(corpus, tmp_path / "run", "data.train=[train, 'extra:2.5']"))
    prepare(cfg.data, tmp_path / "p")
    prepared = PreparedCorpus(tmp_path / "p")
    assert (
        prepared.set_ranges == [(0, 300), (300, 500)]
        and prepared.text(300)[0] == (extra / "train.src").read_text().split("\n")[0]
    )
    source = EpochSource(prepared, cfg.data, max_tokens=256, seed=1)
    for epoch in (1, 2):
        seen = np.bincount(
            [i for j in range(len(source.batches(epoch))) for i in source.batches(epoch)[j]], minlength=500
        )
        assert (seen[:300] == 1).all() and set(seen[300:]) == {2, 3} and (seen[300:] == 3).sum() == 100
    assert source.epoch_pairs(1).tolist() != source.epoch_pairs(2).tolist()  # a new half each epoch
    assert stale_reason(tmp_path / "p", cfg.data, None) == ""  # the weights are not part of the prepared data
    other = load_config(TINY, tiny_overrides(corpus, tmp_path / "run", "data.train=[train, 'extra:3']")).data
    assert stale_reason(tmp_path / "p", other, None) == ""
    assert (
        stale_reason(tmp_path / "p", data_config(corpus), None) == "changed: data.train ['train', 'extra'] -> ['train']"
    )


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda m: m.pop("shards"), "'shards' is missing or not a list"),
        (lambda m: m.update(dtype="float64"), "'dtype' is 'float64'"),
        (lambda m: m["shards"][0].update(pairs="12"), r"shards\[0\]: 'pairs', 'set' or 'lines'"),
        (lambda m: m["shards"][0].update(max_id=[1]), r"shards\[0\]: 'max_id' is missing"),
        (lambda m: m["shards"][0]["sizes"].pop("len"), r"shards\[0\]: 'sizes' is missing"),
        (lambda m: m.update(format=1), "prepared by another version of seq2seq"),
    ],
)
def test_opening_checks_the_manifest(tmp_path: Path, change: Any, message: str) -> None:
    corpus = write_corpus(tmp_path / "corpus", n_train=100)
    manifest = prepare(data_config(corpus), tmp_path / "p")
    change(manifest)
    (tmp_path / "p" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DataError, match=message):
        PreparedCorpus(tmp_path / "p")
