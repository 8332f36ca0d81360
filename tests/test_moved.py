"""The modules that moved into rooms (text, decoding, deploy, runs) still import at their old paths."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

from seq2seq._moved import MOVED


@pytest.mark.parametrize(("old", "new"), sorted(MOVED.items()))
def test_an_old_module_path_gives_the_moved_module_itself(old: str, new: str) -> None:
    assert importlib.import_module(old) is importlib.import_module(new)  # one module: patching one patches both


def test_old_imports_work_in_a_fresh_interpreter() -> None:
    code = (
        "from seq2seq.data import Batch; from seq2seq.search import search; import seq2seq.checkpoint as c; "
        "from seq2seq import translate; print(Batch.__module__, c.__name__, translate.__name__, search.__module__)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.split() == [
        "seq2seq.text.corpus",
        "seq2seq.runs.checkpoint",
        "seq2seq.decoding.translate",
        "seq2seq.decoding.search",
    ]


def test_a_module_that_never_existed_is_still_an_import_error() -> None:
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("seq2seq.no_such_module")
