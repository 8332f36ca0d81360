"""Distillation's data: the teacher's translation in saved chunks (a rerun translates only those missing),
and the student's data directory."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import cast

import pytest
from conftest import write_corpus

from seq2seq.app.distill import (
    DISTILLED,
    ORIGINAL,
    teacher_identity,
    training_pairs,
    translate_in_chunks,
    write_student_data,
)
from seq2seq.config import DataConfig, DecodeConfig, ExperimentConfig, apply_overrides
from seq2seq.decoding.translate import TextTranslator
from seq2seq.errors import ConfigError


class Upper:
    """A teacher that upper-cases its input and remembers every line it was asked to translate."""

    def __init__(self) -> None:
        self.asked: list[str] = []

    def translate(self, lines: Sequence[str], tgt_lang: str = "") -> list[str]:
        self.asked += lines
        return [line.upper() for line in lines]


def chunked(sources: list[str], directory: Path, teacher: Upper, identity: dict, notes: list[str]) -> list[str]:
    return translate_in_chunks(lambda: cast(TextTranslator, teacher), sources, directory, identity, notes.append)


@pytest.fixture
def teacher_file(tmp_path: Path) -> Path:
    path = tmp_path / "teacher.pt"
    path.write_bytes(b"weights")
    return path


def test_a_rerun_translates_only_the_missing_chunks(tmp_path: Path, teacher_file: Path) -> None:
    sources = [f"line {i}" for i in range(25)]
    identity = teacher_identity([teacher_file], DecodeConfig(), sources, "tgt", chunk_lines=10)
    first, notes = Upper(), []
    assert chunked(sources, tmp_path / "chunks", first, identity, notes) == [s.upper() for s in sources]
    assert first.asked == sources
    assert sorted(p.name for p in (tmp_path / "chunks").glob("chunk*.txt")) == [
        "chunk00000.txt",
        "chunk00001.txt",
        "chunk00002.txt",
    ]
    assert notes[0].startswith("distill: chunk 1/3 (10/25 lines)")

    (tmp_path / "chunks" / "chunk00001.txt").unlink()
    (tmp_path / "chunks" / "chunk00002.txt").write_text("cut short\n", encoding="utf-8")  # a damaged chunk
    kept = (tmp_path / "chunks" / "chunk00000.txt").read_text(encoding="utf-8")
    again = Upper()
    assert chunked(sources, tmp_path / "chunks", again, identity, notes) == [s.upper() for s in sources]
    assert again.asked == sources[10:]
    assert (tmp_path / "chunks" / "chunk00000.txt").read_text(encoding="utf-8") == kept

    done = Upper()  # every chunk is there: the teacher is not even opened
    opened: list[bool] = []

    def open_teacher() -> TextTranslator:
        opened.append(True)
        return cast(TextTranslator, done)

    assert translate_in_chunks(open_teacher, sources, tmp_path / "chunks", identity, notes.append)[24] == "LINE 24"
    assert not opened


def test_chunks_of_another_teacher_setting_or_language_are_translated_again(tmp_path: Path, teacher_file: Path) -> None:
    sources = ["a b", "c d", "e f"]
    notes: list[str] = []
    chunked(sources, tmp_path, Upper(), teacher_identity([teacher_file], DecodeConfig(), sources, "tgt", 2), notes)
    beam = teacher_identity([teacher_file], DecodeConfig(beam_size=2), sources, "tgt", 2)
    again, before = Upper(), len(notes)
    chunked(sources, tmp_path, again, beam, notes)
    assert again.asked == sources
    assert "2 chunk(s) discarded" in notes[before]
    teacher_file.write_bytes(b"other weights")
    retrained = Upper()
    retrained_identity = teacher_identity([teacher_file], DecodeConfig(beam_size=2), sources, "tgt", 2)
    chunked(sources, tmp_path, retrained, retrained_identity, notes)
    assert retrained.asked == sources
    other_language = Upper()  # a teacher of several target languages, into another one
    chunked(sources, tmp_path, other_language, {**retrained_identity, "tgt_lang": "xx"}, notes)
    assert other_language.asked == sources


def test_the_student_data_holds_the_distilled_pairs_and_the_original_val_and_test(tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "corpus", n_train=30)
    data = DataConfig(dir=str(corpus), src_lang="src", tgt_lang="tgt", test="test")
    sources, targets = training_pairs(data)
    distilled = [f"teacher {i}" for i in range(len(sources))]
    overrides = write_student_data(data, tmp_path / "student", distilled, mix=True)
    student = apply_overrides(ExperimentConfig(data=data), overrides).data
    assert student.dir == str(tmp_path / "student") and student.train == (ORIGINAL, DISTILLED)
    out = Path(student.dir)
    assert (out / f"{DISTILLED}.src").read_text(encoding="utf-8").splitlines() == sources
    assert (out / f"{DISTILLED}.tgt").read_text(encoding="utf-8").splitlines() == distilled
    assert (out / f"{ORIGINAL}.tgt").read_text(encoding="utf-8").splitlines() == targets
    for split in ("val", "test"):
        for side in ("src", "tgt"):
            assert (out / f"{split}.{side}").read_bytes() == (corpus / f"{split}.{side}").read_bytes()

    written = (out / f"{DISTILLED}.tgt").stat().st_mtime_ns
    assert write_student_data(data, out, distilled, mix=False)[2] == f"data.train=[{DISTILLED}]"
    assert (out / f"{DISTILLED}.tgt").stat().st_mtime_ns == written  # unchanged: the prepared data stays valid


def test_distillation_refuses_several_language_pairs(tmp_path: Path) -> None:
    data = DataConfig(dir=str(tmp_path), src_lang="de", tgt_lang="en", pairs=("de-en", "fr-en"))
    with pytest.raises(ConfigError, match="one language pair"):
        training_pairs(data)
