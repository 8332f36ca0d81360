"""What a run shows: running statistics, TensorBoard scalars, metrics.jsonl, progress bars, the log file.

Where the numbers go is a `MetricSink`: TensorBoard's scalars and texts (`TensorBoard`), the records of
metrics.jsonl (`MetricsFile`), or both behind one `Sinks`. The log lines go to train.log through `logging`
(`RunDirectory.attach_log`). Only rank 0 writes any of it: elsewhere `setup_sinks` gives an empty `Sinks`.
"""

from __future__ import annotations

import json
import logging
import math
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from seq2seq.training.update import UpdateStats

log = logging.getLogger("seq2seq.train")


class ScalarWriter(Protocol):
    def add_scalar(self, tag: str, value: float, step: int) -> None: ...


class MetricSink(ScalarWriter, Protocol):
    """Where a run's numbers go: scalars and texts by tag (TensorBoard's words), records of an event
    (metrics.jsonl's: start, train, valid, finish), and the end of the run."""

    def add_text(self, tag: str, text: str, step: int) -> None: ...

    def write(self, event: str, step: int, epoch: int, **values: float | str) -> None: ...

    def close(self) -> None: ...


class Sinks:
    """Several sinks as one; none (ranks other than 0) writes nothing."""

    def __init__(self, *sinks: MetricSink) -> None:
        self.sinks = list(sinks)

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        for sink in self.sinks:
            sink.add_scalar(tag, value, step)

    def add_text(self, tag: str, text: str, step: int) -> None:
        for sink in self.sinks:
            sink.add_text(tag, text, step)

    def write(self, event: str, step: int, epoch: int, **values: float | str) -> None:
        for sink in self.sinks:
            sink.write(event, step, epoch, **values)

    def close(self) -> None:
        while self.sinks:
            self.sinks.pop().close()


class TensorBoard:
    """RUN/tensorboard: the scalars and texts; on resume, events logged after the checkpoint (lost steps)
    are purged. Event records are metrics.jsonl's, not TensorBoard's."""

    def __init__(self, directory: Path, resume_step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(directory), purge_step=resume_step + 1 if resume_step else None)

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self.writer.add_scalar(tag, value, step)

    def add_text(self, tag: str, text: str, step: int) -> None:
        self.writer.add_text(tag, text, step)

    def write(self, event: str, step: int, epoch: int, **values: float | str) -> None:
        pass

    def close(self) -> None:
        self.writer.close()


class Meter:
    """Running training statistics between two log lines."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.loss = self.nll = self.tokens = self.grad_norm = self.lr = 0.0
        self.updates = 0
        self.restart_clock()

    def restart_clock(self) -> None:
        """Start timing afresh, e.g. after a validation, so tokens/s counts training time only."""
        self.start = time.monotonic()
        self.timed_tokens = 0.0

    def add(self, stats: UpdateStats) -> None:
        self.loss += stats.loss * stats.tokens
        self.nll += stats.nll * stats.tokens
        self.tokens += stats.tokens
        self.timed_tokens += stats.tokens
        self.grad_norm += stats.grad_norm
        self.updates += 1
        self.lr = stats.lr

    def log(self, writer: ScalarWriter | None, step: int, metrics: MetricSink | None = None, epoch: int = 0) -> str:
        """Write the averages to TensorBoard, metrics.jsonl and the log file; return a short progress-bar text."""
        seconds = max(time.monotonic() - self.start, 1e-9)
        loss, nll = self.loss / max(self.tokens, 1), self.nll / max(self.tokens, 1)
        values = {
            "loss": loss,
            "nll": nll,
            "ppl": math.exp(min(nll, 50)),
            "lr": self.lr,
            "grad_norm": self.grad_norm / max(self.updates, 1),
            "tokens_per_s": self.timed_tokens / seconds,
        }
        if writer is not None:
            for name, value in values.items():
                writer.add_scalar(f"train/{name}", value, step)
        if metrics is not None:
            metrics.write("train", step, epoch, **values)
        log.log(
            logging.DEBUG if on_terminal() else logging.INFO,  # without a bar, these lines show the progress
            "step %d: loss %.3f, nll %.3f, lr %.2e, grad norm %.2f, %.0f tokens/s",
            step,
            loss,
            nll,
            self.lr,
            values["grad_norm"],
            values["tokens_per_s"],
        )
        self.reset()
        return f"loss={loss:.3f}, lr={values['lr']:.2e}, tok/s={values['tokens_per_s']:.0f}"


class MetricsFile:
    """RUN/metrics.jsonl: one JSON object a line per log event, for programs to read instead of the log's words.

    Events: "start" (parameters), "train" (loss, nll, ppl, lr, grad_norm, tokens_per_s), "valid" (loss, nll,
    ppl, bleu when decoded, minutes of training) and "finish" (reason), each with its step and epoch: the
    epoch in progress, 1-based, which after an epoch's last update is already the next one (the validation
    at the end of epoch 1 says 2; a run stopped by `train.max_epochs=10` finishes in epoch 11, with 10 done).
    Appended across resumes: a resumed run logs the steps after its checkpoint again, so `read_metrics`
    keeps the last record of each event and step. `path` None (ranks other than 0) writes nothing.
    """

    def __init__(self, path: Path | None) -> None:
        self.path = path

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        pass  # the values come with their event

    def add_text(self, tag: str, text: str, step: int) -> None:
        pass

    def close(self) -> None:
        pass

    def write(self, event: str, step: int, epoch: int, **values: float | str) -> None:
        if self.path is None:
            return
        record = {"event": event, "step": step, "epoch": epoch, **{k: _finite(v) for k, v in values.items()}}
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")


def _finite(value: float | str) -> float | str | None:
    """JSON has no NaN or infinity (a diverged loss): null instead."""
    return None if isinstance(value, float) and not math.isfinite(value) else value


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl in step order, the last one of each event and step.

    A line cut short by a kill is skipped; a file that is not there or holds no record gives [].
    """
    latest: dict[tuple[str, int], dict[str, Any]] = {}
    lines = path.read_text(encoding="utf-8").splitlines() if path.is_file() else []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            key = (str(record.get("event")), record["step"])
            latest.pop(key, None)  # a later record of the same step replaces it, in its place
            latest[key] = record
    return sorted(latest.values(), key=lambda r: int(r["step"]))


def on_terminal() -> bool:
    """Whether stderr is a terminal: a redirected one (a log file, a pipe) gets log lines, not a progress bar
    redrawn into one endless line."""
    return sys.stderr is not None and sys.stderr.isatty()


def progress(total: int, initial: int, desc: str, enabled: bool) -> Any:
    """A tqdm bar with ETA, on a terminal and on rank 0 only."""
    from tqdm import tqdm

    shown = enabled and on_terminal()
    return tqdm(total=total, initial=initial, desc=desc, unit="upd", disable=not shown, dynamic_ncols=True, leave=False)


def log_validation(
    writer: MetricSink | None, step: int, scores: dict[str, float], minutes: float, examples: str
) -> None:
    """Validation scores, the training minutes so far and (with BLEU) example translations, to TensorBoard."""
    if writer is None:
        return
    for name, value in scores.items():
        writer.add_scalar(f"valid/{name}", value, step)
    writer.add_scalar("valid/minutes", minutes, step)
    if "bleu" in scores:
        writer.add_text("valid/examples", examples, step)
