"""The commands' log on stderr: one line a message, written so that it never breaks a progress bar."""

from __future__ import annotations

import logging
import sys

log = logging.getLogger("seq2seq")


class TqdmHandler(logging.Handler):
    """Log lines that do not break progress bars."""

    def emit(self, record: logging.LogRecord) -> None:
        from tqdm import tqdm

        tqdm.write(self.format(record), file=sys.stderr)


def setup_logging(verbose: bool) -> None:
    """INFO lines (DEBUG with `verbose`, with their level) on stderr; again in one process replaces, not adds."""
    for old in [h for h in log.handlers if isinstance(h, TqdmHandler)]:
        log.removeHandler(old)  # main() may run many times in one process (tests, notebooks)
    handler = TqdmHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s" if verbose else "%(message)s"))
    handler.setLevel(logging.DEBUG if verbose else logging.INFO)
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)
