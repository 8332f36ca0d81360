"""Device and numeric precision: resolved once, from the config, in one place."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from seq2seq.config import UserError


class TrainingError(UserError):
    """A training run cannot go on; described in one line for the user."""


def resolve_device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise TrainingError("train.device=cuda but CUDA is not available on this machine")
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_precision(precision: str, device: torch.device) -> str:
    """The precision `train.precision` means on `device`.

    `auto` on CUDA: bf16 where the GPU supports it (no loss scaling needed), else
    fp16 with a gradient scaler. `auto` on CPU: fp32. scripts/bench_train.py
    measured bf16 autocast on this machine's CPU (AMD EPYC with avx512_bf16, no
    AMX) at 0.64x (3+3 layers, d_model 256) and 0.68x (6+6 layers, d_model
    512) the tokens/s of fp32: the casts around every matmul and the
    non-matmul work cost more than the bf16 matmuls save. bf16 stays available
    as an explicit choice for CPUs with AMX, where it may pay.
    """
    if precision == "fp16" and device.type != "cuda":
        raise TrainingError("train.precision=fp16 needs CUDA; use bf16 or fp32 on CPU")
    if precision == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise TrainingError("train.precision=bf16 is not supported by this GPU; use fp16")
    if precision != "auto":
        return precision
    if device.type == "cuda":
        return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    return "fp32"


def autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """Mixed-precision context for forward passes; a no-op for fp32."""
    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device.type, dtype=dtype)
