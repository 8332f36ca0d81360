"""One optimizer update: precision, attention kernel, loss, gradient scaling, accumulation, clipping.

Everything an update depends on is a field of `UpdateStep`, so a benchmark or
a test configures one (e.g. `dataclasses.replace(step, precision="bf16")`)
instead of patching a trainer.

The dropout RNG is re-seeded before every forward pass from (seed, step,
micro-batch), as fairseq does: a resumed run draws the same masks as an
uninterrupted one, and two DDP ranks draw what one process accumulating their
two batches would (see `micro_batch_seed`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math

import torch
from torch.nn.parallel import DistributedDataParallel

from seq2seq.config import TrainConfig
from seq2seq.data import Batch
from seq2seq.device import autocast
from seq2seq.errors import TrainingError
from seq2seq.model import Kernels, kernel_scope, training_kernel
from seq2seq.training import distributed as dist
from seq2seq.training.loss import batch_loss

log = logging.getLogger("seq2seq.train")


def micro_batch_seed(seed: int, step: int, index: int) -> int:
    """Seed of the dropout RNG for micro-batch `index` (global over ranks) of update `step`."""
    return ((seed * 1_000_003 + step) * 10_007 + index) % (2**63)


@dataclasses.dataclass
class UpdateStep:
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    device: torch.device
    precision: str  # fp32, bf16 or fp16 (resolved, never auto)
    attention_kernel: Kernels  # None: PyTorch's choice
    label_smoothing: float
    rdrop_alpha: float = 0.0
    clip_norm: float = 0.0  # 0: no clipping
    seed: int = 1
    max_bad_steps: int = 20  # non-finite updates in a row before giving up
    ddp: DistributedDataParallel | None = None  # the model wrapped for data parallelism, if any
    bad_steps: int = dataclasses.field(default=0, init=False)

    @classmethod
    def from_config(
        cls,
        t: TrainConfig,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scaler: torch.amp.GradScaler,
        device: torch.device,
        precision: str,
        ddp: DistributedDataParallel | None = None,
    ) -> UpdateStep:
        """The update `train.*` describes, on the best attention kernel for training on `device` in `precision`."""
        kernel = training_kernel(device, precision)
        return cls(
            model,
            optimizer,
            scaler,
            device,
            precision,
            kernel,
            t.label_smoothing,
            t.rdrop_alpha,
            t.clip_norm,
            t.seed,
            t.max_bad_steps,
            ddp,
        )

    def __call__(self, batches: list[Batch], step: int, lr: float) -> dict[str, float] | None:
        """Update `step` over `batches` (update_freq of them) at learning rate `lr`.

        Returns the update's statistics, or None if it was skipped as non-finite.
        """
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        loss, nll, tokens = self.accumulate(batches, step)
        grad_norm = self.apply_gradients(math.isfinite(loss))
        if not math.isfinite(grad_norm):
            self._skipped(step, loss)
            return None
        self.bad_steps = 0
        return {"loss": loss / tokens, "nll": nll / tokens, "tokens": tokens, "lr": lr, "grad_norm": grad_norm}

    def accumulate(self, batches: list[Batch], step: int) -> tuple[float, float, float]:
        """Forward and backward over the micro-batches, leaving in `.grad` the gradient of the
        summed loss divided by the target tokens of the whole update on all ranks.

        Returns the summed (loss, nll) and the number of target tokens, over all ranks.
        """
        world, rank = dist.world_size(), dist.rank()
        tokens = dist.sum_all([float(sum(b.n_tokens for b in batches))], self.device)[0]
        scale = world / tokens  # DDP averages gradients over ranks; undo that
        model = self.ddp or self.model
        loss_sum = torch.zeros((), device=self.device, dtype=torch.float64)
        nll_sum = torch.zeros_like(loss_sum)
        for i, batch in enumerate(batches):
            torch.manual_seed(micro_batch_seed(self.seed, step, i * world + rank))
            last = i == len(batches) - 1
            with contextlib.nullcontext() if self.ddp is None or last else self.ddp.no_sync():
                with autocast(self.precision, self.device), kernel_scope(self.attention_kernel):
                    loss, nll = batch_loss(model, batch.to(self.device), self.label_smoothing, self.rdrop_alpha)
                self.scaler.scale(loss * scale).backward()
            loss_sum += loss.detach()
            nll_sum += nll.detach()
        loss_total, nll_total = dist.sum_all([loss_sum.item(), nll_sum.item()], self.device)
        return loss_total, nll_total, tokens

    def apply_gradients(self, loss_finite: bool) -> float:
        """Unscale, clip and apply the gradients; returns their norm, or nan if the update was skipped."""
        self.scaler.unscale_(self.optimizer)
        max_norm = self.clip_norm or math.inf
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm))
        applied = loss_finite and math.isfinite(grad_norm)
        if applied:
            self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm if applied else math.nan

    def _skipped(self, step: int, loss: float) -> None:
        """Warn about a skipped update; give up when they keep coming."""
        self.bad_steps += 1
        what = (
            "gradient overflow (fp16 loss scale lowered)" if self.precision == "fp16" else f"non-finite loss ({loss})"
        )
        log.warning("update %d skipped: %s or gradients, %d in a row", step, what, self.bad_steps)
        if self.bad_steps >= self.max_bad_steps:
            raise TrainingError(
                f"training diverged: {self.bad_steps} updates in a row had a non-finite loss or gradients "
                f"(at step {step}); lower train.lr, raise train.warmup_steps or clip with train.clip_norm"
            )
