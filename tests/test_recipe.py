"""scripts/run_recipe.py end to end on the reversal task: train, average, pick on val, score test."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, TINY, single_thread_env, tiny_overrides, write_corpus, write_multi_corpus

from seq2seq import metrics
from seq2seq.runs import checkpoint

RECIPE = ROOT / "scripts" / "run_recipe.py"


def run_recipe(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(RECIPE), *args],
        cwd=ROOT,
        env=single_thread_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.trains
def test_recipe_trains_averages_picks_on_val_and_rescores(corpus: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    args = [
        str(TINY),
        *tiny_overrides(corpus, run_dir, "train.max_epochs=4", "train.threads=1"),
        "--average",
        "2,3",
        "--no-download",
    ]
    done = run_recipe(*args)
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads((run_dir / "results.json").read_text(encoding="utf-8"))
    assert results["epochs"] == 4 and results["updates"] > 0
    assert set(results["val"]) == {"checkpoint_best", "checkpoint_avg2", "checkpoint_avg3"}
    assert results["val"][results["picked"]] == max(results["val"].values())
    assert all((run_dir / f"{name}.pt").is_file() for name in results["val"])
    assert "tok_lc_bleu" not in results["test"]  # this corpus has no tokenized references
    hyps = (run_dir / f"test.{results['picked']}.tgt").read_text(encoding="utf-8").splitlines()
    src, refs = ((corpus / f"test.{side}").read_text(encoding="utf-8").splitlines() for side in ("src", "tgt"))
    assert len(hyps) == len(refs) == 100
    # the reported score is the picked checkpoint's saved test output scored against the references
    assert results["test"]["sacrebleu"] == round(metrics.bleu(hyps, refs).score, 2)
    resampled = metrics.bleu(hyps, refs, n_bootstrap=1000).ci95  # sacreBLEU's resampling is seeded
    assert resampled is not None and results["test"]["sacrebleu_ci95"] == round(resampled, 2)
    assert results["examples"] == [{"source": src[0], "reference": refs[0], "ours": hyps[0]}]
    assert (run_dir / "results.md").read_text(encoding="utf-8").startswith("| pair |")

    again = run_recipe(*args)  # the run reached its budget: no more training, the same scores
    assert again.returncode == 0, again.stderr[-2000:]
    rescored = json.loads((run_dir / "results.json").read_text(encoding="utf-8"))
    assert rescored["updates"] == results["updates"]
    assert rescored["test"] == results["test"]
    # nothing changed, so nothing was decoded again: every translation was read back, test's speed with it
    assert again.stderr.count("reused (same checkpoints, decode settings and sources)") == 4  # 3 val, 1 test
    assert rescored["test_sentences_per_second"] == results["test_sentences_per_second"]

    other = run_recipe(args[0], "decode.length_penalty=0.3", *args[1:])  # another decode setting: decoded again
    assert other.returncode == 0, other.stderr[-2000:]
    assert "reused" not in other.stderr


def test_recipe_stops_when_training_fails(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    done = run_recipe(str(TINY), *tiny_overrides(tmp_path / "missing", run_dir), "--no-download")
    assert done.returncode == 1
    assert "`seq2seq train` exited with code 1; nothing was scored" in done.stderr
    assert "Traceback" not in done.stderr
    assert not (run_dir / "results.json").exists()


def test_recipe_rejects_a_bad_average_list() -> None:
    done = run_recipe(str(TINY), "--average", "5,ten")
    assert done.returncode == 2
    assert "5,ten" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.trains
def test_recipe_ensembles_seeded_models_and_distils_them_into_a_student(tmp_path: Path) -> None:
    corpus, run_dir = write_corpus(tmp_path / "corpus", n_train=400), tmp_path / "run"
    overrides = tiny_overrides(corpus, run_dir, "train.max_epochs=2", "train.threads=1", "train.precision=fp32")
    args = [str(TINY), *overrides, "--no-download", "--average", "2", "--seeds", "1,2"]
    bad_student = run_recipe(*args, "--distill", "--student", "model.no_such_key=1")
    assert bad_student.returncode == 2 and "no_such_key" in bad_student.stderr
    teacher = json.loads((run_dir / "results.json").read_text(encoding="utf-8"))  # written before the student
    assert teacher["picked"] == "ensemble" and "test" in teacher and "student" not in teacher

    done = run_recipe(*args, "--distill", "--distill-chunk", "150")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stderr.count("reused (same checkpoints") == 6  # 2 candidates a member; the ensemble on val, test
    results = json.loads((run_dir / "results.json").read_text(encoding="utf-8"))
    assert results["test"] == teacher["test"]

    members = results["members"]
    assert [m["seed"] for m in members] == [1, 2]
    assert [m["run_dir"] for m in members] == [str(run_dir / "seed1"), str(run_dir / "seed2")]
    assert results["checkpoints"] == [str(run_dir / f"seed{m['seed']}" / f"{m['picked']}.pt") for m in members]
    assert results["picked"] == "ensemble" and set(results["val"]) == {"ensemble"}
    refs = (corpus / "test.tgt").read_text(encoding="utf-8").splitlines()
    hyps = (run_dir / "test.ensemble.tgt").read_text(encoding="utf-8").splitlines()
    assert results["test"]["sacrebleu"] == round(metrics.bleu(hyps, refs).score, 2)
    table = (run_dir / "results.md").read_text(encoding="utf-8")
    assert "| src-tgt, seed 2 |" in table and "| src-tgt, ensemble of 2 |" in table

    data = run_dir / "distilled" / "data"
    sources = (corpus / "train.src").read_text(encoding="utf-8").splitlines()
    assert (data / "distilled.src").read_text(encoding="utf-8").splitlines() == sources
    assert len((data / "distilled.tgt").read_text(encoding="utf-8").splitlines()) == len(sources) == 400
    assert "distill: chunk 3/3 (400/400 lines)" in done.stderr
    student = results["student"]
    assert (
        student["run_dir"] == str(run_dir / "student") and (run_dir / "student" / f"{student['picked']}.pt").is_file()
    )
    assert json.loads((run_dir / "student" / "student_results.json").read_text(encoding="utf-8")) == student
    assert student["test"]["sacrebleu"] >= 0 and student["test_sentences_per_second"] > 0
    assert "| student on distilled (" in table
    int8 = student["ctranslate2_int8"]
    if importlib.util.find_spec("ctranslate2") is None:
        assert "not installed" in int8["skipped"] and "Student in CTranslate2 int8: skipped" in table
    else:
        assert int8["test_sentences_per_second"] > 0 and "| student, CTranslate2 int8 |" in table


@pytest.mark.trains
def test_a_shared_teacher_of_two_pairs_is_trained_once_and_serves_the_recipe_of_each_pair(tmp_path: Path) -> None:
    """--teacher: the recipe's system is another config's model (here one of two pairs, src-rev and src-same),
    trained in that config's run directory, picked on this recipe's val and tested and distilled into this
    recipe's target language; the recipe of the other pair finds it trained and only decodes it."""
    corpus, teacher_dir = write_multi_corpus(tmp_path / "corpus", n_train=300), tmp_path / "teacher"
    teacher = [
        f"--teacher={TINY}",
        *(
            f"--teacher-set={setting}"
            for setting in tiny_overrides(corpus, teacher_dir, "data.pairs=[src-rev, src-same]", "train.max_epochs=3")
        ),
        "--teacher-set=train.threads=1",
        "--teacher-set=train.precision=fp32",
    ]

    def recipe(tgt: str, *extra: str) -> subprocess.CompletedProcess[str]:
        pair = [f"data.tgt_lang={tgt}", "train.max_epochs=2", "train.threads=1", "train.precision=fp32"]
        run_dir = tmp_path / f"run_{tgt}"
        return run_recipe(str(TINY), *tiny_overrides(corpus, run_dir, *pair), "--no-download", *teacher, *extra)

    done = recipe("rev", "--average", "2", "--distill", "--distill-chunk", "200")
    assert done.returncode == 0, done.stderr[-2000:]
    run_dir = tmp_path / "run_rev"
    results = json.loads((run_dir / "results.json").read_text(encoding="utf-8"))
    assert results["pair"] == "src-rev" and results["teacher"][0] == str(TINY)
    assert results["run_dir"] == str(teacher_dir) and results["updates"] > 0
    assert results["checkpoints"] == [str(teacher_dir / f"{results['picked']}.pt")]
    assert not (run_dir / "checkpoint_best.pt").exists()  # the recipe trained no model of its own
    test_save = teacher_dir / f"test.{results['picked']}.rev"
    record = json.loads((teacher_dir / f"test.{results['picked']}.rev.json").read_text(encoding="utf-8"))
    assert record["identity"]["tgt_lang"] == "rev"  # into the recipe's language: a tagless line would be refused
    refs = (corpus / "test.rev").read_text(encoding="utf-8").splitlines()
    hyps = test_save.read_text(encoding="utf-8").splitlines()
    assert len(hyps) == len(refs) and results["test"]["sacrebleu"] == round(metrics.bleu(hyps, refs).score, 2)
    data = run_dir / "distilled" / "data"
    sources = (corpus / "train.src").read_text(encoding="utf-8").splitlines()
    assert (data / "distilled.src").read_text(encoding="utf-8").splitlines() == sources
    assert len((data / "distilled.rev").read_text(encoding="utf-8").splitlines()) == len(sources)
    assert results["student"]["run_dir"] == str(run_dir / "student")
    assert "The system is the model of" in (run_dir / "results.md").read_text(encoding="utf-8")

    other = recipe("same", "--average", "2")  # the same teacher, the other pair: not trained again
    assert other.returncode == 0, other.stderr[-2000:]
    same = json.loads((tmp_path / "run_same" / "results.json").read_text(encoding="utf-8"))
    assert same["pair"] == "src-same" and same["updates"] == results["updates"]
    assert (teacher_dir / f"val.{same['picked']}.same").is_file()
    assert (teacher_dir / "val.checkpoint_best.rev").is_file()  # each pair's translations apart


def test_a_teacher_must_translate_the_recipes_pair(tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "corpus", n_train=20)
    args = [str(TINY), *tiny_overrides(corpus, tmp_path / "run"), "--no-download"]
    other = run_recipe(*args, f"--teacher={TINY}", "--teacher-set=data.tgt_lang=xx")
    assert other.returncode == 2 and "translates src-xx, not this recipe's src-tgt" in other.stderr
    assert "Traceback" not in other.stderr
    missing = run_recipe(*args, "--teacher=no/such.yaml")
    assert missing.returncode == 2 and "--teacher no/such.yaml: no such config file" in missing.stderr
    alone = run_recipe(*args, "--teacher-set=train.max_epochs=1")
    assert alone.returncode == 2 and "--teacher-set needs --teacher" in alone.stderr
    both = run_recipe(*args, f"--teacher={TINY}", "--seeds", "1,2")
    assert both.returncode == 2 and "--teacher and --seeds" in both.stderr


def test_recipe_refuses_a_student_config_that_does_not_exist() -> None:
    done = run_recipe(str(TINY), "--distill", "train.max_epochs=3")
    assert done.returncode == 2
    assert "no such config file" in done.stderr and "--student" in done.stderr


@pytest.mark.trains
@pytest.mark.parametrize("to_group", [True, False], ids=["ctrl-c-to-the-terminal-group", "signal-to-the-recipe-pid"])
def test_a_signal_stops_the_recipe_only_after_its_training_saved_its_step(
    corpus: Path, tmp_path: Path, to_group: bool
) -> None:
    """subprocess.run killed the training at once on a Ctrl-C: the updates since its last checkpoint were lost."""
    run_dir = tmp_path / "run"
    overrides = tiny_overrides(corpus, run_dir, "train.max_epochs=1000", "train.threads=1")
    recipe = subprocess.Popen(
        [sys.executable, str(RECIPE), str(TINY), *overrides, "--no-download"],
        cwd=ROOT,
        env=single_thread_env(),
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # as in a terminal, whatever ran pytest
    )
    log = run_dir / "train.log"
    deadline = time.monotonic() + 120
    while not (log.is_file() and "step 20:" in log.read_text(encoding="utf-8")) and time.monotonic() < deadline:
        time.sleep(0.2)
    if to_group:
        os.killpg(recipe.pid, signal.SIGINT)
    else:
        recipe.send_signal(signal.SIGINT)
    _, stderr = recipe.communicate(timeout=120)
    assert recipe.returncode == 130, stderr[-2000:]
    assert "SIGINT: saving step" in stderr and "run_recipe: interrupted" in stderr
    assert "Traceback" not in stderr and "nothing was scored" not in stderr
    saved = checkpoint.read(run_dir / "checkpoint_last.pt")
    assert saved.training is not None and saved.training.progress.step >= 20
