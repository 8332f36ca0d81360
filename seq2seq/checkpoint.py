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

from seq2seq.config import ConfigError, UserError, ExperimentConfig, from_dict, to_dict
from seq2seq.model import Seq2SeqTransformer, build_model
from seq2seq.tokenizer import Tokenizer

FORMAT = "seq2seq-checkpoint-1"


class CheckpointError(UserError):
    """An unusable checkpoint, described in one line for the user."""


@dataclass
class Loaded:
    model: Seq2SeqTransformer
    tokenizer: Tokenizer
    config: ExperimentConfig
    train_state: dict[str, Any] | None


def atomic_save(obj: Any, path: str | Path) -> None:
    """torch.save to a temporary file in the same directory, fsync, then rename over `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


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
        data = torch.load(path, map_location="cpu", weights_only=False)
    except (RuntimeError, EOFError, OSError, pickle.UnpicklingError, zipfile.BadZipFile, ValueError) as e:
        raise CheckpointError(f"{path}: not a readable checkpoint (corrupt or truncated?): {str(e).splitlines()[0]}") from None
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
    """Average the weights of several checkpoints of one run (config/tokenizer from the last)."""
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
    averaged = {name: (t / len(paths)).to(last["model"][name].dtype) for name, t in total.items()}
    atomic_save({**last, "model": averaged, "train_state": None, "averaged_from": [str(p) for p in paths]}, output)
