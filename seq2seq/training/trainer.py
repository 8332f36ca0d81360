"""The training loop: updates, validation, checkpoints, logging, resume.

A run directory holds everything: `config.yaml`, the SentencePiece model,
`train.log`, TensorBoard events under `tb/`, and checkpoints. Pointing
`train` at a run directory that has `checkpoint_last.pt` continues that run
exactly: weights, optimizer, schedule position, epoch, position within the
epoch, best score and early-stopping count all come back.

Exactness rests on two pure functions rather than on saved generator states:
the batches of an epoch depend only on (seed, epoch, rank), and the dropout
RNG is re-seeded before every forward pass from (seed, step, micro-batch),
as fairseq does. A resumed run therefore draws the same masks as an
uninterrupted one, and two DDP ranks draw what one process accumulating
their two batches would (see `micro_batch_seed`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import time
from pathlib import Path
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from seq2seq.checkpoint import (
    BEST,
    LAST,
    average_checkpoints,
    prune_step_checkpoints,
    read_checkpoint,
    remove_stale_temporaries,
    save_checkpoint,
    step_checkpoint_path,
    step_checkpoints,
)
from seq2seq.config import ExperimentConfig, save_config, to_dict
from seq2seq.data import Batch, EncodedCorpus, collate, encode_corpus, make_batches, read_parallel
from seq2seq.device import autocast, resolve_device, resolve_precision
from seq2seq.errors import TrainingError
from seq2seq.model import Seq2SeqTransformer, build_model, kernel_scope, training_kernel
from seq2seq.tokenizer import Sampling, Tokenizer, train_tokenizer
from seq2seq.training import distributed as dist
from seq2seq.training import monitor, validation
from seq2seq.training.loss import batch_loss
from seq2seq.training.optim import build_optimizer, lr_at
from seq2seq.training.signals import StopSignal

__all__ = ["TrainState", "Trainer", "TrainingError", "resolve_device", "step_checkpoints", "train"]

log = logging.getLogger("seq2seq.train")


@dataclasses.dataclass
class TrainState:
    """Everything about a run's progress that is not a tensor; saved in checkpoint_last."""

    step: int = 0  # optimizer updates applied
    epoch: int = 1  # the epoch in progress (1-based)
    batch_in_epoch: int = 0  # batches of this epoch already consumed (per rank)
    best: float | None = None  # best validation score so far
    best_metric: str = ""  # what `best` measures: bleu or loss
    bad_validations: int = 0  # validations since the best one
    validated_step: int = -1  # step of the last validation
    elapsed: float = 0.0  # training seconds of the processes before this one


def micro_batch_seed(seed: int, step: int, index: int) -> int:
    """Seed of the dropout RNG for micro-batch `index` (global over ranks) of update `step`."""
    return ((seed * 1_000_003 + step) * 10_007 + index) % (2**63)


class Trainer:
    """Trains the model an `ExperimentConfig` describes; `fit()` runs to the end.

    `tokenizer` skips training one (a resumed run always uses its checkpoint's).
    """

    def __init__(self, cfg: ExperimentConfig, tokenizer: Tokenizer | None = None) -> None:
        self.cfg = cfg
        self.run_dir = Path(cfg.train.run_dir)
        self.writer: Any = None
        self.device, self.precision = self._setup_device()
        self.attention_kernel = training_kernel(self.device)  # scripts/bench_train.py swaps it
        self.main = dist.is_main()
        self._log_file = self._prepare_run_dir()
        try:
            self._load(tokenizer)
        except BaseException:
            self.close()  # a failed start must not leave the log file attached or the process group up
            raise
        n_params = sum(p.numel() for p in self.model.parameters())
        log.info(
            "model: %.2fM parameters; device %s, %s, %d process(es)",
            n_params / 1e6,
            self.device,
            self.precision,
            dist.world_size(),
        )

    def _load(self, tokenizer: Tokenizer | None) -> None:
        """Tokenizer, data, model and optimizer, then the checkpoint's state if there is one."""
        resume = read_checkpoint(self.run_dir / LAST) if (self.run_dir / LAST).exists() else None
        self.tokenizer = Tokenizer.from_state(resume["tokenizer"]) if resume else tokenizer or self._train_tokenizer()
        self.train_data, self.valid_data, self.valid_text = self._load_data()
        self.model, self.optimizer, self.scaler = self._build()
        self.state = TrainState()
        self.updates_per_epoch = math.ceil(len(self.epoch_batches(1)) / self.cfg.train.update_freq)
        self._bad_steps = 0
        if resume is not None:
            self._restore(resume)
        self.ddp = self._wrap_ddp()
        if self.main:
            save_config(self.cfg, self.run_dir / "config.yaml")
            self.tokenizer.save(self.run_dir)
            self.writer = monitor.tensorboard(self.run_dir / "tb", self.state.step)
        self.meter = monitor.Meter()
        self.stop = StopSignal()
        self.start_time = time.monotonic()

    # Set-up.

    def _setup_device(self) -> tuple[torch.device, str]:
        """Device, precision, threads and (under torchrun) the process group."""
        t = self.cfg.train
        device = resolve_device(t.device)
        precision = resolve_precision(t.precision, device)
        if t.threads:
            torch.set_num_threads(t.threads)
        dist.setup(device)
        if device.type == "cuda":
            device = torch.device("cuda", torch.cuda.current_device())  # this rank's GPU under torchrun
        if t.deterministic:
            if device.type == "cuda":
                os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS refuses determinism without it
            torch.use_deterministic_algorithms(True)
        return device, precision

    def _prepare_run_dir(self) -> logging.Handler | None:
        """Create the run directory and the log file; quiet the other ranks' console logs."""
        if not self.main:
            logging.getLogger("seq2seq").setLevel(logging.WARNING)
            return None
        self.run_dir.mkdir(parents=True, exist_ok=True)
        handler = monitor.attach_log_file(self.run_dir / "train.log")
        for path in remove_stale_temporaries(self.run_dir):
            log.info("removed %s, left by a save that was interrupted", path.name)
        return handler

    def _train_tokenizer(self) -> Tokenizer:
        """Train SentencePiece on rank 0 and share it with the other ranks."""
        proto: list[Any] = [None]
        if self.main:
            d = self.cfg.data
            src, tgt = read_parallel(d.dir, d.train, d.src_lang, d.tgt_lang)
            log.info(
                "training a %s SentencePiece vocabulary of %d (%s)",
                d.spm_model_type,
                d.vocab_size,
                "shared" if d.shared_vocab else "per language",
            )
            proto[0] = train_tokenizer(src, tgt, d.vocab_size, d.shared_vocab, d.spm_model_type).state()
        if dist.world_size() > 1:
            torch.distributed.broadcast_object_list(proto, src=0)
        return Tokenizer.from_state(proto[0])

    def _load_data(self) -> tuple[EncodedCorpus, EncodedCorpus, tuple[list[str], list[str]]]:
        d = self.cfg.data
        train_src, train_tgt = read_parallel(d.dir, d.train, d.src_lang, d.tgt_lang)
        valid_src, valid_tgt = read_parallel(d.dir, d.valid, d.src_lang, d.tgt_lang)
        train = encode_corpus(self.tokenizer, train_src, train_tgt, d.max_len, f"{d.dir}/{d.train}")
        self._train_text = (train_src, train_tgt) if d.sampling_alpha else None  # re-encoded every epoch
        self._sampled: tuple[int, EncodedCorpus] | None = None  # (epoch, its encoding)
        valid_len = self.cfg.model.max_positions - 1
        valid = encode_corpus(self.tokenizer, valid_src, valid_tgt, valid_len, f"{d.dir}/{d.valid}")
        log.info("data: %d training pairs, %d validation pairs", len(train), len(valid))
        return train, valid, (valid_src, valid_tgt)

    def _build(self) -> tuple[Seq2SeqTransformer, torch.optim.Optimizer, torch.amp.GradScaler]:
        torch.manual_seed(self.cfg.train.seed)  # the same initial weights on every rank
        model = build_model(self.cfg.model, self.tokenizer.src_vocab_size, self.tokenizer.tgt_vocab_size)
        model.to(self.device)
        scaler = torch.amp.GradScaler(self.device.type, enabled=self.precision == "fp16")
        return model, build_optimizer(model, self.cfg.train), scaler

    def _wrap_ddp(self) -> DistributedDataParallel | None:
        if dist.world_size() == 1:
            return None
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        return DistributedDataParallel(self.model, device_ids=device_ids)

    def _restore(self, data: dict[str, Any]) -> None:
        state = data.get("train_state")
        if not state:
            raise TrainingError(f"{self.run_dir / LAST} has no training state to resume from")
        try:
            self.model.load_state_dict(data["model"])
        except RuntimeError as e:
            raise TrainingError(
                f"cannot resume {self.run_dir}: the config's model does not match its checkpoint "
                f"({str(e).splitlines()[0]})"
            ) from None
        self.optimizer.load_state_dict(state["optimizer"])
        self.scaler.load_state_dict(state["scaler"])
        known = {f.name for f in dataclasses.fields(TrainState)}
        self.state = TrainState(**{k: v for k, v in state["progress"].items() if k in known})
        for change in _changes(data["config"], to_dict(self.cfg)):
            log.info("config changed since the checkpoint: %s", change)
        log.info(
            "resuming %s at step %d (epoch %d, batch %d)",
            self.run_dir,
            self.state.step,
            self.state.epoch,
            self.state.batch_in_epoch,
        )

    # The loop.

    def fit(self) -> TrainState:
        """Train until a limit, early stopping or a signal; then validate and save (or just save)."""
        t = self.cfg.train
        try:
            with self.stop:
                log.info("training from step %d (epoch %d)", self.state.step, self.state.epoch)
                reason = self._should_stop()
                while not reason and self.state.epoch <= t.max_epochs:
                    reason = self._run_epoch()
                self._finish(reason or "max_epochs")
            if self.main and t.average_last > 0 and not self.stop.received:
                self._average()
        finally:
            self.close()
        return self.state

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
        monitor.detach_log_file(self._log_file)
        self._log_file = None
        dist.teardown()

    def _run_epoch(self) -> str:
        """Train on the rest of the current epoch; returns why training must stop, or ''."""
        t, s = self.cfg.train, self.state
        data, batches = self.epoch_data(s.epoch), self.epoch_batches(s.epoch)
        total, done = math.ceil(len(batches) / t.update_freq), math.ceil(s.batch_in_epoch / t.update_freq)
        with monitor.progress(total, done, f"epoch {s.epoch}", enabled=self.main) as bar:
            for start in range(s.batch_in_epoch, len(batches), t.update_freq):
                group = batches[start : start + t.update_freq]
                stats = self.train_step([collate(data, indices) for indices in group])
                s.batch_in_epoch = start + len(group)
                bar.update(1)
                if stats is not None:
                    self._after_step(stats, bar)
                reason = self._should_stop()
                if reason:
                    return reason
        s.epoch, s.batch_in_epoch = s.epoch + 1, 0
        if not t.valid_every and s.validated_step != s.step:
            self._validate_and_save()
            self.meter.restart_clock()
        return self._should_stop()

    def _after_step(self, stats: dict[str, float], bar: Any) -> None:
        """Log, validate or save on the steps the config asks for."""
        t, step = self.cfg.train, self.state.step
        self.meter.add(stats)
        if step % t.log_every == 0:
            bar.set_postfix_str(self.meter.log(self.writer, step), refresh=False)
        if t.valid_every and step % t.valid_every == 0:
            self._validate_and_save()
            self.meter.restart_clock()
        elif t.save_every and step % t.save_every == 0:
            self._save()

    def _finish(self, reason: str) -> None:
        s = self.state
        if reason == "signal":
            self._save()
            log.info("stopped by a signal at step %d; run the same command to resume", s.step)
            return
        if s.validated_step != s.step:
            self._validate_and_save()
        log.info("training finished at step %d, epoch %d (%s)", s.step, s.epoch, reason.replace("_", " "))

    def epoch_data(self, epoch: int) -> EncodedCorpus:
        """The training pairs of an epoch: one fixed encoding, or with `data.sampling_alpha`
        a fresh segmentation drawn from (seed, epoch), the same on every rank and after a resume."""
        if self._train_text is None:
            return self.train_data
        if self._sampled is None or self._sampled[0] != epoch:
            d = self.cfg.data
            sampling = Sampling(d.sampling_alpha, d.sampling_nbest, seed=self._epoch_seed(epoch) % 2**32)
            corpus = encode_corpus(self.tokenizer, *self._train_text, d.max_len, f"{d.dir}/{d.train}", sampling)
            self._sampled = (epoch, corpus)
        return self._sampled[1]

    def epoch_batches(self, epoch: int) -> list[list[int]]:
        """This rank's batches of an epoch: a pure function of (seed, epoch, rank)."""
        t = self.cfg.train
        batches = make_batches(self.epoch_data(epoch).lengths(), t.max_tokens, seed=self._epoch_seed(epoch))
        world = dist.world_size()
        return batches[: len(batches) // world * world][dist.rank() :: world]

    def _epoch_seed(self, epoch: int) -> int:
        return self.cfg.train.seed * 100_003 + epoch

    def _should_stop(self) -> str:
        """Why training must stop now ('' if it need not); every rank gets the same answer."""
        t, s = self.cfg.train, self.state
        signalled, out_of_time = dist.any_all(
            [self.stop.received is not None, bool(t.max_minutes) and self._elapsed() >= 60 * t.max_minutes],
            self.device,
        )
        if signalled:
            return "signal"
        if t.max_steps and s.step >= t.max_steps:
            return "max_steps"
        if out_of_time:
            return "max_minutes"
        if t.patience and s.bad_validations >= t.patience:
            return "patience"
        return ""

    def _elapsed(self) -> float:
        """Training seconds over all the processes of this run."""
        return self.state.elapsed + time.monotonic() - self.start_time

    # One update.

    def train_step(self, batches: list[Batch]) -> dict[str, float] | None:
        """One optimizer update over `batches` (update_freq of them); None if it was skipped as non-finite."""
        step = self.state.step + 1
        lr = lr_at(
            step,
            self.cfg.train.schedule,
            self.cfg.train.lr,
            self.cfg.train.warmup_steps,
            self._total_steps(),
            self.cfg.model.d_model,
        )
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        loss, nll, tokens = self.accumulate(batches, step)
        grad_norm = self._apply_gradients(math.isfinite(loss))
        if not math.isfinite(grad_norm):
            self._skipped(step, loss)
            return None
        self._bad_steps = 0
        self.state.step = step
        return {"loss": loss / tokens, "nll": nll / tokens, "tokens": tokens, "lr": lr, "grad_norm": grad_norm}

    def accumulate(self, batches: list[Batch], step: int) -> tuple[float, float, float]:
        """Forward and backward over the micro-batches, leaving in `.grad` the gradient of the
        summed loss divided by the target tokens of the whole update on all ranks.

        Returns the summed (loss, nll) and the number of target tokens, over all ranks.
        """
        t, world, rank = self.cfg.train, dist.world_size(), dist.rank()
        tokens = dist.sum_all([float(sum(b.n_tokens for b in batches))], self.device)[0]
        scale = world / tokens  # DDP averages gradients over ranks; undo that
        model = self.ddp or self.model
        loss_sum = torch.zeros((), device=self.device, dtype=torch.float64)
        nll_sum = torch.zeros_like(loss_sum)
        for i, batch in enumerate(batches):
            torch.manual_seed(micro_batch_seed(self.cfg.train.seed, step, i * world + rank))
            last = i == len(batches) - 1
            with contextlib.nullcontext() if self.ddp is None or last else self.ddp.no_sync():
                with autocast(self.precision, self.device), kernel_scope(self.attention_kernel):
                    loss, nll = batch_loss(model, batch.to(self.device), t.label_smoothing, t.rdrop_alpha)
                self.scaler.scale(loss * scale).backward()
            loss_sum += loss.detach()
            nll_sum += nll.detach()
        loss_total, nll_total = dist.sum_all([loss_sum.item(), nll_sum.item()], self.device)
        return loss_total, nll_total, tokens

    def _apply_gradients(self, loss_finite: bool) -> float:
        """Unscale, clip and apply the gradients; returns their norm, or nan if the update was skipped."""
        self.scaler.unscale_(self.optimizer)
        max_norm = self.cfg.train.clip_norm or math.inf
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm))
        applied = loss_finite and math.isfinite(grad_norm)
        if applied:
            self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm if applied else math.nan

    def _skipped(self, step: int, loss: float) -> None:
        """Warn about a skipped update; give up when they keep coming."""
        self._bad_steps += 1
        what = (
            "gradient overflow (fp16 loss scale lowered)" if self.precision == "fp16" else f"non-finite loss ({loss})"
        )
        log.warning("update %d skipped: %s or gradients, %d in a row", step, what, self._bad_steps)
        if self._bad_steps >= self.cfg.train.max_bad_steps:
            raise TrainingError(
                f"training diverged: {self._bad_steps} updates in a row had a non-finite loss or gradients "
                f"(at step {step}); lower train.lr, raise train.warmup_steps or clip with train.clip_norm"
            )

    def _total_steps(self) -> int:
        """Length of the whole run in updates, for the cosine schedule."""
        t = self.cfg.train
        return t.max_steps or self.updates_per_epoch * t.max_epochs

    # Validation and checkpoints.

    def _validate_and_save(self) -> None:
        improved = self._validate()
        self._save(improved=improved, keep=True)

    def _validate(self) -> bool:
        """Validate on rank 0, update the early-stopping state on every rank; True if this is the best yet."""
        improved = self._record(self.validate()) if self.main else False
        self.state.validated_step = self.state.step
        if dist.world_size() > 1:
            shared = [self.state.best, self.state.best_metric, self.state.bad_validations, improved]
            torch.distributed.broadcast_object_list(shared, src=0)
            self.state.best, self.state.best_metric, self.state.bad_validations, improved = shared
        return improved

    def _record(self, scores: dict[str, float]) -> bool:
        """Compare with the best score so far by train.best_metric (loss if BLEU is off)."""
        s = self.state
        key = "bleu" if self.cfg.train.best_metric == "bleu" and "bleu" in scores else "loss"
        value = scores[key]
        if s.best_metric != key:  # a new run, or the metric changed on resume
            s.best, s.best_metric = None, key
        improved = s.best is None or (value > s.best if key == "bleu" else value < s.best)
        if improved:
            s.best, s.bad_validations = value, 0
        else:
            s.bad_validations += 1
        log.info(
            "step %d: valid %s (best %s %.3f%s)",
            s.step,
            ", ".join(f"{k} {v:.3f}" for k, v in scores.items()),
            key,
            s.best,
            f", {s.bad_validations} without improvement" if s.bad_validations else "",
        )
        return improved

    def validate(self) -> dict[str, float]:
        """Validation loss, perplexity and (if train.valid_bleu) BLEU; written to TensorBoard."""
        t, step = self.cfg.train, self.state.step
        scores = validation.loss_scores(
            self.model, self.valid_data, t.max_tokens, t.label_smoothing, self.precision, self.device
        )
        if t.valid_bleu:
            sources, references = self.valid_text
            hypotheses = validation.translations(self.model, self.tokenizer, self.cfg.decode, sources, self.device)
            scores["bleu"] = validation.bleu(hypotheses, references)
            if self.writer is not None:
                self.writer.add_text("valid/examples", validation.examples(sources, hypotheses, references), step)
        if self.writer is not None:
            for name, value in scores.items():
                self.writer.add_scalar(f"valid/{name}", value, step)
            self.writer.add_scalar("valid/minutes", self._elapsed() / 60, step)
        return scores

    def _save(self, improved: bool = False, keep: bool = False) -> None:
        """Write checkpoints on rank 0; checkpoint_last last, as the commit point of a resume."""
        if not self.main:
            return
        if improved:
            save_checkpoint(self.run_dir / BEST, self.model, self.tokenizer, self.cfg)
        if keep and self.cfg.train.keep_last:
            save_checkpoint(step_checkpoint_path(self.run_dir, self.state.step), self.model, self.tokenizer, self.cfg)
            prune_step_checkpoints(self.run_dir, self.cfg.train.keep_last)
        progress = dataclasses.asdict(self.state)
        progress["elapsed"] = self._elapsed()
        train_state = {
            "progress": progress,
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict(),
        }
        save_checkpoint(self.run_dir / LAST, self.model, self.tokenizer, self.cfg, train_state)

    def _average(self) -> None:
        paths = step_checkpoints(self.run_dir)[-self.cfg.train.average_last :]
        if paths:
            average_checkpoints(paths, self.run_dir / "checkpoint_avg.pt")
            log.info("averaged %d checkpoints into %s", len(paths), self.run_dir / "checkpoint_avg.pt")


def _changes(old: dict[str, Any], new: dict[str, Any], prefix: str = "") -> list[str]:
    """`key: old -> new` for each setting that differs between two config dicts."""
    out = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _changes(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key}: {a} -> {b}")
    return out


def train(cfg: ExperimentConfig) -> TrainState:
    return Trainer(cfg).fit()
