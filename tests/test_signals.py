"""A Ctrl-C or SIGTERM is never lost, wherever it lands.

Each case runs the real command in a child process whose driver sends the signal to
the process itself at a chosen moment: inside a garbage-collector callback (where
Python's own KeyboardInterrupt is swallowed as "Exception ignored"), inside a decode
step (a torch call in the middle of the search) or inside a checkpoint save. The
command must end with the shell's code (130, 143), one line on stderr and no
traceback, with the output written so far intact: whole lines, a prefix of the
uninterrupted output; a training run's checkpoint loadable and resumable.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, TINY, single_thread_env, tiny_overrides

from seq2seq import interrupt
from seq2seq.cli import main
from seq2seq.interrupt import Interrupted, Interrupts
from seq2seq.runs import checkpoint as ckpt

pytestmark = pytest.mark.usefixtures("one_thread")

# Sends `signal` to its own process once armed: after `after` calls of the function `arm` names
# ("module:attribute.path"; e.g. a chunk translated, a checkpoint written), at the moment `where` names:
# in the next garbage collection (soon: the threshold is set to 1), in the 25th torch call from then on, or at once.
DRIVER = r"""
import gc, json, os, signal, sys
import torch
from torch.overrides import TorchFunctionMode

spec = json.loads(sys.argv[1])
sig = getattr(signal, spec["signal"])
state = {"calls": 0, "fired": False}

def fire():
    if not state["fired"]:
        state["fired"] = True
        os.kill(os.getpid(), sig)  # handled right here, in this frame, before the next bytecode

def in_gc_callback(phase, info):
    if phase == "start":
        fire()

class InTorchCall(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.calls = 0
    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        if self.calls == 25:
            fire()
        return func(*args, **(kwargs or {}))

def armed():
    if spec["where"] == "gc":
        gc.callbacks.append(in_gc_callback)
        gc.set_threshold(1)  # a collection at the next allocation of a container, wherever that is
    elif spec["where"] == "step":
        InTorchCall().__enter__()
    else:
        fire()

def counting(original):
    def wrapper(*args, **kwargs):
        result = original(*args, **kwargs)
        state["calls"] += 1
        if state["calls"] == spec["after"]:
            armed()
        return result
    return wrapper

import importlib
module, _, path = spec["arm"].partition(":")
owner = importlib.import_module(module)
*parents, name = path.split(".")
for parent in parents:
    owner = getattr(owner, parent)
setattr(owner, name, counting(getattr(owner, name)))

from seq2seq.entry import main
sys.exit(main(spec["argv"]))
"""

TRANSLATE_CHUNK = "seq2seq.decoding.translate:Translator.translate_full"
LINES = [
    f"{a} {b} {c}"
    for a, b, c in zip(
        "red blue green cat dog sun".split() * 2,
        "moon tree car house bird fish".split() * 2,
        "sun dog cat red blue tree".split() * 2,
    )
]


def run_driver(
    argv: list[str], sig: signal.Signals, where: str, arm: str, after: int
) -> subprocess.CompletedProcess[str]:
    spec = {"argv": argv, "signal": sig.name, "where": where, "arm": arm, "after": after}
    env = {**single_thread_env(), "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-c", DRIVER, json.dumps(spec)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # undo a shell's SIG_IGN
    )


def assert_interrupted(proc: subprocess.CompletedProcess[str], sig: signal.Signals) -> None:
    assert proc.returncode == 128 + sig, proc.stderr
    assert "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("seq2seq: interrupted"), proc.stderr


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("signals") / "input.txt"
    path.write_text("".join(line + "\n" for line in LINES), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def uninterrupted(trained_run: Path, source: Path, tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    out = tmp_path_factory.mktemp("signals") / "full.txt"
    argv = ["translate", "-c", str(trained_run / "checkpoint_best.pt"), "-i", str(source), "-o", str(out)]
    assert main([*argv, "--interactive", "decode.strategy=greedy"]) == 0
    return out.read_text(encoding="utf-8").splitlines(keepends=True)


@pytest.mark.parametrize("where", ["gc", "step"])
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=lambda s: s.name)
def test_translate_stops_with_its_output_intact(
    trained_run: Path, source: Path, uninterrupted: list[str], where: str, sig: signal.Signals
) -> None:
    """One line a chunk (--interactive), armed after the third: the signal lands in the middle of decoding."""
    argv = ["translate", "-c", str(trained_run / "checkpoint_best.pt"), "-i", str(source), "--interactive"]
    proc = run_driver([*argv, "decode.strategy=greedy"], sig, where, arm=TRANSLATE_CHUNK, after=3)
    assert_interrupted(proc, sig)
    written = proc.stdout.splitlines(keepends=True)
    assert 3 <= len(written) < len(LINES)  # stopped at the next safe point, not at the end
    assert written == uninterrupted[: len(written)]


def test_evaluate_stops_inside_a_decode_step(trained_run: Path, corpus: Path) -> None:
    """The test set is one call: the safe point is between its batches (armed after the first)."""
    argv = ["evaluate", "-c", str(trained_run / "checkpoint_best.pt"), "decode.max_tokens=64", "decode.strategy=greedy"]
    proc = run_driver(argv, signal.SIGINT, "step", arm="seq2seq.decoding.translate:Translator._search", after=1)
    assert_interrupted(proc, signal.SIGINT)
    assert "BLEU" not in proc.stdout


@pytest.mark.trains
@pytest.mark.parametrize("where", ["save", "gc"])
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=lambda s: s.name)
def test_training_saves_and_resumes_after_a_signal_anywhere(
    corpus: Path, tmp_path: Path, where: str, sig: signal.Signals
) -> None:
    """Armed after the second update's saves (a step checkpoint and checkpoint_last each update): inside the
    fourth write, or in the next collection."""
    run = tmp_path / "run"
    fast = ["validation.bleu=false", "train.max_tokens=256", "train.max_steps=200", "train.threads=1"]
    argv = ["train", "--config", str(TINY), *tiny_overrides(corpus, run, *fast, "checkpoint.every=1")]
    proc = run_driver(argv, sig, where, arm="torch:save", after=4)
    assert proc.returncode == 128 + sig, proc.stderr
    assert "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr, proc.stderr
    assert f"stopped by {sig.name}; run the same command to resume" in proc.stderr
    training = ckpt.read(run / "checkpoint_last.pt").training
    assert training is not None
    stopped = training.progress.step
    assert 2 <= stopped < 200
    assert f"stopped by a signal at step {stopped}" in (run / "train.log").read_text()
    assert main([*argv[:-1], f"train.max_steps={stopped + 1}", "checkpoint.every=1"]) == 0
    assert f"at step {stopped} (epoch" in (run / "train.log").read_text()


# The mechanism itself, in this process.


def _deliver(sig: signal.Signals = signal.SIGINT) -> None:
    os.kill(os.getpid(), sig)  # handled before the next bytecode of this frame


def test_a_signal_is_recorded_and_raised_at_the_next_safe_point() -> None:
    with Interrupts() as interrupts:
        _deliver(signal.SIGTERM)
        assert interrupts.received == signal.SIGTERM  # nothing raised where it landed
        with pytest.raises(Interrupted) as caught:
            interrupt.check()
    assert caught.value.exit_code == 143 and interrupts.exit_code == 143


def test_at_once_raises_only_in_the_waiting_frame() -> None:
    with Interrupts() as interrupts, pytest.raises(Interrupted), interrupts.at_once():
        os.kill(os.getpid(), signal.SIGINT)  # lands in this frame, the one waiting
    with Interrupts() as interrupts, interrupts.at_once():
        _deliver()  # lands in another frame (as in a callback): recorded, not raised there
    assert interrupts.received == signal.SIGINT


def test_interrupts_without_library_checks_leave_library_safe_points_alone() -> None:
    """A trainer's: a validation in progress runs on; the trainer itself reads `received` between updates."""
    with Interrupts(library_checks=False) as interrupts:
        _deliver()
        interrupt.check()
        with interrupt.at_once():
            pass
    assert interrupts.received == signal.SIGINT


def test_an_inherited_ignore_is_kept() -> None:
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with Interrupts() as interrupts:
            _deliver()
        assert interrupts.received is None
    finally:
        signal.signal(signal.SIGINT, previous)
