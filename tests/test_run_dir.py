"""The run directory's guarantees: one process at a time, only this run's checkpoints, nothing lost to a kill."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from conftest import ROOT, TINY, single_thread_env, tiny_overrides, write_corpus

from seq2seq.cli import main
from seq2seq.config import load_config
from seq2seq.runs import checkpoint as ckpt
from seq2seq.runs.run_dir import RunDirectory
from seq2seq.training.trainer import train

pytestmark = pytest.mark.trains  # every test but one trains, here or in a child `seq2seq train`
FAST = ("validation.bleu=false", "train.max_tokens=256", "train.max_epochs=1000", "train.log_every=1")
DROPOUT = ("model.dropout=0.2", "model.transformer.attention_dropout=0.1", "optim.warmup_steps=4")  # so the RNG matters


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("small"), n_train=600)


def overrides(corpus: Path, run_dir: Path, *extra: str) -> list[str]:
    return tiny_overrides(corpus, run_dir, *FAST, "train.threads=1", *extra)


def cli_train(corpus: Path, run_dir: Path, *extra: str) -> int:
    return main(["train", "--config", str(TINY), *overrides(corpus, run_dir, *extra)])


def one_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0], err
    return err[0]


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return ckpt.read(run_dir / ckpt.LAST).model


def test_a_run_dir_that_is_a_file_is_one_line_and_the_file_is_kept(
    small: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    taken = tmp_path / "notes.txt"
    taken.write_text("keep", encoding="utf-8")
    assert cli_train(small, taken) == 1
    assert f"train.run_dir {taken} is a file, not a directory" in one_line(capsys)
    assert taken.read_text(encoding="utf-8") == "keep"


def test_a_second_train_on_a_busy_directory_stops_at_once_and_touches_nothing(
    small: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = RunDirectory(tmp_path / "run")
    run.acquire()  # as a running `seq2seq train` holds it
    try:
        in_flight = run.path / ".checkpoint_last.pt.a1b2.tmp"
        in_flight.write_bytes(b"a save in progress")
        assert cli_train(small, run.path) == 1
        assert f"in use by another training process (pid {os.getpid()})" in one_line(capsys)
        assert in_flight.exists(), "the other run's save in progress must survive"
        assert sorted(p.name for p in run.path.iterdir()) == [".checkpoint_last.pt.a1b2.tmp", ".lock"]
    finally:
        run.release()
    assert cli_train(small, run.path, "train.max_steps=2") == 0  # free again once released
    assert not in_flight.exists()  # a stale temporary, now that its owner is gone


def test_a_fresh_run_refuses_another_runs_checkpoints(
    small: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    first, second = tmp_path / "first", tmp_path / "second"
    assert cli_train(small, first, "train.max_steps=4", "validation.every=2", "checkpoint.keep_last=5") == 0
    second.mkdir()
    for name in ("checkpoint_step2.pt", "checkpoint_step4.pt"):
        (second / name).write_bytes((first / name).read_bytes())
    before = sorted(p.name for p in second.iterdir())
    capsys.readouterr()
    assert cli_train(small, second, "train.max_steps=4") == 1
    line = one_line(capsys)
    assert "holds checkpoints of an earlier run (checkpoint_step2.pt, checkpoint_step4.pt)" in line
    assert sorted(p.name for p in second.iterdir() if p.name != ".lock") == before


@pytest.mark.trains
@pytest.mark.parametrize("keep_last", [0, 5], ids=["checkpoint_best only", "with step checkpoints"])
def test_a_fresh_run_refuses_its_own_checkpoints_once_checkpoint_last_is_gone(
    small: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], keep_last: int
) -> None:
    """A run that wrote checkpoint_last, which was then deleted: its checkpoint_best and step checkpoints are
    work a rerun would overwrite, not the leftovers of an interrupted first save."""
    run = tmp_path / "run"
    settings = ("train.max_steps=4", "validation.every=2", f"checkpoint.keep_last={keep_last}")
    assert cli_train(small, run, *settings) == 0
    (run / ckpt.LAST).unlink()
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file() and p.name != ".lock"}
    assert {"config.yaml", "metrics.jsonl", "train.log", "run_id", ckpt.BEST} <= set(before)
    capsys.readouterr()
    assert cli_train(small, run, *settings) == 1
    kept = ", checkpoint_step2.pt, checkpoint_step4.pt" if keep_last else ""
    line = one_line(capsys)
    assert f"holds checkpoints of an earlier run (checkpoint_best.pt{kept}) but no checkpoint_last.pt" in line
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file() and p.name != ".lock"} == before


def test_a_resumed_run_averages_and_prunes_only_its_own_checkpoints(small: Path, tmp_path: Path) -> None:
    run = RunDirectory(tmp_path / "run")
    assert cli_train(small, run.path, "train.max_steps=2", "validation.every=1", "checkpoint.keep_last=3") == 0
    ours = ckpt.read(run.last).run_id
    foreign = ckpt.read(run.step(2))
    ckpt.save(run.step(100), ckpt.Checkpoint(foreign.config, foreign.tokenizer, foreign.model, "another-run"))
    extra = ("validation.every=1", "checkpoint.keep_last=3", "checkpoint.average_last=3")
    assert cli_train(small, run.path, "train.max_steps=5", *extra) == 0
    assert [p.name for p in run.step_checkpoints(ours)] == [f"checkpoint_step{n}.pt" for n in (3, 4, 5)]
    assert run.step(100).exists(), "another run's file is neither pruned nor averaged"
    assert ckpt.read(run.average).averaged_from == [str(run.step(n)) for n in (3, 4, 5)]


def test_save_every_writes_step_checkpoints_and_average_says_when_it_finds_fewer(
    small: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = RunDirectory(tmp_path / "run")
    settings = ("train.max_steps=4", "validation.every=0", "checkpoint.every=2", "checkpoint.keep_last=5")
    assert cli_train(small, run.path, *settings, "checkpoint.average_last=3") == 0
    assert [p.name for p in run.step_checkpoints()] == ["checkpoint_step2.pt", "checkpoint_step4.pt"]
    assert "checkpoint.average_last=3, but this run kept 2 step checkpoints" in capsys.readouterr().err
    assert main(["average", "--run-dir", str(run.path), "--last", "5", "-o", str(tmp_path / "avg.pt")]) == 0
    err = capsys.readouterr().err
    assert "--last 5: " in err and "holds only 2 step checkpoint(s) of its run; averaging those" in err
    assert ckpt.read(tmp_path / "avg.pt").averaged_from == [str(run.step(n)) for n in (2, 4)]


@pytest.mark.parametrize("change", ["data.vocab_size=40", "data.spm_model_type=bpe", "model.transformer.d_ff=64"])
def test_resume_refuses_what_the_tokenizer_data_or_weights_fixed(
    small: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], change: str
) -> None:
    run = tmp_path / "run"
    assert cli_train(small, run, "train.max_steps=1") == 0
    before = (run / ckpt.LAST).read_bytes()
    capsys.readouterr()
    assert cli_train(small, run, "train.max_steps=2", change) == 1
    key = change.split("=")[0]
    assert f"the config does not match its checkpoint: {key} is" in one_line(capsys)
    assert (run / ckpt.LAST).read_bytes() == before
    assert cli_train(small, run, "train.max_steps=2", "optim.lr=1e-3", "train.log_every=5") == 0  # harmless ones
    assert "config changed since the checkpoint: optim.lr" in (run / "train.log").read_text()


# Killed processes: deterministic (inside a save) and at random moments.


def _uninterrupted(corpus: Path, tmp_path: Path, steps: int) -> dict[str, torch.Tensor]:
    run = tmp_path / "whole"
    train(load_config(TINY, overrides(corpus, run, *DROPOUT, "checkpoint.every=1", f"train.max_steps={steps}")))
    return weights(run)


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_process_killed_inside_a_save_loses_nothing_and_resumes_exactly(small: Path, tmp_path: Path) -> None:
    """The child dies by SIGKILL between writing a save's temporary file and renaming it into place."""
    run, steps = tmp_path / "run", 8
    args = ["train", "--config", str(TINY), *overrides(small, run, *DROPOUT, "checkpoint.every=1")]
    child = textwrap.dedent(f"""
        import os, signal
        from seq2seq.runs import checkpoint
        from seq2seq.cli import main
        real, calls = os.replace, [0]
        def replace(src, dst):
            calls[0] += 1
            if calls[0] == 10:  # step 5's checkpoint_last (each save writes a step checkpoint first), complete on disk
                os.kill(os.getpid(), signal.SIGKILL)
            real(src, dst)
        checkpoint.os.replace = replace
        main({args!r})
    """)
    proc = subprocess.run([sys.executable, "-c", child], cwd=ROOT, env=single_thread_env(), capture_output=True)
    assert proc.returncode == -signal.SIGKILL
    leftovers = [p.name for p in run.glob(".checkpoint*.tmp")]
    assert len(leftovers) == 1, leftovers  # the interrupted save; checkpoint_last is the previous one
    assert ckpt.read(run / ckpt.LAST).training.progress.step == 4
    assert cli_train(small, run, *DROPOUT, "checkpoint.every=1", f"train.max_steps={steps}") == 0
    assert not list(run.glob(".checkpoint*.tmp"))
    _assert_same(weights(run), _uninterrupted(small, tmp_path, steps))


def test_kill_9_at_random_moments_then_resume_gives_the_uninterrupted_weights(small: Path, tmp_path: Path) -> None:
    run, steps, rng = tmp_path / "run", 24, random.Random(0)
    command = [sys.executable, "-m", "seq2seq", "train", "--config", str(TINY)]
    command += overrides(small, run, *DROPOUT, "checkpoint.every=1", f"train.max_steps={steps}")
    kills = 0
    for _ in range(3):
        proc = subprocess.Popen(command, cwd=ROOT, env=single_thread_env(), stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 120
        while not (run / ckpt.LAST).exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(rng.uniform(0.0, 1.5))  # somewhere in the updates and saves that follow
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            kills += 1
        proc.wait(timeout=60)
    assert kills >= 2, "the run finished before it could be killed; make it longer"
    assert cli_train(small, run, *DROPOUT, "checkpoint.every=1", f"train.max_steps={steps}") == 0
    assert ckpt.read(run / ckpt.LAST).training.progress.step == steps
    _assert_same(weights(run), _uninterrupted(small, tmp_path, steps))


def test_prepare_refuses_a_directory_that_a_train_holds(
    small: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = RunDirectory(tmp_path / "run")
    run.acquire()
    try:
        assert main(["prepare", "--config", str(TINY), *overrides(small, run.path)]) == 1
        assert "in use by another training process" in one_line(capsys)
        assert not (run.path / "prepared").exists()
    finally:
        run.release()
    assert main(["prepare", "--config", str(TINY), *overrides(small, run.path)]) == 0
    assert (run.path / "prepared").is_dir()


def test_a_kill_inside_the_first_save_is_rerun_from_the_start(
    small: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Killed after checkpoint_best, before the first checkpoint_last: the rerun knows those files as its own."""
    run = tmp_path / "run"
    settings = ("train.max_steps=3", "validation.every=2", "checkpoint.keep_last=2")
    args = ["train", "--config", str(TINY), *overrides(small, run, *settings)]
    child = textwrap.dedent(f"""
        import os, signal
        from seq2seq.runs import checkpoint
        from seq2seq.cli import main
        real = os.replace
        def replace(src, dst):
            if str(dst).endswith("{ckpt.LAST}"):
                os.kill(os.getpid(), signal.SIGKILL)
            real(src, dst)
        checkpoint.os.replace = replace
        main({args!r})
    """)
    proc = subprocess.run([sys.executable, "-c", child], cwd=ROOT, env=single_thread_env(), capture_output=True)
    assert proc.returncode == -signal.SIGKILL
    assert sorted(p.name for p in run.glob("checkpoint*.pt")) == ["checkpoint_best.pt", "checkpoint_step2.pt"]
    run_id = (run / "run_id").read_text().strip()
    assert ckpt.peek_run_id(run / ckpt.BEST) == run_id
    capsys.readouterr()
    assert cli_train(small, run, *settings) == 0
    assert "this run's first save was interrupted; starting the run over" in capsys.readouterr().err
    last = ckpt.read(run / ckpt.LAST)
    assert last.run_id == run_id and last.training is not None and last.training.progress.step == 3
    assert RunDirectory(run).step_checkpoints(run_id) == [run / "checkpoint_step2.pt", run / "checkpoint_step3.pt"]
