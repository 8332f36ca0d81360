"""RUN/recipe_state.json: the recipe's finished steps, so that running the same command again skips them.

A step is recorded once it has finished, with what it depended on (its inputs: settings, the size and
modification time of the files it read, digests of the lines it scored), the files it wrote (each with
its size and modification time) and its typed result. A later run skips the step when its inputs are the
same and its files are still as it left them, and takes its result from the record; anything else runs it
again (training resumes from its own checkpoint_last). The file is replaced atomically after each step.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from seq2seq.app.recipe.results import Result, from_dict

log = logging.getLogger("seq2seq")

STATE_FILE = "recipe_state.json"
VERSION = 1


def stamp(path: str | Path) -> list[int]:
    """A file's size and modification time (ns): what says it is still the file a step read or wrote."""
    try:
        st = os.stat(path)
    except OSError:
        return []
    return [st.st_size, st.st_mtime_ns]


def stamps(paths: Iterable[str | Path]) -> dict[str, list[int]]:
    return {str(p): stamp(p) for p in paths}


def lines_digest(*sides: Sequence[str]) -> str:
    """A digest of some lists of lines (a split's sources and references)."""
    digest = hashlib.sha256()
    for lines in sides:
        digest.update(hashlib.sha256("\n".join(lines).encode("utf-8")).digest())
    return digest.hexdigest()


class RecipeState:
    """The steps a recipe has finished in its output directory, read from and written to `STATE_FILE`."""

    def __init__(self, directory: str | Path) -> None:
        self.path = Path(directory) / STATE_FILE
        self.steps: dict[str, dict[str, Any]] = self._read()

    def _read(self) -> dict[str, dict[str, Any]]:
        if not self.path.is_file():
            return {}
        try:
            saved = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            log.warning("recipe: %s is unreadable (%s): every step runs again", self.path, e)
            return {}
        if not isinstance(saved, dict) or saved.get("version") != VERSION or not isinstance(saved.get("steps"), dict):
            log.warning("recipe: %s is of another version: every step runs again", self.path)
            return {}
        return saved["steps"]

    def finished(self, key: str, inputs: dict[str, Any], kind: type[Result]) -> Result | None:
        """The result of step `key`, if it finished with these inputs and its files are as it left them."""
        entry = self.steps.get(key)
        if entry is None or entry.get("inputs") != _as_json(inputs):
            return None
        if any(stamp(path) != saved for path, saved in entry.get("outputs", {}).items()):
            return None
        try:
            return from_dict(kind, entry["result"])
        except (KeyError, TypeError, ValueError, StopIteration):  # a record of another layout: run it again
            return None

    def record(self, key: str, inputs: dict[str, Any], outputs: Iterable[str | Path], result: Result) -> Result:
        """Record step `key` as finished and write the state file; returns `result`."""
        self.steps[key] = {"inputs": _as_json(inputs), "outputs": stamps(outputs), "result": dataclasses.asdict(result)}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps({"version": VERSION, "steps": self.steps}, indent=2), encoding="utf-8")
        os.replace(tmp, self.path)
        return result

    def step(
        self,
        key: str,
        inputs: dict[str, Any],
        kind: type[Result],
        run: Callable[[], tuple[Result, Sequence[str | Path]]],
    ) -> tuple[Result, bool]:
        """Step `key`'s recorded result, or `run`'s (its result and the files it wrote), recorded; and whether
        it was skipped."""
        done = self.finished(key, inputs, kind)
        if done is not None:
            log.info("recipe: %s: finished before with the same inputs, skipped", key)
            return done, True
        result, outputs = run()
        return self.record(key, inputs, outputs, result), False


def _as_json(value: dict[str, Any]) -> Any:
    """What the value reads back as from JSON (tuples become lists), for comparing with a record."""
    return json.loads(json.dumps(value))
