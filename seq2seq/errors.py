"""The errors a user can cause and fix: each is reported as one line, never a traceback.

`seq2seq.cli` turns `ConfigError` (and `UsageError`, a command-line flag's) into
exit code 2 and every other `UserError` into exit code 1; the scripts under scripts/ do the same through
`run_script`. They live here, below every other module, so that any module can raise them without importing the one
that owns the topic.
"""

from __future__ import annotations

import sys
from collections.abc import Callable


class UserError(ValueError):
    """A problem with the user's input (config, data, checkpoint...), told in one line."""


class ConfigError(UserError):
    """A configuration problem: a key, a value, a command-line option."""


class UsageError(ConfigError):
    """A command-line flag that is out of range or does not go with another (not a config key)."""


class DataError(UserError):
    """A problem with the input text: a missing, unreadable or misaligned file."""


class CheckpointError(UserError):
    """An unusable checkpoint."""


class TrainingError(UserError):
    """A training run cannot go on."""


class DownloadError(UserError):
    """A file could not be fetched or is not what it should be."""


class RunDirError(UserError):
    """A run directory that cannot be used as asked: in use, or holding another run's checkpoints."""


class AttentionError(UserError):
    """Attention that cannot be shown as asked: a model without attention, or a layer it does not have."""


def run_script(name: str, main: Callable[[], object]) -> None:
    """Run a script's `main` as the CLI runs a command: a `UserError`, or a file the system cannot open, ends it in
    one line `name: message` (exit code 2 for a `ConfigError`, else 1), not a traceback."""
    try:
        main()
    except UserError as e:
        print(f"{name}: {e}", file=sys.stderr)
        sys.exit(2 if isinstance(e, ConfigError) else 1)
    except OSError as e:  # e.g. an --input file that does not exist: the system's message names it
        print(f"{name}: {e}", file=sys.stderr)
        sys.exit(1)
