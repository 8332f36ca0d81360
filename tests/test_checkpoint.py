"""Checkpoint files: atomic writes, clear errors, round trips, step-checkpoint bookkeeping and averaging."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch
from conftest import TINY, reversal_pairs

from seq2seq.checkpoint import (
    CheckpointError,
    atomic_save,
    average_checkpoints,
    load_checkpoint,
    prune_step_checkpoints,
    read_checkpoint,
    remove_stale_temporaries,
    save_checkpoint,
    step_checkpoint_path,
    step_checkpoints,
)
from seq2seq.cli import main
from seq2seq.config import ExperimentConfig, load_config
from seq2seq.model import Seq2SeqTransformer, build_model
from seq2seq.tokenizer import Tokenizer, train_tokenizer
from seq2seq.translate import Translator


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    src, tgt = reversal_pairs(300, seed=0)
    return train_tokenizer(src, tgt, 64, shared=True)


@pytest.fixture(scope="module")
def cfg() -> ExperimentConfig:
    return load_config(TINY)


def model_with_seed(cfg: ExperimentConfig, tokenizer: Tokenizer, seed: int) -> Seq2SeqTransformer:
    torch.manual_seed(seed)
    return build_model(cfg.model, tokenizer.src_vocab_size, tokenizer.tgt_vocab_size)


def test_round_trip_gives_identical_logits(tmp_path: Path, cfg: ExperimentConfig, tokenizer: Tokenizer) -> None:
    model = model_with_seed(cfg, tokenizer, 0).eval()
    save_checkpoint(tmp_path / "c.pt", model, tokenizer, cfg)
    loaded = load_checkpoint(tmp_path / "c.pt")
    src = torch.tensor([[5, 6, 7, 2], [8, 9, 2, 0]])
    tgt = torch.tensor([[1, 5, 6], [1, 8, 9]])
    with torch.no_grad():
        logits = model(src, src == 0, tgt)
        assert torch.equal(loaded.model(src, src == 0, tgt), logits)
        # The comparison can fail: a model of the same shape with other weights disagrees.
        assert not torch.allclose(model_with_seed(cfg, tokenizer, 123).eval()(src, src == 0, tgt), logits, atol=1e-3)
    assert loaded.config == cfg and loaded.tokenizer.state() == tokenizer.state() and loaded.train_state is None


def test_atomic_save_keeps_the_old_file_when_writing_fails(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint_last.pt"
    atomic_save({"format": "old"}, path)
    with pytest.raises((pickle.PicklingError, AttributeError)):
        atomic_save({"unpicklable": lambda: None}, path)
    assert torch.load(path, weights_only=False) == {"format": "old"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint_last.pt"]


def test_stale_temporaries_are_removed(tmp_path: Path) -> None:
    (tmp_path / ".checkpoint_last.pt.abc123.tmp").write_bytes(b"partial")
    (tmp_path / "notes.tmp").write_text("not ours")
    assert [p.name for p in remove_stale_temporaries(tmp_path)] == [".checkpoint_last.pt.abc123.tmp"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.tmp"]


def test_damaged_or_foreign_files_give_one_line_errors(
    tmp_path: Path, cfg: ExperimentConfig, tokenizer: Tokenizer
) -> None:
    save_checkpoint(tmp_path / "good.pt", model_with_seed(cfg, tokenizer, 0), tokenizer, cfg)
    data = (tmp_path / "good.pt").read_bytes()
    (tmp_path / "truncated.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        read_checkpoint(tmp_path / "truncated.pt")
    torch.save({"weights": 1}, tmp_path / "foreign.pt")
    with pytest.raises(CheckpointError, match="not a seq2seq checkpoint"):
        read_checkpoint(tmp_path / "foreign.pt")
    with pytest.raises(CheckpointError, match="checkpoint not found"):
        read_checkpoint(tmp_path / "missing.pt")


def test_step_checkpoints_sort_by_number_and_prune_oldest(tmp_path: Path) -> None:
    for step in (9, 10, 100, 2):
        step_checkpoint_path(tmp_path, step).write_bytes(b"x")
    (tmp_path / "checkpoint_stepfoo.pt").write_bytes(b"x")
    assert [p.name for p in step_checkpoints(tmp_path)] == [f"checkpoint_step{n}.pt" for n in (2, 9, 10, 100)]
    prune_step_checkpoints(tmp_path, 2)
    assert [p.name for p in step_checkpoints(tmp_path)] == ["checkpoint_step10.pt", "checkpoint_step100.pt"]


def test_average_is_the_mean_of_the_parameters(tmp_path: Path, cfg: ExperimentConfig, tokenizer: Tokenizer) -> None:
    models = [model_with_seed(cfg, tokenizer, seed) for seed in range(3)]
    paths = [tmp_path / f"c{seed}.pt" for seed in range(3)]
    for model, path in zip(models, paths):
        save_checkpoint(path, model, tokenizer, cfg)
    average_checkpoints(paths, tmp_path / "avg.pt")
    averaged = read_checkpoint(tmp_path / "avg.pt")
    assert averaged["train_state"] is None and averaged["averaged_from"] == [str(p) for p in paths]
    states = [m.state_dict() for m in models]
    for name, tensor in averaged["model"].items():
        expected = sum(s[name].double() for s in states) / 3
        torch.testing.assert_close(tensor, expected.float(), rtol=0, atol=1e-7)
        assert tensor.dtype == states[0][name].dtype


def test_average_refuses_checkpoints_of_different_models(
    tmp_path: Path, cfg: ExperimentConfig, tokenizer: Tokenizer
) -> None:
    save_checkpoint(tmp_path / "a.pt", model_with_seed(cfg, tokenizer, 0), tokenizer, cfg)
    wider = load_config(TINY, ["model.d_ff=256"])
    save_checkpoint(tmp_path / "b.pt", model_with_seed(wider, tokenizer, 0), tokenizer, wider)
    with pytest.raises(CheckpointError, match="has shape"):
        average_checkpoints([tmp_path / "a.pt", tmp_path / "b.pt"], tmp_path / "avg.pt")
    with pytest.raises(CheckpointError, match="no checkpoints"):
        average_checkpoints([], tmp_path / "avg.pt")


def test_cli_averages_the_last_n_step_checkpoints_and_the_result_translates(
    tmp_path: Path, cfg: ExperimentConfig, tokenizer: Tokenizer, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    states = []
    for step in (1, 2, 3):
        model = model_with_seed(cfg, tokenizer, step)
        save_checkpoint(step_checkpoint_path(run, step), model, tokenizer, cfg)
        states.append(model.state_dict())
    out = tmp_path / "avg.pt"
    assert main(["average", "--run-dir", str(run), "--last", "2", "-o", str(out)]) == 0
    averaged = read_checkpoint(out)
    assert averaged["averaged_from"] == [str(step_checkpoint_path(run, s)) for s in (2, 3)]
    for name, tensor in averaged["model"].items():
        torch.testing.assert_close(tensor, ((states[1][name].double() + states[2][name].double()) / 2).float())
    translations = Translator.from_checkpoint(out).translate(["red cat dog", "sun"])
    assert len(translations) == 2 and all(isinstance(t, str) for t in translations)
    assert main(["average", "--run-dir", str(tmp_path / "nowhere"), "-o", str(out)]) == 1
    assert "run directory not found" in capsys.readouterr().err
