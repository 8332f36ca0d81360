"""The training loop over the parts of a run (assembly.py assembles them from a config).

    RunDirectory (seq2seq.runs.run_dir)   lock, log file, checkpoint files of this run
    EpochSource  (epochs.py)         which pairs and batches make epoch e
    UpdateStep   (update.py)         one optimizer update over a group of batches
    Validator    (validation.py)     validation loss and BLEU
    StopPolicy   (stopping.py)       when to stop, which validation is the best
    Saver        (saving.py)         the checkpoints written, kept and averaged
    Sinks        (monitor.py)        TensorBoard and metrics.jsonl

Pointing `train` at a run directory that has `checkpoint_last.pt` continues
that run exactly: weights, optimizer, schedule position, epoch, position
within the epoch, best score and early-stopping count all come back. The
batches of an epoch are a pure function of (data, seed, epoch, rank) and the
dropout RNG is re-seeded from (seed, step, micro-batch) before every forward
pass, so a resumed run computes what an uninterrupted one would.

With `train.init_from`, a run without a checkpoint of its own starts from another
run's weights and tokenizer, with everything else fresh (finetune.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import math
import time
from typing import Any

from seq2seq.config import ExperimentConfig
from seq2seq.interrupt import Interrupts
from seq2seq.runs.checkpoint import Progress
from seq2seq.training import distributed as dist
from seq2seq.training import monitor
from seq2seq.training.assembly import TrainingRun, assemble
from seq2seq.training.update import Launched, UpdateStats

__all__ = ["Trainer", "train"]

log = logging.getLogger("seq2seq.train")


class Trainer:
    """Trains the parts of a run (`assembly.assemble`); `fit()` runs to the end and closes them."""

    def __init__(self, parts: TrainingRun) -> None:
        self.parts = parts
        self.run, self.main, self.device, self.loop = parts.run, parts.main, parts.device, parts.loop
        self.tokenizer, self.epochs, self.model, self.update = parts.tokenizer, parts.epochs, parts.model, parts.update
        self.lr, self.policy, self.validator, self.progress = parts.lr, parts.policy, parts.validator, parts.progress
        self.saver, self.sinks, self.run_id = parts.saver, parts.sinks, parts.run_id
        self.meter, self.stop, self.start_time = monitor.Meter(), Interrupts(library_checks=False), time.monotonic()
        self.validation_seconds = 0.0  # this session's, for its share of the wall time
        self.run_seconds = self.progress.elapsed  # training seconds at the last stop check, the same on every rank

    # The loop.

    def fit(self) -> Progress:
        """Train until a limit, early stopping or a signal; then validate and save (or just save)."""
        try:
            with self.stop:
                log.info("training from step %d (epoch %d)", self.progress.step, self.progress.epoch)
                reason = self.should_stop()
                while not reason:
                    reason = self._run_epoch()
                self._finish(reason)
            if not self.stop.received:
                self.saver.average()
        finally:
            self.close()
        return self.progress

    def close(self) -> None:
        self.parts.close()

    def _run_epoch(self) -> str:
        """Train on the rest of the current epoch; returns why training must stop, or ''.

        Update k is read back only once the batches of update k + 1 are fetched and on their way to the
        device: the host prepares data while the device computes, and still knows whether update k counted
        before it numbers the next one."""
        freq, p = self.loop.update_freq, self.progress
        n = len(self.epochs.batches(p.epoch))
        total, done = math.ceil(n / freq), math.ceil(p.batch_in_epoch / freq)
        loader = self.epochs.loader(p.epoch, p.batch_in_epoch, pin_memory=self.device.type == "cuda")
        with monitor.progress(total, done, f"epoch {p.epoch}", enabled=self.main) as bar, contextlib.closing(loader):
            launched: tuple[Launched, int] | None = None  # the update on the device, and the batch after its own
            for start in range(p.batch_in_epoch, n, freq):
                group = [batch.to(self.device) for batch in itertools.islice(loader, freq)]
                if launched is not None:
                    reason = self._finish_update(*launched, bar)
                    if reason:
                        return reason
                lr = self.lr(p.step + 1, self.run_seconds)
                launched = self.update.launch(group, p.step + 1, lr), start + len(group)
            if launched is not None:
                reason = self._finish_update(*launched, bar)
                if reason:
                    return reason
        p.epoch, p.batch_in_epoch = p.epoch + 1, 0
        if not self.loop.valid_every and p.validated_step != p.step:
            self._validate_and_save()
        return self.should_stop()

    def _finish_update(self, launched: Launched, end: int, bar: Any) -> str:
        """Read a launched update back and account for it; returns why training must stop, or ''."""
        stats = self.update.finish(launched)
        p = self.progress
        p.batch_in_epoch = end
        bar.update(1)
        if stats is not None:
            p.step += 1
            self._after_update(stats, bar)
        return self.should_stop()

    def _after_update(self, stats: UpdateStats, bar: Any) -> None:
        """Log, validate or save on the steps the config asks for."""
        t, step = self.loop, self.progress.step
        self.meter.add(stats)
        if step % t.log_every == 0:
            bar.set_postfix_str(self.meter.log(self.sinks, step, self.sinks, self.progress.epoch), refresh=False)
        if t.valid_every and step % t.valid_every == 0:
            self._validate_and_save()
        elif t.save_every and step % t.save_every == 0:
            self._save(keep=True)

    def _finish(self, reason: str) -> None:
        p = self.progress
        if reason == "signal":
            by = self.stop.received.name if self.stop.received else "a signal to another process"
            log.warning("%s: saving step %d and stopping (a second signal quits without saving)", by, p.step)
            self._save()
            log.info("stopped by a signal at step %d; run the same command to resume", p.step)
            return
        if p.validated_step != p.step:
            self._validate_and_save()
        self.sinks.write("finish", p.step, p.epoch, reason=reason)
        partial = f" and {p.batch_in_epoch} batches of epoch {p.epoch}" if p.batch_in_epoch else ""
        done = f"{p.epochs_done} epoch{'' if p.epochs_done == 1 else 's'}{partial}"
        log.info("training finished at step %d after %s (%s)", p.step, done, reason.replace("_", " "))

    def should_stop(self) -> str:
        """Why training must stop now ('' if it need not); every rank gets the same answer."""
        signals, seconds = dist.sum_all([float(self.stop.received is not None), self.elapsed()], self.device)
        self.run_seconds = seconds / dist.world_size()  # the ranks' mean: one learning rate for all
        return self.policy.reason(self.progress, signals > 0, self.policy.out_of_time(self.run_seconds))

    def elapsed(self) -> float:
        """Training seconds over all the processes of this run."""
        return self.progress.elapsed + time.monotonic() - self.start_time

    # Validation and checkpoints.

    def _validate_and_save(self) -> None:
        improved = self._validate()
        self._save(improved=improved, keep=True)
        self.meter.restart_clock()  # tokens/s counts training time only

    def _validate(self) -> bool:
        """Validate on rank 0, update the early-stopping state on every rank; True if this is the best yet."""
        p, improved = self.progress, False
        if self.main:
            began = time.monotonic()
            scores = self.validator()
            seconds = time.monotonic() - began
            self.validation_seconds += seconds
            minutes = self.elapsed() / 60
            share = self.validation_seconds / max(time.monotonic() - self.start_time, 1e-9)
            log.info("validation took %.1f s; %.0f%% of this session's training time so far", seconds, 100 * share)
            monitor.log_validation(self.sinks, p.step, scores, minutes, self.validator.examples)
            self.sinks.write("valid", p.step, p.epoch, **scores, minutes=minutes, seconds=seconds, share=share)
            improved = self.policy.record(p, scores)
        p.validated_step = p.step
        shared = dist.broadcast_from_main([p.best, p.best_metric, p.bad_validations, improved])
        p.best, p.best_metric, p.bad_validations, improved = shared
        return bool(improved)

    def _save(self, improved: bool = False, keep: bool = False) -> None:
        """Write checkpoints on rank 0; checkpoint_last last, as the commit point of a resume."""
        progress = dataclasses.replace(self.progress, elapsed=self.elapsed())
        u = self.update
        self.saver.save(self.model, u.optimizer, u.scaler, progress, improved=improved, keep=keep)


def train(cfg: ExperimentConfig) -> Progress:
    """Train (or resume) the run `cfg` describes, to its end."""
    return Trainer(assemble(cfg)).fit()
