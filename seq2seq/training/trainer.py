"""The training loop: an orchestration of the pieces in this package.

    RunDirectory (seq2seq.run_dir)   lock, log file, checkpoint files of this run
    EpochSource  (epochs.py)         which pairs and batches make epoch e
    UpdateStep   (update.py)         one optimizer update over a group of batches
    Validator    (validation.py)     validation loss and BLEU
    StopPolicy   (stopping.py)       when to stop, which validation is the best
    Checkpoint   (seq2seq.checkpoint) what is saved and resumed

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

from seq2seq.checkpoint import Checkpoint, Progress, TrainingState
from seq2seq.config import ExperimentConfig, save_config
from seq2seq.interrupt import Interrupts
from seq2seq.run_dir import RunDirectory
from seq2seq.tokenizer import Tokenizer
from seq2seq.training import distributed as dist
from seq2seq.training import finetune, monitor
from seq2seq.training.budget import plan_warnings
from seq2seq.training.optim import lr_schedule
from seq2seq.training.setup import (
    build_training_model,
    build_validator,
    check_resumable,
    prepared_corpus,
    restore,
    setup_device,
    training_data,
    wrap_ddp,
)
from seq2seq.training.stopping import StopPolicy
from seq2seq.training.update import Launched, UpdateStats, UpdateStep

__all__ = ["Trainer", "train"]

log = logging.getLogger("seq2seq.train")


class Trainer:
    """Trains the model an `ExperimentConfig` describes; `fit()` runs to the end.

    `tokenizer` skips training one (a resumed run always uses its checkpoint's, a fine-tuning run its parent's).
    """

    def __init__(self, cfg: ExperimentConfig, tokenizer: Tokenizer | None = None) -> None:
        self.cfg = cfg
        self.run = RunDirectory(cfg.train.run_dir)
        self.writer: Any = None
        try:
            self._build(tokenizer)
        except BaseException:
            self.close()  # a failed start must not keep the lock, the log file or the process group
            raise

    def _build(self, tokenizer: Tokenizer | None) -> None:
        cfg = self.cfg
        self.device, precision = setup_device(cfg.train)  # joins the process group under torchrun
        self.main = dist.is_main()
        resume, changes, parent = self._claim_run_dir()
        self.run_id = resume.run_id if resume else self.run.fresh_run_id(record=self.main)
        corpus = prepared_corpus(cfg, resume.tokenizer if resume else parent.tokenizer if parent else tokenizer)
        self.tokenizer = corpus.tokenizer
        self.epochs = training_data(cfg, corpus)
        self.model, optimizer, scaler = build_training_model(cfg, self.tokenizer, self.device, precision)
        if parent:
            finetune.initialize(self.model, parent, cfg.train.init_from)
        self.validator = build_validator(cfg, self.tokenizer, self.model, precision, self.device)
        self.progress = restore(resume, self.model, optimizer, scaler, self.run, changes) if resume else Progress()
        ddp = wrap_ddp(self.model, self.device)
        self.update = UpdateStep.from_config(cfg.train, self.model, optimizer, scaler, self.device, precision, ddp)
        self.policy = StopPolicy.from_config(cfg.train)
        per_epoch = math.ceil(len(self.epochs.batches(1)) / cfg.train.update_freq)
        self.lr = lr_schedule(cfg, per_epoch)
        if self.main:
            for warning in plan_warnings(cfg.train, len(corpus), per_epoch):
                log.warning(warning)
            save_config(cfg, self.run.config)
            self.tokenizer.save(self.run.path)
            self.writer = monitor.tensorboard(self.run.tensorboard, self.progress.step)
        self.metrics = monitor.MetricsFile(self.run.metrics if self.main else None)
        self.meter, self.stop, self.start_time = monitor.Meter(), Interrupts(library_checks=False), time.monotonic()
        self.validation_seconds = 0.0  # this session's, for its share of the wall time
        params = sum(p.numel() for p in self.model.parameters())
        self.metrics.write("start", self.progress.step, self.progress.epoch, parameters=params)
        log.info(
            "model: %.2fM parameters; %s, %s, %d process(es)", params / 1e6, self.device, precision, dist.world_size()
        )

    def _claim_run_dir(self) -> tuple[Checkpoint | None, list[str], Checkpoint | None]:
        """Lock the run directory (rank 0), check what is there (or the parent of a fine-tuning run), then log
        into it: a refused start writes nothing. Returns the checkpoint to resume, its changes and the parent."""
        if self.main:
            self.run.acquire()
        else:
            logging.getLogger("seq2seq").setLevel(logging.WARNING)
        resume = self.run.resume_point()
        changes = check_resumable(resume, self.cfg, self.run) if resume else []
        parent = None if resume else finetune.read_parent(self.cfg, self.run)
        if self.main:
            self.run.attach_log()
        if resume:
            finetune.note_resume(self.cfg, self.run)
        return resume, changes, parent

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
            if self.main and self.cfg.train.average_last > 0 and not self.stop.received:
                paths = self.run.average_last(self.cfg.train.average_last, run_id=self.run_id)
                log.info("averaged %d checkpoints into %s", len(paths), self.run.average)
                if len(paths) < self.cfg.train.average_last:
                    log.warning("train.average_last=%d, but this run kept %d step checkpoints (train.keep_last=%d)",
                                self.cfg.train.average_last, len(paths), self.cfg.train.keep_last)  # fmt: skip
        finally:
            self.close()
        return self.progress

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
        self.run.release()
        dist.teardown()

    def _run_epoch(self) -> str:
        """Train on the rest of the current epoch; returns why training must stop, or ''.

        Update k is read back only once the batches of update k + 1 are fetched and on their way to the
        device: the host prepares data while the device computes, and still knows whether update k counted
        before it numbers the next one."""
        freq, p = self.cfg.train.update_freq, self.progress
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
                launched = self.update.launch(group, p.step + 1, self.lr(p.step + 1)), start + len(group)
            if launched is not None:
                reason = self._finish_update(*launched, bar)
                if reason:
                    return reason
        p.epoch, p.batch_in_epoch = p.epoch + 1, 0
        if not self.cfg.train.valid_every and p.validated_step != p.step:
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
        t, step = self.cfg.train, self.progress.step
        self.meter.add(stats)
        if step % t.log_every == 0:
            bar.set_postfix_str(self.meter.log(self.writer, step, self.metrics, self.progress.epoch), refresh=False)
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
        self.metrics.write("finish", p.step, p.epoch, reason=reason)
        log.info("training finished at step %d, epoch %d (%s)", p.step, p.epoch, reason.replace("_", " "))

    def should_stop(self) -> str:
        """Why training must stop now ('' if it need not); every rank gets the same answer."""
        signalled, out_of_time = dist.any_all(
            [self.stop.received is not None, self.policy.out_of_time(self.elapsed())], self.device
        )
        return self.policy.reason(self.progress, signalled, out_of_time)

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
            monitor.log_validation(self.writer, p.step, scores, minutes, self.validator.examples)
            self.metrics.write("valid", p.step, p.epoch, **scores, minutes=minutes, seconds=seconds, share=share)
            improved = self.policy.record(p, scores)
        p.validated_step = p.step
        shared = dist.broadcast_from_main([p.best, p.best_metric, p.bad_validations, improved])
        p.best, p.best_metric, p.bad_validations, improved = shared
        return bool(improved)

    def _save(self, improved: bool = False, keep: bool = False) -> None:
        """Write checkpoints on rank 0; checkpoint_last last, as the commit point of a resume."""
        if not self.main:
            return
        progress = dataclasses.replace(self.progress, elapsed=self.elapsed())
        state = TrainingState(progress, self.update.optimizer.state_dict(), self.update.scaler.state_dict())
        checkpoint = Checkpoint(
            self.cfg, self.tokenizer, self.model.state_dict(), self.run_id, state, step=self.progress.step
        )
        self.run.save(checkpoint, best=improved, keep_last=self.cfg.train.keep_last if keep else 0)


def train(cfg: ExperimentConfig) -> Progress:
    return Trainer(cfg).fit()
