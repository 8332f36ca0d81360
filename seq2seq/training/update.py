"""One optimizer update: precision, attention kernel, loss, gradient scaling, accumulation, clipping.

Everything an update depends on is a field of `UpdateStep`, so a benchmark or
a test configures one (e.g. `dataclasses.replace(step, precision="bf16")`)
instead of patching a trainer.

An update is launched (`launch`: forward, backward, clipping, the optimizer
step, all queued on the device, nothing read back) and finished (`finish`:
its loss, gradient norm and finiteness read to the host in one transfer).
The trainer finishes update k only after it has fetched and sent the batches
of update k + 1, so on CUDA the host never waits for the device with nothing
else to do. A non-finite update is skipped on the device itself: the fused
optimizer takes a `found_inf` flag and leaves weights and moments untouched.

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
import time

import torch
from torch.nn.parallel import DistributedDataParallel

from seq2seq.config import OptimConfig, TrainConfig
from seq2seq.device import autocast
from seq2seq.errors import TrainingError
from seq2seq.model import Kernels, kernel_scope, training_kernel
from seq2seq.text.corpus import Batch
from seq2seq.training import distributed as dist
from seq2seq.training.loss import batch_loss

log = logging.getLogger("seq2seq.train")


def micro_batch_seed(seed: int, step: int, index: int) -> int:
    """Seed of the dropout RNG for micro-batch `index` (global over ranks) of update `step`."""
    return ((seed * 1_000_003 + step) * 10_007 + index) % (2**63)


class Compiled(torch.nn.Module):
    """A model's training forward pass through `torch.compile`, one graph per batch shape.

    Batches come padded to a bounded set of shapes (`seq2seq.text.corpus.bounded_shape`), and the graph computes
    the logits of every position, (B, T, V); the real target positions are selected after it, since
    selecting them inside would give the graph a shape that changes every batch. Dynamo's limit of graphs
    per function is raised to cover the bounded set; `graphs()` counts the graphs built for it.

    Off by default: on a 2-core AMD EPYC CPU (avx512_bf16) Inductor took 83 s for the quickstart model's
    first update against 0.8 s eager, 15-50 s for each later shape, and the Multi30k batches of one epoch
    take 27-35 shapes (`bounded_shape`, 23% more token slots than unpadded); the first measured round ran
    at 0.10x eager (`scripts/bench/bench_train.py --compare compile`). Where it pays on a GPU is for
    `scripts/gpu_check.sh` to measure.
    """

    def __init__(self, model: torch.nn.Module, mode: str) -> None:
        super().__init__()
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, MAX_GRAPHS)
        self.forward_pass = torch.compile(model, mode=mode, dynamic=False)
        self.graphs_before = self._built()

    def forward(
        self, src: torch.Tensor, src_pad_mask: torch.Tensor, tgt_in: torch.Tensor, select: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The model's teacher-forced logits: (B, T, V), or (N, V) at the `select`ed positions."""
        logits = self.forward_pass(src, src_pad_mask, tgt_in)  # (B, T, V)
        return logits if select is None else logits[select]

    def graphs(self) -> int:
        """Graphs built since this model was compiled (a graph break would count as one more)."""
        return self._built() - self.graphs_before

    @staticmethod
    def _built() -> int:
        return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


MAX_GRAPHS = 256  # batch shapes compiled per model before torch.compile falls back to eager (and warns)


@dataclasses.dataclass(frozen=True)
class UpdateStats:
    """What one applied update did, per target token where it is a loss."""

    loss: float  # label-smoothed loss per target token
    nll: float  # negative log-likelihood per target token
    tokens: float  # target tokens of the update, over all ranks
    lr: float
    grad_norm: float  # before clipping


@dataclasses.dataclass
class Launched:
    """An update queued on the device, not yet read back."""

    step: int
    lr: float
    tokens: float  # target tokens of the update, over all ranks
    numbers: torch.Tensor  # (4,) float64 on the device: loss sum, nll sum, gradient norm, 1.0 if applied else 0.0


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
    compiled: Compiled | None = None  # the forward pass compiled (train.compile), if it is
    source_loss: float = 0.0  # model.decoder_only.source_loss: the weight of the source part's loss
    bad_steps: int = dataclasses.field(default=0, init=False)

    @classmethod
    def from_config(
        cls,
        t: TrainConfig,
        o: OptimConfig,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scaler: torch.amp.GradScaler,
        device: torch.device,
        precision: str,
        ddp: DistributedDataParallel | None = None,
        source_loss: float = 0.0,
    ) -> UpdateStep:
        """The update `train.*` and `optim.*` describe, on the best attention kernel for `device` in `precision`."""
        kernel = training_kernel(device, precision)
        compiled = Compiled(ddp or model, t.compile) if t.compile != "off" else None
        return cls(
            model,
            optimizer,
            scaler,
            device,
            precision,
            kernel,
            o.label_smoothing,
            o.rdrop_alpha,
            o.clip_norm,
            t.seed,
            t.max_bad_steps,
            ddp,
            compiled,
            source_loss,
        )

    def __call__(self, batches: list[Batch], step: int, lr: float) -> UpdateStats | None:
        """Update `step` over `batches` (update_freq of them) at learning rate `lr`, read back at once.

        Returns the update's statistics, or None if it was skipped as non-finite.
        """
        return self.finish(self.launch(batches, step, lr))

    def launch(self, batches: list[Batch], step: int, lr: float) -> Launched:
        """Queue update `step` over `batches` at learning rate `lr`; nothing is read back from the device."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        graphs = self.compiled.graphs() if self.compiled else 0
        began = time.monotonic()
        loss, nll, tokens = self.accumulate(batches, step)
        if self.compiled and self.compiled.graphs() > graphs:
            shapes = sorted({(tuple(b.src.shape), tuple(b.tgt_in.shape)) for b in batches})
            log.info(
                "torch.compile: %d graph(s) so far; update %d compiled batches of %s in %.1f s",
                self.compiled.graphs(), step, ", ".join(f"{s} -> {t}" for s, t in shapes), time.monotonic() - began,
            )  # fmt: skip
        grad_norm, applied = self.apply_gradients(torch.isfinite(loss))
        return Launched(step, lr, tokens, torch.stack([loss, nll, grad_norm.double(), applied.double()]))

    def finish(self, launched: Launched) -> UpdateStats | None:
        """The launched update's statistics (one read from the device), or None if it was skipped."""
        loss, nll, grad_norm, applied = launched.numbers.tolist()
        if not applied:
            self._skipped(launched.step, loss)
            return None
        self.bad_steps = 0
        tokens = launched.tokens  # 0 only where a pretraining update's sentences had no token to mask
        return UpdateStats(loss / max(tokens, 1), nll / max(tokens, 1), tokens, launched.lr, grad_norm)

    def accumulate(self, batches: list[Batch], step: int) -> tuple[torch.Tensor, torch.Tensor, float]:
        """Forward and backward over the micro-batches, leaving in `.grad` the gradient of the
        summed loss divided by the target tokens of the whole update on all ranks.

        Returns the summed (loss, nll) over all ranks, as float64 scalars on the device, and the
        number of target tokens over all ranks.
        """
        world, rank = dist.world_size(), dist.rank()
        tokens = dist.sum_all([float(sum(b.n_tokens for b in batches))], self.device)[0]
        scale = world / max(tokens, 1)  # DDP averages gradients over ranks; undo that
        model = self.compiled or self.ddp or self.model
        loss_sum = torch.zeros((), device=self.device, dtype=torch.float64)
        nll_sum = torch.zeros_like(loss_sum)
        for i, batch in enumerate(batches):
            torch.manual_seed(micro_batch_seed(self.seed, step, i * world + rank))
            last = i == len(batches) - 1
            with contextlib.nullcontext() if self.ddp is None or last else self.ddp.no_sync():
                with autocast(self.precision, self.device), kernel_scope(self.attention_kernel):
                    loss, nll = batch_loss(
                        model, batch.to(self.device), self.label_smoothing, self.rdrop_alpha, self.source_loss
                    )
                self.scaler.scale(loss * scale).backward()
            loss_sum += loss.detach()
            nll_sum += nll.detach()
        loss_total, nll_total = dist.sum_tensors(torch.stack([loss_sum, nll_sum]))
        return loss_total, nll_total, tokens

    def apply_gradients(self, loss_finite: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Unscale, clip and apply the gradients unless the loss or their norm is not finite.

        Returns their norm and whether they were applied, both on the device: with a fused optimizer
        in fp32 or bf16 nothing is read back (the optimizer skips a non-finite update itself); with
        fp16's gradient scaler, or an optimizer that takes no such flag, the flag is read here.
        """
        self.scaler.unscale_(self.optimizer)
        max_norm = self.clip_norm or math.inf
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        applied = loss_finite & torch.isfinite(grad_norm)
        if self.scaler.is_enabled() or not self.optimizer.defaults.get("fused"):
            if bool(applied):
                self.scaler.step(self.optimizer)
        else:
            self.optimizer.found_inf = (~applied).float()  # type: ignore[attr-defined]
            self.optimizer.grad_scale = None  # type: ignore[attr-defined]
            try:
                self.optimizer.step()
            finally:
                del self.optimizer.found_inf, self.optimizer.grad_scale  # type: ignore[attr-defined]
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm, applied

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
                f"(at step {step}); lower optim.lr, raise optim.warmup_steps or clip with optim.clip_norm"
            )
