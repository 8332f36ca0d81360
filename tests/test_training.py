"""The trainer: schedules, accumulation, exact resume, signals, kill -9, NaN handling, early stopping, logs."""

from __future__ import annotations

import json
import logging
import math
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import ROOT, TINY, tiny_overrides, write_corpus

from seq2seq import device as device_module
from seq2seq.cli import main
from seq2seq.config import ExperimentConfig, OptimConfig, load_config
from seq2seq.device import resolve_precision
from seq2seq.errors import TrainingError
from seq2seq.runs import checkpoint as ckpt
from seq2seq.runs.checkpoint import LAST, Progress
from seq2seq.text.corpus import Batch, collate_pairs
from seq2seq.training import update as update_module
from seq2seq.training.assembly import TrainingRun, assemble
from seq2seq.training.epochs import EpochSource
from seq2seq.training.monitor import read_metrics
from seq2seq.training.optim import Schedule, lr_at, projected_updates
from seq2seq.training.trainer import Trainer, train

# Small batches of a small corpus: 14 batches an epoch, a few milliseconds an update. One thread: on a
# busy machine, two OpenMP threads per process can make these tiny steps 20x slower.
FAST = (
    "validation.bleu=false",
    "train.max_tokens=256",
    "train.max_epochs=1000",
    "train.log_every=1",
    "train.threads=1",
)


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("small"), n_train=600)


def config(corpus: Path, run_dir: Path, *extra: str) -> ExperimentConfig:
    return load_config(TINY, tiny_overrides(corpus, run_dir, *FAST, *extra))


def weights(run_dir: Path, name: str = LAST) -> dict[str, torch.Tensor]:
    return ckpt.read(run_dir / name).model


def progress(run_dir: Path) -> Progress:
    training = ckpt.read(run_dir / LAST).training
    assert training is not None
    return training.progress


# Learning-rate schedules: pure functions of the step.


def test_inverse_sqrt_warms_up_linearly_then_decays_as_inverse_sqrt() -> None:
    lr, warmup = 1e-3, 100
    assert lr_at(1, "inverse_sqrt", lr, warmup) == pytest.approx(lr / 100)
    assert lr_at(50, "inverse_sqrt", lr, warmup) == pytest.approx(lr / 2)
    assert lr_at(100, "inverse_sqrt", lr, warmup) == pytest.approx(lr)
    assert lr_at(400, "inverse_sqrt", lr, warmup) == pytest.approx(lr / 2)
    assert lr_at(10_000, "inverse_sqrt", lr, warmup) == pytest.approx(lr / 10)
    peak = max(range(1, 1000), key=lambda s: lr_at(s, "inverse_sqrt", lr, warmup))
    assert peak == warmup


def test_noam_is_the_paper_formula() -> None:
    d_model, warmup, factor = 512, 4000, 2.0
    for step in (1, 100, 3999, 4000, 4001, 50_000):
        expected = factor * d_model**-0.5 * min(step**-0.5, step * warmup**-1.5)
        assert lr_at(step, "noam", factor, warmup, d_model=d_model) == pytest.approx(expected)
    assert max(range(1, 10_000), key=lambda s: lr_at(s, "noam", factor, warmup, d_model=d_model)) == warmup


def test_cosine_warms_up_then_reaches_zero_at_the_last_step() -> None:
    lr, warmup, total = 1e-3, 10, 110
    assert lr_at(5, "cosine", lr, warmup, total) == pytest.approx(lr / 2)
    assert lr_at(10, "cosine", lr, warmup, total) == pytest.approx(lr)
    assert lr_at(60, "cosine", lr, warmup, total) == pytest.approx(lr / 2)  # half way through the decay
    assert lr_at(110, "cosine", lr, warmup, total) == pytest.approx(0.0, abs=1e-15)
    assert lr_at(500, "cosine", lr, warmup, total) == pytest.approx(0.0, abs=1e-15)
    values = [lr_at(s, "cosine", lr, warmup, total) for s in range(warmup, total + 1)]
    assert values == sorted(values, reverse=True)


def test_constant_after_warmup_and_without_warmup() -> None:
    assert lr_at(3, "constant", 5e-4, 4) == pytest.approx(3.75e-4)
    assert [lr_at(s, "constant", 5e-4, 4) for s in (4, 5, 10**6)] == [5e-4] * 3
    assert lr_at(1, "constant", 5e-4, 0) == 5e-4


def test_schedules_are_pure_functions_of_the_step() -> None:
    for schedule in ("inverse_sqrt", "noam", "cosine", "constant"):
        first = [lr_at(s, schedule, 1e-3, 20, 200) for s in range(1, 300)]
        assert first == [lr_at(s, schedule, 1e-3, 20, 200) for s in range(1, 300)]
    with pytest.raises(ValueError, match="unknown schedule"):
        lr_at(1, "linear", 1e-3, 10)


def test_a_time_limited_run_is_projected_from_its_rate_so_far() -> None:
    assert projected_updates(100, elapsed=30.0, max_minutes=1.0) == 200
    assert projected_updates(100, elapsed=90.0, max_minutes=1.0) == 100  # out of time: no more than made
    assert projected_updates(0, elapsed=0.0, max_minutes=1.0) == 0  # nothing to project from yet
    assert projected_updates(100, elapsed=30.0, max_minutes=0.0) == 0  # no time limit


def test_a_decaying_schedule_ends_at_the_first_limit_reached() -> None:
    optim = OptimConfig(schedule="cosine", lr=1e-3, warmup_steps=10)
    by_steps = Schedule(optim, planned=110, max_minutes=0.0, d_model=256)
    assert [by_steps(s, elapsed=10**6) for s in (5, 60, 110)] == [
        lr_at(s, "cosine", 1e-3, 10, 110) for s in (5, 60, 110)
    ]
    timed = Schedule(optim, planned=10_000, max_minutes=1.0, d_model=256)
    # 59 updates made in 30 of the 60 seconds: 118 in all, half of the decay after warm-up left.
    assert timed(60, elapsed=30.0) == pytest.approx(lr_at(60, "cosine", 1e-3, 10, 118))
    assert timed(60, elapsed=59.9) < 1e-3 * 0.01  # time is nearly up: the rate is nearly 0
    assert timed(60, elapsed=0.1) == lr_at(60, "cosine", 1e-3, 10, 10_000)  # the step limit comes first
    assert Schedule(optim, planned=0, max_minutes=0.0, d_model=256)(500) == 1e-3  # no limit: no decay


@pytest.mark.trains
def test_a_run_bound_by_time_decays_its_rate_to_the_end(small: Path, tmp_path: Path) -> None:
    """The cosine of a run that train.max_minutes stops has nearly reached 0 at its last update."""
    run = tmp_path / "timed"
    train(config(small, run, "optim.schedule=cosine", "optim.warmup_steps=0", "train.max_minutes=0.05"))
    rows = read_metrics(run / "metrics.jsonl")
    assert [r["reason"] for r in rows if r["event"] == "finish"] == ["max_minutes"]
    rates = [r["lr"] for r in rows if r["event"] == "train"]
    assert len(rates) > 10
    assert rates[-1] < 0.1 * max(rates)


# Gradient accumulation.


def test_accumulating_two_batches_equals_one_batch_of_their_union(
    small: Path, tmp_path: Path, device: torch.device
) -> None:
    on = (f"train.device={device.type}", "train.precision=fp32")  # the arithmetic, not the rounding of bf16/fp16
    trainer = assemble(config(small, tmp_path / "run", "model.dropout=0", *on))
    try:
        first, second = trainer.epochs.batches(1)[0], trainer.epochs.batches(1)[1]
        parts = [collate_ids(trainer, first), collate_ids(trainer, second)]
        union = [collate_ids(trainer, first + second)]
        results, grads = [], []
        for batches in (parts, union):
            loss, nll, tokens = trainer.update.accumulate(batches, step=1)  # (device, device, host)
            results.append((float(loss), float(nll), tokens))
            grads.append([p.grad.clone() for p in trainer.model.parameters()])
            trainer.update.optimizer.zero_grad(set_to_none=True)
        (loss_a, nll_a, tokens_a), (loss_b, nll_b, tokens_b) = results
        assert tokens_a == tokens_b == parts[0].n_tokens + parts[1].n_tokens
        assert loss_a == pytest.approx(loss_b, rel=1e-5) and nll_a == pytest.approx(nll_b, rel=1e-5)
        for a, b in zip(*grads):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
        # ... and the gradient is per target token: the mean, not the sum, over the update.
        norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads[0]))
        assert 0.01 < norm < 100
    finally:
        trainer.close()


def collate_ids(trainer: TrainingRun, indices: list[int]) -> Batch:
    pairs = [trainer.epochs.corpus.ids(i) for i in indices]
    return collate_pairs([s for s, _ in pairs], [t for _, t in pairs])


# Precision.


def test_precision_choices_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    monkeypatch.setattr(device_module, "cpu_has_native_bf16", lambda: True)
    assert resolve_precision("auto", cpu) == "bf16"  # see scripts/bench/bench_train.py
    monkeypatch.setattr(device_module, "cpu_has_native_bf16", lambda: False)
    assert resolve_precision("auto", cpu) == "fp32"
    assert resolve_precision("bf16", cpu) == "bf16" and resolve_precision("fp32", cpu) == "fp32"
    with pytest.raises(TrainingError, match="fp16 needs CUDA"):
        resolve_precision("fp16", cpu)


@pytest.mark.trains
def test_bf16_autocast_trains_like_fp32_on_cpu(small: Path, tmp_path: Path) -> None:
    """bf16 autocast keeps fp32 weights and converges as fp32 does (the safety half of `auto`)."""
    losses = {}
    for precision in ("fp32", "bf16"):
        run = tmp_path / precision
        losses[precision] = train(config(small, run, f"train.precision={precision}", "train.max_steps=60")).best
        assert all(t.dtype == torch.float32 for t in weights(run).values() if t.is_floating_point())
    assert losses["bf16"] == pytest.approx(losses["fp32"], rel=0.05)
    assert losses["fp32"] < 2.5  # from ~4.2 at the start: it did learn


@pytest.mark.trains
def test_rdrop_reaches_the_training_step_and_trains(small: Path, tmp_path: Path) -> None:
    losses = []
    for alpha in (1e-6, 2.0):  # R-Drop on in both: the same two dropout masks, a heavier KL in the second
        trainer = assemble(config(small, tmp_path / f"alpha{alpha}", "model.dropout=0.1", f"optim.rdrop_alpha={alpha}"))
        try:
            batch = trainer.epochs.batch(1, 0)
            losses.append(float(trainer.update.accumulate([batch], step=1)[0]))
        finally:
            trainer.close()
    assert losses[1] > losses[0]
    state = train(config(small, tmp_path / "run", "model.dropout=0.1", "optim.rdrop_alpha=2", "train.max_steps=60"))
    assert state.best < 2.5  # as far as without R-Drop in the test above


# Exact resume.


@pytest.mark.trains
@pytest.mark.parametrize(
    "update_freq, stop, end, extra",
    [
        (1, 5, 20, ()),
        (2, 3, 10, ()),
        (1, 5, 20, ("data.sampling_alpha=0.2", "data.sampling_nbest=-1")),
        (2, 3, 10, ("optim.rdrop_alpha=2",)),
        (1, 5, 20, ("model.arch=rnn", "model.transformer=null", "model.rnn.hidden_size=32", "model.rnn.attention=mlp")),
        (1, 5, 20, ("train.num_workers=2", "data.sampling_alpha=0.2")),  # collated in worker processes
        (2, 3, 10, ("train.precision=bf16",)),  # autocast, bounded rows, the kernel choice: on every CPU kind
    ],
)
def test_resume_reaches_the_same_weights_as_an_uninterrupted_run(
    small: Path, tmp_path: Path, update_freq: int, stop: int, end: int, extra: tuple[str, ...], device: torch.device
) -> None:
    """Dropout on (so the RNG matters), stopped mid-epoch (so the data position matters), across an epoch end;
    with subword sampling, the resumed epoch must be segmented as before; with R-Drop, both passes masked as before."""
    settings = (
        "model.dropout=0.2",
        "model.transformer.attention_dropout=0.1",
        f"train.update_freq={update_freq}",
        "optim.warmup_steps=4",
        f"train.device={device.type}",
        *extra,
    )
    whole = train(config(small, tmp_path / "whole", *settings, f"train.max_steps={end}"))
    part = train(config(small, tmp_path / "part", *settings, f"train.max_steps={stop}"))
    assert part.step == stop and part.epoch == 1 and part.batch_in_epoch == stop * update_freq
    resumed = train(config(small, tmp_path / "part", *settings, f"train.max_steps={end}"))
    assert whole.epoch == 2, "the test should cross an epoch boundary"
    assert (resumed.step, resumed.epoch, resumed.batch_in_epoch) == (whole.step, whole.epoch, whole.batch_in_epoch)
    a, b = weights(tmp_path / "whole"), weights(tmp_path / "part")
    assert all(torch.equal(a[name], b[name]) for name in a)
    log = (tmp_path / "part" / "train.log").read_text()
    assert f"resuming {tmp_path / 'part'} at step {stop}" in log
    assert f"train.max_steps: {stop} -> {end}" in log


def test_subword_sampling_draws_a_new_segmentation_each_epoch(small: Path, tmp_path: Path) -> None:
    fixed = assemble(config(small, tmp_path / "fixed"))
    sampled = assemble(config(small, tmp_path / "sampled", "data.sampling_alpha=0.2", "data.sampling_nbest=-1"))
    try:
        epochs = sampled.epochs
        # Over the whole corpus (600 pairs), not a few sentences that a draw may well segment the best way.
        seg = {e: segmentations(epochs, e) for e in (1, 2)}
        best = {i: epochs.corpus.ids(i)[0][:-1] for i in seg[1]}  # the best segmentation is prepared
        assert seg[1].keys() == seg[2].keys() == best.keys()
        assert seg[1] != seg[2] and best not in (seg[1], seg[2])
        assert torch.equal(epochs.batch(1, 0).src, epochs.batch(1, 0).src)  # re-drawn, not remembered
        assert torch.equal(fixed.epochs.batch(1, 0).src, fixed.epochs.batch(1, 0).src)
        assert sampled.validator.corpus == fixed.validator.corpus  # validation keeps the best segmentation
        decode = sampled.tokenizer.decode_tgt
        assert [decode(seg[1][i]) for i in best] == [decode(best[i]) for i in best]
    finally:
        fixed.close()
        sampled.close()


def segmentations(epochs: EpochSource, epoch: int) -> dict[int, list[int]]:
    """Each pair's source ids as the batches of `epoch` segment it (without EOS and padding)."""
    out = {}
    for j, pairs in enumerate(epochs.batches(epoch)):
        src = epochs.batch(epoch, j).src
        out.update({i: strip(src[k]) for k, i in enumerate(pairs)})
    return out


def strip(row: torch.Tensor) -> list[int]:
    """A padded row's ids without EOS and padding."""
    ids = [int(x) for x in row if int(x) > 0]
    return ids[:-1]


@pytest.mark.trains
def test_resuming_a_finished_run_changes_nothing(small: Path, tmp_path: Path) -> None:
    cfg = config(small, tmp_path / "run", "train.max_steps=3")
    train(cfg)
    before = weights(tmp_path / "run")
    state = train(cfg)
    assert state.step == 3
    after = weights(tmp_path / "run")
    assert all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.trains
def test_resume_refuses_a_different_model(small: Path, tmp_path: Path) -> None:
    train(config(small, tmp_path / "run", "train.max_steps=1"))
    with pytest.raises(TrainingError, match="does not match its checkpoint") as refused:
        assemble(config(small, tmp_path / "run", "model.d_model=32", "model.transformer.d_ff=64"))
    message = str(refused.value)
    assert "model.d_model is 32" in message and "(and model.transformer.d_ff)" in message
    assert message.endswith("choose another train.run_dir")
    assert not [h for h in logging.getLogger("seq2seq").handlers if isinstance(h, logging.FileHandler)]


@pytest.mark.trains
def test_resume_in_the_middle_of_an_epoch_refuses_other_batches_and_takes_other_dropout(
    small: Path, tmp_path: Path
) -> None:
    train(config(small, tmp_path / "run", "train.max_steps=3"))  # 3 of the epoch's 14 batches
    for change, old in (("train.max_tokens=512", "256"), ("train.seed=2", "1")):
        key = change.split("=")[0]
        with pytest.raises(TrainingError, match=f"in the middle of epoch 1 with {key} changed from {old}") as refused:
            assemble(config(small, tmp_path / "run", "train.max_steps=6", change))
        assert str(refused.value).endswith(f"resume with {key}={old}")
    state = train(config(small, tmp_path / "run", "train.max_steps=6", "model.dropout=0.3"))
    assert state.step == 6
    assert "config changed since the checkpoint: model.dropout: " in (tmp_path / "run" / "train.log").read_text()


# Signals and kill -9, on a real `seq2seq train` process.


def _start(corpus: Path, run_dir: Path, *extra: str) -> tuple[subprocess.Popen[bytes], Path]:
    stderr = run_dir.parent / f"{run_dir.name}.stderr"
    args = [
        sys.executable,
        "-m",
        "seq2seq",
        "train",
        "--config",
        str(TINY),
        *tiny_overrides(corpus, run_dir, *FAST, *extra),
    ]
    with open(stderr, "wb") as err:
        proc = subprocess.Popen(
            args,
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=err,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # undo a shell's SIG_IGN (a `cmd &`)
        )
    return proc, stderr


def _wait_for(condition: Callable[[], bool], proc: subprocess.Popen[bytes], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, f"training exited early with code {proc.returncode}"
        assert time.monotonic() < deadline, "timed out waiting for training to progress"
        time.sleep(0.05)


def _logged_step(run_dir: Path, step: int) -> Callable[[], bool]:
    log = run_dir / "train.log"
    return lambda: log.exists() and f"step {step}: loss" in log.read_text()


@pytest.mark.trains
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_saves_a_checkpoint_and_exits_cleanly(small: Path, tmp_path: Path, sig: signal.Signals) -> None:
    run = tmp_path / "run"
    proc, stderr = _start(small, run)
    _wait_for(_logged_step(run, 3), proc)
    proc.send_signal(sig)
    assert proc.wait(timeout=120) == 128 + sig  # the shell's code: a stopped run is not a finished one
    err = stderr.read_text()
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    assert f"stopped by {sig.name}; run the same command to resume" in err
    stopped = progress(run).step
    assert stopped >= 3
    assert f"stopped by a signal at step {stopped}" in (run / "train.log").read_text()
    state = train(config(small, run, f"train.max_steps={stopped + 2}"))
    assert state.step == stopped + 2
    assert f"at step {stopped} (epoch" in (run / "train.log").read_text()


@pytest.mark.trains
def test_kill_9_leaves_only_complete_checkpoints_and_the_run_resumes(small: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc, _ = _start(small, run, "checkpoint.every=1", "validation.every=4", "checkpoint.keep_last=2")
    _wait_for(_logged_step(run, 9), proc)
    proc.send_signal(signal.SIGKILL)  # saving is continuous here, so this often lands mid-write
    proc.wait(timeout=60)
    expected = re.compile(
        r"checkpoint_(last|best|step\d+)\.pt|config\.yaml|spm\.model|train\.log|metrics\.jsonl|tb|prepared|run_id|\.lock|\.checkpoint.*\.tmp"
    )
    assert all(expected.fullmatch(name) for name in os.listdir(run)), os.listdir(run)
    for path in run.glob("checkpoint*.pt"):
        ckpt.read(path)  # complete and loadable
    saved = progress(run).step
    assert saved >= 8
    (run / ".checkpoint_last.pt.x1y2.tmp").write_bytes(b"half a checkpoint")
    state = train(
        config(
            small,
            run,
            "checkpoint.every=1",
            "validation.every=4",
            "checkpoint.keep_last=2",
            f"train.max_steps={saved + 2}",
        )
    )
    assert state.step == saved + 2
    assert not list(run.glob(".*.tmp"))
    assert len(list(run.glob("checkpoint_step*.pt"))) == 2  # checkpoint.keep_last


# Non-finite losses.


def _nan_loss(monkeypatch: pytest.MonkeyPatch, bad: Callable[[int], bool]) -> None:
    """Make the training loss of the micro-batches `bad` selects (by call number) NaN."""
    real, calls = update_module.batch_loss, [0]

    def loss(model: torch.nn.Module, batch: object, *args: float) -> tuple[torch.Tensor, torch.Tensor]:
        value, nll = real(model, batch, *args)
        calls[0] += 1
        return (value * math.nan, nll) if model.training and bad(calls[0]) else (value, nll)

    monkeypatch.setattr(update_module, "batch_loss", loss)


@pytest.mark.trains
def test_a_nan_loss_skips_the_update_with_a_warning(
    small: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    _nan_loss(monkeypatch, lambda call: call == 2)
    state = train(config(small, tmp_path / "run", "train.max_steps=4"))
    assert state.step == 4 and state.batch_in_epoch == 5  # one batch went to the skipped update
    assert "update 2 skipped: non-finite loss (nan)" in caplog.text
    assert all(torch.isfinite(t).all() for t in weights(tmp_path / "run").values())


@pytest.mark.trains
def test_persistent_nan_stops_with_a_clear_message(
    small: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _nan_loss(monkeypatch, lambda call: call > 2)
    with pytest.raises(TrainingError, match=r"training diverged: 3 updates in a row .* \(at step 3\); lower optim.lr"):
        train(config(small, tmp_path / "run", "train.max_bad_steps=3", "train.max_steps=50"))


@pytest.mark.trains
def test_persistent_nan_is_one_line_from_the_cli(
    small: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _nan_loss(monkeypatch, lambda call: True)
    overrides = tiny_overrides(small, tmp_path / "run", *FAST, "train.max_bad_steps=2")
    assert main(["train", "--config", str(TINY), *overrides]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("seq2seq: error: training diverged: 2 updates in a row")
    assert "Traceback" not in "\n".join(err)


# Validation: best checkpoint and early stopping.


@pytest.mark.trains
@pytest.mark.parametrize("metric, scores", [("bleu", [1.0, 3.0, 2.0, 2.5, 9.0]), ("loss", [3.0, 1.0, 2.0, 1.5, 0.1])])
def test_best_checkpoint_by_metric_and_early_stopping(
    small: Path, tmp_path: Path, metric: str, scores: list[float]
) -> None:
    remaining = iter(scores)

    class Scripted:
        """A validator that returns the scores of the test's script."""

        examples = ""

        def __call__(self) -> dict[str, float]:
            value = next(remaining)
            return {"loss": value, "ppl": math.exp(value), "bleu": value}

    run = tmp_path / "run"
    trainer = Trainer(
        assemble(
            config(
                small,
                run,
                f"validation.best_metric={metric}",
                "validation.patience=2",
                "validation.every=1",
                "checkpoint.keep_last=3",
                "checkpoint.average_last=2",
                "train.max_steps=20",
            )
        )
    )
    trainer.validator = Scripted()  # type: ignore[assignment]
    state = trainer.fit()
    assert state.step == 4, "two validations without improvement after the best (step 2) stop the run"
    assert (state.best, state.best_metric, state.bad_validations) == (scores[1], metric, 2)
    best, step2 = weights(run, "checkpoint_best.pt"), weights(run, "checkpoint_step2.pt")
    assert all(torch.equal(best[k], step2[k]) for k in best)
    assert "(patience)" in (run / "train.log").read_text()
    assert sorted(p.name for p in run.glob("checkpoint_step*.pt")) == [f"checkpoint_step{n}.pt" for n in (2, 3, 4)]
    step3, step4 = weights(run, "checkpoint_step3.pt"), weights(run, "checkpoint_step4.pt")
    for name, tensor in weights(run, "checkpoint_avg.pt").items():  # checkpoint.average_last
        torch.testing.assert_close(tensor, ((step3[name].double() + step4[name].double()) / 2).float())


# Logging.


@pytest.mark.trains
def test_tensorboard_scalars_examples_and_log_file(small: Path, tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "run"
    train(config(small, run, "validation.bleu=true", "validation.every=3", "train.max_steps=6", "decode.max_len=12"))
    events = EventAccumulator(str(run / "tb"), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    scalars = set(events.Tags()["scalars"])
    for tag in (
        "train/loss",
        "train/lr",
        "train/grad_norm",
        "train/tokens_per_s",
        "valid/loss",
        "valid/ppl",
        "valid/bleu",
    ):
        assert tag in scalars, tag
    assert [e.step for e in events.Scalars("valid/bleu")] == [3, 6]
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2, 3, 4, 5, 6]
    assert any("valid/examples" in tag for tag in events.Tags()["tensors"])
    log = (run / "train.log").read_text()
    assert re.search(r"step 3: valid loss [\d.]+, nll [\d.]+, ppl [\d.]+, bleu [\d.]+", log)
    assert "step 6: valid" in log and "training finished at step 6" in log


@pytest.mark.trains
def test_a_run_stopped_by_its_epoch_limit_says_how_many_epochs_it_trained(small: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    train(config(small, run, "train.max_epochs=2"))
    assert "after 2 epochs (max epochs)" in (run / "train.log").read_text()
    finish = [r for r in read_metrics(run / "metrics.jsonl") if r["event"] == "finish"]
    assert finish[-1]["epoch"] == 3 and progress(run).epochs_done == 2  # a record's epoch: the one in progress


@pytest.mark.trains
def test_metrics_jsonl_holds_every_log_event_appended_across_a_resume(small: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    settings = ("validation.bleu=true", "validation.every=3", "decode.max_len=12")
    train(config(small, run, *settings, "train.max_steps=3"))
    first = (run / "metrics.jsonl").read_text().splitlines()
    train(config(small, run, *settings, "train.max_steps=6"))
    lines = (run / "metrics.jsonl").read_text().splitlines()
    assert lines[: len(first)] == first and len(lines) > len(first)  # appended, not rewritten
    records = [json.loads(line) for line in lines]
    steps = {event: [r["step"] for r in records if r["event"] == event] for event in ("start", "train", "valid")}
    assert steps == {"start": [0, 3], "train": [1, 2, 3, 4, 5, 6], "valid": [3, 6]}
    assert [(r["step"], r["reason"]) for r in records if r["event"] == "finish"] == [(3, "max_steps"), (6, "max_steps")]
    start, step, valid = records[0], records[1], next(r for r in records if r["event"] == "valid")
    assert start["parameters"] > 0 and start["epoch"] == 1
    assert {"loss", "nll", "ppl", "lr", "grad_norm", "tokens_per_s"} <= step.keys() and step["epoch"] == 1
    assert {"loss", "nll", "ppl", "bleu", "minutes"} <= valid.keys() and 0 <= valid["bleu"] <= 100
    assert valid["seconds"] > 0 and 0 < valid["share"] < 1  # validation's cost: its seconds and share of the time
    assert read_metrics(run / "metrics.jsonl") == sorted(records, key=lambda r: r["step"])


# The input pipeline and the update's numbers.


def test_worker_processes_yield_the_batches_of_the_training_process(small: Path, tmp_path: Path) -> None:
    """Sampled segmentations are drawn from (seed, epoch, batch), so two workers collate what one process would,
    in the same order, from any start within the epoch."""
    sampled = ("data.sampling_alpha=0.2", "data.sampling_nbest=-1")
    here = assemble(config(small, tmp_path / "here", *sampled))
    there = assemble(config(small, tmp_path / "there", *sampled, "train.num_workers=2"))
    try:
        assert there.epochs.num_workers == 2
        for epoch, start in ((1, 0), (2, 3)):
            expected = list(here.epochs.loader(epoch, start))
            got = list(there.epochs.loader(epoch, start))
            assert len(got) == len(expected) == len(here.epochs.batches(epoch)) - start > 0
            for a, b in zip(expected, got):
                assert a.n_tokens == b.n_tokens
                assert all(torch.equal(x, y) for x, y in zip(vars(a).values(), vars(b).values()) if torch.is_tensor(x))
    finally:
        here.close()
        there.close()


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_numbers_read_back_from_an_update_are_those_computed_on_the_host(
    small: Path, tmp_path: Path, precision: str
) -> None:
    """Loss, nll and gradient norm stay on the device until `finish` reads them in one transfer: the same
    numbers as summing each micro-batch's loss on the host and taking the norm of the gradients it leaves."""
    settings = ("model.dropout=0", f"train.precision={precision}", "train.update_freq=2", "optim.clip_norm=0.5")
    trainer = assemble(config(small, tmp_path / "run", *settings))
    try:
        update, batches = trainer.update, [trainer.epochs.batch(1, 0), trainer.epochs.batch(1, 1)]
        tokens = sum(b.n_tokens for b in batches)
        loss, nll, counted = update.accumulate(batches, step=1)
        grads = [p.grad.double() for p in trainer.model.parameters() if p.grad is not None]
        norm = math.sqrt(sum(float(g.pow(2).sum()) for g in grads))
        update.optimizer.zero_grad(set_to_none=True)
        before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        stats = update.finish(update.launch(batches, step=1, lr=1e-3))
        assert stats is not None and counted == tokens and stats.tokens == tokens and stats.lr == 1e-3
        assert stats.loss == pytest.approx(float(loss) / tokens, rel=1e-6)
        assert stats.nll == pytest.approx(float(nll) / tokens, rel=1e-6)
        assert stats.grad_norm == pytest.approx(norm, rel=1e-4)  # the norm before clipping
        assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())  # applied
    finally:
        trainer.close()
