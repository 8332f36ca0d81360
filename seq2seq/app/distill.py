"""Sequence-level knowledge distillation (Kim and Rush, 2016): a teacher's translations of the training
source become a student's training targets.

Translating a training corpus with beam search takes hours on a CPU, so it goes in chunks, each saved as
soon as it is done: a rerun with the same teacher, decode settings and source translates only the chunks
still missing. The student's data directory holds the distilled pairs (and, to mix them, the original
ones) beside copies of the original validation and test splits, so it trains and evaluates like any other.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from seq2seq.errors import ConfigError
from seq2seq.text.corpus import read_lines, read_split

if TYPE_CHECKING:
    from seq2seq.config import DataConfig, DecodeConfig
    from seq2seq.decoding.translate import TextTranslator

log = logging.getLogger("seq2seq")

CHUNK_LINES = 1000  # seconds to a minute of beam search on a CPU: a kill loses little, the files stay few
MANIFEST = "teacher.json"
DISTILLED = "distilled"  # the split of the teacher's translations in the student's data directory
ORIGINAL = "original"  # the split of the original training pairs, when they are mixed in


def teacher_identity(
    paths: Sequence[Path], decode: DecodeConfig, sources: Sequence[str], tgt_lang: str, chunk_lines: int
) -> dict[str, Any]:
    """What the saved chunks depend on: the translation's identity and the chunk size; chunks saved under
    another identity are translated again."""
    return {**translation_identity(paths, decode, sources, tgt_lang), "chunk_lines": chunk_lines}


def translation_identity(
    paths: Sequence[Path], decode: DecodeConfig, sources: Sequence[str], tgt_lang: str
) -> dict[str, Any]:
    """What a saved translation depends on: the checkpoints' files (their bytes), the decode settings, the
    source lines and the target language (a model of several translates the same lines into each); a
    translation saved under another identity must be made again."""
    return {
        "checkpoints": [{"path": str(p), "sha256": _file_hash(p)} for p in paths],
        "decode": dataclasses.asdict(decode),
        "sources": hashlib.sha256("\n".join(sources).encode("utf-8")).hexdigest(),
        "lines": len(sources),
        "tgt_lang": tgt_lang,
    }


def _file_hash(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def translate_in_chunks(
    open_teacher: Callable[[], TextTranslator],
    sources: Sequence[str],
    directory: Path,
    identity: dict[str, Any],
    report: Callable[[str], None] = log.info,
    tgt_lang: str = "",
) -> list[str]:
    """The teacher's translation of every source line (into `tgt_lang`, for a teacher of several target
    languages), one per line, from the chunks saved in `directory` and, for the chunks missing there, from
    the teacher (opened only if one is missing); `report` gets a line after each chunk translated."""
    _forget_other_teacher(directory, identity, report)
    size, translator = identity["chunk_lines"], None
    total, out, start, fresh = -(-len(sources) // size), [], time.monotonic(), 0
    for index, begin in enumerate(range(0, len(sources), size)):
        chunk, path = sources[begin : begin + size], directory / f"chunk{index:05d}.txt"
        lines = _saved_chunk(path, len(chunk))
        if lines is None:
            translator = translator or open_teacher()
            lines = [" ".join(h.splitlines()) for h in translator.translate(chunk, tgt_lang=tgt_lang)]  # one line each
            _write_atomically(path, lines)
            fresh += len(chunk)
            report(_progress(index + 1, total, begin + len(chunk), len(sources), fresh, time.monotonic() - start))
        out.extend(lines)
    report(f"distill: {len(sources):,} lines, {total} chunks in {directory} ({fresh:,} lines translated now)")
    return out


def _progress(chunk: int, total: int, lines: int, all_lines: int, fresh: int, seconds: float) -> str:
    rate = fresh / max(seconds, 1e-9)
    left = (all_lines - lines) / max(rate, 1e-9) / 60
    return (
        f"distill: chunk {chunk}/{total} ({lines:,}/{all_lines:,} lines), {rate:.1f} lines/s, about {left:.0f} min left"
    )


def _forget_other_teacher(directory: Path, identity: dict[str, Any], report: Callable[[str], None]) -> None:
    """Remove the chunks of another teacher, decode setting, source or chunk size; record this identity."""
    directory.mkdir(parents=True, exist_ok=True)
    manifest = directory / MANIFEST
    if manifest.is_file() and json.loads(manifest.read_text(encoding="utf-8")) == identity:
        return
    stale = sorted(directory.glob("chunk*.txt"))
    if stale:
        report(f"distill: the teacher, its decode settings or the source changed: {len(stale)} chunk(s) discarded")
    for path in stale:
        path.unlink()
    _write_atomically(manifest, [json.dumps(identity, indent=2)])


def _saved_chunk(path: Path, lines: int) -> list[str] | None:
    """A finished chunk's lines; None when it is missing or does not hold one line per source line."""
    if not path.is_file():
        return None
    saved = read_lines(path)
    return saved if len(saved) == lines else None


def _write_atomically(path: Path, lines: Sequence[str]) -> None:
    """A complete file or none: a kill while writing leaves no half chunk behind."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    os.replace(tmp, path)


def training_pairs(data: DataConfig) -> tuple[list[str], list[str]]:
    """The source and target lines of every training set of data.train, once each (weights do not apply)."""
    if data.pairs:
        raise ConfigError("distillation translates one language pair: not with data.pairs")
    sources: list[str] = []
    targets: list[str] = []
    for name, _ in data.train_sets():
        src, tgt = read_split(data, name)
        sources += src
        targets += tgt
    return sources, targets


def write_student_data(data: DataConfig, directory: Path, distilled: Sequence[str], mix: bool) -> list[str]:
    """The student's data directory (text format): the distilled pairs, the original training pairs when
    `mix`, the original validation and test splits (and the test's tokenized reference, when there is
    one); returns the `data.*` overrides that make a config train on it."""
    from seq2seq.text.download import tokenized_reference

    directory.mkdir(parents=True, exist_ok=True)
    sources, targets = training_pairs(data)
    splits = {DISTILLED: (sources, list(distilled))}
    if mix:
        splits[ORIGINAL] = (sources, targets)
    for split in (data.valid, data.test):
        splits[split] = read_split(data, split)
    for split, sides in splits.items():
        for lang, lines in zip((data.src_lang, data.tgt_lang), sides):
            _write_if_changed(directory / f"{split}.{lang}", lines)
    tok = tokenized_reference(data.dir, data.test, data.tgt_lang)
    if tok.is_file():
        _write_if_changed(tokenized_reference(directory, data.test, data.tgt_lang), read_lines(tok))
    train = f"[{ORIGINAL}, {DISTILLED}]" if mix else f"[{DISTILLED}]"
    return [f"data.dir={directory}", "data.format=text", f"data.train={train}", "data.prepared_dir="]


def _write_if_changed(path: Path, lines: Sequence[str]) -> None:
    """Write the lines unless the file already holds them: an unchanged file keeps its time, so the
    student's prepared data stays valid across reruns."""
    if path.is_file() and read_lines(path) == list(lines):
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    _write_atomically(path, lines)
