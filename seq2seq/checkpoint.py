"""Self-describing checkpoints: weights, config and tokenizer in one file.

A checkpoint holds everything `translate` needs (the resolved config and the
SentencePiece models as bytes), and optionally the trainer's state for an
exact resume. Files are written to a temporary name and renamed into place,
so a crash never leaves a half-written checkpoint under the real name.

This module sits below `translate` (which loads models) and `training`
(which also saves them), so both use one file format.
"""

from __future__ import annotations

import os
import pickle
import tempfile
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from seq2seq.config import ExperimentConfig, from_dict, to_dict
from seq2seq.errors import CheckpointError, ConfigError
from seq2seq.model import Seq2SeqTransformer, build_model
from seq2seq.tokenizer import Tokenizer

FORMAT = "seq2seq-checkpoint-1"
LAST, BEST = "checkpoint_last.pt", "checkpoint_best.pt"
_TMP_SUFFIX = ".tmp"


@dataclass
class Loaded:
    model: Seq2SeqTransformer
    tokenizer: Tokenizer
    config: ExperimentConfig
    train_state: dict[str, Any] | None


def atomic_save(obj: Any, path: str | Path) -> None:
    """torch.save to a hidden temporary file in the same directory, fsync, then rename over `path`.

    The rename is atomic, so `path` always holds a complete file, old or new,
    whenever the process dies (kill -9 included). The directory is fsynced too,
    so the rename itself survives a power cut. A killed save leaves only a
    hidden `.{name}.*.tmp` file, which `remove_stale_temporaries` cleans up.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=_TMP_SUFFIX)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_directory(path.parent)


def _fsync_directory(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # e.g. platforms that cannot open directories
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def remove_stale_temporaries(directory: str | Path) -> list[Path]:
    """Delete the temporary files of saves that were killed midway; returns what was removed."""
    stale = sorted(Path(directory).glob(f".checkpoint*{_TMP_SUFFIX}"))
    for path in stale:
        path.unlink(missing_ok=True)
    return stale


def step_checkpoints(run_dir: str | Path) -> list[Path]:
    """A run's `checkpoint_step{N}.pt` files, oldest first."""
    paths = [p for p in Path(run_dir).glob("checkpoint_step*.pt") if p.stem.removeprefix("checkpoint_step").isdigit()]
    return sorted(paths, key=lambda p: int(p.stem.removeprefix("checkpoint_step")))


def step_checkpoint_path(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / f"checkpoint_step{step}.pt"


def prune_step_checkpoints(run_dir: str | Path, keep: int) -> None:
    """Delete all but the `keep` newest step checkpoints."""
    paths = step_checkpoints(run_dir)
    for old in paths[: max(len(paths) - keep, 0)]:
        old.unlink(missing_ok=True)


def save_checkpoint(
    path: str | Path,
    model: torch.nn.Module,
    tokenizer: Tokenizer,
    config: ExperimentConfig,
    train_state: dict[str, Any] | None = None,
) -> None:
    atomic_save(
        {
            "format": FORMAT,
            "config": to_dict(config),
            "tokenizer": tokenizer.state(),
            "model": model.state_dict(),
            "train_state": train_state,
        },
        path,
    )


def read_checkpoint(path: str | Path) -> dict[str, Any]:
    """The raw checkpoint dict, with one-line errors for missing or damaged files."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint not found: {path}")
    try:
        # weights_only: a checkpoint is data (tensors, numbers, strings, bytes), never code to run.
        data = torch.load(path, map_location="cpu", weights_only=True)
    except (
        RuntimeError,
        EOFError,
        OSError,
        pickle.UnpicklingError,
        zipfile.BadZipFile,
        ValueError,
        OverflowError,
        MemoryError,
        UnicodeDecodeError,
    ) as e:
        first_line = (str(e).splitlines() or [type(e).__name__])[0]
        raise CheckpointError(f"{path}: not a readable checkpoint (corrupt or truncated?): {first_line}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a seq2seq checkpoint")
    return data


def load_checkpoint(path: str | Path, device: str | torch.device = "cpu") -> Loaded:
    """Rebuild the model, tokenizer and config stored in a checkpoint."""
    data = read_checkpoint(path)
    try:
        config = from_dict(data["config"], source=f"{path} (stored config)")
    except ConfigError as e:
        raise CheckpointError(str(e)) from None
    tokenizer = Tokenizer.from_state(data["tokenizer"])
    model = build_model(config.model, tokenizer.src_vocab_size, tokenizer.tgt_vocab_size)
    try:
        model.load_state_dict(data["model"])
    except RuntimeError as e:
        raise CheckpointError(f"{path}: weights do not fit the stored config: {str(e).splitlines()[0]}") from None
    model.to(device).eval()
    return Loaded(model, tokenizer, config, data.get("train_state"))


def average_checkpoints(paths: Sequence[str | Path], output: str | Path) -> None:
    """Average the weights of several checkpoints of one run (config/tokenizer from the last).

    Sums are taken in float64, so the result does not depend on the order of
    the files; integer buffers, if any, are taken from the last checkpoint.
    """
    if not paths:
        raise CheckpointError("no checkpoints to average")
    total: dict[str, torch.Tensor] = {}
    last: dict[str, Any] = {}
    for path in paths:
        last = read_checkpoint(path)
        weights = last["model"]
        if total and weights.keys() != total.keys():
            raise CheckpointError(f"{path}: its parameters differ from {paths[0]}; cannot average")
        for name, tensor in weights.items():
            if name in total and total[name].shape != tensor.shape:
                raise CheckpointError(f"{path}: {name} has shape {tuple(tensor.shape)}, not {tuple(total[name].shape)}")
            total[name] = total[name] + tensor.double() if name in total else tensor.double().clone()
    final = last["model"]
    averaged = {
        name: (t / len(paths)).to(final[name].dtype) if final[name].is_floating_point() else final[name]
        for name, t in total.items()
    }
    atomic_save({**last, "model": averaged, "train_state": None, "averaged_from": [str(p) for p in paths]}, output)
