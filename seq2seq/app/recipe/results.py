"""The recipe's results, typed: what each step found, and the layout of results.json built from them.

Every step's result is a frozen dataclass of JSON values (numbers, strings, lists, string-keyed dicts and
other such dataclasses), so that the state file can keep it and give it back as it was (`from_dict`).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

Result = TypeVar("Result", bound="DataclassInstance")

BLEU, CHRF, TER = "BLEU", "chrF", "TER"  # the names `seq2seq evaluate --format json` gives the scores
TOKENIZED_BLEU = "BLEU (lc, Moses-tokenized)"


@dataclass(frozen=True)
class TestScore:
    """A test translation's scores, rounded to 2 decimals, each BLEU with the half-width of its 95% interval."""

    __test__ = False  # not a test class, to pytest

    sacrebleu: float
    sacrebleu_ci95: float | None
    chrf: float
    ter: float
    signature: str
    tok_lc_bleu: float | None = None  # when the dataset has tokenized references
    tok_lc_bleu_ci95: float | None = None

    @classmethod
    def from_evaluation(cls, record: Mapping[str, Any]) -> TestScore:
        """From the object `seq2seq evaluate --format json` prints (`Evaluation.record()`)."""
        scores = {s["name"]: s for s in record["scores"]}
        bleu, tokenized = scores[BLEU], scores.get(TOKENIZED_BLEU)
        return cls(
            round(bleu["score"], 2),
            _round(bleu["ci95"]),
            round(scores[CHRF]["score"], 2),
            round(scores[TER]["score"], 2),
            bleu["signature"],
            None if tokenized is None else round(tokenized["score"], 2),
            None if tokenized is None else _round(tokenized["ci95"]),
        )

    def to_json(self) -> dict[str, Any]:
        """results.json's "test": the tokenized BLEU's keys only when there is one."""
        scores: dict[str, Any] = {"sacrebleu": self.sacrebleu, "sacrebleu_ci95": self.sacrebleu_ci95}
        scores.update(chrf=self.chrf, ter=self.ter, signature=self.signature)
        if self.tok_lc_bleu is not None:
            scores.update(tok_lc_bleu=self.tok_lc_bleu, tok_lc_bleu_ci95=self.tok_lc_bleu_ci95)
        return scores


def _round(value: float | None) -> float | None:
    return None if value is None else round(float(value), 2)


@dataclass(frozen=True)
class Example:
    """A test sentence, its reference and the system's translation."""

    source: str
    reference: str
    ours: str


@dataclass(frozen=True)
class TestResult:
    """The test set decoded once by a system (`translation`, the file) and scored, with the decoding speed."""

    __test__ = False

    checkpoints: list[str]
    translation: str
    score: TestScore
    sentences_per_second: float
    examples: list[Example]

    def to_json(self) -> dict[str, Any]:
        return {
            "test": self.score.to_json(),
            "test_sentences_per_second": self.sentences_per_second,
            "examples": [dataclasses.asdict(e) for e in self.examples],
        }


@dataclass(frozen=True)
class TrainResult:
    """A finished training run, as its metrics.jsonl tells it."""

    run_dir: str
    params_millions: float
    updates: int
    epochs: int  # completed; a time budget may stop training inside the next one
    train_minutes: float


@dataclass(frozen=True)
class Averages:
    """The averages of the last k step checkpoints written for a run."""

    checkpoints: list[str]


@dataclass(frozen=True)
class Pick:
    """The val BLEU of each candidate, the one picked, and the val translations scored."""

    val: dict[str, float]
    picked: str
    checkpoints: list[str]  # the picked system's: one checkpoint, or an ensemble's
    translations: list[str]


@dataclass(frozen=True)
class Member:
    """One trained model of the recipe: `name` "" for the recipe's one model, "seed1" for a model of --seeds,
    "student" for the distilled one."""

    name: str
    train: TrainResult
    pick: Pick

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self.train), "val": self.pick.val, "picked": self.pick.picked}


@dataclass(frozen=True)
class Distilled:
    """The teacher's translation of the training source, written as the student's data directory."""

    directory: str
    data_overrides: list[str]  # the `data.*` settings that train on it


@dataclass(frozen=True)
class Int8Result:
    """The student exported to CTranslate2 int8 and its test decoding, or why there is none."""

    skipped: str = ""
    directory: str = ""
    test: TestResult | None = None

    def to_json(self) -> dict[str, Any]:
        if self.test is None:
            return {"skipped": self.skipped}
        return {"dir": self.directory, **self.test.to_json()}


@dataclass(frozen=True)
class StudentResult:
    """A student trained on the teacher's translations: its config, training, pick, test and int8 export."""

    config: str
    overrides: list[str]
    mix: bool
    member: Member
    test: TestResult
    int8: Int8Result

    def to_json(self) -> dict[str, Any]:
        return {
            "config": self.config,
            "overrides": self.overrides,
            "mix": self.mix,
            **self.member.to_json(),
            "checkpoints": self.test.checkpoints,
            **self.test.to_json(),
            "ctranslate2_int8": self.int8.to_json(),
        }


@dataclass(frozen=True)
class RecipeResults:
    """Everything a recipe found: its models, the system it picked (one model, or with seeds their ensemble),
    that system's test scores and, with distillation, the student."""

    config: str
    overrides: list[str]
    pair: str
    decode: dict[str, Any]
    threads: int
    test_set: str
    seeds: list[int]  # empty: one model
    members: list[Member]
    system: Pick  # the one model's pick, or the ensemble's val score
    test: TestResult
    student: StudentResult | None = None
    this_invocation_minutes: float = 0.0
    teacher: list[str] = field(default_factory=list)  # --teacher's config and settings: the system is that model

    @property
    def ensemble(self) -> bool:
        return bool(self.seeds)

    def to_json(self) -> dict[str, Any]:
        """results.json: the layout scripts and docs/results.md read."""
        head = {
            "config": self.config,
            "overrides": self.overrides,
            "pair": self.pair,
            "decode": self.decode,
            "threads": self.threads,
            "test_set": self.test_set,
        }
        if not self.ensemble:
            system = self.members[0].to_json()
        else:
            members = [{"seed": seed, **m.to_json()} for seed, m in zip(self.seeds, self.members)]
            system = {
                "members": members,
                "params_millions": round(sum(m.train.params_millions for m in self.members), 1),
                "updates": sum(m.train.updates for m in self.members),
                "train_minutes": round(sum(m.train.train_minutes for m in self.members), 1),
                "val": self.system.val,
                "picked": self.system.picked,
            }
        if self.teacher:
            head["teacher"] = self.teacher
        out = {**head, **system, "checkpoints": self.test.checkpoints, **self.test.to_json()}
        if self.student is not None:
            out["student"] = self.student.to_json()
        out["this_invocation_minutes"] = self.this_invocation_minutes
        return out


def from_dict(cls: type[Result], data: Mapping[str, Any]) -> Result:
    """A result dataclass from `dataclasses.asdict`'s dict of it (as read back from JSON)."""
    hints = typing.get_type_hints(cls)
    return cls(**{f.name: _value(hints[f.name], data[f.name]) for f in dataclasses.fields(cls) if f.name in data})


def _value(kind: Any, value: Any) -> Any:
    if value is None:
        return None
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin in (typing.Union, types.UnionType):
        return _value(next(a for a in args if a is not type(None)), value)
    if dataclasses.is_dataclass(kind):
        return from_dict(kind, value)  # type: ignore[arg-type]
    if origin is list:
        return [_value(args[0], v) for v in value]
    if origin is dict:
        return {k: _value(args[1], v) for k, v in value.items()}
    if kind is float:
        return float(value)  # JSON writes 2.0 as 2.0, but a hand-edited 2 must compare equal too
    return value
