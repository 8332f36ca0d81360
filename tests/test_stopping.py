"""Stopping a command from outside: Ctrl-C and SIGTERM in every phase of `prepare`, a Ctrl-C before the signal
handlers exist, a kill in the middle of replacing prepared data, a signal while a server loads its model.

Each case runs the real command (`python -m seq2seq`) in a process group of its own, through a driver that
swaps one function for a stand-in from `stopper.py` (written next to the test): the stand-in sends the signal
to the whole group from inside the phase under test, as a terminal's Ctrl-C does, and where that phase could
run for minutes (SentencePiece's training, an encoding worker's chunk) it then sleeps for ten. The command
must end with the shell's code (130, 143), one line on stderr and no traceback, its temporary directory
removed and no process of its group left; a killed preparation must leave a whole directory, and the next
`prepare` must leave no temporary behind.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import ROOT, TINY, single_thread_env, tiny_overrides, write_corpus

from seq2seq.cli import main
from seq2seq.text.prepare import MANIFEST

# Runs `python -m seq2seq ARGV` after replacing spec["patch"]'s attributes ("module:attr.path") with stopper.py's
# ("stopper:name") or a value, and, with spec["fire_on_import"], sends SIGINT to itself when that module is first
# looked for (before it is imported).
DRIVER = r"""
import importlib, json, os, runpy, signal, sys

spec = json.loads(sys.argv[1])

class FireOnImport:
    def find_spec(self, name, path=None, target=None):
        if name == spec["fire_on_import"]:
            sys.meta_path.remove(self)
            os.kill(os.getpid(), signal.SIGINT)  # handled right here, inside the import machinery
        return None

for where, what in spec["patch"].items():
    module, _, path = where.partition(":")
    owner = importlib.import_module(module)
    *parents, name = path.split(".")
    for parent in parents:
        owner = getattr(owner, parent)
    if isinstance(what, str):
        source, _, attribute = what.partition(":")
        what = getattr(importlib.import_module(source), attribute)
    setattr(owner, name, what)
if spec["fire_on_import"]:
    sys.meta_path.insert(0, FireOnImport())
sys.argv = ["seq2seq", *spec["argv"]]
runpy.run_module("seq2seq", run_name="__main__", alter_sys=True)
"""

STOPPER = r'''
"""Stand-ins that stop the command from inside one phase (STOP_SIGNAL to its process group, as a Ctrl-C would;
or SIGKILL to the process itself), then run the real function or work on for ten minutes."""
import os
import pathlib
import shutil
import signal
import sys
import time

import seq2seq.text.prepare as prepare

SIGNAL = signal.Signals[os.environ.get("STOP_SIGNAL", "SIGINT")]
real = {
    "reservoir": prepare._reservoir,
    "encode_shards": prepare.encode_shards,
    "init_worker": prepare._init_worker,
    "rename": pathlib.Path.rename,
    "rmtree": shutil.rmtree,
}
fired = []
renames = []


def to_the_group():
    if not fired:
        fired.append(True)
        os.killpg(os.getpgid(0), SIGNAL)


def reservoir(*args):  # the streaming pass, in the command's own process
    to_the_group()
    return real["reservoir"](*args)


def trained_state(*args):  # SentencePiece's training, in its child process
    to_the_group()
    time.sleep(600)


def encode_chunk(task):  # an encoding worker's chunk
    to_the_group()
    time.sleep(600)


def two_workers(directory, shard_lines, tokenizer, max_len, workers):  # a pool, however small the corpus
    return real["encode_shards"](directory, shard_lines, tokenizer, max_len, 2)


def init_worker(state):  # importing this module in a worker sent the signal already, before this runs
    real["init_worker"](state)


def killed(*args):  # SIGKILL to this process alone: the out-of-memory killer, a `kill -9`
    os.kill(os.getpid(), signal.SIGKILL)


def rename_or_killed(self, target):  # killed before the KILL_AT_RENAME-th rename
    renames.append(self)
    if len(renames) == int(os.environ["KILL_AT_RENAME"]):
        os.kill(os.getpid(), signal.SIGKILL)
    return real["rename"](self, target)


def rmtree_or_killed(*args, **kwargs):  # killed at the first removal of a directory tree
    os.kill(os.getpid(), signal.SIGKILL)


if "--multiprocessing-fork" in sys.orig_argv and os.environ.get("STOP_WHILE_STARTING"):
    to_the_group()  # imported while an encoding worker starts (unpickling its initializer)
'''


def drive(
    tmp_path: Path,
    argv: list[str],
    patch: dict[str, Any] | None = None,
    fire_on_import: str = "",
    timeout: float = 120,
    **env: str,
) -> subprocess.CompletedProcess[str]:
    """The command under the driver, in a new session (its own process group); returns once it has ended and
    no process of its group is left running."""
    (tmp_path / "stopper.py").write_text(STOPPER, encoding="utf-8")
    spec = {"argv": argv, "patch": patch or {}, "fire_on_import": fire_on_import}
    environment = {**single_thread_env(), "PYTHONPATH": f"{tmp_path}:{ROOT}", **env}
    command = [sys.executable, "-c", DRIVER, json.dumps(spec)]
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environment,
                          start_new_session=True) as child:  # fmt: skip
        try:
            out, err = child.communicate(timeout=timeout)
        finally:
            if child.poll() is None:
                os.killpg(child.pid, signal.SIGKILL)
    assert_group_gone(child.pid)
    return subprocess.CompletedProcess(command, child.returncode, out, err)


def assert_group_gone(pgid: int, timeout: float = 30) -> None:
    """No process of the group is alive (zombies aside: this machine's init may not reap them)."""
    if not pgid or not Path("/proc/self/stat").exists():
        return
    deadline = time.monotonic() + timeout
    while (alive := _group_members(pgid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive, f"processes of the command's group still running: {alive}"


def _group_members(pgid: int) -> list[int]:
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, _, group = stat.read_text().rpartition(")")[2].split()[:3]
        except (OSError, ValueError):
            continue
        if int(group) == pgid and state != "Z":
            members.append(int(stat.parent.name))
    return members


def assert_stopped(proc: subprocess.CompletedProcess[str], sig: signal.Signals) -> list[str]:
    """The shell's code, no traceback, and exactly one line saying so, the last; returns stderr's lines."""
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 128 + sig, proc.stderr
    assert "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr, proc.stderr
    said = [entry for entry in lines if entry.startswith("seq2seq: ")]
    assert len(said) == 1 and said[0] == lines[-1], lines
    by = "" if sig == signal.SIGINT else f" by {sig.name}"
    assert lines[-1].startswith(f"seq2seq: interrupted{by}"), lines
    return lines


# `seq2seq prepare`: a signal in each phase stops it within moments, its temporary directory removed.

POOL = {"seq2seq.text.prepare:encode_shards": "stopper:two_workers"}
PHASES: dict[str, dict[str, Any]] = {
    "streaming pass": {"seq2seq.text.prepare:_reservoir": "stopper:reservoir"},
    "SentencePiece": {
        "seq2seq.text.prepare:_trained_state": "stopper:trained_state",
        "seq2seq.text.prepare:SPM_PROCESS_MIN": 0,
    },
    "workers starting": {**POOL, "seq2seq.text.prepare:_init_worker": "stopper:init_worker"},
    "encoding": {**POOL, "seq2seq.text.prepare:encode_chunk": "stopper:encode_chunk"},
}


@pytest.mark.parametrize(
    "phase, sig",
    [
        ("streaming pass", signal.SIGINT),
        ("SentencePiece", signal.SIGINT),
        ("SentencePiece", signal.SIGTERM),
        ("workers starting", signal.SIGINT),
        ("encoding", signal.SIGINT),
        ("encoding", signal.SIGTERM),
    ],
    ids=lambda x: x.name if isinstance(x, signal.Signals) else x,
)
def test_prepare_stops_in_every_phase(phase: str, sig: signal.Signals, tmp_path: Path) -> None:
    corpus, run = write_corpus(tmp_path / "corpus"), tmp_path / "run"
    argv = ["prepare", "--config", str(TINY), "--workers", "2", *tiny_overrides(corpus, run)]
    env = {"STOP_SIGNAL": sig.name, **({"STOP_WHILE_STARTING": "1"} if phase == "workers starting" else {})}
    started = time.monotonic()
    proc = drive(tmp_path, argv, PHASES[phase], **env)
    lines = assert_stopped(proc, sig)
    assert time.monotonic() - started < 100  # the stand-ins work on for ten minutes unless stopped
    assert not list(run.glob("prepared*")), list(run.glob("*"))  # nothing prepared, no temporary left
    if phase == "streaming pass":  # stopped there, not at the next phase's first safe point
        assert not any("SentencePiece" in line for line in lines), lines


def test_an_encoding_worker_killed_alone_is_one_line(tmp_path: Path) -> None:
    """Not a wait for a lock the dead worker held (multiprocessing.Pool's hang)."""
    corpus, run = write_corpus(tmp_path / "corpus"), tmp_path / "run"
    argv = ["prepare", "--config", str(TINY), "--workers", "2", *tiny_overrides(corpus, run)]
    proc = drive(tmp_path, argv, {**POOL, "seq2seq.text.prepare:encode_chunk": "stopper:killed"})
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        "seq2seq: error: an encoding process ended without finishing its work (killed by SIGKILL; out of memory?)"
    )
    assert not list(run.glob("prepared*"))


# A Ctrl-C before the handlers exist (the entry point's own imports) or while torch loads.


@pytest.mark.parametrize(
    "command, moment",
    [
        ("translate", "seq2seq.entry"),
        ("translate", "seq2seq.interrupt"),
        ("translate", "torch"),
        ("evaluate", "seq2seq.interrupt"),
        ("evaluate", "torch"),
        ("train", "seq2seq.interrupt"),
        ("train", "torch"),
    ],
)
def test_an_early_ctrl_c_is_one_line(
    command: str, moment: str, trained_run: Path, corpus: Path, tmp_path: Path
) -> None:
    checkpoint = str(trained_run / "checkpoint_best.pt")
    argv = {
        "translate": ["translate", "-c", checkpoint, "-i", str(corpus / "test.src")],
        "evaluate": [
            "evaluate",
            "-c",
            checkpoint,
            "--src",
            str(corpus / "test.src"),
            "--ref",
            str(corpus / "test.tgt"),
        ],
        "train": ["train", "--config", str(TINY), *tiny_overrides(corpus, tmp_path / "run")],
    }[command]
    proc = drive(tmp_path, argv, fire_on_import=moment)
    assert_stopped(proc, signal.SIGINT)
    assert proc.stdout == ""


# A preparation killed outright: the next one leaves no temporary and never lost both directories.


@pytest.mark.parametrize(
    "kill, reused",
    [
        ("while building", True),  # the rerun asks for the data already there
        ("before the swap", False),
        ("between the swap's renames", True),  # the finished directory is put in place
        ("removing the old directory", True),
    ],
)
def test_a_killed_preparation_leaves_no_temporary(
    kill: str, reused: bool, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    corpus, run = write_corpus(tmp_path / "corpus", n_train=300), tmp_path / "run"
    argv = ["prepare", "--config", str(TINY), *tiny_overrides(corpus, run)]
    assert main(argv) == 0
    changed = [*argv, "data.max_len=20"]
    patch, env = {
        "while building": ({"seq2seq.text.prepare:_reservoir": "stopper:killed"}, {}),
        "before the swap": ({"pathlib:Path.rename": "stopper:rename_or_killed"}, {"KILL_AT_RENAME": "1"}),
        "between the swap's renames": ({"pathlib:Path.rename": "stopper:rename_or_killed"}, {"KILL_AT_RENAME": "2"}),
        "removing the old directory": ({"shutil:rmtree": "stopper:rmtree_or_killed"}, {}),
    }[kill]
    assert drive(tmp_path, changed, patch, **env).returncode == -signal.SIGKILL
    whole = [path for path in run.rglob(MANIFEST)]
    assert whole, "a kill lost both the old and the new data"
    rerun = argv if kill == "while building" else changed
    capsys.readouterr()
    assert main(rerun) == 0
    err = capsys.readouterr().err
    assert ("using the prepared data" in err) == reused, err
    assert not list(run.glob("prepared.tmp*")) and (run / "prepared").is_dir()
    max_len = json.loads((run / "prepared" / MANIFEST).read_text())["settings"]["max_len"]
    assert max_len == (64 if kill == "while building" else 20)


# `seq2seq serve`: a signal while it starts (its engine, the model) ends the command before anything listens.


def test_a_signal_while_the_server_starts_stops_it_before_it_listens(trained_run: Path, tmp_path: Path) -> None:
    argv = ["serve", "-c", str(trained_run / "checkpoint_best.pt"), "--port", "0", "--threads", "1"]
    proc = drive(tmp_path, argv, fire_on_import="seq2seq.serve.engine", timeout=120)
    lines = assert_stopped(proc, signal.SIGINT)
    assert not any("serving on" in line for line in lines), lines
