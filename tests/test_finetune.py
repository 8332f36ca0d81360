"""Fine-tuning (`train.init_from`): a fresh run from a trained model's weights and tokenizer."""

from __future__ import annotations

import hashlib
import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch
from conftest import TINY, WORDS, reversal_pairs, tiny_overrides

from seq2seq.cli import main
from seq2seq.config import ExperimentConfig, load_config
from seq2seq.errors import ConfigError
from seq2seq.runs import checkpoint as ckpt
from seq2seq.text.prepare import MANIFEST, tokenizer_hash
from seq2seq.training.assembly import assemble
from seq2seq.training.trainer import Trainer, train

FAST = ("validation.bleu=false", "train.max_tokens=256", "train.log_every=1", "train.threads=1")
MAPPED = {"cat": "dog"}  # the changed task: reversal, with every cat of the source a dog in the target


def write_shifted_corpus(directory: Path, mapped: dict[str, str], seed: int = 50) -> Path:
    """Other sentences than the parent's, reversed, with the `mapped` words replaced in the target."""
    directory.mkdir(parents=True, exist_ok=True)
    for split, n, split_seed in (("train", 400, seed), ("val", 100, seed + 1), ("test", 20, seed + 2)):
        src, tgt = reversal_pairs(n, split_seed)
        tgt = [" ".join(mapped.get(word, word) for word in line.split()) for line in tgt]
        (directory / f"{split}.src").write_text("\n".join(src) + "\n", encoding="utf-8")
        (directory / f"{split}.tgt").write_text("\n".join(tgt) + "\n", encoding="utf-8")
    return directory


@pytest.fixture(scope="module")
def shifted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_shifted_corpus(tmp_path_factory.mktemp("shifted"), MAPPED)


@pytest.fixture(scope="module")
def other_sentences(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_shifted_corpus(tmp_path_factory.mktemp("other"), {})


def config(corpus: Path, run_dir: Path, *extra: str) -> ExperimentConfig:
    return load_config(TINY, tiny_overrides(corpus, run_dir, *FAST, *extra))


def child(corpus: Path, run_dir: Path, parent: Path, *extra: str) -> ExperimentConfig:
    return config(corpus, run_dir, f"train.init_from={parent}", *extra)


def first_logged_loss(run_dir: Path) -> float:
    found = re.search(r"step 1: loss ([0-9.]+)", (run_dir / "train.log").read_text(encoding="utf-8"))
    assert found, "train.log should log step 1"
    return float(found.group(1))


def validate_then_fit(cfg: ExperimentConfig) -> float:
    """The validation loss of the model a run starts with, then the run (one at a time: each logs to its own)."""
    trainer = Trainer(assemble(cfg))
    loss = trainer.validator()["loss"]
    trainer.fit()
    return loss


def files_digest(directory: Path) -> dict[str, str]:
    """Every file of a directory tree and a hash of its bytes: what 'left untouched' means."""
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file() and p.name != ".lock"
    }


def test_a_fine_tuned_run_starts_near_the_parents_loss_not_from_scratch(
    trained_run: Path, corpus: Path, other_sentences: Path, shifted: Path, tmp_path: Path
) -> None:
    """Validated before any update and logged at step 1: the child's loss is the trained model's, not log(V)'s.

    On other sentences of the parent's task the child starts where the parent ended; on the changed task
    (cat -> dog) it starts higher, but still far below a model trained from scratch."""
    parent = assemble(child(corpus, tmp_path / "same", trained_run))  # the parent's model on its own task
    parent_loss, vocab = parent.validator()["loss"], parent.tokenizer.tgt_vocab_size
    parent.close()
    changed = assemble(child(shifted, tmp_path / "changed", trained_run))
    changed_start = changed.validator()["loss"]
    changed.close()
    child_start = validate_then_fit(child(other_sentences, tmp_path / "child", trained_run, "train.max_steps=1"))
    scratch_start = validate_then_fit(config(other_sentences, tmp_path / "scratch", "train.max_steps=1"))
    child_logged, scratch_logged = first_logged_loss(tmp_path / "child"), first_logged_loss(tmp_path / "scratch")
    losses = (parent_loss, child_start, child_logged, changed_start, scratch_start, scratch_logged)
    assert parent_loss < 0.1 and min(scratch_start, scratch_logged) > 0.7 * math.log(vocab), losses
    assert abs(child_start - parent_loss) < 0.1 and child_logged < parent_loss + 0.2, losses
    assert changed_start < scratch_start / 2, losses


def test_the_child_is_a_new_run_with_the_parents_tokenizer_and_the_parent_is_only_read(
    trained_run: Path, shifted: Path, tmp_path: Path
) -> None:
    before = files_digest(trained_run)
    best = ckpt.read(trained_run / ckpt.BEST)  # whichever step validated best: the child starts from it
    run = tmp_path / "child"
    trainer = Trainer(assemble(child(shifted, run, trained_run, "train.max_steps=3", "model.dropout=0.1")))
    assert trainer.progress.step == 0 and not trainer.update.optimizer.state
    assert trainer.run_id != best.run_id
    assert trainer.tokenizer.state() == best.tokenizer.state()
    loaded = trainer.model.state_dict()
    assert all(torch.equal(loaded[name], best.model[name]) for name in best.model)
    assert trainer.fit().step == 3
    stored = ckpt.read(run / ckpt.LAST)
    assert stored.training is not None and stored.training.progress.step == 3 and stored.run_id == trainer.run_id
    assert stored.tokenizer.state() == best.tokenizer.state()
    assert (run / "spm.model").read_bytes() == (trained_run / "spm.model").read_bytes()
    manifest = json.loads((run / "prepared" / MANIFEST).read_text(encoding="utf-8"))
    assert manifest["tokenizer"] == tokenizer_hash(best.tokenizer)
    log = (run / "train.log").read_text(encoding="utf-8")
    assert f"initialized from {trained_run / ckpt.BEST} (step {best.step} of run {best.run_id})" in log
    assert "training from step 0 (epoch 1)" in log
    assert files_digest(trained_run) == before


def test_init_from_names_a_checkpoint_file(trained_run: Path, shifted: Path, tmp_path: Path) -> None:
    """Any checkpoint, not only a run's best: here its last."""
    trainer = assemble(child(shifted, tmp_path / "child", trained_run / ckpt.LAST))
    expected = ckpt.read(trained_run / ckpt.LAST).model
    assert all(torch.equal(trainer.model.state_dict()[name], expected[name]) for name in expected)
    trainer.close()


@pytest.mark.parametrize(
    ("setting", "key", "old", "new"),
    [
        ("model.d_model=32", "model.d_model", "64", "32"),
        ("model.transformer.decoder_layers=3", "model.transformer.decoder_layers", "2", "3"),
        ("model.transformer.positions=rope", "model.transformer.positions", "sinusoidal", "rope"),
        ("data.vocab_size=80", "data.vocab_size", "64", "80"),
        ("data.spm_model_type=bpe", "data.spm_model_type", "unigram", "bpe"),
    ],
)
def test_a_setting_the_weights_or_the_vocabulary_depend_on_must_match_the_parent(
    trained_run: Path,
    shifted: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    setting: str,
    key: str,
    old: str,
    new: str,
) -> None:
    run = tmp_path / "child"
    args = tiny_overrides(shifted, run, *FAST, f"train.init_from={trained_run}", setting)
    assert main(["train", "--config", str(TINY), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{key} is {new}, but the parent" in err and f"with {old}" in err, err
    assert not (run / "train.log").exists() and not (run / "prepared").exists()


@pytest.mark.parametrize("where", ["missing.pt", "empty_dir"])
def test_a_missing_parent_is_one_line(
    shifted: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], where: str
) -> None:
    (tmp_path / "empty_dir").mkdir()
    args = tiny_overrides(shifted, tmp_path / "child", *FAST, f"train.init_from={tmp_path / where}")
    assert main(["train", "--config", str(TINY), *args]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "train.init_from: checkpoint not found" in err, err


def test_a_parent_inside_the_new_run_directory_is_refused(shifted: Path, tmp_path: Path) -> None:
    """The new run would write checkpoint_best.pt over the parent."""
    run = tmp_path / "run"
    with pytest.raises(ConfigError, match="is in train.run_dir"):
        assemble(child(shifted, run, run / ckpt.BEST))
    with pytest.raises(ConfigError, match="is in train.run_dir"):
        assemble(child(shifted, run, run))
    assert not (run / "train.log").exists()


def test_an_interrupted_fine_tuning_run_resumes_exactly(trained_run: Path, shifted: Path, tmp_path: Path) -> None:
    """Once the child has its own checkpoint_last, a restart resumes it; the parent is not read again."""
    settings = ("model.dropout=0.2", "optim.warmup_steps=4")
    parent = tmp_path / "parent.pt"
    shutil.copyfile(trained_run / ckpt.BEST, parent)
    whole = train(child(shifted, tmp_path / "whole", parent, *settings, "train.max_steps=6"))
    part = train(child(shifted, tmp_path / "part", parent, *settings, "train.max_steps=3"))
    assert part.step == 3
    parent.unlink()  # the resume must not need the parent any more
    resumed = train(child(shifted, tmp_path / "part", parent, *settings, "train.max_steps=6"))
    assert (resumed.step, resumed.epoch, resumed.batch_in_epoch) == (whole.step, whole.epoch, whole.batch_in_epoch)
    a, b = ckpt.read(tmp_path / "whole" / ckpt.LAST).model, ckpt.read(tmp_path / "part" / ckpt.LAST).model
    assert all(torch.equal(a[name], b[name]) for name in a)
    log = (tmp_path / "part" / "train.log").read_text(encoding="utf-8")
    assert log.count("initialized from") == 1
    assert f"train.init_from={parent} is ignored" in log and "resuming" in log


def test_prepare_encodes_a_fine_tuning_runs_data_with_the_parents_tokenizer(
    trained_run: Path, shifted: Path, tmp_path: Path
) -> None:
    run = tmp_path / "child"
    overrides = tiny_overrides(shifted, run, f"train.init_from={trained_run}")
    assert main(["prepare", "--config", str(TINY), *overrides]) == 0
    manifest = json.loads((run / "prepared" / MANIFEST).read_text(encoding="utf-8"))
    assert manifest["tokenizer"] == tokenizer_hash(ckpt.read(trained_run / ckpt.BEST).tokenizer)
    assert set(MAPPED) | set(MAPPED.values()) <= set(WORDS)
