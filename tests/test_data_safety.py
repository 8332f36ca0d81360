"""Nothing deleted that seq2seq did not create; prepared data and exports checked when read back.

Each case runs the real command and checks the bad-input contract (exit code, one short
stderr without a traceback) and that every file that existed before is still there, unchanged.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from conftest import TINY, tiny_overrides, write_corpus
from test_bad_input import assert_clean_failure, run_in_process

from seq2seq.cli import main
from seq2seq.config import RNNConfig, to_dict
from seq2seq.runs import checkpoint as ckpt
from seq2seq.text.prepare import MANIFEST
from seq2seq.text.tokenizer import train_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")


def snapshot(*roots: Path) -> dict[str, str]:
    """sha256 of every file under `roots` (a link as the path it points to), by path."""
    out = {}
    for root in roots:
        for path in sorted(root.rglob("*")):
            if path.is_symlink():
                out[str(path)] = "link:" + os.readlink(path)
            elif path.is_file():
                out[str(path)] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def user_tree(root: Path) -> Path:
    """A user's directory with files and a subdirectory."""
    (root / "notes").mkdir(parents=True)
    (root / "thesis.tex").write_text("months of work\n")
    (root / "notes" / "todo.txt").write_text("back up\n")
    return root


def prepare_argv(corpus: Path, run: Path, *extra: str) -> list[str]:
    return ["prepare", "--config", str(TINY), *tiny_overrides(corpus, run, "train.threads=1", *extra)]


@pytest.fixture
def small_corpus(tmp_path: Path) -> Path:
    return write_corpus(tmp_path / "corpus", n_train=300)


# data.prepared_dir: only a directory seq2seq prepared (or an empty one) is ever replaced.


def test_a_prepared_dir_holding_a_users_files_is_refused(
    small_corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    mine = user_tree(tmp_path / "mine")
    before = snapshot(mine, small_corpus)
    outcome = run_in_process(prepare_argv(small_corpus, tmp_path / "run", f"data.prepared_dir={mine}"), capsys)
    assert_clean_failure(outcome, 1, "holds files seq2seq did not write there (notes, thesis.tex)")
    assert snapshot(mine, small_corpus) == before


@pytest.mark.parametrize("where", ["corpus", "parent"])
def test_a_prepared_dir_that_is_or_contains_the_corpus_is_refused(
    where: str, small_corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prepared = small_corpus if where == "corpus" else small_corpus.parent
    before = snapshot(small_corpus)
    outcome = run_in_process(prepare_argv(small_corpus, tmp_path / "run", f"data.prepared_dir={prepared}"), capsys)
    assert_clean_failure(outcome, 2, "is or contains data.dir")
    assert snapshot(small_corpus) == before


def test_the_current_directory_as_prepared_dir_is_refused(
    small_corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    here = user_tree(tmp_path / "here")
    monkeypatch.chdir(here)
    before = snapshot(here, small_corpus)
    outcome = run_in_process(prepare_argv(small_corpus, tmp_path / "run", "data.prepared_dir=."), capsys)
    assert_clean_failure(outcome, 1, "holds files seq2seq did not write there")
    assert snapshot(here, small_corpus) == before


@pytest.mark.trains
def test_the_run_directory_as_prepared_dir_on_resume_is_refused(
    small_corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    train = ["train", *prepare_argv(small_corpus, run)[1:], "train.max_steps=2", "validation.bleu=false"]
    assert run_in_process(train, capsys).code == 0
    before = snapshot(run, small_corpus)
    outcome = run_in_process([*prepare_argv(small_corpus, run), f"data.prepared_dir={run}"], capsys)
    assert_clean_failure(outcome, 1, "holds files seq2seq did not write there (.lock, checkpoint_best.pt")
    assert snapshot(run, small_corpus) == before
    log = (run / "train.log").read_text()
    outcome = run_in_process([*train, "train.max_steps=4", f"data.prepared_dir={run}"], capsys)
    assert_clean_failure(outcome, 1, "holds files seq2seq did not write there")
    after = snapshot(run, small_corpus)
    assert (run / "train.log").read_text().startswith(log)  # the log only grows
    assert {k: v for k, v in after.items() if not k.endswith("train.log")} == {
        k: v for k, v in before.items() if not k.endswith("train.log")
    }


def test_an_earlier_preparation_is_replaced_but_not_with_a_users_file_in_it(
    small_corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prepared = tmp_path / "prepared"
    argv = prepare_argv(small_corpus, tmp_path / "run", f"data.prepared_dir={prepared}")
    assert run_in_process(argv, capsys).code == 0
    assert run_in_process([*argv, "data.max_len=20"], capsys).code == 0  # stale: rebuilt in place
    assert json.loads((prepared / MANIFEST).read_text())["settings"]["max_len"] == 20
    (prepared / "mine.txt").write_text("keep me\n")
    before = snapshot(prepared)
    outcome = run_in_process([*argv, "data.max_len=30"], capsys)
    assert_clean_failure(outcome, 1, "(mine.txt)")
    assert snapshot(prepared) == before


def test_only_marked_temporaries_of_dead_processes_are_removed(
    small_corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prepared = tmp_path / "prepared"
    abandoned = prepared.with_name("prepared.tmp999999999")  # no such process
    abandoned.mkdir()
    (abandoned / ".seq2seq-temporary").write_bytes(b"")
    (abandoned / "shard0.src.txt").write_bytes(b"half")
    lookalike = user_tree(prepared.with_name("prepared.tmp999999998"))  # the same pattern, not ours
    before = snapshot(lookalike)
    assert (
        run_in_process(prepare_argv(small_corpus, tmp_path / "run", f"data.prepared_dir={prepared}"), capsys).code == 0
    )
    assert not abandoned.exists() and snapshot(lookalike) == before


@pytest.mark.trains
def test_train_removes_only_its_own_stale_checkpoint_temporaries(
    small_corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    run.mkdir()
    stale = run / ".checkpoint_last.pt.ab12cd34.tmp"  # what a save killed midway leaves
    stale.write_bytes(b"half a checkpoint")
    mine = [run / ".checkpoint_notes.tmp", run / ".checkpoint.tmp"]  # the same prefix and suffix, not ours
    for path in mine:
        path.write_text("mine\n")
    train = ["train", *prepare_argv(small_corpus, run)[1:], "train.max_steps=1", "validation.bleu=false"]
    assert run_in_process(train, capsys).code == 0
    assert not stale.exists() and all(path.read_text() == "mine\n" for path in mine)


# Prepared data is checked against its manifest when opened.


def damage_shard(prepared: Path) -> None:
    path = prepared / "shard0.src.ids"
    path.write_bytes(path.read_bytes()[:-6])


def replace_tokenizer(prepared: Path) -> None:
    other = write_corpus(prepared.parent / "other", n_train=300, seed=7)
    src = (other / "train.src").read_text().splitlines()
    tgt = [line.upper() for line in (other / "train.tgt").read_text().splitlines()]  # another vocabulary
    train_tokenizer(src, tgt, 40, True, "unigram", "other").save(prepared)


def garbage_ids(prepared: Path) -> None:
    path = prepared / "shard0.tgt.ids"
    ids = np.fromfile(path, dtype=np.uint16)
    ids[len(ids) // 2] = 60_000
    ids.tofile(path)


def garbage_offsets(prepared: Path) -> None:
    path = prepared / "shard0.src.off"
    offsets = np.fromfile(path, dtype=np.int64)
    offsets[-1] += 7
    offsets.tofile(path)


def unordered_offsets(prepared: Path) -> None:
    path = prepared / "shard0.tgt.off"
    offsets = np.fromfile(path, dtype=np.int64)
    offsets[5] = offsets[7]
    offsets.tofile(path)


@pytest.mark.parametrize(
    "damage, message",
    [
        (damage_shard, "bytes, but manifest.json says"),
        (replace_tokenizer, "spm.model: not the SentencePiece model the data was encoded with"),
        (garbage_ids, "shard0.tgt.ids: token id 60000 is outside the vocabulary"),
        (garbage_offsets, "shard0.src.off: its offsets do not fit"),
        (unordered_offsets, "shard0.tgt.off: its offsets do not fit"),
    ],
)
def test_damaged_prepared_data_is_one_line(
    damage: Callable[[Path], None], message: str, small_corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prepared = tmp_path / "prepared"
    argv = prepare_argv(small_corpus, tmp_path / "run", f"data.prepared_dir={prepared}")
    assert run_in_process(argv, capsys).code == 0
    damage(prepared)
    before = snapshot(prepared, small_corpus)
    for command in ("prepare", "train"):
        outcome = run_in_process([command, *argv[1:], "train.max_steps=1"], capsys)
        assert_clean_failure(outcome, 1, message, "delete")
    assert snapshot(prepared, small_corpus) == before


# A rerun after a first save that was interrupted before checkpoint_last.


@pytest.mark.trains
def test_a_rerun_after_an_interrupted_first_save_starts_the_run_over(
    small_corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    run = tmp_path / "run"
    train = ["train", *prepare_argv(small_corpus, run)[1:], "train.max_steps=2", "validation.bleu=false"]
    real = os.replace

    def disk_full_at_checkpoint_last(src: str, dst: str) -> None:
        if str(dst).endswith("checkpoint_last.pt"):
            raise OSError(errno.ENOSPC, "No space left on device")
        real(src, dst)

    monkeypatch.setattr(ckpt.os, "replace", disk_full_at_checkpoint_last)
    full = run_in_process(train, capsys)  # after the training's log lines, the error
    assert full.code == 1 and "Traceback" not in full.err
    assert "checkpoint_last.pt: no space left on the device" in full.err.strip().splitlines()[-1]
    monkeypatch.undo()
    assert (run / "checkpoint_best.pt").is_file() and not (run / "checkpoint_last.pt").exists()
    outcome = run_in_process(train, capsys)
    assert outcome.code == 0 and "first save was interrupted; starting the run over" in outcome.err
    assert (run / "checkpoint_last.pt").is_file()
    (run / "checkpoint_last.pt").unlink()
    (run / "run_id").write_text("0123456789abcdef\n")  # the checkpoints left are not this run's
    before = snapshot(run, small_corpus)
    assert_clean_failure(run_in_process(train, capsys), 1, "holds checkpoints of an earlier run")
    assert snapshot(run, small_corpus) == before


# Exports: a manifest of sizes and hashes, checked when the directory is loaded.


@pytest.fixture(scope="module")
def exported(trained_run: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("ctranslate2", reason="the export extra is not installed")
    out = tmp_path_factory.mktemp("export") / "ct2"
    assert main(["export", str(trained_run / "checkpoint_best.pt"), "-o", str(out)]) == 0
    return out


@pytest.fixture
def export_copy(exported: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(exported, tmp_path / "ct2"))


def flip_weights(directory: Path) -> None:
    data = bytearray((directory / "model.bin").read_bytes())
    rng = random.Random(0)
    for position in rng.sample(range(len(data) // 2, len(data)), 1000):  # in the weights, past the header
        data[position] ^= 1 << rng.randrange(8)
    (directory / "model.bin").write_bytes(bytes(data))


def other_tokenizer(directory: Path) -> None:
    other = write_corpus(directory.parent / "other", n_train=300, seed=7)
    src = (other / "train.src").read_text().splitlines()
    tgt = [line.upper() for line in (other / "train.tgt").read_text().splitlines()]
    train_tokenizer(src, tgt, 40, True, "unigram", "other").save(directory)


def garbage_tokenizer(directory: Path) -> None:
    (directory / "spm.model").write_bytes(b"not a model")


def linked_tokenizer(directory: Path) -> None:
    elsewhere = directory.parent / "elsewhere.model"
    (directory / "spm.model").rename(elsewhere)
    (directory / "spm.model").symlink_to(elsewhere)


def linked_other_tokenizer(directory: Path) -> None:
    other_tokenizer(directory)
    linked_tokenizer(directory)


def dangling_tokenizer(directory: Path) -> None:
    linked_tokenizer(directory)
    (directory.parent / "elsewhere.model").unlink()


def shortened_vocabulary(directory: Path) -> None:
    path = next(directory.glob("*_vocabulary.json"))
    path.write_text(json.dumps(json.loads(path.read_text())[:-3]))


def raised_max_positions(directory: Path) -> None:
    path = directory / "seq2seq.yaml"
    path.write_text(path.read_text().replace("max_positions: 128", "max_positions: 4096"))


@pytest.mark.parametrize(
    "damage, message",
    [
        (flip_weights, "model.bin does not match seq2seq-manifest.json"),
        (other_tokenizer, "spm.model does not match seq2seq-manifest.json"),
        (garbage_tokenizer, "spm.model does not match seq2seq-manifest.json"),
        (linked_other_tokenizer, "spm.model does not match seq2seq-manifest.json"),
        (dangling_tokenizer, "spm.model is a link to nothing"),
        (shortened_vocabulary, "_vocabulary.json does not match seq2seq-manifest.json"),
        (raised_max_positions, "model.max_positions is 4096, but the exported model has 128"),
    ],
)
def test_a_damaged_export_is_one_line(
    damage: Callable[[Path], None],
    message: str,
    export_copy: Path,
    trained_run: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    damage(export_copy)
    before = snapshot(export_copy)
    argv = ["translate", "-c", str(export_copy), "-i", str(trained_run / "config.yaml"), "--threads", "1"]
    assert_clean_failure(run_in_process(argv, capsys), 1, message)
    assert snapshot(export_copy) == before


@pytest.mark.parametrize(
    "damage, message",
    [
        (None, ""),
        (garbage_tokenizer, "spm.model: not a readable SentencePiece model"),
        (linked_tokenizer, ""),
        (dangling_tokenizer, "spm.model is a link to nothing"),
        (shortened_vocabulary, "_vocabulary.json has"),
    ],
)
def test_an_export_without_a_manifest_loads_with_a_warning_and_is_still_checked(
    damage: Callable[[Path], None] | None,
    message: str,
    export_copy: Path,
    trained_run: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    (export_copy / "seq2seq-manifest.json").unlink()  # as exported before the manifest existed
    if damage is not None:
        damage(export_copy)
    argv = ["translate", "-c", str(export_copy), "-i", str(trained_run / "config.yaml"), "--threads", "1"]
    outcome = run_in_process(argv, capsys)
    if not message:
        assert outcome.code == 0 and "its files are not checked" in outcome.err and "Traceback" not in outcome.err
    else:
        assert_clean_failure(outcome, 1, message)


def as_model_store(directory: Path) -> dict[str, Path]:
    """The export's files moved to blobs named by their hash, each name in the directory a relative link to its
    blob, as the Hugging Face cache keeps a snapshot; the blob of each file, by name."""
    blobs = directory.parent / "blobs"
    blobs.mkdir()
    out = {}
    for path in sorted(directory.iterdir()):
        blob = blobs / hashlib.sha256(path.read_bytes()).hexdigest()
        path.rename(blob)
        path.symlink_to(os.path.relpath(blob, directory))
        out[path.name] = blob
    return out


def test_an_export_of_links_to_blobs_loads_and_the_blobs_are_checked(
    export_copy: Path, trained_run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    blobs = as_model_store(export_copy)
    argv = ["translate", "-c", str(export_copy), "-i", str(trained_run / "config.yaml"), "--threads", "1"]
    outcome = run_in_process(argv, capsys)
    assert outcome.code == 0 and outcome.out.count("\n") == len((trained_run / "config.yaml").read_bytes().splitlines())
    flip_weights(export_copy)  # written through the link, into model.bin's blob
    assert (export_copy / "model.bin").is_symlink() and (export_copy / "model.bin").resolve() == blobs["model.bin"]
    before = snapshot(export_copy, blobs["model.bin"].parent)
    assert_clean_failure(run_in_process(argv, capsys), 1, "model.bin does not match seq2seq-manifest.json")
    assert snapshot(export_copy, blobs["model.bin"].parent) == before


def as_flat_layout(model: dict[str, Any]) -> dict[str, Any]:
    """A model section as versions before model.transformer wrote it: every key flat, the RNN's too."""
    shared = {key: value for key, value in model.items() if key != "transformer"}
    return {**shared, **model["transformer"], "rnn": to_dict(RNNConfig())}


@pytest.mark.parametrize("d_ff", [128, 256])
def test_an_export_of_the_flat_model_layout_loads_and_is_still_checked(
    d_ff: int, export_copy: Path, trained_run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    manifest = json.loads((export_copy / "seq2seq-manifest.json").read_text())
    (export_copy / "seq2seq-manifest.json").write_text(
        json.dumps({**manifest, "model": as_flat_layout(manifest["model"])})
    )
    config = yaml.safe_load((export_copy / "seq2seq.yaml").read_text())
    config["model"] = {**as_flat_layout(config["model"]), "d_ff": d_ff}
    (export_copy / "seq2seq.yaml").write_text(yaml.safe_dump(config))
    argv = ["translate", "-c", str(export_copy), "-i", str(trained_run / "config.yaml"), "--threads", "1"]
    outcome = run_in_process(argv, capsys)
    if d_ff == 128:  # as exported
        assert outcome.code == 0 and "Traceback" not in outcome.err
    else:
        assert_clean_failure(outcome, 1, "model.transformer.d_ff is 256, but the exported model has 128")


def test_export_replaces_only_an_earlier_export(
    exported: Path, trained_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    checkpoint = str(trained_run / "checkpoint_best.pt")
    mine = user_tree(tmp_path / "mine")
    link = tmp_path / "link"
    link.symlink_to(mine)
    before = snapshot(mine)
    for output, message in ((mine, "(notes, thesis.tex)"), (link, "is a symbolic link")):
        assert_clean_failure(run_in_process(["export", checkpoint, "-o", str(output)], capsys), 1, message)
    assert snapshot(mine) == before
    again = Path(shutil.copytree(exported, tmp_path / "again"))
    assert run_in_process(["export", checkpoint, "-o", str(again), "--quantization", "int8"], capsys).code == 0
    assert (again / "model.bin").stat().st_size < (exported / "model.bin").stat().st_size  # int8 replaced float32
    translate = ["translate", "-c", str(again), "-i", str(trained_run / "config.yaml"), "--threads", "1"]
    assert run_in_process(translate, capsys).code == 0  # its manifest describes the new files
    assert not list(tmp_path.glob("again.tmp*"))
    (again / "keep.txt").write_text("mine\n")
    assert_clean_failure(run_in_process(["export", checkpoint, "-o", str(again)], capsys), 1, "(keep.txt)")
    assert (again / "keep.txt").read_text() == "mine\n"


@pytest.mark.parametrize(
    "manifest", ['{"format": 2}', '{"format": 2, "shards": "x"}', "[1, 2]", "not json", '{"format": 2, "shards": [{}]}']
)
def test_a_damaged_manifest_of_its_own_is_prepared_again(
    manifest: str, small_corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prepared = tmp_path / "prepared"
    argv = prepare_argv(small_corpus, tmp_path / "run", f"data.prepared_dir={prepared}")
    assert run_in_process(argv, capsys).code == 0
    (prepared / MANIFEST).write_text(manifest)
    outcome = run_in_process(argv, capsys)
    assert outcome.code == 0 and "preparing 300 lines" in outcome.err and "Traceback" not in outcome.err
    assert json.loads((prepared / MANIFEST).read_text())["pairs"] == 300
