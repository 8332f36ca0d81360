"""The training loop: updates, validation, checkpoints, logging, resume.

A run directory holds everything: `config.yaml`, the SentencePiece model,
`train.log`, TensorBoard events under `tb/`, and checkpoints. Pointing
`train` at a run directory that has `checkpoint_last.pt` continues that run
exactly: model, optimizer, schedule position, epoch, position within the
epoch, RNG state, best score and early-stopping count all come back.
"""

from __future__ import annotations

import contextlib
import logging
import math
import signal
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from seq2seq import metrics
from seq2seq.checkpoint import average_checkpoints, read_checkpoint, save_checkpoint
from seq2seq.config import ExperimentConfig, UserError, save_config
from seq2seq.data import Batch, EncodedCorpus, collate, encode_corpus, make_batches, read_parallel
from seq2seq.model import Seq2SeqTransformer, build_model
from seq2seq.tokenizer import Tokenizer, train_tokenizer
from seq2seq.training import distributed as dist
from seq2seq.training.loss import label_smoothed_loss
from seq2seq.training.optim import build_optimizer, lr_at
from seq2seq.translate import Translator

log = logging.getLogger("seq2seq.train")

LAST, BEST = "checkpoint_last.pt", "checkpoint_best.pt"


class TrainingError(UserError):
    """A training run cannot go on; described in one line for the user."""


@dataclass
class TrainState:
    step: int = 0  # optimizer updates done
    epoch: int = 1  # the epoch in progress (1-based)
    batch_in_epoch: int = 0  # batches of this epoch already consumed (per rank)
    best: float | None = None  # best validation score by train.best_metric
    bad_validations: int = 0  # validations since the best one
    elapsed: float = 0.0  # training seconds spent before this process started
    validated_step: int = -1  # step of the last validation


def resolve_device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise TrainingError("train.device=cuda but CUDA is not available on this machine")
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_precision(precision: str, device: torch.device) -> str:
    """`auto`: bf16 on GPUs that support it, else fp16; fp32 on CPU (see scripts/bench_train.py)."""
    if precision == "fp16" and device.type != "cuda":
        raise TrainingError("train.precision=fp16 needs CUDA; use bf16 or fp32 on CPU")
    if precision != "auto":
        return precision
    if device.type == "cuda":
        return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    return "fp32"


def autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager[Any]:
    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device.type, dtype=dtype)


class StopSignal:
    """Turns SIGINT/SIGTERM into a flag checked between updates, so a checkpoint can be saved."""

    def __init__(self) -> None:
        self.received: str | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignal:
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, frame: object) -> None:
        self.received = signal.Signals(signum).name


class Trainer:
    """Trains the model an `ExperimentConfig` describes; `fit()` runs to the end."""

    def __init__(self, cfg: ExperimentConfig) -> None:
        self.cfg = cfg
        self.run_dir = Path(cfg.train.run_dir)
        self.device = resolve_device(cfg.train.device)
        self.precision = resolve_precision(cfg.train.precision, self.device)
        if cfg.train.threads:
            torch.set_num_threads(cfg.train.threads)
        dist.setup(self.device)
        self.main = dist.is_main()
        self.state = TrainState()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if self.main:
            _log_to_file(self.run_dir / "train.log")
        resume = read_checkpoint(self.run_dir / LAST) if (self.run_dir / LAST).exists() else None
        self.tokenizer = self._tokenizer(resume)
        self.train_data, self.valid_data, self.valid_text = self._load_data()
        torch.manual_seed(cfg.train.seed + 1000 * dist.rank())
        if cfg.train.deterministic:
            torch.use_deterministic_algorithms(True)
        self.model = build_model(cfg.model, self.tokenizer.src_vocab_size, self.tokenizer.tgt_vocab_size)
        self.model.to(self.device)
        self.optimizer = build_optimizer(self.model, cfg.train)
        self.updates_per_epoch = math.ceil(len(self._epoch_batches(1)) / cfg.train.update_freq)
        self._bad_steps = 0
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.precision == "fp16")
        if resume is not None:
            self._restore(resume)
        self.ddp = DistributedDataParallel(self.model) if dist.world_size() > 1 else None
        if self.main:
            save_config(cfg, self.run_dir / "config.yaml")
            self.tokenizer.save(self.run_dir)
        self.writer = self._tensorboard()
        n_params = sum(p.numel() for p in self.model.parameters())
        log.info("model: %.2fM parameters; device %s, %s, %d process(es)", n_params / 1e6, self.device,
                 self.precision, dist.world_size())  # fmt: skip

    # Set-up.

    def _tokenizer(self, resume: dict[str, Any] | None) -> Tokenizer:
        if resume is not None:
            return Tokenizer.from_state(resume["tokenizer"])
        proto: list[Any] = [None]
        if self.main:
            d = self.cfg.data
            src, tgt = read_parallel(d.dir, d.train, d.src_lang, d.tgt_lang)
            log.info("training a %s SentencePiece vocabulary of %d (%s)", d.spm_model_type, d.vocab_size,
                     "shared" if d.shared_vocab else "per language")  # fmt: skip
            proto[0] = train_tokenizer(src, tgt, d.vocab_size, d.shared_vocab, d.spm_model_type).state()
        if dist.world_size() > 1:
            torch.distributed.broadcast_object_list(proto, src=0)
        return Tokenizer.from_state(proto[0])

    def _load_data(self) -> tuple[EncodedCorpus, EncodedCorpus, tuple[list[str], list[str]]]:
        d = self.cfg.data
        train_src, train_tgt = read_parallel(d.dir, d.train, d.src_lang, d.tgt_lang)
        valid_src, valid_tgt = read_parallel(d.dir, d.valid, d.src_lang, d.tgt_lang)
        train = encode_corpus(self.tokenizer, train_src, train_tgt, d.max_len, f"{d.dir}/{d.train}")
        valid = encode_corpus(self.tokenizer, valid_src, valid_tgt, self.cfg.model.max_positions - 1, f"{d.dir}/{d.valid}")
        log.info("data: %d training pairs, %d validation pairs", len(train), len(valid))
        return train, valid, (valid_src, valid_tgt)

    def _tensorboard(self) -> Any:
        if not self.main:
            return None
        from torch.utils.tensorboard import SummaryWriter

        return SummaryWriter(str(self.run_dir / "tb"), purge_step=self.state.step + 1 if self.state.step else None)

    def _restore(self, data: dict[str, Any]) -> None:
        state = data.get("train_state")
        if not state:
            raise TrainingError(f"{self.run_dir / LAST} has no training state to resume from")
        try:
            self.model.load_state_dict(data["model"])
        except RuntimeError as e:
            raise TrainingError(f"cannot resume {self.run_dir}: the config's model does not match its checkpoint "
                                f"({str(e).splitlines()[0]})") from None  # fmt: skip
        self.optimizer.load_state_dict(state["optimizer"])
        self.scaler.load_state_dict(state["scaler"])
        self.state = TrainState(**state["progress"])
        if dist.is_main():
            torch.set_rng_state(state["rng_cpu"])
            if self.device.type == "cuda" and state.get("rng_cuda") is not None:
                torch.cuda.set_rng_state(state["rng_cuda"])
        else:
            torch.manual_seed(self.cfg.train.seed + 1000 * dist.rank() + self.state.step)
        log.info("resuming %s at step %d (epoch %d, batch %d)", self.run_dir, self.state.step, self.state.epoch,
                 self.state.batch_in_epoch)  # fmt: skip

    # The loop.

    def fit(self) -> TrainState:
        t = self.cfg.train
        self.start_time = time.monotonic()
        try:
            with StopSignal() as stop:
                self.stop = stop
                while self.state.epoch <= t.max_epochs and not self._should_stop():
                    self._run_epoch()
                if not self._interrupted() and self.state.validated_step != self.state.step:
                    self._validate_and_save()
                elif self._interrupted():
                    self._save(validated=False)
                    log.info("stopped by %s at step %d; run the same command to resume", stop.received,
                             self.state.step)  # fmt: skip
            if self.main and t.average_last > 0 and not self._interrupted():
                self._average()
        finally:
            if self.writer is not None:
                self.writer.close()
            dist.teardown()
        return self.state

    def _run_epoch(self) -> None:
        t, s = self.cfg.train, self.state
        batches = self._epoch_batches(s.epoch)
        updates = [batches[i : i + t.update_freq] for i in range(0, len(batches), t.update_freq)]
        done = s.batch_in_epoch // t.update_freq
        bar = _progress(len(updates), done, s.epoch, enabled=self.main)
        meter = _Meter()
        for group in updates[done:]:
            stats = self._update([collate(self.train_data, b) for b in group])
            s.batch_in_epoch += len(group)
            meter.add(stats)
            bar.update(1)
            if s.step % t.log_every == 0:
                bar.set_postfix_str(meter.log(self.writer, s.step), refresh=False)
            if t.valid_every and s.step % t.valid_every == 0:
                self._validate_and_save()
            if self._should_stop():
                bar.close()
                return
        bar.close()
        s.epoch, s.batch_in_epoch = s.epoch + 1, 0
        if not t.valid_every:
            self._validate_and_save()

    def _epoch_batches(self, epoch: int) -> list[list[int]]:
        """This rank's batches of an epoch: a pure function of (seed, epoch, rank)."""
        t = self.cfg.train
        batches = make_batches(self.train_data.lengths(), t.max_tokens, seed=t.seed * 100_003 + epoch)
        world = dist.world_size()
        return batches[: len(batches) // world * world][dist.rank() :: world]

    def _update(self, batches: list[Batch]) -> dict[str, float]:
        """One optimizer step over `update_freq` batches, normalised per target token of the whole update."""
        self.state.step += 1
        lr = lr_at(self.state.step, self.cfg.train.schedule, self.cfg.train.lr, self.cfg.train.warmup_steps,
                   self._total_steps(), self.cfg.model.d_model)  # fmt: skip
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        n_tokens = dist.sum_all([float(sum(b.n_tokens for b in batches))], self.device)[0]
        scale = dist.world_size() / n_tokens  # DDP averages gradients over ranks; undo that
        loss_sum = nll_sum = 0.0
        model = self.ddp or self.model
        for i, batch in enumerate(batches):
            batch = batch.to(self.device)
            sync = self.ddp is None or i == len(batches) - 1
            with contextlib.nullcontext() if sync else self.ddp.no_sync(), autocast(self.precision, self.device):
                logits = model(batch.src, batch.src_pad_mask, batch.tgt_in)
                loss, nll = label_smoothed_loss(logits, batch.tgt_out, self.cfg.train.label_smoothing)
            self.scaler.scale(loss * scale).backward()
            loss_sum, nll_sum = loss_sum + loss.item(), nll_sum + nll.item()
        grad_norm = self._step()
        loss_sum, nll_sum = dist.sum_all([loss_sum, nll_sum], self.device)
        return {"loss": loss_sum / n_tokens, "nll": nll_sum / n_tokens, "tokens": n_tokens, "lr": lr,
                "grad_norm": grad_norm}  # fmt: skip

    def _step(self) -> float:
        """Clip, check and apply the gradients; skip the update if they are not finite."""
        self.scaler.unscale_(self.optimizer)
        max_norm = self.cfg.train.clip_norm or math.inf
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm))
        if math.isfinite(grad_norm):
            self.scaler.step(self.optimizer)
            self._bad_steps = 0
        else:
            self._bad_steps += 1
            log.warning("step %d: non-finite loss or gradients; update skipped", self.state.step)
            if self._bad_steps >= self.cfg.train.max_bad_steps and self.precision != "fp16":
                raise TrainingError(f"{self._bad_steps} consecutive non-finite updates at step {self.state.step}; "
                                    "lower train.lr or check the data")  # fmt: skip
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm

    def _total_steps(self) -> int:
        """Length of the whole run in updates, for the cosine schedule."""
        t = self.cfg.train
        return t.max_steps or self.updates_per_epoch * t.max_epochs

    def _elapsed_minutes(self) -> float:
        return (self.state.elapsed + time.monotonic() - self.start_time) / 60

    def _interrupted(self) -> bool:
        return dist.broadcast_flag(self.stop.received is not None, self.device)

    def _should_stop(self) -> bool:
        t, s = self.cfg.train, self.state
        if self._interrupted():
            return True
        if t.max_steps and s.step >= t.max_steps:
            return True
        if t.max_minutes and self._elapsed_minutes() >= t.max_minutes:
            return True
        return bool(t.patience) and s.bad_validations >= t.patience

    # Validation and checkpoints.

    def _validate_and_save(self) -> None:
        scores = self.validate() if self.main else {}
        improved = False
        if self.main:
            key = "bleu" if self.cfg.train.best_metric == "bleu" and self.cfg.train.valid_bleu else "loss"
            value = scores[key]
            better = self.state.best is None or (value > self.state.best if key == "bleu" else value < self.state.best)
            if better:
                self.state.best, self.state.bad_validations, improved = value, 0, True
            else:
                self.state.bad_validations += 1
            log.info("step %d: valid %s (best %s %.3f)", self.state.step,
                     ", ".join(f"{k} {v:.3f}" for k, v in scores.items()), key, self.state.best)  # fmt: skip
        self.state.validated_step = self.state.step
        self._sync_state()
        self._save(validated=True, improved=improved)

    def _sync_state(self) -> None:
        """Share rank 0's validation outcome so every rank makes the same stopping decision."""
        if dist.world_size() > 1:
            values = [self.state.best, self.state.bad_validations]
            torch.distributed.broadcast_object_list(values, src=0)
            self.state.best, self.state.bad_validations = values

    @torch.no_grad()
    def validate(self) -> dict[str, float]:
        self.model.eval()
        loss_sum = nll_sum = tokens = 0.0
        for indices in make_batches(self.valid_data.lengths(), self.cfg.train.max_tokens):
            batch = collate(self.valid_data, indices).to(self.device)
            with autocast(self.precision, self.device):
                logits = self.model(batch.src, batch.src_pad_mask, batch.tgt_in)
            loss, nll = label_smoothed_loss(logits, batch.tgt_out, self.cfg.train.label_smoothing)
            loss_sum, nll_sum, tokens = loss_sum + loss.item(), nll_sum + nll.item(), tokens + batch.n_tokens
        scores = {"loss": loss_sum / tokens, "nll": nll_sum / tokens, "ppl": math.exp(min(nll_sum / tokens, 50))}
        if self.cfg.train.valid_bleu:
            scores["bleu"] = self._valid_bleu()
        for name, value in scores.items():
            self.writer.add_scalar(f"valid/{name}", value, self.state.step)
        self.writer.add_scalar("valid/minutes", self._elapsed_minutes(), self.state.step)
        self.model.train()
        return scores

    def _valid_bleu(self) -> float:
        src, refs = self.valid_text
        translator = Translator(self.model, self.tokenizer, self.cfg.decode, self.device)
        hyps = translator.translate(src, strategy=self.cfg.decode.valid_strategy)
        examples = "\n\n".join(f"    {s}\n    -> {h}\n    (ref) {r}" for s, h, r in list(zip(src, hyps, refs))[:3])
        self.writer.add_text("valid/examples", examples, self.state.step)
        return metrics.bleu(hyps, refs).score

    def _save(self, validated: bool, improved: bool = False) -> None:
        if not self.main:
            return
        self.state.elapsed += time.monotonic() - self.start_time
        self.start_time = time.monotonic()
        train_state = {
            "progress": asdict(self.state),
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict(),
            "rng_cpu": torch.get_rng_state(),
            "rng_cuda": torch.cuda.get_rng_state() if self.device.type == "cuda" else None,
        }
        save_checkpoint(self.run_dir / LAST, self.model, self.tokenizer, self.cfg, train_state)
        if improved:
            save_checkpoint(self.run_dir / BEST, self.model, self.tokenizer, self.cfg)
        if validated and self.cfg.train.keep_last:
            save_checkpoint(self.run_dir / f"checkpoint_step{self.state.step}.pt", self.model, self.tokenizer, self.cfg)
            for old in step_checkpoints(self.run_dir)[: -self.cfg.train.keep_last]:
                old.unlink(missing_ok=True)

    def _average(self) -> None:
        paths = step_checkpoints(self.run_dir)[-self.cfg.train.average_last :]
        if paths:
            average_checkpoints(paths, self.run_dir / "checkpoint_avg.pt")
            log.info("averaged %d checkpoints into %s", len(paths), self.run_dir / "checkpoint_avg.pt")


def step_checkpoints(run_dir: str | Path) -> list[Path]:
    """A run's `checkpoint_step{N}.pt` files, oldest first."""
    paths = Path(run_dir).glob("checkpoint_step*.pt")
    return sorted(paths, key=lambda p: int(p.stem.removeprefix("checkpoint_step")))


class _Meter:
    """Running training statistics between two log lines."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.loss = self.nll = self.tokens = self.grad_norm = 0.0
        self.updates = 0
        self.lr = 0.0
        self.start = time.monotonic()

    def add(self, stats: dict[str, float]) -> None:
        self.loss += stats["loss"] * stats["tokens"]
        self.nll += stats["nll"] * stats["tokens"]
        self.tokens += stats["tokens"]
        self.grad_norm += stats["grad_norm"] if math.isfinite(stats["grad_norm"]) else 0.0
        self.updates += 1
        self.lr = stats["lr"]

    def log(self, writer: Any, step: int) -> str:
        """Write the averages to TensorBoard and the log; return a short progress-bar text."""
        seconds = max(time.monotonic() - self.start, 1e-9)
        loss, nll = self.loss / max(self.tokens, 1), self.nll / max(self.tokens, 1)
        speed = self.tokens / seconds
        if writer is not None:
            for name, value in (("loss", loss), ("nll", nll), ("lr", self.lr), ("tokens_per_s", speed),
                                ("grad_norm", self.grad_norm / max(self.updates, 1))):  # fmt: skip
                writer.add_scalar(f"train/{name}", value, step)
            log.debug("step %d: loss %.3f nll %.3f lr %.2e %.0f tok/s", step, loss, nll, self.lr, speed)
        text = f"loss={loss:.3f}, lr={self.lr:.2e}, tok/s={speed:.0f}"
        self.reset()
        return text


def _progress(total: int, initial: int, epoch: int, enabled: bool) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc=f"epoch {epoch}", unit="upd", disable=not enabled,
                dynamic_ncols=True, leave=True)  # fmt: skip


def _log_to_file(path: Path) -> None:
    root = logging.getLogger("seq2seq")
    if any(isinstance(h, logging.FileHandler) and Path(h.baseFilename) == path.resolve() for h in root.handlers):
        return
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    handler.setLevel(logging.DEBUG)
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)


def train(cfg: ExperimentConfig) -> TrainState:
    return Trainer(cfg).fit()
