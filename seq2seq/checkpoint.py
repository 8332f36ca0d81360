"""Self-describing, versioned checkpoints: weights, config, tokenizer and the run's id in one file.

A checkpoint holds everything `translate` needs (the resolved config and the
SentencePiece models as bytes), the id of the run that wrote it, and
optionally the trainer's state for an exact resume. `Checkpoint` is the one
typed view of the file: `to_dict` is what is written, `from_dict` checks
every field's type before anything is built from it.

Safety. Files are read with `torch.load(weights_only=True)`, which unpickles
tensors and plain containers only, never code, on a torch release without
known bypasses (`seq2seq.security`). A sha256 over the whole content, written at save
and verified at load, catches flipped bytes. Stored shapes are checked against
the stored config on the meta device before any model memory is allocated.
Files are written to a temporary name, fsynced and renamed into place, so a
crash never leaves a half-written checkpoint under the real name.

This module sits below `translate` (which loads models) and `training`
(which also saves them), so both use one file format.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import math
import os
import pickle
import re
import tempfile
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from seq2seq.config import ExperimentConfig, from_dict, to_dict
from seq2seq.errors import CheckpointError, ConfigError
from seq2seq.model import Seq2SeqModel, build_model
from seq2seq.security import check_torch_version
from seq2seq.tokenizer import Tokenizer

FORMAT = "seq2seq-checkpoint"
VERSION = 2  # 1: no version key (format "seq2seq-checkpoint-1"), no run id, no checksum
_FORMAT_V1 = "seq2seq-checkpoint-1"
LAST, BEST = "checkpoint_last.pt", "checkpoint_best.pt"
_TMP_SUFFIX = ".tmp"
_STALE = re.compile(r"\.checkpoint\w*\.pt\.\w+\.tmp")  # atomic_save's temporaries: .{name}.{random}.tmp


@dataclass
class Progress:
    """Everything about a run's progress that is not a tensor; saved in checkpoint_last."""

    step: int = 0  # optimizer updates applied
    epoch: int = 1  # the epoch in progress (1-based)
    batch_in_epoch: int = 0  # batches of this epoch already consumed (per rank)
    best: float | None = None  # best validation score so far
    best_metric: str = ""  # what `best` measures: bleu or loss
    bad_validations: int = 0  # validations since the best one
    validated_step: int = -1  # step of the last validation
    elapsed: float = 0.0  # training seconds of the processes before this one

    @classmethod
    def from_dict(cls, raw: Any, source: str) -> Progress:
        _expect(raw, dict, f"{source}: train_state.progress")
        kinds: dict[str, type | tuple[type, ...]] = {
            "step": int,
            "epoch": int,
            "batch_in_epoch": int,
            "best_metric": str,
            "bad_validations": int,
            "validated_step": int,
            "elapsed": (int, float),
            "best": (int, float, type(None)),
        }
        values = {}
        for name, kind in kinds.items():
            if name in raw:
                values[name] = _expect(raw[name], kind, f"{source}: train_state.progress.{name}")
        return cls(**values)


@dataclass
class TrainingState:
    """What an exact resume needs besides the weights."""

    progress: Progress
    optimizer: dict[str, Any]
    scaler: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return {"progress": dataclasses.asdict(self.progress), "optimizer": self.optimizer, "scaler": self.scaler}

    @classmethod
    def from_dict(cls, raw: Any, source: str) -> TrainingState:
        _expect(raw, dict, f"{source}: train_state")
        optimizer = _expect(raw.get("optimizer"), dict, f"{source}: train_state.optimizer")
        scaler = _expect(raw.get("scaler"), dict, f"{source}: train_state.scaler")
        return cls(Progress.from_dict(raw.get("progress"), source), optimizer, scaler)


@dataclass
class Checkpoint:
    config: ExperimentConfig
    tokenizer: Tokenizer
    model: dict[str, torch.Tensor]  # the model's state_dict
    run_id: str = ""  # the run that wrote it ("" for files of format version 1)
    training: TrainingState | None = None  # only in checkpoint_last
    averaged_from: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "run_id": self.run_id,
            "config": to_dict(self.config),
            "tokenizer": self.tokenizer.state(),
            "model": self.model,
            "train_state": self.training.to_dict() if self.training else None,
            "averaged_from": list(self.averaged_from),
        }

    @classmethod
    def from_dict(cls, raw: Any, source: str) -> Checkpoint:
        """Check the schema and types of every field; one-line errors naming the field."""
        if not isinstance(raw, dict) or raw.get("format") not in (FORMAT, _FORMAT_V1):
            raise CheckpointError(f"{source}: not a seq2seq checkpoint")
        version = raw.get("version", 1)
        if version != VERSION and not (version == 1 and raw["format"] == _FORMAT_V1):
            raise CheckpointError(
                f"{source}: checkpoint format version {version!r} is not supported (this is {VERSION})"
            )
        try:
            config = from_dict(
                _expect(raw.get("config"), dict, f"{source}: config"), source=f"{source} (stored config)"
            )
        except ConfigError as e:
            raise CheckpointError(str(e)) from None
        model = _expect(raw.get("model"), dict, f"{source}: model")
        for name, tensor in model.items():
            _expect(name, str, f"{source}: model key")
            _expect(tensor, torch.Tensor, f"{source}: model.{name}")
        training = raw.get("train_state")
        averaged = _expect(raw.get("averaged_from", []), list, f"{source}: averaged_from")
        return cls(
            config=config,
            tokenizer=_tokenizer(raw.get("tokenizer"), source),
            model=model,
            run_id=_expect(raw.get("run_id", ""), str, f"{source}: run_id"),
            training=TrainingState.from_dict(training, source) if training is not None else None,
            averaged_from=[str(p) for p in averaged],
        )

    def build_model(self, device: str | torch.device = "cpu") -> Seq2SeqModel:
        """The model the config describes, with these weights, in eval mode on `device`."""
        check_shapes(self.config, self.tokenizer, self.model)
        model = build_model(self.config.model, self.tokenizer.src_vocab_size, self.tokenizer.tgt_vocab_size)
        model.load_state_dict(self.model)
        return model.to(device).eval()


def _expect(value: Any, kind: type | tuple[type, ...], what: str) -> Any:
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise CheckpointError(f"{what} must be {names}, not {type(value).__name__}")
    return value


def _tokenizer(raw: Any, source: str) -> Tokenizer:
    _expect(raw, dict, f"{source}: tokenizer")
    _expect(raw.get("src"), bytes, f"{source}: tokenizer.src")
    _expect(raw.get("tgt"), (bytes, type(None)), f"{source}: tokenizer.tgt")
    try:
        return Tokenizer.from_state(raw)
    except (RuntimeError, OSError, ValueError, TypeError) as e:
        raise CheckpointError(f"{source}: the stored SentencePiece model is unusable ({_first_line(e)})") from None


def check_shapes(config: ExperimentConfig, tokenizer: Tokenizer, weights: Mapping[str, torch.Tensor]) -> None:
    """Compare the stored tensors with the model the config describes, built on the meta device (no memory)."""
    with torch.device("meta"):
        expected = build_model(config.model, tokenizer.src_vocab_size, tokenizer.tgt_vocab_size).state_dict()
    missing, unexpected = sorted(set(expected) - set(weights)), sorted(set(weights) - set(expected))
    if missing or unexpected:
        what = f"missing {missing[0]}" if missing else f"unexpected {unexpected[0]}"
        raise CheckpointError(
            f"weights do not fit the stored config: {what} (and {len(missing) + len(unexpected) - 1} more)"
        )
    for name, tensor in expected.items():
        if tuple(weights[name].shape) != tuple(tensor.shape):
            raise CheckpointError(
                f"weights do not fit the stored config: {name} has shape {tuple(weights[name].shape)}, "
                f"the config asks for {tuple(tensor.shape)}"
            )


# Reading and writing.


def save(path: str | Path, checkpoint: Checkpoint) -> None:
    """Write `checkpoint` atomically, with its content checksum."""
    raw = checkpoint.to_dict()
    raw["sha256"] = content_hash(raw)
    atomic_save(raw, path)


def read(path: str | Path) -> Checkpoint:
    """A checkpoint file, checked: readable, safe, untampered, well-formed; one-line errors otherwise."""
    path = Path(path)
    raw = _load(path)
    if isinstance(raw, dict) and "sha256" in raw:
        stored = raw.pop("sha256")
        if stored != content_hash(raw):
            raise CheckpointError(f"{path}: checksum mismatch: the file was damaged after it was written")
    elif isinstance(raw, dict) and raw.get("version", 1) != 1:
        raise CheckpointError(f"{path}: checkpoint has no checksum")
    return Checkpoint.from_dict(raw, str(path))


def _load(path: Path) -> Any:
    check_torch_version()
    if not path.is_file():
        raise CheckpointError(f"checkpoint not found: {path}")
    if not zipfile.is_zipfile(path):  # torch.save writes a zip archive; anything else is not ours
        raise CheckpointError(f"{path}: not a readable checkpoint (corrupt or truncated, or not written by torch.save)")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        if "unsupported global" in str(e).lower():  # the weights-only unpickler met a class or function
            raise CheckpointError(
                f"{path}: refused as unsafe: it contains Python objects other than tensors and plain data"
            ) from None
        raise CheckpointError(f"{path}: not a readable checkpoint (corrupt or truncated?): {_first_line(e)}") from None
    except (
        RuntimeError,
        EOFError,
        OSError,
        zipfile.BadZipFile,
        ValueError,
        OverflowError,
        MemoryError,
        UnicodeDecodeError,
        KeyError,
        IndexError,
        TypeError,
        AttributeError,
    ) as e:
        raise CheckpointError(f"{path}: not a readable checkpoint (corrupt or truncated?): {_first_line(e)}") from None


def peek_run_id(path: str | Path) -> str | None:
    """The run id stored in a checkpoint, reading tensors lazily (memory-mapped); None if unreadable."""
    try:
        raw = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # any unreadable file simply belongs to no run
        return None
    if not isinstance(raw, dict) or raw.get("format") not in (FORMAT, _FORMAT_V1):
        return None
    run_id = raw.get("run_id", "")
    return run_id if isinstance(run_id, str) else None


def _first_line(e: BaseException) -> str:
    return (str(e).splitlines() or [type(e).__name__])[0]


def content_hash(raw: Any) -> str:
    """sha256 of a checkpoint's content: tensors by dtype, shape and bytes; plain values by type and repr."""
    digest = hashlib.sha256()
    _hash_into(digest, raw)
    return digest.hexdigest()


def _hash_into(digest: Any, value: Any) -> None:
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        digest.update(f"T{t.dtype}{tuple(t.shape)}".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy() if t.numel() else b"")
    elif isinstance(value, dict):
        digest.update(f"D{len(value)}".encode())
        for key in sorted(value, key=repr):
            _hash_into(digest, key)
            _hash_into(digest, value[key])
    elif isinstance(value, (list, tuple)):
        digest.update(f"L{len(value)}".encode())
        for item in value:
            _hash_into(digest, item)
    elif isinstance(value, bytes):
        digest.update(f"B{len(value)}".encode() + value)
    elif isinstance(value, float) and math.isnan(value):
        digest.update(b"Fnan")
    else:
        digest.update(f"{type(value).__name__}:{value!r}".encode())


def atomic_save(obj: Any, path: str | Path) -> None:
    """torch.save to a hidden temporary file in the same directory, fsync, then rename over `path`.

    The rename is atomic, so `path` always holds a complete file, old or new,
    whenever the process dies (kill -9 included). The directory is fsynced too,
    so the rename itself survives a power cut. A killed save leaves only a
    hidden `.{name}.*.tmp` file, which `remove_stale_temporaries` cleans up.
    A full disk (or any other write failure) leaves the old file and says so in one line.
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
    except (OSError, RuntimeError) as e:
        Path(tmp).unlink(missing_ok=True)
        full = isinstance(e, OSError) and e.errno == errno.ENOSPC or "unexpected pos" in str(e)
        reason = "no space left on the device" if full else _first_line(e)
        raise CheckpointError(f"cannot write {path}: {reason}; the previous file, if any, is intact") from None
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
    """Delete the temporary files of saves that were killed midway; returns what was removed.

    Call only while holding the run directory's lock: another run's save in progress looks the same.
    """
    stale = sorted(p for p in Path(directory).glob(f".checkpoint*{_TMP_SUFFIX}") if _STALE.fullmatch(p.name))
    for path in stale:
        path.unlink(missing_ok=True)
    return stale


# Loading for translation, and averaging.


@dataclass
class Loaded:
    model: Seq2SeqModel
    tokenizer: Tokenizer
    config: ExperimentConfig
    checkpoint: Checkpoint


def load_checkpoint(path: str | Path, device: str | torch.device = "cpu") -> Loaded:
    """Rebuild the model, tokenizer and config stored in a checkpoint."""
    checkpoint = read(path)
    try:
        model = checkpoint.build_model(device)
    except CheckpointError as e:
        raise CheckpointError(f"{path}: {e}") from None
    return Loaded(model, checkpoint.tokenizer, checkpoint.config, checkpoint)


def average_checkpoints(paths: Sequence[str | Path], output: str | Path) -> Checkpoint:
    """Average the weights of several checkpoints of one model (config, tokenizer and run id from the last).

    Sums are taken in float64, so the result does not depend on the order of
    the files; integer buffers, if any, are taken from the last checkpoint.
    """
    if not paths:
        raise CheckpointError("no checkpoints to average")
    total: dict[str, torch.Tensor] = {}
    last: Checkpoint | None = None
    for path in paths:
        last = read(path)
        if total and last.model.keys() != total.keys():
            raise CheckpointError(f"{path}: its parameters differ from {paths[0]}; cannot average")
        for name, tensor in last.model.items():
            if name in total and total[name].shape != tensor.shape:
                raise CheckpointError(f"{path}: {name} has shape {tuple(tensor.shape)}, not {tuple(total[name].shape)}")
            total[name] = total[name] + tensor.double() if name in total else tensor.double().clone()
    assert last is not None
    final = last.model
    averaged = {
        name: (t / len(paths)).to(final[name].dtype) if final[name].is_floating_point() else final[name]
        for name, t in total.items()
    }
    result = dataclasses.replace(last, model=averaged, training=None, averaged_from=[str(p) for p in paths])
    save(output, result)
    return result
