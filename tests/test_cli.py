"""End to end through the `seq2seq` command: a tiny model learns to reverse sentences, then translates and scores.

`trained_run` (conftest.py) trains once per session.
"""

from __future__ import annotations

import io
import json
import logging
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import TINY, single_thread_env, tiny_overrides

from seq2seq import metrics
from seq2seq.cli import main
from seq2seq.config import load_config
from seq2seq.decoding.translate import Translator
from seq2seq.device import resolve_device
from seq2seq.errors import UserError
from seq2seq.runs.checkpoint import load_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")
SOURCES = ["red cat dog", "", "blue sun moon tree", "fish bird"]


def lines(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8").splitlines()


def one_error_line(capsys: pytest.CaptureFixture[str]) -> str:
    """stderr must hold exactly one `seq2seq: ...error...` line (the CLI's contract for known problems)."""
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("seq2seq: ") and "error" in err[0]
    return err[0]


# Training produced a complete, useful run.


def test_run_directory_has_everything(trained_run: Path) -> None:
    for name in ("config.yaml", "spm.model", "train.log", "checkpoint_last.pt", "checkpoint_best.pt"):
        assert (trained_run / name).is_file(), name
    assert list((trained_run / "tb").glob("events.out.tfevents.*"))
    assert "valid" in (trained_run / "train.log").read_text(encoding="utf-8")
    stored = load_config(trained_run / "config.yaml")
    assert stored.train.run_dir == str(trained_run) and stored.data.src_lang == "src"
    assert load_checkpoint(trained_run / "checkpoint_best.pt").config == stored


def test_tiny_model_learns_to_reverse(trained_run: Path, corpus: Path) -> None:
    translator = Translator.from_checkpoint(trained_run / "checkpoint_best.pt")
    src, ref = lines(corpus / "test.src"), lines(corpus / "test.tgt")
    for strategy in ("beam", "greedy"):
        hyps = translator.with_decode(strategy=strategy).translate(src)
        exact = sum(h == r for h, r in zip(hyps, ref)) / len(ref)
        assert exact >= 0.9, (strategy, exact, [(h, r) for h, r in zip(hyps, ref) if h != r][:5])


# Checkpoints.


def test_last_checkpoint_can_resume(trained_run: Path) -> None:
    last = load_checkpoint(trained_run / "checkpoint_last.pt")
    training = last.checkpoint.training
    assert training is not None and training.progress.step > 0 and last.checkpoint.run_id


@pytest.mark.parametrize("damage", ["random-bytes", "truncated", "empty", "missing", "directory"])
def test_unusable_checkpoint_is_one_line_exit_1(
    damage: str, trained_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "model.pt"
    good = (trained_run / "checkpoint_best.pt").read_bytes()
    if damage == "random-bytes":
        path.write_bytes(random.Random(0).randbytes(4096))
    elif damage == "truncated":
        path.write_bytes(good[: len(good) // 2])
    elif damage == "empty":
        path.write_bytes(b"")
    elif damage == "directory":
        path.mkdir()
    source = tmp_path / "in.txt"
    source.write_text("red cat\n", encoding="utf-8")
    assert main(["translate", "-c", str(path), "-i", str(source)]) == 1
    assert str(path) in one_error_line(capsys)


# translate and evaluate.


def test_translate_stdin_to_stdout(trained_run: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "seq2seq", "translate", "-c", str(trained_run / "checkpoint_best.pt")],
        input="\n".join(SOURCES) + "\n",
        capture_output=True,
        text=True,
        timeout=300,
        env=single_thread_env(),
    )
    assert proc.returncode == 0, proc.stderr
    expected = Translator.from_checkpoint(trained_run / "checkpoint_best.pt").translate(SOURCES)
    assert proc.stdout.splitlines() == expected  # the command translates as the library does, whatever it learnt
    assert len(expected) == len(SOURCES) and expected[1] == ""  # one line out per line in, empty stays empty
    assert "Traceback" not in proc.stderr


def test_translate_rejects_training_overrides(trained_run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["translate", "-c", str(trained_run / "checkpoint_best.pt"), "optim.lr=1"]) == 2
    assert "only decode.* settings" in one_error_line(capsys)


def test_translate_files_and_threads(trained_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source, output = tmp_path / "in.txt", tmp_path / "out.txt"
    source.write_text("\n".join(SOURCES) + "\n", encoding="utf-8")
    torch.set_num_threads(2)  # the one_thread fixture restores its own setting afterwards
    argv = ["translate", "-c", str(trained_run / "checkpoint_best.pt"), "-i", str(source), "-o", str(output)]
    assert main([*argv, "--threads", "1"]) == 0
    assert torch.get_num_threads() == 1
    expected = Translator.from_checkpoint(trained_run / "checkpoint_best.pt").translate(SOURCES)
    assert lines(output) == expected and len(expected) == len(SOURCES) and expected[1] == ""  # empty stays empty
    assert main([*argv, "--threads", "-1"]) == 2
    assert "--threads" in one_error_line(capsys)


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_translate_and_evaluate_show_progress_only_on_a_terminal(
    trained_run: Path, corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A bar with sentences done, their rate and the total (so an ETA) when stderr is a terminal; nothing in a pipe."""
    checkpoint = str(trained_run / "checkpoint_best.pt")
    source = tmp_path / "in.txt"
    source.write_text("\n".join(SOURCES) + "\n", encoding="utf-8")
    translate = ["translate", "-c", checkpoint, "-i", str(source), "-o", str(tmp_path / "out.txt")]
    evaluate = ["evaluate", "-c", checkpoint, "--src", str(corpus / "val.src"), "--ref", str(corpus / "val.tgt")]
    for argv, total in ((translate, len(SOURCES)), (evaluate, len(lines(corpus / "val.src")))):
        assert main(argv) == 0
        assert "sent/s" not in capsys.readouterr().err  # not a terminal: no bar
        terminal = Terminal()
        monkeypatch.setattr(sys, "stderr", terminal)
        assert main(argv) == 0
        monkeypatch.undo()
        bar = terminal.getvalue()
        assert "translating" in bar and f"{total}/{total}" in bar and "sent/s" in bar


def test_translate_missing_input_file(trained_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nope.txt"
    assert main(["translate", "-c", str(trained_run / "checkpoint_best.pt"), "-i", str(missing)]) == 1
    assert str(missing) in one_error_line(capsys)


def test_evaluate_a_checkpoint(
    trained_run: Path, corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without --src/--ref it scores the config's test split; with them, the given files. --save keeps the order.

    Whatever the model learnt (test_tiny_model_learns_to_reverse checks that): the saved lines are the library's
    translations of the sources, in their order, and the scores are those of the saved lines."""
    checkpoint = str(trained_run / "checkpoint_best.pt")
    translator = Translator.from_checkpoint(checkpoint)
    test_hyp, val_hyp = tmp_path / "test.hyp", tmp_path / "val.hyp"
    assert main(["evaluate", "-c", checkpoint, "--save", str(test_hyp)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split(" = ")[0] for line in out] == ["BLEU", "chrF", "TER"]
    for line in out:
        assert "nrefs:1" in line and "version:" in line  # the sacreBLEU signature
    assert "tok:13a" in out[0]
    assert lines(test_hyp) == translator.translate(lines(corpus / "test.src"))
    assert out[0].split()[2] == f"{metrics.bleu(lines(test_hyp), lines(corpus / 'test.tgt')).score:.2f}"

    val = ["--src", str(corpus / "val.src"), "--ref", str(corpus / "val.tgt")]
    assert main(["evaluate", "-c", checkpoint, *val, "--save", str(val_hyp), "decode.strategy=greedy"]) == 0
    bleu = capsys.readouterr().out.splitlines()[0].split()[2]
    hyps = lines(val_hyp)
    assert hyps == translator.with_decode(strategy="greedy").translate(lines(corpus / "val.src"))
    assert len(hyps) == 100 and bleu == f"{metrics.bleu(hyps, lines(corpus / 'val.tgt')).score:.2f}"


def test_evaluate_scores_a_hypothesis_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    refs = ["A dog runs through the snow.", "Two men are playing chess in a park.", "A girl in a red coat."]
    (tmp_path / "ref.en").write_text("\n".join(refs) + "\n", encoding="utf-8")
    (tmp_path / "hyp.en").write_text("\n".join(r.lower() for r in refs) + "\n", encoding="utf-8")
    files = ["--hypotheses", str(tmp_path / "hyp.en"), "--ref", str(tmp_path / "ref.en")]
    assert main(["evaluate", *files, "--lowercase"]) == 0
    report = {line.split(" = ")[0]: line for line in capsys.readouterr().out.splitlines()}
    assert set(report) == {"BLEU", "chrF", "TER", "BLEU (lowercase)"}
    assert "nrefs:1|case:mixed" in report["BLEU"] and "case:lc" in report["BLEU (lowercase)"]
    assert "BLEU (lowercase) = 100.00" in report["BLEU (lowercase)"] and "BLEU = 100.00" not in report["BLEU"]
    assert "nrefs:1" in report["chrF"] and "nrefs:1" in report["TER"]  # each score prints its signature


def test_evaluate_json_holds_the_text_scores_for_programs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    refs = ["A dog runs through the snow.", "Two men are playing chess in a park.", "A girl in a red coat."]
    (tmp_path / "ref.en").write_text("\n".join(refs) + "\n", encoding="utf-8")
    (tmp_path / "hyp.en").write_text("A dog runs in the snow.\nTwo men play chess.\nA girl in red.\n", encoding="utf-8")
    files = ["evaluate", "--hypotheses", str(tmp_path / "hyp.en"), "--ref", str(tmp_path / "ref.en"), "--lowercase"]
    assert main([*files, "--bootstrap", "20"]) == 0
    text = capsys.readouterr().out.splitlines()
    assert main([*files, "--bootstrap", "20", "--format", "json"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 1  # one JSON object
    record = json.loads(out[0])
    names = [score["name"] for score in record["scores"]]
    assert record["sentences"] == 3 and names == ["BLEU", "chrF", "TER", "BLEU (lowercase)"]
    for line, score in zip(text, record["scores"], strict=True):  # the same numbers as the text lines
        interval = f" ± {score['ci95']:.2f} (95% bootstrap)" if score["ci95"] is not None else ""
        assert line == f"{score['name']} = {score['score']:.2f}{interval}  ({score['signature']})"
    assert record["scores"][0]["ci95"] is not None and record["scores"][1]["ci95"] is None  # BLEU's interval only


def test_evaluate_refuses_bad_arguments(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "two.txt").write_text("a\nb\n", encoding="utf-8")
    (tmp_path / "three.txt").write_text("a\nb\nc\n", encoding="utf-8")
    assert main(["evaluate", "--hypotheses", str(tmp_path / "two.txt"), "--ref", str(tmp_path / "three.txt")]) == 1
    assert "2 hypotheses but 3 references" in one_error_line(capsys)
    (tmp_path / "empty.txt").write_text("", encoding="utf-8")
    assert main(["evaluate", "--hypotheses", str(tmp_path / "empty.txt"), "--ref", str(tmp_path / "empty.txt")]) == 1
    assert "the test set has no references" in one_error_line(capsys)
    assert main(["evaluate", "--hypotheses", str(tmp_path / "two.txt")]) == 2
    assert "needs --ref" in one_error_line(capsys)
    assert main(["evaluate"]) == 2
    assert "needs --checkpoint or --hypotheses" in one_error_line(capsys)
    both = ["evaluate", "-c", "x.pt", "--hypotheses", str(tmp_path / "two.txt"), "--ref", str(tmp_path / "two.txt")]
    assert main(both) == 2 and "not both" in one_error_line(capsys)


def test_evaluate_tokenized_bleu_takes_the_language_from_the_file_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("sacremoses")
    hyps, tok = tmp_path / "hyp.txt", tmp_path / "ref.tok.en"
    hyps.write_text("A dog runs.\n", encoding="utf-8")
    tok.write_text("a dog runs .\n", encoding="utf-8")
    assert main(["evaluate", "--hypotheses", str(hyps), "--ref", str(hyps), "--tok-ref", str(tok)]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("BLEU (lc, Moses-tokenized) = 100.00")


def test_evaluate_bootstrap_adds_an_interval_and_keeps_the_score(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rng = random.Random(0)
    words = "a dog cat runs sleeps the on mat red ball".split()
    refs = [" ".join(rng.choices(words, k=8)) for _ in range(200)]
    hyps = [" ".join(w if rng.random() < 0.7 else rng.choice(words) for w in r.split()) for r in refs]
    ref, hyp = tmp_path / "ref.txt", tmp_path / "hyp.txt"
    ref.write_text("\n".join(refs) + "\n", encoding="utf-8")
    hyp.write_text("\n".join(hyps) + "\n", encoding="utf-8")
    assert main(["evaluate", "--hypotheses", str(hyp), "--ref", str(ref)]) == 0
    plain = capsys.readouterr().out.splitlines()[0]
    assert main(["evaluate", "--hypotheses", str(hyp), "--ref", str(ref), "--bootstrap", "200"]) == 0
    resampled = capsys.readouterr().out.splitlines()[0]
    score = plain.split()[2]
    assert "±" not in plain and resampled.startswith(f"BLEU = {score} ± ") and "bs:200" in resampled
    assert 0 < float(resampled.split()[4]) < 20
    assert main(["evaluate", "--hypotheses", str(hyp), "--ref", str(ref), "--bootstrap", "0"]) == 2
    assert "--bootstrap must be at least 1" in one_error_line(capsys)
    # refused before anything is decoded or saved
    save = tmp_path / "saved.txt"
    assert main(["evaluate", "-c", "missing.pt", "--bootstrap", "0", "--save", str(save)]) == 2
    assert "--bootstrap must be at least 1" in one_error_line(capsys) and not save.exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_device_error_names_the_option_the_user_gave(trained_run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["translate", "-c", str(trained_run / "checkpoint_best.pt"), "--device", "cuda"]) == 1
    assert "--device cuda but CUDA is not available" in one_error_line(capsys)
    with pytest.raises(UserError, match=r"^train\.device=cuda but CUDA is not available"):
        resolve_device("cuda")


# Bad input to train.


def test_train_on_misaligned_corpus_is_one_line_exit_1(
    corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad"
    bad.mkdir()
    for path in corpus.iterdir():
        (bad / path.name).write_bytes(path.read_bytes())
    (bad / "train.tgt").write_text("\n".join(lines(corpus / "train.tgt")[:10]) + "\n", encoding="utf-8")
    assert main(["train", "--config", str(TINY), *tiny_overrides(bad, tmp_path / "run")]) == 1
    message = one_error_line(capsys)
    assert "misaligned" in message and "train.src" in message and "train.tgt" in message and "has 10" in message


def test_main_can_run_twice_without_duplicating_log_lines(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    ref = tmp_path / "ref.txt"
    ref.write_text("x\n", encoding="utf-8")
    for _ in range(2):
        main(["evaluate", "--hypotheses", str(ref), "--ref", str(ref)])
    capsys.readouterr()
    logging.getLogger("seq2seq").info("marker line")
    assert capsys.readouterr().err.count("marker line") == 1


def test_the_top_level_help_names_every_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    first = capsys.readouterr().out.split("\n\n")[1]  # the description, before the argument lists
    for command in ("download", "prepare", "train", "translate", "evaluate", "average", "export", "serve"):
        assert command in first, command


def test_a_flag_is_a_usage_error_and_a_key_a_config_error(capsys: pytest.CaptureFixture[str]) -> None:
    """Both exit 2, labelled by where the mistake is: on the command line's flags, or in the settings."""
    assert main(["evaluate", "--hypotheses", "h.txt", "--ref", "r.txt", "--bootstrap", "0"]) == 2
    assert capsys.readouterr().err == "seq2seq: usage error: --bootstrap must be at least 1, got 0\n"
    assert main(["train", "--config", str(TINY), "train.no_such_key=1"]) == 2
    assert capsys.readouterr().err.startswith("seq2seq: config error: ")


@pytest.mark.trains
def test_training_into_a_redirected_stderr_writes_log_lines_not_a_bar(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A log file or a pipe gets one line per logged step, not a progress bar redrawn into one endless line."""
    from conftest import write_corpus

    corpus = write_corpus(tmp_path / "corpus", n_train=200)
    overrides = tiny_overrides(corpus, tmp_path / "run", "train.max_steps=3", "train.log_every=1", "train.threads=1")
    assert main(["train", "--config", str(TINY), *overrides, "validation.bleu=false"]) == 0
    err = capsys.readouterr().err
    assert "step 3: loss" in err and "upd/s" not in err and "\r" not in err
