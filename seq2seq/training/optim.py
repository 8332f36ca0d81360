"""Optimizers and learning-rate schedules; each schedule is a pure function of the step."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch

from seq2seq.config import OptimConfig, TrainConfig


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


def lr_schedule(o: OptimConfig, t: TrainConfig, d_model: int, updates_per_epoch: int) -> Callable[[int], float]:
    """The learning rate of each update of a run; the cosine ends at train.max_steps (or the last epoch's end)."""
    total = t.max_steps or updates_per_epoch * t.max_epochs
    return functools.partial(
        lr_at, schedule=o.schedule, lr=o.lr, warmup=o.warmup_steps, total_steps=total, d_model=d_model
    )
