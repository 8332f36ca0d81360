"""Hostile input through the real `seq2seq` command: nothing lost, nothing silent.

Every case ends with the documented exit code (2: config error, 1: other bad input,
130: interrupted), a short stderr whose last line is `seq2seq: ...` and no traceback,
and leaves every file it was given as it was. Add a case to a table to cover a new probe.
In-process `main([...])` where that is faithful; a child process where a real stdin,
a redirection or a signal matters.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import ROOT, TINY, single_thread_env, write_corpus

from seq2seq.app import streams
from seq2seq.cli import main
from seq2seq.config import TransformerConfig
from seq2seq.decoding.translate import Translator
from seq2seq.errors import UserError
from seq2seq.runs.security import MIN_TORCH, check_torch_version
from seq2seq.text.tokenizer import train_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")

# exit 2: a config key, or a command-line flag (usage error)
PREFIX = {
    1: ("seq2seq: error: ",),
    2: ("seq2seq: config error: ", "seq2seq: usage error: "),
    130: ("seq2seq: interrupted",),
}


@dataclass
class Outcome:
    code: int
    out: str
    err: str


def assert_clean_failure(outcome: Outcome, code: int, *needles: str) -> str:
    """The CLI's contract for bad input; returns the error line."""
    lines = outcome.err.strip().splitlines()
    assert outcome.code == code, outcome.err
    assert "Traceback" not in outcome.err
    assert 1 <= len(lines) <= 3, lines
    assert lines[-1].startswith(PREFIX[code]), lines
    for needle in needles:
        assert needle in lines[-1], (needle, lines[-1])
    return lines[-1]


def run_in_process(argv: list[str], capsys: pytest.CaptureFixture[str]) -> Outcome:
    capsys.readouterr()  # drop what earlier steps printed
    code = main(argv)
    captured = capsys.readouterr()
    return Outcome(code, captured.out, captured.err)


def run_process(argv: list[str], stdin: bytes | Path = b"", timeout: float = 300) -> Outcome:
    """`python -m seq2seq ARGV` with `stdin` piped in (bytes) or redirected from a file (Path)."""
    env = {**single_thread_env(), "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "seq2seq", *argv]
    if isinstance(stdin, Path):
        with open(stdin, "rb") as f:
            proc = subprocess.run(command, stdin=f, capture_output=True, timeout=timeout, env=env)
    else:
        proc = subprocess.run(command, input=stdin, capture_output=True, timeout=timeout, env=env)
    return Outcome(proc.returncode, proc.stdout.decode("utf-8"), proc.stderr.decode("utf-8", "replace"))


@pytest.fixture(scope="module")
def checkpoint(trained_run: Path) -> Path:
    return trained_run / "checkpoint_best.pt"


def translate_argv(checkpoint: Path, *options: str, override: str = "decode.strategy=greedy") -> list[str]:
    return ["translate", "-c", str(checkpoint), *options, "decode.strategy=greedy", override]


def greedy(checkpoint: Path, lines: list[str]) -> list[str]:
    """What `translate_argv` makes of `lines` given in one batch: the library's greedy translations, whatever the
    model learnt (what it learns moves with the CPU's kernels)."""
    return Translator.from_checkpoint(checkpoint, strategy="greedy").translate(lines)


# Config: exit 2 with the key named, before anything is written.

CONFIG_CASES = {
    # id: (overrides, YAML file text or None for configs/tiny.yaml, what the message must name)
    "seed from YAML beyond 64 bits": ([], b"train:\n  seed: 1.0e+20\n", ["train.seed"]),
    "seed beyond 64 bits": (["train.seed=100000000000000000000"], None, ["train.seed"]),
    "seed 2**63": (["train.seed=9223372036854775808"], None, ["train.seed"]),
    "negative seed": (["train.seed=-1"], None, ["train.seed"]),
    "decode seed beyond 64 bits": (["decode.seed=9223372036854775808"], None, ["decode.seed"]),
    "negative decode seed": (["decode.seed=-5"], None, ["decode.seed"]),
    "negative max_len_b": (["decode.max_len_b=-1000"], None, ["decode.max_len_b"]),
    "no length allowed": (["decode.max_len_a=0", "decode.max_len_b=0"], None, ["decode.max_len_b"]),
    "empty run_dir": (["train.run_dir="], None, ["train.run_dir"]),
    "blank run_dir": (["train.run_dir=   "], None, ["train.run_dir"]),
    "empty data.dir": (["data.dir="], None, ["data.dir"]),
    "empty split": (["data.train="], None, ["data.train"]),
    "empty language": (["data.src_lang="], None, ["data.src_lang"]),
    "threads beyond C int": (["train.threads=100000000000"], None, ["train.threads"]),
    "beam beyond 64 bits": ([], b"decode:\n  beam_size: 1.0e+30\n", ["decode.beam_size"]),
    "Latin-1 byte in the file": ([], b"data:\n  dir: caf\xe9\n", [":2:", "UTF-8"]),
    "YAML nested too deeply": ([], b"[" * 100_000, ["nested too deeply"]),
    "override nested too deeply": (["train.seed=" + "[" * 100_000], None, ["train.seed"]),
}


@pytest.mark.parametrize("overrides, yaml, needles", CONFIG_CASES.values(), ids=CONFIG_CASES.keys())
def test_bad_config_is_one_line_and_writes_nothing(
    overrides: list[str],
    yaml: bytes | None,
    needles: list[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.chdir(tmp_path)  # an empty run_dir or data.dir would mean this directory
    config = tmp_path / "experiment.yaml"
    config.write_bytes(yaml if yaml is not None else TINY.read_bytes())
    line = assert_clean_failure(run_in_process(["train", "--config", str(config), *overrides], capsys), 2, *needles)
    if yaml is not None and b"\xe9" in yaml:
        assert str(config) in line
    assert [p.name for p in tmp_path.iterdir()] == ["experiment.yaml"]


@pytest.mark.parametrize("override", ["decode.max_len_b=-1000", "decode.seed=100000000000000000000"])
def test_bad_decode_override_at_translation_time(
    override: str, checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = tmp_path / "in.txt"
    source.write_text("red cat\n", encoding="utf-8")
    outcome = run_in_process(translate_argv(checkpoint, "-i", str(source), override=override), capsys)
    assert_clean_failure(outcome, 2, override.split("=")[0])


# translate: an output that is also read is refused before it is opened (which would empty it).


def same_path(f: Path) -> Path:
    return f.parent / "sub" / ".." / f.name


def hard_link(f: Path) -> Path:
    os.link(f, f.with_name("hard"))
    return f.with_name("hard")


def symbolic_link(f: Path) -> Path:
    f.with_name("soft").symlink_to(f.name)
    return f.with_name("soft")


@pytest.mark.parametrize("alias", [lambda f: f, same_path, hard_link, symbolic_link], ids=lambda a: a.__name__)
def test_output_that_is_the_input_is_refused(
    alias: object, checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = tmp_path / "in.txt"
    source.write_text("red cat\nblue dog\n", encoding="utf-8")
    (tmp_path / "sub").mkdir()
    output = alias(source)  # type: ignore[operator]
    outcome = run_in_process(translate_argv(checkpoint, "-i", str(source), "-o", str(output)), capsys)
    assert_clean_failure(outcome, 1, str(output), "input")
    assert source.read_text(encoding="utf-8") == "red cat\nblue dog\n"


def test_output_that_is_the_checkpoint_is_refused(
    trained_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    checkpoint = tmp_path / "model.pt"  # a copy: a failure must not break the session's checkpoint
    checkpoint.write_bytes((trained_run / "checkpoint_best.pt").read_bytes())
    source = tmp_path / "in.txt"
    source.write_text("red cat\n", encoding="utf-8")
    before = checkpoint.read_bytes()
    outcome = run_in_process(translate_argv(checkpoint, "-i", str(source), "-o", str(checkpoint)), capsys)
    assert_clean_failure(outcome, 1, "checkpoint")
    assert checkpoint.read_bytes() == before


def test_output_that_is_redirected_stdin_is_refused(checkpoint: Path, tmp_path: Path) -> None:
    source = tmp_path / "in.txt"
    source.write_text("red cat\nblue dog\n", encoding="utf-8")
    outcome = run_process(translate_argv(checkpoint, "-o", str(source)), stdin=source)
    assert_clean_failure(outcome, 1, "stdin")
    assert source.read_text(encoding="utf-8") == "red cat\nblue dog\n"


# translate: one input line is one output line, whatever characters it holds.

LINE_BREAKS_INSIDE = {"CR": "\r", "U+2028": "\u2028", "U+2029": "\u2029", "NEL": "\x85", "VT": "\x0b", "FF": "\x0c"}


def split_output(text: str) -> list[str]:
    """Output lines, split on newlines only: a translation may keep a NEL, which str.splitlines would split."""
    assert text.endswith("\n"), text
    return text[:-1].split("\n")


@pytest.mark.parametrize("char", LINE_BREAKS_INSIDE.values(), ids=LINE_BREAKS_INSIDE.keys())
def test_a_line_break_character_inside_a_line_keeps_lines_aligned(
    char: str, checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source, output = tmp_path / "in.txt", tmp_path / "out.txt"
    source.write_bytes(f"red{char}cat\r\nsun moon tree\n".encode())
    outcome = run_in_process(translate_argv(checkpoint, "-i", str(source), "-o", str(output)), capsys)
    assert outcome.code == 0, outcome.err
    translations = split_output(output.read_text(encoding="utf-8"))
    assert len(translations) == 2 and translations[1] == greedy(checkpoint, [f"red{char}cat", "sun moon tree"])[1]


def test_line_break_characters_inside_stdin_lines_keep_lines_aligned(checkpoint: Path) -> None:
    lines = [f"red{char}cat" for char in LINE_BREAKS_INSIDE.values()] + ["sun moon tree"]
    outcome = run_process(translate_argv(checkpoint), stdin="\n".join(lines).encode() + b"\n")
    assert outcome.code == 0, outcome.err
    translations = split_output(outcome.out)
    assert len(translations) == len(lines) and translations[-1] == greedy(checkpoint, lines)[-1]


# translate: an undecodable line is reported with its number, after every line before it is written.


def test_invalid_utf8_reports_its_line_after_translating_the_lines_before(
    checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(streams, "CHUNK_LINES", 4)  # lines 1-4 are one chunk, 5-6 the unfinished next one
    good = ["red cat", "blue dog", "sun moon", "tree car", "house bird", "fish red"]
    source, output = tmp_path / "in.txt", tmp_path / "out.txt"
    source.write_bytes(("\n".join(good) + "\n").encode() + b"caf\xe9\nlast line\n")
    outcome = run_in_process(translate_argv(checkpoint, "-i", str(source), "-o", str(output)), capsys)
    assert_clean_failure(outcome, 1, f"{source}:7: invalid UTF-8")
    chunks = greedy(checkpoint, good[:4]) + greedy(checkpoint, good[4:])
    assert output.read_text(encoding="utf-8").split("\n") == [*chunks, ""]


@pytest.mark.parametrize("mode", [[], ["--interactive"]], ids=["chunks", "interactive"])
def test_invalid_utf8_on_stdin(mode: list[str], checkpoint: Path) -> None:
    outcome = run_process(translate_argv(checkpoint, *mode), stdin=b"red cat\nblue dog\n\xff\xfe\nsun moon\n")
    assert_clean_failure(outcome, 1, "stdin:3: invalid UTF-8")
    before = ["red cat", "blue dog"]
    expected = [greedy(checkpoint, [line])[0] for line in before] if mode else greedy(checkpoint, before)
    assert outcome.out.split("\n") == [*expected, ""]


def test_closed_stdin(checkpoint: Path) -> None:
    env = {**single_thread_env(), "PYTHONPATH": str(ROOT)}
    command = ["sh", "-c", '"$@" <&-', "sh", sys.executable, "-m", "seq2seq", *translate_argv(checkpoint)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert_clean_failure(Outcome(proc.returncode, proc.stdout, proc.stderr), 1, "stdin is closed")


# Ctrl-C: one line and exit 130 in every subcommand, wherever it lands.

INTERRUPTED_AT = {
    # id: (argv after the checkpoint/corpus are known, the function that receives the Ctrl-C)
    "translate, loading the model": (["translate", "-c", "{ckpt}"], "seq2seq.runs.checkpoint.load_checkpoint"),
    "evaluate, decoding": (
        ["evaluate", "-c", "{ckpt}", "--src", "{src}", "--ref", "{ref}"],
        "seq2seq.decoding.translate.Translator.translate",
    ),
    "evaluate, scoring": (["evaluate", "--hypotheses", "{ref}", "--ref", "{ref}"], "seq2seq.metrics.bleu"),
    "average": (["average", "{ckpt}", "-o", "{tmp}/avg.pt"], "seq2seq.runs.checkpoint.average_checkpoints"),
    "download": (["download", "--dest", "{tmp}/data"], "seq2seq.text.download.download_multi30k"),
    "train, reading the config": (["train", "--config", "{tiny}"], "seq2seq.cli.load_config"),
    "train, starting": (
        ["train", "--config", "{tiny}", "train.run_dir={tmp}/run"],
        "seq2seq.training.assembly.assemble",
    ),
}


def interrupt(*args: object, **kwargs: object) -> None:
    raise KeyboardInterrupt


@pytest.mark.parametrize("argv, target", INTERRUPTED_AT.values(), ids=INTERRUPTED_AT.keys())
def test_ctrl_c_is_one_line_and_exit_130(
    argv: list[str],
    target: str,
    checkpoint: Path,
    corpus: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setattr(target, interrupt)
    names = {"ckpt": checkpoint, "src": corpus / "test.src", "ref": corpus / "test.tgt", "tmp": tmp_path, "tiny": TINY}
    try:
        outcome = run_in_process([a.format(**names) for a in argv], capsys)
    except KeyboardInterrupt:  # escaping, it would stop the whole test session
        pytest.fail("KeyboardInterrupt escaped main()")
    assert outcome.code == 130 and "Traceback" not in outcome.err
    assert outcome.err.strip().splitlines()[-1].startswith("seq2seq: interrupted")


def _default_sigint() -> None:
    """Undo an inherited SIG_IGN: a shell starts background jobs (such as this test run) with SIGINT ignored,
    and Python then leaves it ignored in the child, which would read on to EOF and exit 0."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_sigint_to_a_real_translate_process(checkpoint: Path) -> None:
    """A real signal, while the process waits for the next stdin line (after the first was translated)."""
    env = {**single_thread_env(), "PYTHONPATH": str(ROOT)}
    first = (greedy(checkpoint, ["red cat"])[0] + "\n").encode()
    proc = subprocess.Popen(
        [sys.executable, "-m", "seq2seq", *translate_argv(checkpoint, "--interactive")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        preexec_fn=_default_sigint,
    )
    try:
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(b"red cat\n")
        proc.stdin.flush()
        assert proc.stdout.readline() == first  # the model is loaded and the loop is reading
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    outcome = Outcome(proc.returncode, "", err.decode())
    assert_clean_failure(outcome, 130)


# train: an empty corpus is refused with its file names.


@pytest.mark.parametrize("train_text", [(b"", b""), (b"\n \n", b"  \n\n"), (b"a b\n\n", b"\nb a\n")], ids=repr)
def test_training_on_an_empty_corpus_names_the_files(
    train_text: tuple[bytes, bytes], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = write_corpus(tmp_path / "data", n_train=10)
    (data / "train.src").write_bytes(train_text[0])
    (data / "train.tgt").write_bytes(train_text[1])
    argv = ["train", "--config", str(TINY), f"data.dir={data}", f"train.run_dir={tmp_path / 'run'}"]
    assert_clean_failure(run_in_process(argv, capsys), 1, str(data / "train.src"), str(data / "train.tgt"))


@pytest.mark.parametrize("shared", [True, False])
def test_tokenizer_without_text_names_its_source(shared: bool) -> None:
    with pytest.raises(UserError, match="no text to train the SentencePiece vocabulary on: .*a.de and a.en") as info:
        train_tokenizer(["", "  "], ["" if shared else "x y"], 64, shared, source="a.de and a.en")
    assert "\n" not in str(info.value)


# Dependency floors.


def test_torch_version_check() -> None:
    check_torch_version()  # the installed torch
    check_torch_version("2.10.0+cpu")
    for old in ("2.5.1", "2.9.1+cu121", "1.13.0", "unknown"):
        with pytest.raises(UserError, match=rf"torch {re.escape(old)} is installed.*>= 2\.10"):
            check_torch_version(old)


def test_pyproject_floor_is_the_checked_one() -> None:
    floor = re.search(r'"torch>=([\d.]+)', (ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    assert floor is not None and floor[1] == ".".join(map(str, MIN_TORCH))


# Checkpoints: damaged, crafted or unsafe files are one line, exit 1, before any model memory is allocated.


def _crafted(checkpoint: Path, tmp_path: Path, damage: str) -> Path:
    """A copy of the tiny checkpoint, damaged in one way."""
    import dataclasses

    import torch

    from seq2seq.runs import checkpoint as ckpt

    path = tmp_path / f"{damage}.pt"
    good = ckpt.read(checkpoint)
    raw = good.to_dict()
    if damage == "text file":
        path.write_text("this is not a checkpoint\n", encoding="utf-8")
    elif damage == "a few bytes":  # e.g. /etc/hostname: unpickled, they looked like refused Python objects
        path.write_bytes(b"abc1234\n")
    elif damage == "flipped bytes":
        data = bytearray(checkpoint.read_bytes())
        weight = max(good.model.values(), key=lambda t: t.numel())
        start = bytes(data).index(weight.reshape(-1)[:64].numpy().tobytes()) + 64
        data[start : start + 4] = bytes(b ^ 0xFF for b in data[start : start + 4])
        path.write_bytes(bytes(data))
    elif damage == "python objects":
        torch.save({**raw, "payload": Path("x")}, path)
    elif damage == "huge model in config":
        cfg = dataclasses.replace(
            good.config.model, d_model=32768, transformer=TransformerConfig(n_heads=8, d_ff=131072)
        )
        ckpt.save(path, dataclasses.replace(good, config=dataclasses.replace(good.config, model=cfg)))
    else:  # a field missing or replaced, with a valid checksum: crafted, not damaged
        field, value = {
            "no tokenizer": ("tokenizer", None),
            "no model": ("model", None),
            "garbage tokenizer": ("tokenizer", {"src": b"\x00garbage", "tgt": None}),
            "weights of another shape": ("model", {k: v[..., :1] for k, v in good.model.items()}),
        }[damage]
        raw[field] = value
        raw["sha256"] = ckpt.content_hash(raw)
        torch.save(raw, path)
    return path


CHECKPOINT_CASES = {
    "text file": "not a readable checkpoint",
    "a few bytes": "not a readable checkpoint",
    "flipped bytes": "checksum mismatch",
    "python objects": "refused as unsafe",
    "huge model in config": "weights do not fit the stored config",
    "no tokenizer": "tokenizer must be dict",
    "no model": "model must be dict",
    "garbage tokenizer": "SentencePiece model is unusable",
    "weights of another shape": "weights do not fit the stored config",
}


@pytest.mark.parametrize("damage, message", CHECKPOINT_CASES.items(), ids=CHECKPOINT_CASES.keys())
def test_unusable_checkpoints_are_one_line(
    damage: str, message: str, checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _crafted(checkpoint, tmp_path, damage)
    source = tmp_path / "in.txt"
    source.write_text("red cat\n", encoding="utf-8")
    line = assert_clean_failure(run_in_process(translate_argv(path, "-i", str(source)), capsys), 1, message)
    assert str(path) in line
    assert "weights_only=False" not in line  # never advise disabling the safety check


def test_evaluate_and_average_refuse_to_overwrite_their_inputs(
    checkpoint: Path, corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ref = tmp_path / "ref.txt"
    ref.write_bytes((corpus / "test.tgt").read_bytes())
    before = ref.read_bytes()
    argv = ["evaluate", "--hypotheses", str(ref), "--ref", str(ref), "--save", str(ref)]
    assert_clean_failure(run_in_process(argv, capsys), 1, "--save", "is also an input")
    assert ref.read_bytes() == before
    copy = tmp_path / "model.pt"
    copy.write_bytes(checkpoint.read_bytes())
    argv = ["average", str(copy), str(checkpoint), "-o", str(copy)]
    assert_clean_failure(run_in_process(argv, capsys), 1, "--output", "is also an input")
    assert copy.read_bytes() == checkpoint.read_bytes()


# The optional CTranslate2 extra: without it, the commands that need it say how to install it.


@pytest.mark.parametrize("command", ["export", "translate", "evaluate", "translate --engine ctranslate2"])
def test_without_ctranslate2_the_command_says_how_to_install_it(
    command: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "ctranslate2", None)  # `import ctranslate2` raises ImportError
    exported = tmp_path / "ct2"
    exported.mkdir()
    (exported / "model.bin").write_bytes(b"")
    checkpoint = tmp_path / "model.pt"
    checkpoint.write_bytes(b"")
    name, *options = command.split()
    argv = {
        "export": ["export", str(checkpoint), "-o", str(tmp_path / "out")],
        "translate": ["translate", "-c", str(exported if not options else checkpoint), *options],
        "evaluate": ["evaluate", "-c", str(exported)],
    }[name]
    assert_clean_failure(run_in_process(argv, capsys), 1, 'pip install -e ".[export]"')
