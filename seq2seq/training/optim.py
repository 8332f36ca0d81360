"""Optimizers and learning-rate schedules.

Each schedule is a pure function of the step and the run's length in updates. A run whose binding limit is
train.max_minutes does not know its length in updates: its length is projected from its rate so far (the
updates made over the fraction of the time used), so a decaying schedule reaches its end when time does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from seq2seq.config import OptimConfig, TrainConfig
from seq2seq.training.budget import planned_updates


def lr_at(step: int, schedule: str, lr: float, warmup: int, total_steps: int = 0, d_model: int = 512) -> float:
    """Learning rate for optimizer update number `step` (1-based).

    - inverse_sqrt: linear warmup to `lr`, then lr * sqrt(warmup / step) (fairseq).
    - noam: `lr` is a factor: lr * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5) (Vaswani et al., 5.3).
    - cosine: linear warmup, then cosine decay to 0 at `total_steps`.
    - constant: linear warmup, then `lr`.
    """
    step = max(step, 1)
    warm = min(1.0, step / warmup) if warmup > 0 else 1.0
    if schedule == "inverse_sqrt":
        return lr * warm if step <= warmup else lr * math.sqrt(max(warmup, 1) / step)
    if schedule == "noam":
        return lr * d_model**-0.5 * min(step**-0.5, step * warmup**-1.5)
    if schedule == "cosine":
        if step <= warmup or total_steps <= warmup:
            return lr * warm
        progress = min(1.0, (step - warmup) / (total_steps - warmup))
        return lr * 0.5 * (1.0 + math.cos(math.pi * progress))
    if schedule == "constant":
        return lr * warm
    raise ValueError(f"unknown schedule {schedule!r}")


def build_optimizer(model: torch.nn.Module, o: OptimConfig) -> torch.optim.Optimizer:
    # Second moments of rarely seen embeddings decay into denormal floats, which x86
    # CPUs process far slower; flushing them to zero changes nothing else.
    torch.set_flush_denormal(True)
    params = [p for p in model.parameters() if p.requires_grad]
    kind = torch.optim.AdamW if o.optimizer == "adamw" else torch.optim.Adam
    # The fused kernel updates each tensor in one pass (CPU and CUDA) instead of ~10 elementwise ops.
    return kind(params, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay, fused=True)


def projected_updates(done: int, elapsed: float, max_minutes: float) -> int:
    """The updates a run will have made when its `max_minutes` run out, at its rate so far (0: no time limit)."""
    if not max_minutes or done <= 0 or elapsed <= 0:
        return 0
    return max(done, math.ceil(done * 60 * max_minutes / elapsed))


@dataclass(frozen=True)
class Schedule:
    """The learning rate of each update of a run: a decaying schedule (cosine) ends at the first limit reached,
    train.max_steps, the last epoch's end or train.max_minutes (projected from the rate so far)."""

    optim: OptimConfig
    planned: int  # updates until max_steps or the last epoch's end; 0: no such limit
    max_minutes: float  # 0: no time limit
    d_model: int

    def __call__(self, step: int, elapsed: float = 0.0) -> float:
        """The rate of update `step` (1-based), `elapsed` training seconds into the run (the same on every rank)."""
        o = self.optim
        limits = (self.planned, projected_updates(step - 1, elapsed, self.max_minutes))
        total = min((n for n in limits if n), default=0)
        return lr_at(step, o.schedule, o.lr, o.warmup_steps, total, self.d_model)


def lr_schedule(o: OptimConfig, t: TrainConfig, d_model: int, updates_per_epoch: int) -> Schedule:
    """The learning-rate schedule of a run of config sections `o` and `t` with `updates_per_epoch`."""
    return Schedule(o, planned_updates(t, updates_per_epoch), t.max_minutes, d_model)
