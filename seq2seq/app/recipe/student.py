"""The recipe's distillation steps: the teacher translates the training source (`distill`), a student trains
on it and is picked and tested like the teacher's models (`student/...`), and is timed exported to
CTranslate2 int8 (`student/int8`)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
from dataclasses import dataclass
from pathlib import Path

from seq2seq.app.distill import teacher_identity, training_pairs, translate_in_chunks, write_student_data
from seq2seq.app.evaluation import EvalSet
from seq2seq.app.recipe import steps
from seq2seq.app.recipe.results import Distilled, Int8Result, Member, StudentResult
from seq2seq.app.recipe.state import RecipeState, lines_digest, stamps
from seq2seq.app.recipe.systems import open_system, scored, translate
from seq2seq.config import ExperimentConfig, load_config
from seq2seq.errors import ConfigError, UserError
from seq2seq.runs.run_dir import RunDirectory

log = logging.getLogger("seq2seq")


@dataclass(frozen=True)
class StudentPlan:
    """The student's config file and the settings on top of it (the student's own last); the recipe's
    settings for distilling (the original pairs mixed in, lines a saved chunk) and its average sizes."""

    config: str
    base: list[str]  # the recipe's overrides, when the student uses the recipe's config
    student: list[str]
    mix: bool
    chunk_lines: int
    sizes: list[int] | None  # None: each config's checkpoint.average_last


def check_student(plan: StudentPlan, teacher: ExperimentConfig) -> None:
    """The student's settings load, and it learns the teacher's pair: another pair would train on
    translations it cannot use."""
    student = load_config(plan.config, [*plan.base, *plan.student])
    t, s = teacher.data, student.data
    if (t.src_lang, t.tgt_lang) != (s.src_lang, s.tgt_lang):
        raise ConfigError(
            f"--distill: the student translates {s.src_lang}-{s.tgt_lang}, its teacher {t.src_lang}-{t.tgt_lang}"
        )


def distill(
    state: RecipeState, plan: StudentPlan, cfg: ExperimentConfig, teacher: list[Path], val: steps.Split, test: EvalSet
) -> StudentResult:
    """Translate the training source with the teacher, train a student on it, pick it on val, test it once,
    and time it beside the teacher (in PyTorch, and exported to CTranslate2 int8)."""
    check_student(plan, cfg)
    top = Path(cfg.train.run_dir)
    data = distilled(state, plan, cfg, teacher, top / "distilled")
    overrides = [*plan.base, f"train.run_dir={top / 'student'}", *data.data_overrides, *plan.student]
    student_cfg = load_config(plan.config, overrides)
    trained = steps.train(state, "student", plan.config, overrides, student_cfg)
    run = RunDirectory(student_cfg.train.run_dir)
    sizes = steps.average_sizes(plan.sizes, student_cfg)
    picked = steps.pick(state, "student", run, student_cfg, steps.average(state, "student", run, sizes), val)
    d, checkpoint = student_cfg.data, Path(picked.checkpoints[0])
    save = run.path / f"{d.test}.{picked.picked}.{d.tgt_lang}"
    tested = steps.score_test(state, "student/test", student_cfg, [checkpoint], test, save)
    result = StudentResult(
        plan.config,
        overrides,
        plan.mix,
        Member("student", trained, picked),
        tested,
        int8_student(state, checkpoint, student_cfg, test),
    )
    # RUN/results.json keeps the newest student; each student's own directory keeps its results.
    (run.path / "student_results.json").write_text(json.dumps(result.to_json(), indent=2), encoding="utf-8")
    return result


def distilled(
    state: RecipeState, plan: StudentPlan, cfg: ExperimentConfig, teacher: list[Path], directory: Path
) -> Distilled:
    """The teacher's translation of the training source (in resumable chunks) written as the student's
    data directory."""
    sources, targets = training_pairs(cfg.data)

    def translate_source() -> tuple[Distilled, list[Path]]:
        identity = teacher_identity(teacher, cfg.decode, sources, cfg.data.tgt_lang, plan.chunk_lines)
        chunks, into = directory / "chunks", cfg.data.tgt_lang
        hyps = translate_in_chunks(lambda: open_system(teacher, cfg), sources, chunks, identity, log.info, into)
        overrides = write_student_data(cfg.data, directory / "data", hyps, plan.mix)
        written = sorted(p for p in (directory / "data").rglob("*") if p.is_file())
        return Distilled(str(directory / "data"), overrides), written

    inputs = {
        "teacher": stamps(teacher),
        "decode": dataclasses.asdict(cfg.decode),
        "pairs": lines_digest(sources, targets),
        "mix": plan.mix,
        "chunk_lines": plan.chunk_lines,
    }
    result, _ = state.step("distill", inputs, Distilled, translate_source)
    return result


def int8_student(state: RecipeState, checkpoint: Path, cfg: ExperimentConfig, test: EvalSet) -> Int8Result:
    """The student exported to CTranslate2 int8, decoding test with the recipe's threads and decode settings."""
    if importlib.util.find_spec("ctranslate2") is None:
        reason = "CTranslate2 is not installed (pip install 'seq2seq[export]'): no int8 speed for the student"
        log.info("recipe: %s", reason)
        return Int8Result(skipped=reason)
    directory = checkpoint.parent / "ctranslate2_int8"
    save = checkpoint.parent / f"{cfg.data.test}.ctranslate2_int8.{cfg.data.tgt_lang}"

    def export_and_test() -> tuple[Int8Result, list[Path]]:
        from seq2seq.deploy.export import export_ctranslate2

        try:
            exported = export_ctranslate2(checkpoint, directory, "int8")
        except UserError as e:  # an architecture that CTranslate2 does not run
            log.info("recipe: no CTranslate2 int8 student: %s", e)
            return Int8Result(skipped=str(e)), []
        hyps, seconds = translate(open_system([exported], cfg, "ctranslate2"), test.sources, save, cfg.data.tgt_lang)
        return Int8Result("", str(exported), scored([exported], hyps, seconds, test, save)), [save]

    inputs = {**steps.decoding(cfg, [checkpoint], test.sources, test.references)}
    result, _ = state.step("student/int8", inputs, Int8Result, export_and_test)
    return result
