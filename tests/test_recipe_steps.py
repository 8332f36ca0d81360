"""`seq2seq recipe`: its typed results in the state file, its command line, and a rerun that skips what is done."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import TINY, tiny_overrides, write_corpus

from seq2seq import recipe_args
from seq2seq.app.distill import CHUNK_LINES
from seq2seq.app.recipe import STATE_FILE, RecipeResults, RecipeState
from seq2seq.app.recipe.results import (
    Example,
    Int8Result,
    Member,
    Pick,
    StudentResult,
    TestResult,
    TestScore,
    TrainResult,
)
from seq2seq.cli import main


def _results(tmp_path: Path) -> RecipeResults:
    score = TestScore(41.5, 1.62, 66.01, 38.2, "nrefs:1|case:mixed", tok_lc_bleu=43.7, tok_lc_bleu_ci95=1.6)
    test = TestResult(["a.pt", "b.pt"], "test.ensemble.en", score, 12.5, [Example("ein Hund", "a dog", "a dog")])
    members = [
        Member(f"seed{s}", TrainResult(f"run/seed{s}", 50.3, 4500, 21, 53.0), Pick({"x": 1.0}, "x", ["a.pt"], []))
        for s in (1, 2)
    ]
    student_test = TestResult(["s.pt"], "t", TestScore(40.0, None, 60.0, 40.0, "sig"), 30.0, [])
    student = StudentResult(
        "configs/tiny.yaml",
        ["train.max_steps=5"],
        True,
        Member("student", TrainResult("run/student", 20.0, 5, 1, 0.5), Pick({"c": 2.0}, "c", ["s.pt"], ["v"])),
        student_test,
        Int8Result(skipped="CTranslate2 is not installed"),
    )
    return RecipeResults(
        "configs/m30k_de_en_ens.yaml",
        ["train.threads=1"],
        "de-en",
        {"beam_size": 5, "length_penalty": 1.4},
        2,
        "test_2016_flickr",
        [1, 2],
        members,
        Pick({"ensemble": 44.0}, "ensemble", ["a.pt", "b.pt"], ["val.ensemble.en"]),
        test,
        student,
        3.5,
    )


def test_typed_results_round_trip_through_the_state_file(tmp_path: Path) -> None:
    results = _results(tmp_path)
    output = tmp_path / "made.txt"
    output.write_text("made\n", encoding="utf-8")
    RecipeState(tmp_path).record("everything", {"settings": (1, 2)}, [output], results)

    state = RecipeState(tmp_path)  # read back from the file
    assert state.finished("everything", {"settings": (1, 2)}, RecipeResults) == results
    assert state.finished("everything", {"settings": (1, 3)}, RecipeResults) is None  # other inputs: run again
    assert state.finished("nothing", {"settings": (1, 2)}, RecipeResults) is None
    output.write_text("changed since\n", encoding="utf-8")
    assert state.finished("everything", {"settings": (1, 2)}, RecipeResults) is None  # its file changed
    assert results.to_json()["student"]["ctranslate2_int8"] == {"skipped": "CTranslate2 is not installed"}


def test_an_unreadable_state_file_runs_every_step_again(tmp_path: Path) -> None:
    (tmp_path / STATE_FILE).write_text("{not json", encoding="utf-8")
    assert RecipeState(tmp_path).steps == {}


def test_recipe_help_names_its_options(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["recipe", "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    for option in ("--average", "--seeds", "--no-download", "--distill", "--distill-mix", "--student"):
        assert option in out
    assert recipe_args.CHUNK_LINES == CHUNK_LINES  # the parser's default, kept without importing torch


def test_a_bad_config_path_is_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    missing = tmp_path / "no_such.yaml"
    assert main(["recipe", str(missing), "--no-download"]) == 2
    err = capsys.readouterr().err
    assert err == f"seq2seq: config error: {missing}: config file not found\n"
    assert not (tmp_path / STATE_FILE).exists()


def test_student_settings_need_distill(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["recipe", str(TINY), "--student", "train.max_steps=5"]) == 2
    assert capsys.readouterr().err == "seq2seq: usage error: --distill-mix and --student need --distill\n"


@pytest.mark.trains  # the training runs in a `seq2seq train` subprocess
def test_a_second_run_skips_the_finished_steps(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    corpus, run_dir = write_corpus(tmp_path / "corpus", n_train=300), tmp_path / "run"
    overrides = tiny_overrides(corpus, run_dir, "train.max_epochs=2", "train.threads=1", "train.precision=fp32")
    command = ["recipe", str(TINY), *overrides, "--average", "2", "--no-download"]
    assert main(command) == 0
    first = capsys.readouterr()
    state = json.loads((run_dir / STATE_FILE).read_text(encoding="utf-8"))
    assert list(state["steps"]) == ["train", "average", "pick", "test"]
    results = json.loads((run_dir / "results.json").read_text(encoding="utf-8"))
    assert state["steps"]["train"]["result"]["updates"] == results["updates"] > 0
    assert state["steps"]["pick"]["result"]["picked"] == results["picked"]
    last, metrics = run_dir / "checkpoint_last.pt", (run_dir / "metrics.jsonl").read_text(encoding="utf-8")
    trained_at = last.stat().st_mtime_ns

    assert main(command) == 0
    again = capsys.readouterr()
    for step in ("train", "average", "pick", "test"):
        assert f"recipe: {step}: finished before with the same inputs, skipped" in again.err
    assert last.stat().st_mtime_ns == trained_at  # no training ran: not even a resume that stops at once
    assert (run_dir / "metrics.jsonl").read_text(encoding="utf-8") == metrics
    assert again.out == first.out  # the same table, from the recorded results
    rescored = json.loads((run_dir / "results.json").read_text(encoding="utf-8"))
    assert {**rescored, "this_invocation_minutes": 0} == {**results, "this_invocation_minutes": 0}

    longer = [*command[:2], *overrides, "train.max_epochs=3", *command[2 + len(overrides) :]]
    assert main(longer) == 0  # another budget: the training resumes, and what follows it runs again
    more = json.loads((run_dir / "results.json").read_text(encoding="utf-8"))
    assert more["epochs"] == 3 and more["updates"] > results["updates"]
    assert "recipe: train: finished before" not in capsys.readouterr().err


def test_a_training_that_fails_is_not_recorded(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Only a finished step is recorded: the next run trains again (a stopped one resumes from its checkpoint)."""
    run_dir = tmp_path / "run"
    assert main(["recipe", str(TINY), *tiny_overrides(tmp_path / "missing", run_dir), "--no-download"]) == 1
    assert capsys.readouterr().err.endswith("seq2seq: error: `seq2seq train` exited with code 1; nothing was scored\n")
    assert not (run_dir / STATE_FILE).exists() and not (run_dir / "results.json").exists()
