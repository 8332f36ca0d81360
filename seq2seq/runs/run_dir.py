"""A run directory: its layout, its lock, its log file, and the step checkpoints of one run.

    RUN/config.yaml             the resolved config
    RUN/spm.model               the SentencePiece model (spm.src/tgt.model when not shared)
    RUN/train.log               the log, appended across resumes
    RUN/tb/                     TensorBoard events
    RUN/metrics.jsonl           one JSON object per log event, appended across resumes
    RUN/checkpoint_last.pt      the commit point of a resume
    RUN/checkpoint_best.pt      the best validation score so far
    RUN/checkpoint_step{N}.pt   the last checkpoint.keep_last validation checkpoints
    RUN/checkpoint_avg.pt       their average (checkpoint.average_last)
    RUN/.lock                   held by the training process; holds its pid
    RUN/run_id                  the id of the run, written when it starts; a second line, `saved`,
                                once the run has written checkpoint_last

Every checkpoint carries the id of the run that wrote it. Rotation and
averaging only ever touch the current run's step checkpoints, and a fresh run
refuses a directory that already holds checkpoints without a checkpoint_last
to resume from. The one exception is what an interrupted first save (a kill,
a full disk) leaves: checkpoint_best and at most one step checkpoint, all of
one step, carrying the id of a run_id file that does not say `saved`. A rerun
starts that run over, which writes those files again; checkpoints of a run
that did save checkpoint_last (a checkpoint_last since lost or deleted) are
refused, never overwritten.
"""

from __future__ import annotations

import dataclasses
import fcntl
import logging
import os
import uuid
from pathlib import Path
from typing import IO

from seq2seq.runs import checkpoint as ckpt
from seq2seq.errors import RunDirError

log = logging.getLogger("seq2seq.train")

RUN_ID = "run_id"
SAVED = "saved"  # the run_id file's second line once the run has written checkpoint_last


def new_run_id() -> str:
    return uuid.uuid4().hex[:16]


def step_number(path: Path) -> int | None:
    digits = path.stem.removeprefix("checkpoint_step")
    return int(digits) if path.name.startswith("checkpoint_step") and digits.isdigit() else None


class RunLayout:
    """Where each file of a run directory is, and which step checkpoints it holds: reading only."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    @property
    def last(self) -> Path:
        return self.path / ckpt.LAST

    @property
    def best(self) -> Path:
        return self.path / ckpt.BEST

    @property
    def average(self) -> Path:
        return self.path / "checkpoint_avg.pt"

    @property
    def config(self) -> Path:
        return self.path / "config.yaml"

    @property
    def tensorboard(self) -> Path:
        return self.path / "tb"

    @property
    def metrics(self) -> Path:
        return self.path / "metrics.jsonl"

    @property
    def run_id_file(self) -> Path:
        return self.path / RUN_ID

    def step(self, step: int) -> Path:
        return self.path / f"checkpoint_step{step}.pt"

    # Step checkpoints.

    def step_checkpoints(self, run_id: str | None = None) -> list[Path]:
        """`checkpoint_step{N}.pt` files, oldest first; with `run_id`, only that run's."""
        numbered = [(n, p) for p in self.path.glob("checkpoint_step*.pt") if (n := step_number(p)) is not None]
        paths = [p for _, p in sorted(numbered)]
        if run_id is None:
            return paths
        return [p for p in paths if ckpt.peek_run_id(p) == run_id]

    def current_run_id(self) -> str | None:
        """The id of the run checkpoint_last belongs to (None without one)."""
        return ckpt.peek_run_id(self.last) if self.last.exists() else None

    def latest(self, k: int, run_id: str | None = None) -> list[Path]:
        """The last `k` step checkpoints of a run (`run_id`, else checkpoint_last's), oldest first."""
        if k < 1:
            raise RunDirError(f"the number of checkpoints to average must be at least 1, got {k}")
        paths = self.step_checkpoints(run_id if run_id is not None else self.current_run_id())[-k:]
        if not paths:
            raise RunDirError(f"{self.path} has no checkpoint_step*.pt files of its run to average")
        return paths


class RunDirectory(RunLayout):
    """A run directory owned by a training process: its lock, its log file, the run's id, saving and pruning."""

    def __init__(self, path: str | Path) -> None:
        super().__init__(path)
        self._lock_file: IO[str] | None = None
        self._log_handler: logging.Handler | None = None
        self._saved_recorded = False  # whether this process has marked the run_id file `saved`

    # Owning it for a run.

    def acquire(self) -> None:
        """Create the directory and take its lock for this process; one line naming the holder if taken."""
        if self.path.exists() and not self.path.is_dir():
            raise RunDirError(f"train.run_dir {self.path} is a file, not a directory; choose another train.run_dir")
        self.path.mkdir(parents=True, exist_ok=True)
        lock = open(self.path / ".lock", "a+", encoding="utf-8")  # noqa: SIM115 (held until release())
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            holder = lock.read().strip() or "unknown"
            lock.close()
            raise RunDirError(
                f"{self.path} is in use by another training process (pid {holder}); "
                "wait for it to finish or choose another train.run_dir"
            ) from None
        lock.seek(0)
        lock.truncate()
        lock.write(f"{os.getpid()}\n")
        lock.flush()
        self._lock_file = lock
        for path in ckpt.remove_stale_temporaries(self.path):
            log.info("removed %s, left by a save that was interrupted", path.name)

    def attach_log(self) -> None:
        """Copy the `seq2seq` log, debug lines included, into train.log (appending across resumes)."""
        handler = logging.FileHandler(self.path / "train.log", encoding="utf-8")
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        handler.setLevel(logging.DEBUG)
        root = logging.getLogger("seq2seq")
        root.addHandler(handler)
        root.setLevel(logging.DEBUG)
        self._log_handler = handler

    def release(self) -> None:
        """Detach the log file and drop the lock (safe to call twice, or without acquire)."""
        if self._log_handler is not None:
            logging.getLogger("seq2seq").removeHandler(self._log_handler)
            self._log_handler.close()
            self._log_handler = None
        if self._lock_file is not None:
            fcntl.flock(self._lock_file, fcntl.LOCK_UN)
            self._lock_file.close()
            self._lock_file = None

    # Checkpoints.

    def resume_point(self, kind: str = ckpt.TRANSLATION) -> ckpt.Checkpoint | None:
        """checkpoint_last (of `kind`) to resume from; None for a fresh run, which must not find another run's
        checkpoints."""
        if self.last.exists():
            return ckpt.read(self.last, (kind,))
        found = sorted(p.name for p in self.path.glob("checkpoint*.pt"))
        if found and self._left_by_interrupted_first_save(found):
            log.info("%s holds %s but no %s: this run's first save was interrupted; starting the run over",
                     self.path, ", ".join(found), ckpt.LAST)  # fmt: skip
            return None
        if found:
            raise RunDirError(
                f"{self.path} holds checkpoints of an earlier run ({', '.join(found[:3])}"
                f"{', ...' if len(found) > 3 else ''}) but no {ckpt.LAST} to resume from; "
                "move them away or choose another train.run_dir"
            )
        return None

    def _left_by_interrupted_first_save(self, names: list[str]) -> bool:
        """Whether the checkpoint files `names` are all that the recorded run's first save wrote before it was
        interrupted: the run_id file does not say `saved`, and the files are checkpoint_best and at most one
        step checkpoint, of one step, each carrying the recorded id."""
        recorded, saved = self._read_run_id_file()
        steps = [step_number(self.path / name) for name in names if name != ckpt.BEST]
        if recorded is None or saved or len(steps) > 1 or None in steps:
            return False
        paths = [self.path / name for name in names]
        if any(ckpt.peek_run_id(path) != recorded for path in paths):
            return False
        return len({ckpt.peek_step(path) for path in paths} | set(steps)) == 1

    def recorded_run_id(self) -> str | None:
        """The id in the run_id file (None without a valid one)."""
        return self._read_run_id_file()[0]

    def _read_run_id_file(self) -> tuple[str | None, bool]:
        """(the recorded id or None, whether the file says the run has written checkpoint_last)."""
        try:
            lines = self.run_id_file.read_text(encoding="utf-8").split()
        except (OSError, UnicodeDecodeError):
            return None, False
        text = lines[0] if lines else ""
        valid = len(text) == len(new_run_id()) and all(c in "0123456789abcdef" for c in text)
        return (text if valid else None), lines[1:] == [SAVED]

    def _write_run_id_file(self, run_id: str, saved: bool) -> None:
        tmp = self.path / f".{RUN_ID}.{os.getpid()}.tmp"
        tmp.write_text(run_id + "\n" + (SAVED + "\n" if saved else ""), encoding="utf-8")
        tmp.rename(self.run_id_file)  # atomic: a reader sees the old file or the new one

    def fresh_run_id(self, record: bool = True) -> str:
        """The id of a run starting here without checkpoint_last: the recorded one (an earlier attempt of this
        run), else a new one. `record` (the main process) writes it to the run_id file first."""
        run_id = self.recorded_run_id() or new_run_id()
        if record:
            self._write_run_id_file(run_id, saved=False)
        return run_id

    def save(self, checkpoint: ckpt.Checkpoint, best: bool = False, keep_last: int = 0) -> None:
        """checkpoint_best (if `best`), a step checkpoint (if `keep_last`, pruning this run's older ones),
        then checkpoint_last, written last as the commit point of a resume; then, once per process, the run_id
        file says `saved`: from then on, these checkpoints without checkpoint_last are refused."""
        assert checkpoint.training is not None, "checkpoint_last carries the training state"
        weights = dataclasses.replace(checkpoint, training=None)
        if best:
            ckpt.save(self.best, weights)
        if keep_last:
            ckpt.save(self.step(checkpoint.training.progress.step), weights)
            self.prune(keep_last, checkpoint.run_id)
        ckpt.save(self.last, checkpoint)
        if not self._saved_recorded:
            self._write_run_id_file(checkpoint.run_id, saved=True)
            self._saved_recorded = True

    def prune(self, keep: int, run_id: str) -> None:
        """Delete all but the `keep` newest step checkpoints of this run."""
        paths = self.step_checkpoints(run_id)
        for old in paths[: max(len(paths) - keep, 0)]:
            old.unlink(missing_ok=True)

    def average_last(self, k: int, output: Path | None = None, run_id: str | None = None) -> list[Path]:
        """Average `latest(k, run_id)` into `output` (default: checkpoint_avg.pt); returns the files averaged."""
        paths = self.latest(k, run_id)
        ckpt.average_checkpoints(paths, output or self.average)
        return paths
