"""The training meter: what each logged number averages over, and which time tokens/s counts."""

from __future__ import annotations

import logging
import math
from pathlib import Path
from types import SimpleNamespace

import pytest

from seq2seq.training import monitor
from seq2seq.training.monitor import Meter, MetricsFile, read_metrics
from seq2seq.training.update import UpdateStats


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


class FakeWriter:
    def __init__(self) -> None:
        self.scalars: dict[str, tuple[float, int]] = {}

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        assert tag not in self.scalars, f"{tag} written twice"
        self.scalars[tag] = (value, step)


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr(monitor, "time", SimpleNamespace(monotonic=fake.monotonic))
    return fake


def update(loss: float, nll: float, tokens: float, grad_norm: float, lr: float) -> UpdateStats:
    return UpdateStats(loss=loss, nll=nll, tokens=tokens, lr=lr, grad_norm=grad_norm)


def test_averages_weigh_losses_by_tokens_and_grad_norms_by_updates(
    clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    meter = Meter()
    meter.add(update(loss=2.0, nll=1.0, tokens=10, grad_norm=1.0, lr=3e-3))
    clock.now += 50  # a validation: its time is not training time
    meter.restart_clock()
    meter.add(update(loss=5.0, nll=4.0, tokens=30, grad_norm=3.0, lr=2e-3))
    clock.now += 2
    writer = FakeWriter()
    with caplog.at_level(logging.DEBUG, logger="seq2seq"):
        text = meter.log(writer, step=7)

    nll = (1.0 * 10 + 4.0 * 30) / 40
    expected = {
        "loss": (2.0 * 10 + 5.0 * 30) / 40,  # 4.25, not the per-update mean 3.5
        "nll": nll,
        "ppl": math.exp(nll),
        "lr": 2e-3,  # the last value (decaying here), not the largest or a mean
        "grad_norm": 2.0,  # per update, whatever the updates' sizes
        "tokens_per_s": 30 / 2,  # only the tokens and seconds since restart_clock
    }
    assert writer.scalars.keys() == {f"train/{name}" for name in expected}
    for name, value in expected.items():
        assert writer.scalars[f"train/{name}"] == (pytest.approx(value), 7), name
    assert text == "loss=4.250, lr=2.00e-03, tok/s=15"
    assert "step 7: loss 4.250, nll 3.250, lr 2.00e-03, grad norm 2.00, 15 tokens/s" in caplog.text


def test_log_starts_a_new_window(clock: Clock) -> None:
    meter = Meter()
    meter.add(update(loss=9.0, nll=9.0, tokens=100, grad_norm=9.0, lr=1.0))
    clock.now += 10
    meter.log(None, step=1)  # no writer (ranks other than 0): nothing to write, the window still ends

    clock.now += 4
    meter.add(update(loss=3.0, nll=2.0, tokens=20, grad_norm=0.5, lr=0.25))
    writer = FakeWriter()
    meter.log(writer, step=2)
    values = {tag.removeprefix("train/"): value for tag, (value, _) in writer.scalars.items()}
    assert values["loss"] == pytest.approx(3.0) and values["nll"] == pytest.approx(2.0)
    assert values["grad_norm"] == pytest.approx(0.5) and values["lr"] == 0.25
    assert values["tokens_per_s"] == pytest.approx(20 / 4)  # the clock restarted at the first log

    empty = FakeWriter()
    meter.log(empty, step=3)  # a window without updates divides by nothing
    assert empty.scalars["train/loss"] == (0.0, 3) and empty.scalars["train/grad_norm"] == (0.0, 3)


def test_metrics_keep_the_last_record_of_each_event_and_step(tmp_path: Path) -> None:
    """A resumed run logs the steps after its checkpoint again; a kill can cut the last line short."""
    path = tmp_path / "metrics.jsonl"
    metrics = MetricsFile(path)
    metrics.write("train", 1, 1, loss=3.0)
    metrics.write("train", 2, 1, loss=2.5)
    metrics.write("valid", 2, 1, loss=2.4, bleu=float("nan"))
    metrics.write("start", 1, 1, parameters=7)  # resumed from step 1
    metrics.write("train", 2, 1, loss=2.6)
    with open(path, "a") as f:
        f.write('{"event": "train", "st')
    records = read_metrics(path)
    assert [(r["event"], r["step"]) for r in records] == [("train", 1), ("start", 1), ("valid", 2), ("train", 2)]
    assert records[-1]["loss"] == 2.6 and records[2]["bleu"] is None  # JSON has no NaN
    assert read_metrics(tmp_path / "missing.jsonl") == []
    MetricsFile(None).write("train", 3, 1, loss=1.0)  # ranks other than 0 write nothing
    assert len(path.read_text().splitlines()) == 6
