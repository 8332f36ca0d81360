"""Decoding with a recipe's systems: opening one (a checkpoint, an ensemble, a CTranslate2 export) with the
recipe's decode settings, translating once, and scoring a test translation as `seq2seq evaluate` does."""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from seq2seq.app.distill import translation_identity
from seq2seq.app.evaluation import EvalSet, decode, score
from seq2seq.app.model import Engine, ModelOptions, open_translator
from seq2seq.app.recipe.results import Example, TestResult, TestScore
from seq2seq.config import ExperimentConfig
from seq2seq.decoding.translate import TextTranslator
from seq2seq.text.corpus import read_lines

log = logging.getLogger("seq2seq")

BOOTSTRAP = 1000  # resampled test sets for the 95% intervals of the test BLEU scores
EXAMPLE_EVERY = 200  # every 200th test sentence is shown with its reference: a fixed, unpicked sample
REUSED = "reused (same checkpoints, decode settings and sources)"


def open_system(paths: Sequence[Path], cfg: ExperimentConfig, engine: Engine = "torch") -> TextTranslator:
    """One checkpoint, several as an ensemble, or a CTranslate2 export, on the CPU with the recipe's
    decode settings and threads."""
    settings = tuple(f"decode.{key}={value}" for key, value in dataclasses.asdict(cfg.decode).items())
    paths_text = tuple(str(p) for p in paths)
    threads = torch.get_num_threads()
    return open_translator(ModelOptions(paths_text, engine, "cpu", threads, settings, token_scores=False))


def translate(translator: TextTranslator, sources: list[str], save: Path, tgt_lang: str) -> tuple[list[str], float]:
    """The translations into `tgt_lang`, the recipe's target language (also written to `save`), and the seconds
    they took. A model of one pair checks it is its own; one of several (a shared `--teacher`) is asked for it."""
    start = time.monotonic()
    hyps = decode(translator, sources, tgt_lang)
    seconds = time.monotonic() - start
    save.write_text("".join(h + "\n" for h in hyps), encoding="utf-8")
    return hyps, seconds


def record_of(save: Path) -> Path:
    """The file that says what made the translation in `save`, and how long it took."""
    return save.with_name(save.name + ".json")


def translate_once(
    paths: Sequence[Path], cfg: ExperimentConfig, sources: list[str], save: Path
) -> tuple[list[str], float]:
    """The checkpoints' translation of `sources` and the seconds it took, decoded at most once.

    `save` keeps the translation and `save`.json what made it (the checkpoints' bytes, the decode settings,
    the sources) with its seconds; a rerun with the same identity reads them back instead of decoding
    again, so re-scoring a finished recipe, or going on to its student, costs seconds, not minutes.
    """
    identity = translation_identity(paths, cfg.decode, sources, cfg.data.tgt_lang)
    saved = _saved_translation(save, identity)
    if saved is not None:
        note_reused(save)
        return saved
    hyps, seconds = translate(open_system(paths, cfg), sources, save, cfg.data.tgt_lang)
    record_of(save).write_text(json.dumps({"identity": identity, "seconds": seconds}, indent=2), encoding="utf-8")
    return hyps, seconds


def note_reused(save: Path | str) -> None:
    log.info("recipe: %s %s", save, REUSED)


def _saved_translation(save: Path, identity: dict[str, Any]) -> tuple[list[str], float] | None:
    """The translation in `save` and its seconds, if its record says that `identity` made it; else None."""
    record = record_of(save)
    if not (save.is_file() and record.is_file()):
        return None
    made = json.loads(record.read_text(encoding="utf-8"))
    if made.get("identity") != identity:
        return None
    hyps = read_lines(save)
    return (hyps, float(made["seconds"])) if len(hyps) == identity["lines"] else None


def scored(paths: Sequence[Path], hyps: list[str], seconds: float, test: EvalSet, save: Path) -> TestResult:
    """A test translation scored as `seq2seq evaluate --bootstrap 1000 --format json` scores it, with its
    speed and a fixed sample of it."""
    record = score(hyps, test, BOOTSTRAP).record()
    examples = [Example(test.sources[i], test.references[i], hyps[i]) for i in range(0, len(hyps), EXAMPLE_EVERY)]
    speed = round(len(hyps) / max(seconds, 1e-9), 1)
    return TestResult([str(p) for p in paths], str(save), TestScore.from_evaluation(record), speed, examples)
