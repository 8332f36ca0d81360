"""Ctrl-C and SIGTERM as a request that the main thread honours at safe points.

Python's own SIGINT handler raises KeyboardInterrupt wherever the main thread
happens to be, and that can be inside a garbage-collector callback, a weakref
callback or a `__del__`: Python then prints "Exception ignored in ..." and
carries on, and a translation that was asked to stop exits 0 with half its
output. Here a signal only records itself; the work checks at its safe points
(between input lines, batches, updates) and stops there with `Interrupted`,
whose exit code is the shell's (130 for SIGINT, 143 for SIGTERM).

Around a blocking call where nothing can be half-done (waiting for the next
input line), `at_once()` lets a signal raise immediately, so an idle command
still stops at once. It raises only when the signal is handled in the frame
that made the call: a callback that runs during the wait (the garbage
collector's, a finalizer) never sees the exception, and the recorded signal
stops the command at its next safe point instead. A signal is never lost.

Only the thread that installed the handlers (the main one) ever raises `Interrupted`:
a worker thread's library safe points stop instead when its owner sets the event
it runs under (`cancellable`), with `Cancelled`. Worker processes start with both
signals blocked (`starting_workers`) and then ignore SIGINT (`worker_signals`): a
Ctrl-C reaches every process of the terminal's group, and the parent, which hears
it too, ends its workers; it is never a KeyboardInterrupt inside a worker's imports.

This module imports only the standard library: the command installs it before
its heavy imports.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from types import FrameType, TracebackType
from typing import Any

SIGNALS = (signal.SIGINT, signal.SIGTERM)


POLL = 0.1  # seconds between safe points while waiting for another process


class Interrupted(KeyboardInterrupt):
    """The command was asked to stop by `signum`; raised only at a safe point (or where nothing is half-done)."""

    def __init__(self, signum: int) -> None:
        self.signal = signal.Signals(signum)
        super().__init__(self.signal.name)

    @property
    def exit_code(self) -> int:
        """128 + the signal's number, as a shell reports death by that signal."""
        return 128 + self.signal


class Interrupts:
    """While entered, SIGINT and SIGTERM are recorded instead of raising wherever they land.

    Signals the process inherited as ignored stay ignored (a shell starts background
    jobs with SIGINT ignored). A second signal more than `grace` seconds after the
    first raises at once, for a user who does not want to wait for the next safe
    point; signals within the grace period are the same request (Ctrl-C reaches
    every process of the terminal's group, and torchrun forwards it again).

    Entered inside another (a trainer's, a server's), it starts with the signal the
    outer one has recorded, and hands its own out when it exits: nesting never loses one.
    """

    def __init__(self, grace: float = 2.0, library_checks: bool = True, raise_repeated: bool = True) -> None:
        """library_checks: whether the module-level `check()` of library code (translation's batches,
        prepare's chunks) stops for these signals; a trainer that stops only between its updates
        says False, so that a validation in progress runs to its end and the step is saved.
        raise_repeated: whether a signal after the grace period raises at once; False: it only sets
        `repeated`, for a command that ends its own way (a server's drain)."""
        self.received: signal.Signals | None = None
        self.repeated = False  # a signal came more than `grace` seconds after the first
        self.raise_repeated = raise_repeated
        self.grace = grace
        self.library_checks = library_checks
        self.waiting: FrameType | None = None  # the frame blocked in an `at_once` call
        self._first = 0.0
        self._previous: dict[int, Handler] = {}
        self._outer: Interrupts | None = None
        self.thread = 0  # the thread that entered: the one whose safe points raise

    def __enter__(self) -> Interrupts:
        global _active
        for sig in SIGNALS:
            if signal.getsignal(sig) is not signal.SIG_IGN:
                self._previous[sig] = signal.signal(sig, self._handle)
        self._outer, _active = _active, self
        self.thread = threading.get_ident()
        outer = self._outer
        if outer is not None and outer.received is not None and self.received is None:
            self.received, self._first = outer.received, outer._first
        return self

    def __exit__(self, *exc: object) -> None:
        global _active
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
        _active = self._outer
        if self._outer is not None and self._outer.received is None and self.received is not None:
            self._outer.received, self._outer._first = self.received, self._first

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is None:
            self.received, self._first = signal.Signals(signum), time.monotonic()
            if frame is not None and frame is self.waiting:
                raise Interrupted(signum)
            return
        repeated = time.monotonic() - self._first > self.grace
        self.repeated = self.repeated or repeated
        if frame is self.waiting or (repeated and self.raise_repeated):
            raise Interrupted(self.received)

    def check(self) -> None:
        """A safe point: stop here if a signal arrived."""
        if self.received is not None:
            raise Interrupted(self.received)

    def at_once(self) -> _AtOnce:
        """`with interrupts.at_once(): line = stream.readline()`: a signal during the call raises at once."""
        return _AtOnce(self)

    @property
    def exit_code(self) -> int:
        """The shell's code for death by the signal received (130, 143), or 0: a run that stopped
        early must not read as finished to `&&`, `set -e` or a script driving it."""
        return 128 + self.received if self.received is not None else 0


Handler = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None  # what signal.getsignal returns


class _AtOnce:
    """The `with` statement's frame is the one a signal may raise in until the block ends."""

    __slots__ = ("owner", "saved")

    def __init__(self, owner: Interrupts) -> None:
        self.owner = owner
        self.saved: FrameType | None = None

    def __enter__(self) -> None:
        self.owner.check()
        self.saved, self.owner.waiting = self.owner.waiting, sys._getframe(1)

    def __exit__(self, kind: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.owner.waiting = self.saved


_active: Interrupts | None = None  # the innermost entered Interrupts; signal handlers are per process anyway


class Cancelled(Exception):
    """Raised at a library safe point of a worker thread whose owner set the event it runs under (`cancellable`)."""


_worker = threading.local()  # .cancel: the event of `cancellable` in this thread


def check() -> None:
    """A safe point for library code: raises `Interrupted` if the running command received a signal (in the
    thread that runs the command), `Cancelled` if this worker thread's work was cancelled."""
    check_cancelled()
    if _active is not None and _active.library_checks and _active.thread == threading.get_ident():
        _active.check()


def check_cancelled() -> None:
    """A safe point inside a unit of work (a search step): raises `Cancelled` if this worker thread's work
    was cancelled; a signal waits for the unit's end (`check`), where the output is whole."""
    cancel: threading.Event | None = getattr(_worker, "cancel", None)
    if cancel is not None and cancel.is_set():
        raise Cancelled("cancelled by its owner")


def at_once() -> contextlib.AbstractContextManager[None]:
    """`Interrupts.at_once` of the running command; nothing when there is none (a library caller)."""
    if _active is not None and _active.library_checks and _active.thread == threading.get_ident():
        return _active.at_once()
    return contextlib.nullcontext()


@contextlib.contextmanager
def cancellable(cancel: threading.Event) -> Iterator[None]:
    """While inside, library safe points of this (worker) thread raise `Cancelled` once `cancel` is set:
    how the thread's owner stops its work between batches, since signals reach only the main thread."""
    previous = getattr(_worker, "cancel", None)
    _worker.cancel = cancel
    try:
        yield
    finally:
        _worker.cancel = previous


@contextlib.contextmanager
def starting_workers() -> Iterator[None]:
    """Worker processes (multiprocessing's) started inside begin with SIGINT and SIGTERM blocked: a Ctrl-C
    meant for this process reaches the whole group, and must not raise KeyboardInterrupt inside a worker's
    imports. Each worker lets them in with `worker_signals()`. This thread holds them back meanwhile and
    takes them at the end: none is lost."""
    if not hasattr(signal, "pthread_sigmask"):  # not on Windows
        yield
        return
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()  # starting, it unblocks both signals in this thread: start it first
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def worker_signals() -> None:
    """In a worker process started under `starting_workers`: SIGINT ignored (the parent hears a Ctrl-C to the
    group too, and ends its workers), SIGTERM ending it as by default (how the parent ends it), both let in."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)


def report(e: KeyboardInterrupt, detail: str = "") -> int:
    """Say in one line that the command was interrupted (by what, when not Ctrl-C); the exit code to return."""
    code = e.exit_code if isinstance(e, Interrupted) else 130
    by = f" by {e.signal.name}" if isinstance(e, Interrupted) and e.signal != signal.SIGINT else ""
    print(f"seq2seq: interrupted{by}{detail}", file=sys.stderr)
    return code
