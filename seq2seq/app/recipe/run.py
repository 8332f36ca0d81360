"""A whole recipe, step after step: download, train, average, pick, test, and optionally distill a student."""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from seq2seq.app.distill import CHUNK_LINES
from seq2seq.app.evaluation import EvalSet, eval_set
from seq2seq.app.recipe import steps
from seq2seq.app.recipe.report import markdown
from seq2seq.app.recipe.results import Member, RecipeResults, TrainResult
from seq2seq.app.recipe.state import RecipeState
from seq2seq.app.recipe.student import StudentPlan, distill
from seq2seq.config import ExperimentConfig, load_config
from seq2seq.errors import ConfigError, UsageError
from seq2seq.runs.run_dir import RunDirectory
from seq2seq.text.corpus import read_split

log = logging.getLogger("seq2seq")


@dataclass(frozen=True)
class RecipeOptions:
    """config: the YAML experiment file, overrides: its `section.key=value` settings; average: the k of the
    last-k averages (None: checkpoint.average_last); no_download: use the corpus already in data.dir; seeds: one
    model per seed, in RUN/seedS, and test their ensemble; distill: train a student on the teacher's
    translations of the training source, with this config ("": the recipe's); distill_mix: the student
    trains on the original pairs too; distill_chunk: lines a saved chunk of the teacher's translation;
    student: the student's settings, on top of its config; teacher: the config of the recipe's system
    instead of its own (None): a model trained in that config's run directory (skipped once it has finished
    there, so recipes of several pairs can share one), averaged, picked on this recipe's val and tested on
    its pair, into its target language when it translates into several; teacher_settings: that model's
    settings, on top of its config."""

    config: str
    overrides: Sequence[str] = ()
    average: Sequence[int] | None = None
    no_download: bool = False
    seeds: Sequence[int] | None = None
    distill: str | None = None
    distill_mix: bool = False
    distill_chunk: int = CHUNK_LINES
    student: Sequence[str] = ()
    teacher: str | None = None
    teacher_settings: Sequence[str] = ()

    def check(self) -> None:
        if self.distill is None and (self.distill_mix or self.student):
            raise UsageError("--distill-mix and --student need --distill")
        if self.teacher is None and self.teacher_settings:
            raise UsageError("--teacher-set needs --teacher")
        if self.teacher is not None and not Path(self.teacher).is_file():
            raise UsageError(f"--teacher {self.teacher}: no such config file (its settings go to --teacher-set)")
        if self.teacher is not None and self.seeds is not None:
            raise UsageError("--teacher and --seeds: the system is either the given teacher or the seeds' ensemble")
        if self.distill and not Path(self.distill).is_file():
            raise UsageError(f"--distill {self.distill}: no such config file (the student's settings go to --student)")
        if self.seeds is not None and (not self.seeds or len(set(self.seeds)) < len(self.seeds)):
            raise UsageError(f"--seeds: each seed once, please; got {list(self.seeds)}")

    def student_plan(self) -> StudentPlan:
        assert self.distill is not None
        base = [] if self.distill else list(self.overrides)  # the recipe's overrides go with the recipe's config
        sizes = None if self.average is None else list(self.average)
        return StudentPlan(
            self.distill or self.config, base, list(self.student), self.distill_mix, self.distill_chunk, sizes
        )


def run_recipe(options: RecipeOptions) -> RecipeResults:
    """Run (or go on with) the recipe; RUN/results.json and RUN/results.md hold its results (with a student,
    the teacher's are written before the student trains)."""
    options.check()
    start = time.monotonic()
    cfg = load_config(options.config, list(options.overrides))
    d = cfg.data
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    teacher_cfg = None if options.teacher is None else _teacher_config(options, cfg)
    if not options.no_download:
        from seq2seq.text.download import download_multi30k

        download_multi30k(d.dir, (d.src_lang, d.tgt_lang))
        if teacher_cfg is not None:  # the teacher's other pairs too
            languages = {lang for pair in teacher_cfg.data.language_pairs() for lang in pair}
            download_multi30k(teacher_cfg.data.dir, tuple(sorted(languages)))
    top = Path(cfg.train.run_dir)
    state = RecipeState(top)
    if teacher_cfg is not None:
        val = steps.Split(*read_split(d, d.valid))
        cfg, members = _given_teacher(state, options, teacher_cfg, cfg, val)
    else:
        seeds: list[int | None] = [*options.seeds] if options.seeds else [None]
        trained = [_train(state, options, cfg, seed) for seed in seeds]  # every model before any decoding
        val = steps.Split(*read_split(d, d.valid))
        members = [_pick(state, options, *model, val) for model in trained]
    test = eval_set(d)  # the test split and, when the dataset has one, its tokenized reference
    results = _teacher(state, options, cfg, members, val, test)
    if options.distill is not None:
        write_results(top, results, start)  # the teacher's, at once: the student takes another hour
        student = distill(state, options.student_plan(), cfg, [Path(p) for p in results.system.checkpoints], val, test)
        results = dataclasses.replace(results, student=student)
    return write_results(top, results, start)


def _train(
    state: RecipeState, options: RecipeOptions, cfg: ExperimentConfig, seed: int | None
) -> tuple[str, ExperimentConfig, TrainResult]:
    """Train (or resume) the recipe's model, or its model of one seed: its name, config and training."""
    overrides, name = list(options.overrides), "" if seed is None else f"seed{seed}"
    if seed is not None:
        top = Path(cfg.train.run_dir)
        overrides += [f"train.seed={seed}", f"train.run_dir={top / name}"]
        if not cfg.data.prepared_dir:  # one prepared corpus: one vocabulary, which an ensemble needs
            overrides.append(f"data.prepared_dir={top / 'prepared'}")
    member_cfg = load_config(options.config, overrides)
    return name, member_cfg, steps.train(state, name, options.config, overrides, member_cfg)


def _teacher_config(options: RecipeOptions, cfg: ExperimentConfig) -> ExperimentConfig:
    """The `--teacher` model's config, which must translate the recipe's pair."""
    assert options.teacher is not None
    teacher_cfg = load_config(options.teacher, list(options.teacher_settings))
    pair = (cfg.data.src_lang, cfg.data.tgt_lang)
    if pair not in teacher_cfg.data.language_pairs():
        known = ", ".join(f"{s}-{t}" for s, t in teacher_cfg.data.language_pairs())
        raise ConfigError(f"--teacher {options.teacher} translates {known}, not this recipe's {pair[0]}-{pair[1]}")
    return teacher_cfg


def _given_teacher(
    state: RecipeState, options: RecipeOptions, teacher_cfg: ExperimentConfig, cfg: ExperimentConfig, val: steps.Split
) -> tuple[ExperimentConfig, list[Member]]:
    """The `--teacher` model as the recipe's system: trained in its own run directory, averaged and picked on
    this recipe's val. Returns the recipe's config with the teacher's decode settings (what the system is
    decoded with from here on: val, test and the student's data) and the teacher as the one member."""
    assert options.teacher is not None
    decoding = dataclasses.replace(cfg, decode=teacher_cfg.decode)
    trained = steps.train(state, "teacher", options.teacher, list(options.teacher_settings), teacher_cfg)
    run = RunDirectory(teacher_cfg.train.run_dir)
    averages = steps.average(state, "teacher", run, steps.average_sizes(options.average, teacher_cfg))
    return decoding, [Member("teacher", trained, steps.pick(state, "teacher", run, decoding, averages, val))]


def _pick(
    state: RecipeState, options: RecipeOptions, name: str, cfg: ExperimentConfig, trained: TrainResult, val: steps.Split
) -> Member:
    """A trained model's averages, and the one of them or its checkpoint_best picked on val."""
    run = RunDirectory(cfg.train.run_dir)
    averages = steps.average(state, name, run, steps.average_sizes(options.average, cfg))
    return Member(name, trained, steps.pick(state, name, run, cfg, averages, val))


def _teacher(
    state: RecipeState,
    options: RecipeOptions,
    cfg: ExperimentConfig,
    members: list[Member],
    val: steps.Split,
    test: EvalSet,
) -> RecipeResults:
    """The recipe's system (its one model, or the ensemble of the seeds' models) tested once."""
    d, top = cfg.data, Path(cfg.train.run_dir)
    if options.seeds:
        paths = [Path(m.pick.checkpoints[0]) for m in members]
        system = steps.ensemble_pick(state, cfg, paths, val)
        save = top / f"{d.test}.ensemble.{d.tgt_lang}"
    else:
        system, run_dir = members[0].pick, Path(members[0].train.run_dir)
        paths, save = [Path(p) for p in system.checkpoints], run_dir / f"{d.test}.{system.picked}.{d.tgt_lang}"
    return RecipeResults(
        config=options.config,
        overrides=list(options.overrides),
        pair=f"{d.src_lang}-{d.tgt_lang}",
        decode=dataclasses.asdict(cfg.decode),
        threads=torch.get_num_threads(),
        test_set=d.test,
        seeds=list(options.seeds or []),
        teacher=[] if options.teacher is None else [options.teacher, *options.teacher_settings],
        members=members,
        system=system,
        test=steps.score_test(state, "test", cfg, paths, test, save),
    )


def write_results(top: Path, results: RecipeResults, start: float) -> RecipeResults:
    """results.json and results.md as they stand, with the minutes this invocation has taken so far."""
    results = dataclasses.replace(results, this_invocation_minutes=round((time.monotonic() - start) / 60, 1))
    top.mkdir(parents=True, exist_ok=True)
    (top / "results.json").write_text(json.dumps(results.to_json(), indent=2), encoding="utf-8")
    (top / "results.md").write_text(markdown(results), encoding="utf-8")
    return results
