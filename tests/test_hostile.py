"""Crafted or careless input through the real `seq2seq` command: never a hang, a memory blow-up or a traceback.

Each case runs `python -m seq2seq` in a child process and checks the bad-input
contract of docs/guide.md ("Using it"): the documented exit code (2: config, 1: other
input, 130: interrupted), no traceback, at most 3 lines on stderr, and every file
that existed before left as it was. The crafted files are small: a checkpoint
whose pickle shares one list a billion times weighs a few KB.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import ROOT, TINY, single_thread_env, tiny_overrides

from seq2seq.config import load_config
from seq2seq.decoding.translate import Translator
from seq2seq.model import build_model
from seq2seq.runs import checkpoint as ckpt
from seq2seq.text.tokenizer import train_tokenizer

# exit 2: a config key, or a command-line flag (usage error)
PREFIX = {
    1: ("seq2seq: error: ",),
    2: ("seq2seq: config error: ", "seq2seq: usage error: "),
    130: ("seq2seq: interrupted",),
}
COMMAND = [sys.executable, "-m", "seq2seq"]


def run(argv: list[str], stdin: bytes = b"", shell_tail: str = "", timeout: float = 120) -> tuple[int, str, str]:
    """`python -m seq2seq ARGV` (exit code, stdout, stderr); `shell_tail` is bash after the command (`>&-`)."""
    env = {**single_thread_env(), "PYTHONPATH": str(ROOT)}
    command = [*COMMAND, *argv]
    if shell_tail:
        command = ["bash", "-c", f'"$@" {shell_tail}', "bash", *command]
    done = subprocess.run(command, input=stdin, capture_output=True, timeout=timeout, env=env)
    return done.returncode, done.stdout.decode("utf-8", "replace"), done.stderr.decode("utf-8", "replace")


def assert_refused(outcome: tuple[int, str, str], code: int, *needles: str) -> str:
    """The contract for bad input; returns the error line."""
    returned, _, err = outcome
    lines = err.strip().splitlines()
    assert returned == code, err[-2000:]
    assert "Traceback" not in err
    assert 1 <= len(lines) <= 3, lines
    assert lines[-1].startswith(PREFIX[code]), lines
    for needle in needles:
        assert needle in lines[-1], (needle, lines[-1])
    return lines[-1]


def snapshot(directory: Path) -> dict[str, str]:
    """sha256 of every file below `directory`, but the logs a run appends to and its lock."""
    skip = {"train.log", ".lock"}
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file() and p.name not in skip and "tb" not in p.relative_to(directory).parts
    }


@pytest.fixture(scope="module")
def good(trained_run: Path) -> dict[str, Any]:
    """The raw content of the session's trained checkpoint_last, to damage one field at a time."""
    raw = torch.load(trained_run / ckpt.LAST, map_location="cpu", weights_only=True)
    raw.pop("sha256")
    return dict(raw)


def save_raw(path: Path, raw: dict[str, Any], checksum: bool = True) -> Path:
    """A checkpoint file of `raw` with a correct checksum, as a tampering tool would write it
    (a dummy one for content the hash itself refuses: the refusal must come first)."""
    raw = dict(raw)
    raw["sha256"] = ckpt.content_hash(raw) if checksum else "0" * 64
    torch.save(raw, path)
    return path


def craft_pickle(path: Path, payload: bytes) -> Path:
    """A torch.save zip archive whose data.pkl is `payload`: pickles no Python object could produce."""
    torch.save({}, path)
    archive = io.BytesIO()
    with zipfile.ZipFile(path) as source, zipfile.ZipFile(archive, "w") as target:
        for info in source.infolist():
            target.writestr(info.filename, payload if info.filename.endswith("/data.pkl") else source.read(info))
    path.write_bytes(archive.getvalue())
    return path


def pickled_text(text: str) -> bytes:
    data = text.encode()
    return b"X" + len(data).to_bytes(4, "little") + data  # BINUNICODE


def aliased(tmp_path: Path, good: dict[str, Any]) -> Path:
    """A list of 1000 references to a list of 1000 references to 1000 numbers: 10**9 values to walk."""
    numbers = [0] * 1000
    torch.save({**good, "model": {"w": [[numbers] * 1000] * 1000}, "sha256": "0"}, tmp_path / "c.pt")
    return tmp_path / "c.pt"


def nested(tmp_path: Path, good: dict[str, Any]) -> Path:
    """20,000 nested lists, which Python's own pickler could not even write."""
    depth = 20_000
    lists = b"]" * depth + b"a" * (depth - 1)  # EMPTY_LIST x n, then APPEND each into the one below
    payload = b"\x80\x02}" + pickled_text("format") + pickled_text(ckpt.FORMAT) + b"s"
    payload += pickled_text("version") + b"K\x02s" + pickled_text("model") + b"}" + pickled_text("w") + lists + b"ss."
    return craft_pickle(tmp_path / "c.pt", payload)


def huge_config(tmp_path: Path, good: dict[str, Any]) -> Path:
    model = good["config"]["model"]
    config = {**good["config"], "model": {**model, "transformer": {**model["transformer"], "encoder_layers": 300_000}}}
    return save_raw(tmp_path / "c.pt", {**good, "config": config})


def one_weight(
    change: Callable[[torch.Tensor], torch.Tensor], checksum: bool = True
) -> Callable[[Path, dict[str, Any]], Path]:
    def damage(tmp_path: Path, good: dict[str, Any]) -> Path:
        name = next(iter(good["model"]))
        raw = {**good, "model": {**good["model"], name: change(good["model"][name])}}
        return save_raw(tmp_path / "c.pt", raw, checksum)

    return damage


CHECKPOINT_CASES = {
    "pickle aliasing one list": (aliased, "repeats shared parts far beyond the file's size"),
    "20,000-deep nesting": (nested, "nested more than 32 levels deep"),
    "stored config of 300,000 layers": (huge_config, "model.transformer.encoder_layers must be at most 256"),
    "sparse weight": (one_weight(lambda t: t.to_sparse(), checksum=False), "is stored sparse_coo"),
    "weight on the meta device": (one_weight(lambda t: t.to("meta"), checksum=False), "is on the meta device"),
    "integer weight": (one_weight(lambda t: t.long()), "holds torch.int64 numbers"),
}


@pytest.mark.parametrize("craft, needle", CHECKPOINT_CASES.values(), ids=CHECKPOINT_CASES.keys())
def test_crafted_checkpoint_is_refused_at_once(
    craft: Callable[[Path, dict[str, Any]], Path], needle: str, good: dict[str, Any], tmp_path: Path
) -> None:
    path = craft(tmp_path, good)
    (tmp_path / "in.txt").write_text("red cat\n", encoding="utf-8")
    before = snapshot(tmp_path)
    started = time.monotonic()
    assert_refused(run(["translate", "-c", str(path), "-i", str(tmp_path / "in.txt")], timeout=60), 1, needle)
    assert time.monotonic() - started < 30  # the aliased pickle hung for minutes; the config took 101 s
    assert snapshot(tmp_path) == before


# Resuming from a damaged checkpoint_last: refused before load_state_dict sees it.


def bad_optimizer(state: dict[str, Any]) -> dict[str, Any]:
    groups = [{**state["param_groups"][0], "params": state["param_groups"][0]["params"][:-1]}]
    return {**state, "param_groups": groups}


def with_training(change: Callable[[dict[str, Any]], None]) -> Callable[[dict[str, Any]], dict[str, Any]]:
    def damage(good: dict[str, Any]) -> dict[str, Any]:
        training = {**good["train_state"], "progress": dict(good["train_state"]["progress"])}
        change(training)
        return {**good, "train_state": training}

    return damage


RESUME_CASES = {
    "empty optimizer state": (
        with_training(lambda t: t.update(optimizer={})),
        "train_state.optimizer.param_groups must be list",
    ),
    "optimizer state of another model": (
        with_training(lambda t: t.update(optimizer=bad_optimizer(t["optimizer"]))),
        "this model has",
    ),
    "step 2**70": (with_training(lambda t: t["progress"].update(step=2**70)), "progress.step must be in [0, 2**53)"),
}


@pytest.mark.parametrize("damage, needle", RESUME_CASES.values(), ids=RESUME_CASES.keys())
def test_damaged_training_state_is_refused_on_resume(
    damage: Callable[[dict[str, Any]], dict[str, Any]],
    needle: str,
    good: dict[str, Any],
    trained_run: Path,
    corpus: Path,
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / "run"
    shutil.copytree(trained_run, run_dir, ignore=shutil.ignore_patterns("tb", ".lock"))
    save_raw(run_dir / ckpt.LAST, damage(good))
    before = snapshot(run_dir)
    overrides = tiny_overrides(corpus, run_dir, "train.max_epochs=40", "train.threads=1")
    assert_refused(run(["train", "--config", str(TINY), *overrides]), 1, needle)
    assert snapshot(run_dir) == before


# average: only checkpoints of one model.


def test_average_of_unrelated_runs_is_refused(trained_run: Path, tmp_path: Path) -> None:
    base = ckpt.read(trained_run / "checkpoint_best.pt")
    words = "red blue green cat dog sun moon tree car house bird fish lamp".split()
    lines = [" ".join(words[(i * k) % len(words)] for k in range(1, 6)) for i in range(300)]
    tokenizers = {
        "tokenizer": train_tokenizer(lines, lines, 40, True),
        "model.transformer.d_ff": base.tokenizer,
    }
    for needle, tokenizer in tokenizers.items():
        config = base.config if needle == "tokenizer" else load_config(TINY, ["model.transformer.d_ff=256"])
        model = build_model(config.model, tokenizer.src_vocab_size, tokenizer.tgt_vocab_size)
        other = ckpt.Checkpoint(config, tokenizer, model.state_dict(), run_id="another-run")
        ckpt.save(tmp_path / "other.pt", other)
        shutil.copy(trained_run / "checkpoint_best.pt", tmp_path / "ours.pt")
        before = snapshot(tmp_path)
        outcome = run(
            ["average", str(tmp_path / "ours.pt"), str(tmp_path / "other.pt"), "-o", str(tmp_path / "avg.pt")]
        )
        assert_refused(outcome, 1, "other.pt", needle, "cannot average")
        assert snapshot(tmp_path) == before


def test_average_of_two_runs_of_one_model_warns(trained_run: Path, tmp_path: Path) -> None:
    base = ckpt.read(trained_run / "checkpoint_best.pt")
    ckpt.save(tmp_path / "other.pt", ckpt.Checkpoint(base.config, base.tokenizer, base.model, run_id="another-run"))
    code, _, err = run(
        ["average", str(trained_run / "checkpoint_best.pt"), str(tmp_path / "other.pt"), "-o", str(tmp_path / "avg.pt")]
    )
    assert code == 0 and "Traceback" not in err
    assert sum("averaging checkpoints of different runs" in line for line in err.splitlines()) == 1
    assert ckpt.read(tmp_path / "avg.pt").averaged_from


# Config: YAML bombs, endless files, absurd sizes.

ALIAS_BOMB = "".join(
    f"l{n}: &l{n} [" + ", ".join([f"*l{n - 1}" if n else "lol"] * 9) + "]\n" for n in range(9)
)  # 9**9 strings from 600 bytes


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["train", "--config", "{bomb}"], "YAML aliases (*name) are not supported"),
        (["train", "--config", "/dev/zero"], "/dev/zero: not a regular file"),
        (["train", "--config", str(TINY), "model.d_model=1099511627776"], "model.d_model must be at most 65536"),
        (
            ["train", "--config", str(TINY), "model.transformer.encoder_layers=100000"],
            "model.transformer.encoder_layers must be at most 256",
        ),
        (
            ["train", "--config", str(TINY), "model.transformer.max_relative_distance=1099511627776"],
            "must be at most 65536",
        ),
        (
            ["train", "--config", str(TINY), "data.sampling_nbest=1099511627776"],
            "data.sampling_nbest must be at most 1024",
        ),
        (
            ["train", "--config", str(TINY), "checkpoint.keep_last=0", "checkpoint.average_last=3"],
            "checkpoint.keep_last (0)",
        ),
        (
            ["translate", "-c", "{checkpoint}", "decode.beam_size=1099511627776"],
            "decode.beam_size must be at most 1024",
        ),
        (["translate", "-c", "{export}"], "YAML aliases (*name) are not supported"),
        (["evaluate", "--hypotheses", "{text}", "--ref", "{text}", "--bootstrap", "2000000000"], "--bootstrap"),
    ],
    ids=[
        "alias bomb",
        "/dev/zero",
        "d_model",
        "layers",
        "relative distance",
        "sampling_nbest",
        "keep_last",
        "beam_size",
        "export's seq2seq.yaml",
        "bootstrap",
    ],
)
def test_bad_config_is_refused_with_the_key(argv: list[str], needle: str, trained_run: Path, tmp_path: Path) -> None:
    (tmp_path / "bomb.yaml").write_text(ALIAS_BOMB, encoding="utf-8")
    (tmp_path / "export").mkdir()
    (tmp_path / "export" / "model.bin").write_bytes(b"")
    (tmp_path / "export" / "seq2seq.yaml").write_text(ALIAS_BOMB, encoding="utf-8")
    (tmp_path / "text").write_text("red cat\n", encoding="utf-8")
    names = {
        "bomb": tmp_path / "bomb.yaml",
        "checkpoint": trained_run / "checkpoint_best.pt",
        "export": tmp_path / "export",
        "text": tmp_path / "text",
    }
    before = snapshot(tmp_path)
    assert_refused(run([arg.format(**names) for arg in argv], stdin=b"red cat\n"), 2, needle)
    assert snapshot(tmp_path) == before


# Input text: endless lines, corrupt gzip streams, closed or vanished standard streams.


def corrupt_gzip(path: Path, lines: int) -> Path:
    data = bytearray(gzip.compress(b"red cat blue dog\n" * lines))
    data[30:60] = bytes(b ^ 0xFF for b in data[30:60])  # inside the deflate stream, past the header
    path.write_bytes(bytes(data))
    return path


def test_endless_line_is_refused_naming_file_and_line(trained_run: Path) -> None:
    checkpoint = str(trained_run / "checkpoint_best.pt")
    assert_refused(run(["translate", "-c", checkpoint, "-i", "/dev/zero"]), 1, "/dev/zero:1: line longer than 1 MiB")
    piped = run(["translate", "-c", checkpoint], stdin=b"red cat\n" + b"\0" * (2 << 20))
    assert_refused(piped, 1, "stdin:2: line longer than 1 MiB")
    assert piped[1].count("\n") == 1  # the line before it was translated
    for argv in (["translate", "-c", checkpoint], ["translate", "-c", checkpoint, "-i", "/dev/stdin"]):
        code, out, err = run(argv, stdin=b"red cat\nblue dog\n")
        assert (code, out.count("\n")) == (0, 2), err  # stdin and pipes still work


@pytest.mark.usefixtures("one_thread")  # as the command's one thread, for the translations compared
@pytest.mark.parametrize("input_format", ["text", "jsonl"])
def test_a_line_longer_than_1_mib_is_left_untranslated_and_the_rest_is_translated(
    trained_run: Path, input_format: str
) -> None:
    """A 10 MB line between two short ones: an empty output line in its place (one output line per input
    line), a warning naming stdin:LINE, and the other lines translated as they are on their own."""
    checkpoint = str(trained_run / "checkpoint_best.pt")
    words = ["red cat", "blue " * (2 << 20), "sun tree"]
    lines = [json.dumps({"text": w}) if input_format == "jsonl" else w for w in words]
    argv = ["translate", "-c", checkpoint, "--input-format", input_format]
    code, out, err = run(argv, stdin="\n".join(lines).encode() + b"\n")
    assert code == 0, err[-2000:]
    assert "stdin:2: line longer than 1 MiB; not translated, its output line is empty" in err
    output = out.split("\n")
    assert len(output) == 4 and output[1] == "" and output[3] == ""
    assert [output[0], output[2]] == Translator.from_checkpoint(checkpoint).translate(["red cat", "sun tree"])


def test_a_jsonl_number_too_long_for_python_is_one_line_after_the_lines_before_it(trained_run: Path) -> None:
    """An integer of 5,000 digits is past Python's int-string limit (a ValueError inside json.loads)."""
    checkpoint = str(trained_run / "checkpoint_best.pt")
    lines = b'{"text": "red cat"}\n{"text": "sun", "prefix": ' + b"7" * 5000 + b'}\n{"text": "tree"}\n'
    outcome = run(["translate", "-c", checkpoint, "--input-format", "jsonl"], stdin=lines)
    assert_refused(outcome, 1, "stdin:2: a number too long to read")
    assert outcome[1].count("\n") == 1  # the line before it was translated


@pytest.mark.usefixtures("one_thread")  # as the command's one thread, for the translations compared
def test_a_jsonl_input_saved_with_a_byte_order_mark_translates(trained_run: Path) -> None:
    checkpoint = str(trained_run / "checkpoint_best.pt")
    lines = b'\xef\xbb\xbf{"text": "red cat"}\n{"text": "sun tree"}\n'
    code, out, err = run(["translate", "-c", checkpoint, "--input-format", "jsonl"], stdin=lines)
    assert code == 0, err[-2000:]
    assert out.splitlines() == Translator.from_checkpoint(checkpoint).translate(["red cat", "sun tree"])


def test_corrupt_gzip_is_refused_naming_the_file(trained_run: Path, corpus: Path, tmp_path: Path) -> None:
    data = tmp_path / "data"
    shutil.copytree(corpus, data)
    (data / "train.src").unlink()
    bad = corrupt_gzip(data / "train.src.gz", 3000)
    ref = corrupt_gzip(tmp_path / "ref.gz", 10)
    hyps = tmp_path / "hyps.txt"
    hyps.write_text("red cat\n" * 10, encoding="utf-8")
    before = snapshot(tmp_path)
    overrides = tiny_overrides(data, tmp_path / "run", "train.threads=1")
    assert_refused(run(["train", "--config", str(TINY), *overrides]), 1, str(bad), "corrupt compressed data")
    assert_refused(run(["evaluate", "--hypotheses", str(hyps), "--ref", str(ref)]), 1, str(ref), "corrupt")
    assert {k: v for k, v in snapshot(tmp_path).items() if not k.startswith("run/")} == before


def test_closed_stdout_is_one_line(trained_run: Path, tmp_path: Path) -> None:
    source = tmp_path / "in.txt"
    source.write_text("red cat\n", encoding="utf-8")
    outcome = run(["translate", "-c", str(trained_run / "checkpoint_best.pt"), "-i", str(source)], shell_tail=">&-")
    assert_refused(outcome, 1, "stdout is closed")


def test_reader_leaving_early_ends_quietly(trained_run: Path, tmp_path: Path) -> None:
    """`| head -1` as for standard tools: no message, no ignored BrokenPipeError at exit."""
    source = tmp_path / "in.txt"
    source.write_text("red cat\n" * 5000, encoding="utf-8")
    argv = ["translate", "-c", str(trained_run / "checkpoint_best.pt"), "-i", str(source), "decode.strategy=greedy"]
    code, out, err = run(argv, shell_tail="| head -1; exit ${PIPESTATUS[0]}")
    assert (code, err, out.count("\n")) == (0, "", 1)


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="watches the child's memory maps in /proc")
def test_ctrl_c_during_imports_is_one_line(trained_run: Path) -> None:
    """SIGINT while numpy loads (the CLI's imports), not merely once the command runs."""
    env = {**single_thread_env(), "PYTHONPATH": str(ROOT)}
    argv = [*COMMAND, "translate", "-c", str(trained_run / "checkpoint_best.pt"), "-i", "/dev/null"]
    child = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    maps = Path(f"/proc/{child.pid}/maps")
    deadline = time.monotonic() + 30
    while "numpy" not in maps.read_text() and time.monotonic() < deadline:
        time.sleep(0.001)
    child.send_signal(signal.SIGINT)
    _, err = child.communicate(timeout=60)
    assert_refused((child.returncode, "", err.decode()), 130)


# Data-parallel training: one rank killed.


@pytest.mark.trains  # torchrun's workers train, then a `seq2seq train` resumes: both in child processes
def test_survivor_of_a_killed_rank_says_one_line_and_the_run_resumes(corpus: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    common = ("validation.bleu=false", "train.max_tokens=256", "train.threads=1", "checkpoint.every=2")
    overrides = tiny_overrides(corpus, run_dir, *common)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", *COMMAND[1:]]
    env = {**single_thread_env(), "PYTHONPATH": str(ROOT)}
    launcher = subprocess.Popen(
        [*command, "train", "--config", str(TINY), *overrides, "train.max_steps=100000"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 120
    while not (run_dir / ckpt.LAST).exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in subprocess.run(["pgrep", "-P", str(launcher.pid)], capture_output=True, text=True).stdout.split():
        if b"\0RANK=1\0" in b"\0" + Path(f"/proc/{pid}/environ").read_bytes():
            os.kill(int(pid), signal.SIGKILL)
    err = launcher.communicate(timeout=120)[1].decode("utf-8", "replace")
    assert launcher.returncode != 0
    assert "seq2seq: error: rank 0: another process of this run stopped" in err or "stopped by SIGTERM" in err, err
    assert "[rank0]: Traceback" not in err and "seq2seq/training" not in err  # torchrun's own traceback remains
    step = ckpt.read(run_dir / ckpt.LAST).training
    assert step is not None
    code, _, err = run(["train", "--config", str(TINY), *overrides, f"train.max_steps={step.progress.step + 2}"])
    assert code == 0, err[-2000:]
