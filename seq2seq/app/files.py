"""Guards for outputs: a command never empties or overwrites a file it reads."""

from __future__ import annotations

import os
import stat
from collections.abc import Sequence
from pathlib import Path
from typing import BinaryIO

from seq2seq.errors import UserError


def refuse_output_that_is_read(output: str | None, source: BinaryIO, name: str, checkpoints: Sequence[str]) -> None:
    """Opening --output empties it, so it must not be a file this command reads: refuse before opening it.

    source: the input stream, whether named by --input or redirected to stdin, under any path or link;
    name: what the messages call it.
    """
    if not output:
        return
    path = Path(output)
    for checkpoint in checkpoints:
        if same_file(path, Path(checkpoint)):
            raise UserError(f"--output {output} is the checkpoint; writing there would empty it first")
    try:
        read = os.fstat(source.fileno())
        reads_output = stat.S_ISREG(read.st_mode) and path.exists() and os.path.samestat(read, path.stat())
    except (OSError, ValueError):  # a stdin without a file descriptor (a test's, a notebook's)
        reads_output = False
    if reads_output:
        raise UserError(f"--output {output} is the input file ({name}); writing there would empty it first")


def refuse_overwriting(output: Path, option: str, *inputs: str | Path | None) -> None:
    """An output must not be one of the command's own inputs: writing it would destroy what is being read."""
    for given in inputs:
        if given and output.exists() and same_file(output, Path(given)):
            raise UserError(f"{option} {output} is also an input of this command; choose another file")


def same_file(a: Path, b: Path) -> bool:
    """The same path once resolved, or the same file under another name (a hard or symbolic link)."""
    if a.resolve() == b.resolve():
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist (yet)
        return False
