"""Stopping on SIGINT/SIGTERM at a safe point instead of wherever the signal lands."""

from __future__ import annotations

import logging
import signal
import time
from typing import Any

log = logging.getLogger("seq2seq.train")


class StopSignal:
    """Turns SIGINT/SIGTERM into a flag checked between updates, so a checkpoint can be saved.

    Another signal more than `grace` seconds later raises KeyboardInterrupt at
    once, for a user who does not want to wait. Signals within the grace period
    are the same request: Ctrl-C reaches every process of the terminal's group,
    and torchrun forwards it to its workers a second time.
    """

    def __init__(self, grace: float = 2.0) -> None:
        self.received: str | None = None
        self.grace = grace
        self._first = 0.0
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignal:
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, frame: object) -> None:
        if self.received is None:
            self.received, self._first = signal.Signals(signum).name, time.monotonic()
            log.warning("%s received: stopping after this update (again to quit without saving)", self.received)
        elif time.monotonic() - self._first > self.grace:
            raise KeyboardInterrupt

    @property
    def exit_code(self) -> int:
        """The shell's code for death by the signal received (130, 143), or 0: a run that stopped
        early must not read as finished to `&&`, `set -e` or a script driving it."""
        return 128 + signal.Signals[self.received] if self.received else 0
