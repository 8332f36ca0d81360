"""The progress bar of translate and evaluate: on stderr, and only when stderr is a terminal."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tqdm import tqdm


def progress_bar(path: str | Path | None, total: int | None = None) -> tqdm | None:
    """A bar on stderr (sentences done, sentences/s, and the ETA when the number of lines is known)
    when stderr is a terminal; None otherwise, so that pipes and logs stay clean.

    path: the input file, whose lines are counted when `total` is not given (None: stdin, not counted).
    """
    if not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    if total is None and path is not None:
        from seq2seq.text.inputs import count_lines

        try:
            total = count_lines(path)
        except OSError:  # counted only for the ETA
            total = None
    return tqdm(total=total, unit="sent", desc="translating", file=sys.stderr, dynamic_ncols=True)
