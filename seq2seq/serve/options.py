"""The server's own settings: request limits, batching, shutdown. Stdlib only, so the CLI parser can use it."""

from __future__ import annotations

import argparse
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import PurePath

from seq2seq.errors import UsageError, UserError


@dataclass(frozen=True)
class ServeOptions:
    host: str = "127.0.0.1"
    port: int = 8080
    max_lines: int = 64  # lines per request
    max_chars: int = 1000  # characters per line
    max_body: int = 1_000_000  # bytes per request body
    max_beam: int = 16  # the largest beam_size a request may ask for
    max_attention: int = 500_000  # attention weights in one answer (layers x heads x target x source, summed)
    batch_tokens: int = 0  # source subwords per batch; 0: the checkpoint's decode.max_tokens
    batch_wait_ms: float = 5.0  # how long the oldest waiting request may wait for others to join it
    max_queue: int = 1000  # requests waiting for the decoder; more are refused with 503
    shutdown_timeout: int = 30  # seconds to finish in-flight requests after SIGTERM/SIGINT
    read_timeout: float = 30.0  # seconds to receive a request's head, and again its body (else closed, or 408)

    def __post_init__(self) -> None:
        _require(0 <= self.port <= 65535, "--port", "must be in [0, 65535]")
        for name in ("max_lines", "max_chars", "max_body", "max_beam", "max_attention", "max_queue"):
            _require(getattr(self, name) >= 1, f"--{name.replace('_', '-')}", "must be at least 1")
        _require(self.batch_tokens >= 0, "--batch-tokens", "must be >= 0")
        _require(0 <= self.batch_wait_ms <= 1000, "--batch-wait-ms", "must be in [0, 1000]")
        _require(0 <= self.shutdown_timeout <= 3600, "--shutdown-timeout", "must be in [0, 3600]")
        _require(0 < self.read_timeout <= 3600, "--read-timeout", "must be in (0, 3600]")


def _require(ok: bool, option: str, message: str) -> None:
    if not ok:
        raise UsageError(f"{option} {message}")


NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def served_models(checkpoints: Sequence[str], named: Sequence[str], compare: bool) -> list[tuple[str, tuple[str, ...]]]:
    """The models to serve, each a name and its paths (several: an ensemble).

    -c alone is one model (several -c: an ensemble, named "default"); with --compare each -c is a model
    of its own, named after its run directory; --model NAME=PATH names each model.
    """
    if named and checkpoints:
        raise UsageError("give the models as -c (one model; with --compare, side by side) or as --model, not both")
    if named:
        models = [_named(item) for item in named]
    elif compare:
        if len(checkpoints) < 2:
            raise UsageError("--compare needs two or more -c, one for each model to show side by side")
        models = [(_name_of(path), (path,)) for path in checkpoints]
    elif checkpoints:
        return [("default", tuple(checkpoints))]
    else:
        raise UsageError("give a model: -c CHECKPOINT (or --model NAME=CHECKPOINT)")
    return _distinct(models, given=bool(named))


def _named(item: str) -> tuple[str, tuple[str, ...]]:
    name, sep, path = item.partition("=")
    if not sep or not path or not NAME.fullmatch(name):
        raise UsageError(f"--model {item!r}: give NAME=CHECKPOINT, NAME of letters, digits, '.', '_' or '-'")
    return name, (path,)


def _name_of(path: str) -> str:
    """A run's checkpoint is named after its run directory (runs/rnn/checkpoint_best.pt: rnn); another file
    or an exported directory after itself."""
    p = PurePath(path)
    stem = p.parent.name if p.name.startswith("checkpoint") and p.parent.name else p.stem
    return re.sub(r"[^A-Za-z0-9._-]", "_", stem)[:64] or "model"


def _distinct(models: list[tuple[str, tuple[str, ...]]], given: bool) -> list[tuple[str, tuple[str, ...]]]:
    """Given names must differ; names taken from paths get -2, -3... when they repeat."""
    seen: set[str] = set()
    out = []
    for name, paths in models:
        if name in seen and given:
            raise UsageError(f"--model {name} is given twice; each model needs its own name")
        unique, n = name, 1
        while unique in seen:
            n += 1
            unique = f"{name}-{n}"
        seen.add(unique)
        out.append((unique, paths))
    return out


def require_extra() -> None:
    """The server's dependencies, or one line saying how to install them."""
    import importlib.util

    for module in ("starlette", "uvicorn"):
        if importlib.util.find_spec(module) is None:
            raise UserError(f"seq2seq serve needs {module}: pip install 'seq2seq[serve]'")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `serve` subcommand's options beyond the model's (--checkpoint, --device, --threads, decode.*)."""
    d = ServeOptions()
    parser.add_argument(
        "--model",
        action="append",
        default=[],
        metavar="NAME=CHECKPOINT",
        help='a model by name, instead of -c; several are served side by side (a request\'s "model" picks one)',
    )
    parser.add_argument(
        "--compare", action="store_true", help="several -c are models side by side, each on its own, not an ensemble"
    )
    parser.add_argument("--host", default=d.host, help=f"address to listen on (default: {d.host})")
    parser.add_argument("--port", type=int, default=d.port, help=f"port (default: {d.port}; 0: any free one)")
    limits = parser.add_argument_group("limits")
    limits.add_argument("--max-lines", type=int, default=d.max_lines, help=f"lines per request ({d.max_lines})")
    limits.add_argument("--max-chars", type=int, default=d.max_chars, help=f"characters per line ({d.max_chars})")
    limits.add_argument("--max-body", type=int, default=d.max_body, help=f"bytes per request body ({d.max_body})")
    limits.add_argument("--max-beam", type=int, default=d.max_beam, help=f"largest beam_size option ({d.max_beam})")
    limits.add_argument(
        "--max-attention",
        type=int,
        default=d.max_attention,
        help=f"attention weights in one answer, all lines and hypotheses ({d.max_attention})",
    )
    limits.add_argument(
        "--max-queue", type=int, default=d.max_queue, help=f"waiting requests before 503 ({d.max_queue})"
    )
    batching = parser.add_argument_group("batching")
    batching.add_argument(
        "--batch-tokens",
        type=int,
        default=d.batch_tokens,
        help="source subwords decoded together (default: the checkpoint's decode.max_tokens)",
    )
    batching.add_argument(
        "--batch-wait-ms",
        type=float,
        default=d.batch_wait_ms,
        help=f"how long a request may wait for others to share its batch ({d.batch_wait_ms:g})",
    )
    limits.add_argument(
        "--read-timeout",
        type=float,
        default=d.read_timeout,
        help=f"seconds to receive a request's head, and again its body; then cut off ({d.read_timeout:g})",
    )
    parser.add_argument(
        "--shutdown-timeout",
        type=int,
        default=d.shutdown_timeout,
        help=f"seconds to finish in-flight requests on SIGTERM/SIGINT ({d.shutdown_timeout})",
    )
