"""torch.distributed set-up for runs launched by torchrun (gloo on CPU, NCCL on CUDA)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from seq2seq.errors import TrainingError

# How gloo and NCCL word a collective that failed because another rank died or hung up.
_LOST_PEER = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "NCCL", "gloo")


_joined = False  # whether this process joined a process group (the command then ends with os._exit, see entry)


def joined() -> bool:
    return _joined


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
    global _joined
    _joined = True


@contextlib.contextmanager
def peer_failures() -> Iterator[None]:
    """A rank whose collective fails because another rank died ends with one line, not a gloo traceback.

    The collective is anywhere: DDP's gradient all-reduce inside backward, `sum_all`, a broadcast.
    Every rank saves checkpoint_last together, so the run resumes from its last save.
    """
    try:
        yield
    except RuntimeError as e:  # gloo and NCCL raise RuntimeError (torch.distributed.DistError is one)
        if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or not _lost_peer(e):
            raise
        raise TrainingError(
            f"rank {os.environ.get('RANK', '?')}: another process of this run stopped (its connection broke); "
            "run the same command to resume from the last saved checkpoint"
        ) from None


def _lost_peer(error: RuntimeError) -> bool:
    return isinstance(error, dist.DistError) or any(words in str(error) for words in _LOST_PEER)


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


def sum_tensors(values: torch.Tensor) -> torch.Tensor:
    """Sum a tensor over all ranks on the device, nothing read back (identity for one process)."""
    if world_size() == 1:
        return values
    values = values.clone()
    dist.all_reduce(values)
    return values


def broadcast_from_main(values: list[Any]) -> list[Any]:
    """Rank 0's values on every rank (identity for one process)."""
    if world_size() == 1:
        return values
    shared = list(values)
    dist.broadcast_object_list(shared, src=0)
    return shared
