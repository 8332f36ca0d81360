"""Running `python -m seq2seq train ...` as a child process, with the signals a recipe receives passed on."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

from seq2seq import interrupt
from seq2seq.errors import UserError


class StepFailed(UserError):
    """A `seq2seq` subcommand of the recipe failed (its message is on stderr); the recipe exits with its code."""

    def __init__(self, command: str, code: int, consequence: str = "nothing was scored") -> None:
        super().__init__(f"`seq2seq {command}` exited with code {code}; {consequence}")
        self.exit_code = code


def seq2seq(*args: str, consequence: str = "nothing was scored") -> None:
    """Run a `seq2seq` subcommand to its end; StepFailed if it failed, Interrupted if a signal stopped it."""
    own_group: dict[str, Any] = (  # see _wait
        {"process_group": 0} if sys.version_info >= (3, 11) else {"preexec_fn": os.setpgrp}
    )
    code = _wait(subprocess.Popen([sys.executable, "-m", "seq2seq", *args], **own_group))
    interrupt.check()  # stopped by a signal: say so, not "failed"
    if code:
        raise StepFailed(args[0], code, consequence)


def _wait(child: subprocess.Popen[Any]) -> int:
    """The subcommand's exit code, once it has stopped in its own time.

    A signal to the recipe is passed on to it, and the recipe waits: a training saves its step before it
    stops. (subprocess.run would kill it at once, losing the updates since its last checkpoint.) The
    subcommand runs in its own process group, so a Ctrl-C reaches it once, through the recipe: reaching
    both, it would arrive twice, and a late second copy means "quit without saving".
    """
    passed_on = False
    try:
        while True:
            try:
                return child.wait(timeout=0.2)
            except subprocess.TimeoutExpired:
                pass
            if not passed_on:
                try:
                    interrupt.check()
                except interrupt.Interrupted as e:
                    child.send_signal(e.signal)
                    passed_on = True
    except interrupt.Interrupted as e:  # a second signal, later: the user will not wait, nor will the subcommand
        child.send_signal(e.signal)
        raise
