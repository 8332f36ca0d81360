"""The recipe's steps for one model: train, average, pick on val, test; each recorded in the state file."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from seq2seq import metrics
from seq2seq.app.evaluation import EvalSet
from seq2seq.app.recipe.commands import seq2seq
from seq2seq.app.recipe.results import Averages, Pick, TestResult, TrainResult
from seq2seq.app.recipe.state import RecipeState, lines_digest, stamps
from seq2seq.app.recipe.systems import note_reused, record_of, scored, translate_once
from seq2seq.config import ExperimentConfig
from seq2seq.errors import UserError
from seq2seq.runs.run_dir import RunDirectory

log = logging.getLogger("seq2seq")

Translated = TypeVar("Translated", Pick, TestResult)


@dataclass(frozen=True)
class Split:
    """The val split's lines, which every candidate is decoded on."""

    sources: list[str]
    references: list[str]


def step_key(name: str, step: str) -> str:
    """`train` for the recipe's one model, `seed1/train` for a model of --seeds, `student/train`."""
    return f"{name}/{step}" if name else step


def train(state: RecipeState, name: str, config: str, overrides: Sequence[str], cfg: ExperimentConfig) -> TrainResult:
    """Train (or resume) a model with `seq2seq train` in its run directory; skipped when it finished before
    with the same settings (decoding's aside) and its checkpoint_last is untouched."""
    run = RunDirectory(cfg.train.run_dir)
    settings = {k: v for k, v in dataclasses.asdict(cfg).items() if k != "decode"}  # decoding never trains

    def run_training() -> tuple[TrainResult, list[Path]]:
        seq2seq("train", "--config", config, *overrides)
        return read_training(run.path), [run.last]

    result, _ = state.step(step_key(name, "train"), {"settings": settings}, TrainResult, run_training)
    return result


def read_training(run_dir: Path) -> TrainResult:
    """Size and training of a finished run, from its metrics.jsonl (the last start and finish records)."""
    from seq2seq.training.monitor import read_metrics

    records = read_metrics(run_dir / "metrics.jsonl")
    starts = [r for r in records if r["event"] == "start"]
    finishes = [r for r in records if r["event"] == "finish"]
    if not starts or not finishes:
        raise UserError(f"{run_dir}/metrics.jsonl records no finished training")
    minutes = [r["minutes"] for r in records if r["event"] == "valid" and r.get("minutes") is not None]
    finish = finishes[-1]
    return TrainResult(
        run_dir=str(run_dir),
        params_millions=round(starts[-1]["parameters"] / 1e6, 1),
        updates=finish["step"],
        epochs=finish["epoch"] - 1,  # the epoch it was in: completed ones are before it
        train_minutes=round(max(minutes, default=0.0), 1),  # every run validates when it finishes
    )


def average(state: RecipeState, name: str, run: RunDirectory, sizes: Sequence[int]) -> list[Path]:
    """checkpoint_avg{k}.pt from the run's last k step checkpoints, for each k (fewer if fewer exist)."""
    steps = run.step_checkpoints(run.current_run_id())

    def write_averages() -> tuple[Averages, list[Path]]:
        if len(steps) < 2:
            return Averages([]), []
        out = []
        for k in sorted({min(k, len(steps)) for k in sizes}):
            out.append(run.path / f"checkpoint_avg{k}.pt")
            run.average_last(k, out[-1])
        return Averages([str(p) for p in out]), out

    inputs = {"sizes": sorted(set(sizes)), "steps": stamps(steps)}
    result, _ = state.step(step_key(name, "average"), inputs, Averages, write_averages)
    return [Path(p) for p in result.checkpoints]


def decoding(cfg: ExperimentConfig, paths: Sequence[Path], *sides: Sequence[str]) -> dict[str, Any]:
    """What a translation step depends on: the checkpoints, the decode settings and the lines it scores."""
    return {"checkpoints": stamps(paths), "decode": dataclasses.asdict(cfg.decode), "lines": lines_digest(*sides)}


def pick(
    state: RecipeState, name: str, run: RunDirectory, cfg: ExperimentConfig, averages: list[Path], val: Split
) -> Pick:
    """The best on val of checkpoint_best and the averages of the last k step checkpoints."""
    candidates = [run.best, *averages]

    def score_candidates() -> tuple[Pick, list[Path]]:
        scores, saves = {}, []
        for candidate in candidates:
            saves.append(run.path / f"{cfg.data.valid}.{candidate.stem}.{cfg.data.tgt_lang}")
            hyps, _ = translate_once([candidate], cfg, val.sources, saves[-1])
            scores[candidate.stem] = round(metrics.bleu(hyps, val.references).score, 2)
        best = max(scores, key=scores.__getitem__)
        picked = [str(run.path / f"{best}.pt")]
        return Pick(scores, best, picked, [str(s) for s in saves]), _with_records(saves)

    inputs = decoding(cfg, candidates, val.sources, val.references)
    result, skipped = state.step(step_key(name, "pick"), inputs, Pick, score_candidates)
    return _reusing(result, result.translations, skipped)


def ensemble_pick(state: RecipeState, cfg: ExperimentConfig, paths: list[Path], val: Split) -> Pick:
    """The val score of the ensemble of the members' picked checkpoints (the mean of their log-probabilities)."""
    top, d = Path(cfg.train.run_dir), cfg.data
    save = top / f"{d.valid}.ensemble.{d.tgt_lang}"

    def score_ensemble() -> tuple[Pick, list[Path]]:
        hyps, _ = translate_once(paths, cfg, val.sources, save)
        bleu = round(metrics.bleu(hyps, val.references).score, 2)
        return Pick({"ensemble": bleu}, "ensemble", [str(p) for p in paths], [str(save)]), _with_records([save])

    inputs = decoding(cfg, paths, val.sources, val.references)
    result, skipped = state.step("ensemble/pick", inputs, Pick, score_ensemble)
    return _reusing(result, result.translations, skipped)


def score_test(
    state: RecipeState, key: str, cfg: ExperimentConfig, paths: list[Path], test_set: EvalSet, save: Path
) -> TestResult:
    """The test set decoded once by the system of `paths` and scored."""

    def decode_and_score() -> tuple[TestResult, list[Path]]:
        hyps, seconds = translate_once(paths, cfg, test_set.sources, save)
        return scored(paths, hyps, seconds, test_set, save), _with_records([save])

    tokenized = [str(test_set.tokenized)] if test_set.tokenized else []
    inputs = {**decoding(cfg, paths, test_set.sources, test_set.references), "tokenized": stamps(tokenized)}
    result, skipped = state.step(key, inputs, TestResult, decode_and_score)
    return _reusing(result, [result.translation], skipped)


def _with_records(saves: list[Path]) -> list[Path]:
    """The translation files and the records of what made them: the step's outputs."""
    return [path for save in saves for path in (save, record_of(save))]


def _reusing(result: Translated, translations: list[str], skipped: bool) -> Translated:
    """A translating step's result; when it was skipped, a line for each translation it reuses."""
    if skipped:
        for save in translations:
            note_reused(save)
    return result


def average_sizes(sizes: Sequence[int] | None, cfg: ExperimentConfig) -> list[int]:
    """The k of the last-k averages: the recipe's (--average), or the config's checkpoint.average_last."""
    if sizes is not None:
        return list(sizes)
    k = cfg.checkpoint.average_last
    return [k] if k > 0 else []
