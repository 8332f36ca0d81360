"""Self-describing, versioned checkpoints: weights, config, tokenizer and the run's id in one file.

A checkpoint holds everything `translate` needs (the resolved config and the
SentencePiece models as bytes), the id of the run that wrote it, and
optionally the trainer's state for an exact resume. `Checkpoint` is the one
typed view of the file: `to_dict` is what is written, `from_dict` checks
every field's type before anything is built from it.

Safety. Files are read with `torch.load(weights_only=True)`, which unpickles
tensors and plain containers only, never code, on a torch release without
known bypasses (`seq2seq.runs.security`); with `checkpoint.format: safetensors` they are
safetensors files (`seq2seq.runs.tensorfile`: the tensors, and the rest as JSON), read
with nothing unpickled, into the same content. A sha256 over the whole content, written at save
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
import logging
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

from seq2seq.config import ExperimentConfig, config_changes, from_dict, to_dict
from seq2seq.errors import CheckpointError, ConfigError
from seq2seq.model import Seq2SeqModel, build_model, on_meta
from seq2seq.model.masked_lm import build_masked_lm
from seq2seq.runs import tensorfile
from seq2seq.runs.security import check_torch_version
from seq2seq.text.tokenizer import Tokenizer

log = logging.getLogger(__name__)

FORMAT = "seq2seq-checkpoint"
VERSION = 2  # 1: no version key (format "seq2seq-checkpoint-1"), no run id, no checksum
MAX_COUNT = 2**53  # steps, epochs, batches: exact as floats, and far beyond any real run
_FORMAT_V1 = "seq2seq-checkpoint-1"
LAST, BEST = "checkpoint_last.pt", "checkpoint_best.pt"
# What a checkpoint's weights are: a translation model (files without a `kind` key), or the encoder and
# prediction head that `seq2seq pretrain` trains (seq2seq.model.masked_lm), which only
# `train.init_encoder_from` and a resumed pretraining run read.
TRANSLATION, MASKED_LM = "translation", "masked-lm"
KIND_NAMES = {TRANSLATION: "a translation model", MASKED_LM: "a masked-LM pretraining checkpoint"}
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

    @property
    def epochs_done(self) -> int:
        """The epochs trained to their end: all before the one in progress."""
        return self.epoch - 1

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
        lowest = {"step": 0, "epoch": 1, "batch_in_epoch": 0, "bad_validations": 0, "validated_step": -1}
        for name, low in lowest.items():
            if name in values and not low <= values[name] < MAX_COUNT:
                raise CheckpointError(
                    f"{source}: train_state.progress.{name} must be in [{low}, 2**53); got {values[name]}"
                )
        for name in ("elapsed", "best"):
            number = values.get(name)
            if number is not None and not (math.isfinite(number) and (name == "best" or number >= 0)):
                raise CheckpointError(f"{source}: train_state.progress.{name} must be a finite number; got {number}")
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

    def check_fits(self, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None, source: str) -> None:
        """The stored optimizer and scaler states must describe these: their `load_state_dict` checks little."""
        _check_optimizer_state(self.optimizer, optimizer, f"{source}: train_state.optimizer")
        if scaler is not None and scaler.is_enabled():
            _check_same_kinds(self.scaler, scaler.state_dict(), f"{source}: train_state.scaler", required=True)


def _check_optimizer_state(stored: dict[str, Any], optimizer: torch.optim.Optimizer, what: str) -> None:
    """Groups of the same sizes and settings, and per-parameter tensors of the parameters' shapes."""
    groups = _expect(stored.get("param_groups"), list, f"{what}.param_groups")
    state = _expect(stored.get("state"), dict, f"{what}.state")
    if len(groups) != len(optimizer.param_groups):
        raise CheckpointError(
            f"{what} has {len(groups)} parameter groups, this model's optimizer has {len(optimizer.param_groups)}"
        )
    params: dict[Any, torch.Tensor] = {}
    for index, (group, expected) in enumerate(zip(groups, optimizer.param_groups)):
        _expect(group, dict, f"{what}.param_groups.{index}")
        ids = _expect(group.get("params"), list, f"{what}.param_groups.{index}.params")
        if len(ids) != len(expected["params"]):
            raise CheckpointError(
                f"{what} holds {len(ids)} parameters, this model has {len(expected['params'])}; "
                "it is another model's state"
            )
        settings = {k: v for k, v in expected.items() if k != "params"}
        _check_same_kinds(group, settings, f"{what}.param_groups.{index}", required=False)
        for key, param in zip(ids, expected["params"]):
            _expect(key, int, f"{what}.param_groups.{index}.params item")
            params[key] = param
    if len(params) != sum(len(g["params"]) for g in optimizer.param_groups):
        raise CheckpointError(f"{what}.param_groups names a parameter twice")
    for key, values in state.items():
        if key not in params:
            raise CheckpointError(f"{what}.state has an entry for parameter {key!r}, which no group holds")
        for name, value in _expect(values, dict, f"{what}.state.{key}").items():
            _check_state_value(value, params[key], name, f"{what}.state.{key}.{name}")


def _check_state_value(value: Any, param: torch.Tensor, name: str, what: str) -> None:
    """A per-parameter value: a number, a scalar tensor (Adam's step) or a tensor shaped like the parameter."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return
    _expect(value, torch.Tensor, what)
    check_loadable(value, what)
    if not value.is_floating_point():
        raise CheckpointError(f"{what} must hold floating-point numbers, not {value.dtype}")
    if value.dim() != 0 and (name == "step" or value.shape != param.shape):
        raise CheckpointError(f"{what} has shape {tuple(value.shape)}, the parameter {tuple(param.shape)}")


def _check_same_kinds(stored: dict[str, Any], expected: dict[str, Any], what: str, required: bool) -> None:
    """Each expected key's value of the expected kind (numbers interchangeable; None: anything).

    required: every key must be there (GradScaler reads them all); else a missing one is fine
    (an optimizer fills in the settings that a newer torch added since the file was written).
    """
    for key, value in expected.items():
        if key not in stored:
            if required:
                raise CheckpointError(f"{what} lacks {key!r}")
            continue
        if value is None:  # e.g. Adam's foreach: chosen at run time
            continue
        kind: type | tuple[type, ...] = type(value)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            kind = (int, float)
        elif isinstance(value, (list, tuple)):
            kind = (list, tuple)
        _expect(stored[key], kind, f"{what}.{key}")


@dataclass
class Checkpoint:
    config: ExperimentConfig
    tokenizer: Tokenizer
    model: dict[str, torch.Tensor]  # the model's state_dict
    run_id: str = ""  # the run that wrote it ("" for files of format version 1)
    training: TrainingState | None = None  # only in checkpoint_last
    averaged_from: list[str] = field(default_factory=list)
    step: int | None = None  # the optimizer updates behind these weights (None: a file written before it was kept)
    kind: str = TRANSLATION  # TRANSLATION or MASKED_LM: what the weights are

    def to_dict(self) -> dict[str, Any]:
        kind = {} if self.kind == TRANSLATION else {"kind": self.kind}  # a translation model's file as before
        return {
            **kind,
            "format": FORMAT,
            "version": VERSION,
            "run_id": self.run_id,
            "config": to_dict(self.config),
            "tokenizer": self.tokenizer.state(),
            "model": self.model,
            "train_state": self.training.to_dict() if self.training else None,
            "averaged_from": list(self.averaged_from),
            "step": self.step,
        }

    @classmethod
    def from_dict(cls, raw: Any, source: str, kinds: Sequence[str] = (TRANSLATION,)) -> Checkpoint:
        """Check the schema and types of every field; one-line errors naming the field. A checkpoint of
        another kind than `kinds` is refused first, in one line saying what it is."""
        if not isinstance(raw, dict) or raw.get("format") not in (FORMAT, _FORMAT_V1):
            raise CheckpointError(f"{source}: not a seq2seq checkpoint")
        kind = _expect(raw.get("kind", TRANSLATION), str, f"{source}: kind")
        if kind not in KIND_NAMES:
            raise CheckpointError(f"{source}: unknown checkpoint kind {kind[:40]!r}")
        if kind not in kinds:
            raise CheckpointError(f"{source} is {KIND_NAMES[kind]}, not {KIND_NAMES[kinds[0]]}")
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
        step = _expect(raw.get("step"), (int, type(None)), f"{source}: step")
        if isinstance(step, bool) or step is not None and not 0 <= step < MAX_COUNT:
            raise CheckpointError(f"{source}: step must be in [0, 2**53); got {step}")
        return cls(
            config=config,
            tokenizer=_tokenizer(raw.get("tokenizer"), source),
            model=model,
            run_id=_expect(raw.get("run_id", ""), str, f"{source}: run_id"),
            training=TrainingState.from_dict(training, source) if training is not None else None,
            averaged_from=[str(p) for p in averaged],
            step=step,
            kind=kind,
        )

    def check_resumable_into(
        self, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None, source: str
    ) -> None:
        """Weights, optimizer and scaler states that fit the model being resumed; one line naming `source` if not."""
        assert self.training is not None
        try:
            check_shapes(self.config, self.tokenizer, self.model, self.kind)
        except CheckpointError as e:
            raise CheckpointError(f"{source}: {e}") from None
        self.training.check_fits(optimizer, scaler, source)

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


def build_kind(kind: str, config: ExperimentConfig, tokenizer: Tokenizer) -> torch.nn.Module:
    """The model a checkpoint of `kind` holds, as its config and tokenizer describe it (fresh weights)."""
    if kind == MASKED_LM:
        return build_masked_lm(config.model, tokenizer.src_vocab_size)
    return build_model(config.model, tokenizer.src_vocab_size, tokenizer.tgt_vocab_size)


def check_shapes(
    config: ExperimentConfig, tokenizer: Tokenizer, weights: Mapping[str, torch.Tensor], kind: str = TRANSLATION
) -> None:
    """Compare the stored tensors with the model the config describes, built on the meta device (no memory)."""
    m = config.model
    layers = 2 * m.rnn.layers if m.rnn is not None else 0
    layers += m.transformer.encoder_layers + m.transformer.decoder_layers if m.transformer is not None else 0
    if kind == MASKED_LM and m.transformer is not None:  # the encoder alone
        layers = m.transformer.encoder_layers
    if layers > len(weights):  # every layer has weights of its own: refuse before building them all
        raise CheckpointError(
            f"weights do not fit the stored config: {len(weights)} tensors cannot hold its {layers} layers"
        )
    with on_meta():
        expected = build_kind(kind, config, tokenizer).state_dict()
    missing, unexpected = sorted(set(expected) - set(weights)), sorted(set(weights) - set(expected))
    if missing or unexpected:
        what = f"missing {missing[0]}" if missing else f"unexpected {unexpected[0]}"
        raise CheckpointError(
            f"weights do not fit the stored config: {what} (and {len(missing) + len(unexpected) - 1} more)"
        )
    for name, tensor in expected.items():
        check_loadable(weights[name], name)
        if tuple(weights[name].shape) != tuple(tensor.shape):
            raise CheckpointError(
                f"weights do not fit the stored config: {name} has shape {tuple(weights[name].shape)}, "
                f"the config asks for {tuple(tensor.shape)}"
            )
        if weights[name].is_floating_point() != tensor.is_floating_point():
            raise CheckpointError(f"weights do not fit the stored config: {name} holds {weights[name].dtype} numbers")


# Reading and writing.


def save(path: str | Path, checkpoint: Checkpoint) -> None:
    """Write `checkpoint` atomically, with its content checksum, every tensor in CPU memory."""
    raw = _on_cpu(checkpoint.to_dict(), {})
    raw["sha256"] = content_hash(raw)
    atomic_save(raw, path, safetensors=checkpoint.config.checkpoint.format == "safetensors")


def _on_cpu(value: Any, copies: dict[tuple[Any, ...], torch.Tensor]) -> Any:
    """`value` with its GPU tensors copied to the CPU, so a checkpoint written by a CUDA run loads anywhere.

    Views of the same memory (tied embeddings) get one copy, so the file stores them once, as on the CPU.
    """
    if isinstance(value, torch.Tensor):
        if value.device.type == "cpu":
            return value
        key = (value.untyped_storage().data_ptr(), value.storage_offset(), value.shape, value.stride(), value.dtype)
        if key not in copies:
            copies[key] = value.detach().cpu()
        return copies[key]
    if isinstance(value, dict):
        return {k: _on_cpu(v, copies) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_on_cpu(v, copies) for v in value)
    return value


def read(path: str | Path, kinds: Sequence[str] = (TRANSLATION,)) -> Checkpoint:
    """A checkpoint file of one of `kinds`, checked: readable, safe, untampered, well-formed; one-line errors
    otherwise."""
    path = Path(path)
    raw = _load(path)
    stored = raw.pop("sha256", None) if isinstance(raw, dict) else None
    try:  # walked even without a checksum (format 1): the walk bounds nesting and sharing
        actual = content_hash(raw, path.stat().st_size)
    except CheckpointError as e:
        raise CheckpointError(f"{path}: {e}") from None
    if stored is not None and stored != actual:
        raise CheckpointError(f"{path}: checksum mismatch: the file was damaged after it was written")
    if stored is None and isinstance(raw, dict) and raw.get("version", 1) != 1:
        raise CheckpointError(f"{path}: checkpoint has no checksum")
    return Checkpoint.from_dict(raw, str(path), kinds)


def _load(path: Path) -> Any:
    check_torch_version()
    if path.is_dir():  # an exported model directory is opened before this (seq2seq.app.model)
        raise CheckpointError(f"{path} is a directory, not a checkpoint file (such as RUN/checkpoint_best.pt)")
    if not path.is_file():
        raise CheckpointError(f"checkpoint not found: {path}")
    if not zipfile.is_zipfile(path):  # torch.save writes a zip archive; anything else is not ours
        if tensorfile.is_tensorfile(path):  # but checkpoint.format: safetensors
            return _load_tensorfile(path)
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
    raw = _peek(path)
    run_id = raw.get("run_id", "") if raw is not None else None
    return run_id if isinstance(run_id, str) else None


def peek_step(path: str | Path) -> int | None:
    """The step stored in a checkpoint, as `peek_run_id` reads it; None if unreadable or not recorded."""
    raw = _peek(path)
    step = raw.get("step") if raw is not None else None
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def _load_tensorfile(path: Path) -> Any:
    """A checkpoint written with checkpoint.format: safetensors, as the tree torch.save would have stored."""
    try:
        return tensorfile.decode(path)
    except ImportError:
        raise CheckpointError(
            f'{path}: a safetensors checkpoint; reading it needs safetensors: pip install -e ".[hf]"'
        ) from None
    except tensorfile.TensorFileError as e:
        raise CheckpointError(f"{path}: not a readable checkpoint: {e}") from None


def _peek(path: str | Path) -> dict[str, Any] | None:
    try:
        if tensorfile.is_tensorfile(path):
            raw = tensorfile.read_metadata(path)  # the header alone: no tensor is read
            return raw if isinstance(raw, dict) and raw.get("format") == FORMAT else None
        raw = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # any unreadable file simply belongs to no run
        return None
    return raw if isinstance(raw, dict) and raw.get("format") in (FORMAT, _FORMAT_V1) else None


def _first_line(e: BaseException) -> str:
    return (str(e).splitlines() or [type(e).__name__])[0]


MAX_DEPTH = 32  # a checkpoint nests 6 levels (train_state.optimizer.state.0.exp_avg); deeper is crafted


def content_hash(raw: Any, file_size: int | None = None) -> str:
    """sha256 of a checkpoint's content: tensors by dtype, shape and bytes; plain values by type and repr.

    A pickle can share one object many times over, so walking a small file can mean
    visiting (and hashing) an astronomical tree. Given the `file_size` the content was
    read from, the walk is bounded linearly by it: a file written by `save` never shares
    containers, and shares a tensor at most a few times (tied embeddings), so it always
    fits; the digest itself is unchanged, and so are the files' stored hashes.
    """
    walk = _Walk(file_size)
    walk.visit(raw, ())
    return walk.digest.hexdigest()


class _Walk:
    """The hash's walk over nested content, with its budgets: nesting depth, values visited, tensor bytes."""

    def __init__(self, file_size: int | None) -> None:
        self.digest: Any = hashlib.sha256()  # Any: numpy arrays are buffers that typeshed does not know
        self.values_left = math.inf if file_size is None else file_size + 10_000  # a pickled value takes a byte
        self.bytes_left = math.inf if file_size is None else 4 * file_size + 2**20  # tied weights: 3 names

    def visit(self, value: Any, where: tuple[Any, ...]) -> None:
        """Hash `value`, found at the keys and indices `where` (named in errors)."""
        if len(where) > MAX_DEPTH:
            raise CheckpointError(f"content nested more than {MAX_DEPTH} levels deep; not a seq2seq checkpoint")
        self.values_left -= 1
        if self.values_left < 0:
            raise _shared_too_often()
        digest = self.digest
        if isinstance(value, torch.Tensor):
            self.tensor(value, where)
        elif isinstance(value, dict):
            digest.update(f"D{len(value)}".encode())
            for key in sorted(value, key=repr):
                self.visit(key, (*where, key))
                self.visit(value[key], (*where, key))
        elif isinstance(value, (list, tuple)):
            digest.update(f"L{len(value)}".encode())
            for index, item in enumerate(value):
                self.visit(item, (*where, index))
        elif isinstance(value, bytes):
            digest.update(f"B{len(value)}".encode() + value)
        elif isinstance(value, float) and math.isnan(value):
            digest.update(b"Fnan")
        else:
            digest.update(f"{type(value).__name__}:{value!r}".encode())

    def tensor(self, value: torch.Tensor, where: tuple[Any, ...]) -> None:
        check_loadable(value, ".".join(map(str, where)) or "the content")
        self.bytes_left -= value.numel() * value.element_size()
        if self.bytes_left < 0:
            raise _shared_too_often()
        t = value.detach().contiguous()
        self.digest.update(f"T{t.dtype}{tuple(t.shape)}".encode())
        self.digest.update(t.reshape(-1).view(torch.uint8).numpy() if t.numel() else b"")


def _shared_too_often() -> CheckpointError:
    return CheckpointError("its content repeats shared parts far beyond the file's size; not a seq2seq checkpoint")


def check_loadable(tensor: torch.Tensor, what: str) -> None:
    """Only dense tensors in CPU memory can be hashed, averaged and loaded into a model."""
    if tensor.layout != torch.strided:
        layout = str(tensor.layout).removeprefix("torch.")
        raise CheckpointError(f"{what} is stored {layout}; only dense tensors are supported")
    if tensor.device.type != "cpu":  # map_location moves real storage to the CPU; "meta" has none
        raise CheckpointError(f"{what} is on the {tensor.device.type} device, without data")


def atomic_save(obj: Any, path: str | Path, safetensors: bool = False) -> None:
    """torch.save (or, with `safetensors`, seq2seq.runs.tensorfile) to a hidden temporary file in the same
    directory, fsync, then rename over `path`.

    The rename is atomic, so `path` always holds a complete file, old or new,
    whenever the process dies (kill -9 included). The directory is fsynced too,
    so the rename itself survives a power cut. A killed save leaves only a
    hidden `.{name}.*.tmp` file, which `remove_stale_temporaries` cleans up.
    A full disk (or any other write failure) leaves the old file and says so in one line.
    """
    path = Path(path)
    data = _tensorfile_bytes(obj, path) if safetensors else None
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=_TMP_SUFFIX)
    try:
        with os.fdopen(fd, "wb") as f:
            if data is None:
                torch.save(obj, f)
            else:
                f.write(data)
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


def _tensorfile_bytes(obj: Any, path: Path) -> bytes:
    try:
        return tensorfile.encode(obj)
    except ImportError:
        raise CheckpointError(
            f'cannot write {path}: checkpoint.format: safetensors needs safetensors: pip install -e ".[hf]"'
        ) from None


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
    first: Checkpoint | None = None
    for path in paths:
        last = read(path)
        first = first or last
        _check_same_model(first, last, Path(paths[0]), Path(path))
        if total and last.model.keys() != total.keys():
            raise CheckpointError(f"{path}: its parameters differ from {paths[0]}; cannot average")
        for name, tensor in last.model.items():
            if name in total and total[name].shape != tensor.shape:
                raise CheckpointError(f"{path}: {name} has shape {tuple(tensor.shape)}, not {tuple(total[name].shape)}")
            total[name] = total[name] + tensor.double() if name in total else tensor.double().clone()
    assert last is not None and first is not None
    final = last.model
    averaged = {
        name: (t / len(paths)).to(final[name].dtype) if final[name].is_floating_point() else final[name]
        for name, t in total.items()
    }
    result = dataclasses.replace(last, model=averaged, training=None, averaged_from=[str(p) for p in paths])
    save(output, result)
    return result


def _check_same_model(first: Checkpoint, other: Checkpoint, first_path: Path, path: Path) -> None:
    """Averaging mixes weights meaningfully only within one architecture and one vocabulary."""
    if other is first:
        return
    if other.tokenizer.state() != first.tokenizer.state():
        raise CheckpointError(f"{path}: its tokenizer differs from {first_path}'s; cannot average")
    differences = config_changes(to_dict(first.config.model), to_dict(other.config.model), "model.")
    if differences:
        key, ours, theirs = differences[0]
        raise CheckpointError(f"{path}: {key} is {theirs!r}, not {ours!r} as in {first_path}; cannot average")
    if other.run_id != first.run_id:
        log.warning(
            "averaging checkpoints of different runs: %s (%s) and %s (%s)",
            first_path,
            first.run_id or "no run id",
            path,
            other.run_id or "no run id",
        )
