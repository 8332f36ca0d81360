"""torch.distributed set-up for runs launched by torchrun (gloo on CPU, NCCL on CUDA)."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def is_main() -> bool:
    return rank() == 0


def setup(device: torch.device) -> None:
    """Join the process group torchrun describes in the environment; no-op for a single process."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or dist.is_initialized():
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend=backend)


def teardown() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def sum_all(values: list[float], device: torch.device) -> list[float]:
    """Sum a few numbers over all ranks (identity for one process)."""
    if world_size() == 1:
        return values
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor)
    return tensor.tolist()


def any_all(flags: list[bool], device: torch.device) -> list[bool]:
    """Each flag True on every rank if it is True on any rank (a stop signal, a time limit)."""
    return [total > 0 for total in sum_all([float(f) for f in flags], device)]


def broadcast_from_main(values: list[Any]) -> list[Any]:
    """Rank 0's values on every rank (identity for one process)."""
    if world_size() == 1:
        return values
    shared = list(values)
    dist.broadcast_object_list(shared, src=0)
    return shared
