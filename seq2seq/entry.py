"""The `seq2seq` command's entry point: what must hold before the heavy imports of `seq2seq.cli`.

Importing the CLI loads numpy, SentencePiece and YAML (a few hundred milliseconds);
a Ctrl-C then must end like one at any other time, with `seq2seq: interrupted` and
exit code 130, not a traceback. So this module imports nothing but `io`, `os` and
`sys` (loaded with the interpreter) before `main` runs, and `main` catches a Ctrl-C
from its first line: while it imports `seq2seq.interrupt`, before the handlers exist.
Then it turns SIGINT and SIGTERM into requests the command honours at its safe
points (`seq2seq.interrupt`) for its whole run: one that arrives after the last safe
point still ends the command with 130 or 143, never 0, and one the command has
reported is not reported twice. It also makes closed standard streams safe: a
file opened later must never land on descriptor 1 and receive the translations,
and writing to a closed stdout is a one-line error, not an AttributeError.
"""

from __future__ import annotations

import io
import os
import sys

TYPE_CHECKING = False
if TYPE_CHECKING:  # for annotations only: a Ctrl-C during an import here would be a traceback
    from collections.abc import Sequence
    from typing import NoReturn


def main(argv: Sequence[str] | None = None) -> int:
    try:
        code = _run(argv)
    except KeyboardInterrupt:  # before the handlers were installed, or after they were restored
        if sys.stderr is not None:  # None: started with stderr closed; print would write to stdout
            print("seq2seq: interrupted", file=sys.stderr)
        return 130
    distributed = sys.modules.get("seq2seq.training.distributed")
    if distributed is not None and distributed.joined():
        _exit_now(code)
    return code


def _run(argv: Sequence[str] | None) -> int:
    from seq2seq import interrupt

    try:
        with interrupt.Interrupts() as interrupts:
            _guard_standard_streams()
            from seq2seq.cli import main as run

            code = run(argv)
            _flush_stdout()
            if code != interrupts.exit_code:  # else the command said so itself: one line
                interrupts.check()
            return code
    except KeyboardInterrupt as e:
        return interrupt.report(e)


def _exit_now(code: int) -> NoReturn:
    """End a data-parallel worker without the interpreter's finalization.

    A gloo worker thread can still be releasing the last collective (its tensors, owned by Python) when the
    main thread reaches Python's shutdown. It then needs the GIL, Python ends the thread, and unwinding it
    through a C++ destructor aborts the process ("terminate called without an active exception", SIGABRT)
    after a run that finished and saved. DDP keeps the group alive past `destroy_process_group`, so its
    threads outlive the command. By now every file is written and closed: flush what is buffered and leave.
    """
    import contextlib
    import logging

    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a reader gone, a stream closed
            stream.flush()
    os._exit(code)


class ClosedStdout(io.TextIOBase):
    """What stdout is when the command was started with it closed (`>&-`): writing fails in one line."""

    def write(self, text: str, /) -> int:
        from seq2seq.errors import UserError

        raise UserError("cannot write the output: stdout is closed (redirect it, or give --output FILE)")


def _guard_standard_streams() -> None:
    """Put /dev/null on any closed descriptor 0-2, so no file opened later takes its place."""
    for fd in (0, 1, 2):  # os.open takes the lowest free descriptor: fill them in order
        try:
            os.fstat(fd)
        except OSError:
            os.open(os.devnull, os.O_RDWR)
    if sys.stdout is None:
        sys.stdout = ClosedStdout()
    if sys.stderr is None:  # nowhere to tell anything; print(file=None) would write to stdout
        sys.stderr = open(os.devnull, "w", encoding="utf-8")  # noqa: SIM115 (open until exit)


def _flush_stdout() -> None:
    """Flush now, so that a reader gone early (`| head -1`) ends the command quietly, like standard tools:
    Python's own flush at exit would print an ignored BrokenPipeError."""
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
