"""A checkpoint's content in a safetensors file: `checkpoint.format: safetensors`.

A checkpoint is a tree of plain values (dicts, lists, tuples, strings, numbers,
None, bytes) with tensors at its leaves. Here the tensors (and the bytes, as
uint8 tensors) go into the safetensors file under the names t0, t1, ..., and
the tree, with a placeholder where each one was, into its metadata as JSON;
`decode` rebuilds the same tree, so `seq2seq.runs.checkpoint` checks it exactly as
it checks a torch.save file (checksum, types, shapes). Nothing is unpickled:
reading needs neither pickle nor torch's weights-only unpickler. Tensors that
are one tensor in the tree (tied embeddings) are stored once and come back as
one. Only `safetensors` and the standard library: this module sits below
`seq2seq.runs.checkpoint`, which imports it when a file is in this format.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

KEY = "seq2seq"  # the metadata entry holding the tree
TENSOR, BYTES, TUPLE, ITEMS = "__tensor__", "__bytes__", "__tuple__", "__items__"
MARKERS = (TENSOR, BYTES, TUPLE, ITEMS)
MAX_DEPTH = 64  # deeper than any checkpoint (see seq2seq.runs.checkpoint.MAX_DEPTH); a crafted file stops here


class TensorFileError(ValueError):
    """The file is not a checkpoint in this format; the message says why, in one line."""


def is_tensorfile(path: str | Path) -> bool:
    """Whether a file starts as a safetensors file does: a little-endian header length, then `{`."""
    try:
        with open(path, "rb") as f:
            head = f.read(9)
            size = Path(path).stat().st_size
    except OSError:
        return False
    if len(head) < 9 or head[8:9] != b"{":
        return False
    (length,) = struct.unpack("<Q", head[:8])
    return 0 < length <= size - 8


def encode(raw: Any) -> bytes:
    """The safetensors file of a checkpoint's tree."""
    from safetensors.torch import save

    tensors: dict[str, Tensor] = {}
    names: dict[tuple[Any, ...], str] = {}

    def tensor(value: Tensor) -> str:
        key = (value.untyped_storage().data_ptr(), value.storage_offset(), value.shape, value.stride(), value.dtype)
        if key not in names:
            names[key] = f"t{len(names)}"
            tensors[names[key]] = value.detach().cpu().clone().contiguous()  # its own memory: safetensors asks it
        return names[key]

    def walk(value: Any) -> Any:
        if isinstance(value, Tensor):
            return {TENSOR: tensor(value)}
        if isinstance(value, bytes):
            return {BYTES: tensor(torch.frombuffer(bytearray(value), dtype=torch.uint8) if value else _empty())}
        if isinstance(value, dict):
            if all(isinstance(k, str) and k not in MARKERS for k in value):
                return {k: walk(v) for k, v in value.items()}
            return {ITEMS: [[walk(k), walk(v)] for k, v in value.items()]}
        if isinstance(value, tuple):
            return {TUPLE: [walk(v) for v in value]}
        if isinstance(value, list):
            return [walk(v) for v in value]
        if value is None or isinstance(value, (str, int, float)):
            return value
        raise TypeError(f"a checkpoint holds no {type(value).__name__}")

    tree = json.dumps(walk(raw), separators=(",", ":"))
    return bytes(save(tensors, metadata={KEY: tree}))


def _empty() -> Tensor:
    return torch.zeros(0, dtype=torch.uint8)


def decode(path: str | Path) -> Any:
    """The tree `encode` wrote; TensorFileError (one line) for anything else."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            metadata = f.metadata() or {}
            tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118  (safe_open has no __iter__)
    except Exception as e:  # SafetensorsError, OSError: a truncated or damaged file
        raise TensorFileError(f"not a readable safetensors file ({_first_line(e)})") from None
    if KEY not in metadata:
        raise TensorFileError("a safetensors file, but not a seq2seq checkpoint (no seq2seq metadata)")
    try:
        tree = json.loads(metadata[KEY])
    except (ValueError, RecursionError) as e:
        raise TensorFileError(f"its seq2seq metadata is not valid JSON ({_first_line(e)})") from None

    def walk(value: Any, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise TensorFileError(f"its content nests deeper than {MAX_DEPTH} levels")
        if isinstance(value, list):
            return [walk(v, depth + 1) for v in value]
        if not isinstance(value, dict):
            return value
        if len(value) == 1 and next(iter(value)) in MARKERS:
            ((marker, inner),) = value.items()
            if marker in (TENSOR, BYTES):
                if not isinstance(inner, str) or inner not in tensors:
                    raise TensorFileError(f"its content names a tensor {inner!r} the file does not hold")
                found = tensors[inner]
                if marker == TENSOR:
                    return found
                if found.dtype != torch.uint8 or found.dim() != 1:
                    raise TensorFileError(f"tensor {inner} should hold bytes")
                return bytes(found.numpy().tobytes())
            if not isinstance(inner, list):
                raise TensorFileError(f"its content has a malformed {marker}")
            if marker == TUPLE:
                return tuple(walk(v, depth + 1) for v in inner)
            pairs = [walk(pair, depth + 1) for pair in inner]
            if not all(isinstance(p, list) and len(p) == 2 for p in pairs):
                raise TensorFileError("its content has a malformed dictionary")
            try:
                return {k: v for k, v in pairs}
            except TypeError:  # an unhashable key
                raise TensorFileError("its content has a malformed dictionary key") from None
        return {k: walk(v, depth + 1) for k, v in value.items()}

    return walk(tree, 0)


def read_metadata(path: str | Path) -> Any:
    """The tree without its tensors (placeholders left in place), from the header alone; None if unreadable."""
    try:
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > 100 << 20:
                return None
            header = json.loads(f.read(length))
        return json.loads(header["__metadata__"][KEY])
    except Exception:  # any unreadable file simply has no metadata
        return None


def _first_line(e: BaseException) -> str:
    return (str(e).splitlines() or [type(e).__name__])[0][:160]
