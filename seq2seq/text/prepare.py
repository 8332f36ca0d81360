"""Preparing a training corpus once: a streaming pass into memory-mapped shards, reused until it changes.

A prepared directory holds, for shard k (every SHARD_LINES lines of the raw files):

    shard{k}.{src,tgt}.txt     the shard's UTF-8 lines, concatenated    (re-encoded when sampling subwords)
    shard{k}.{src,tgt}.txtoff  int64 byte offsets into .txt, lines + 1
    shard{k}.{src,tgt}.ids     EOS-terminated token ids of the kept pairs (uint16, or uint32 for big vocabularies)
    shard{k}.{src,tgt}.off     int64 offsets into .ids, kept pairs + 1
    shard{k}.len               uint16 length index: the longer side of each kept pair (what batching needs)
    shard{k}.line              uint32 line of each kept pair within the shard's text

Each shard holds lines of one training set (`data.train` may list several).

plus the SentencePiece model(s) and `manifest.json`, which records the source
files (size, mtime, a sampled content fingerprint), the settings the data
depends on and the tokenizer's hash: any difference rebuilds the directory.
It also records each shard file's size and largest token id, checked when the
data is opened: a truncated shard, garbage ids or a replaced SentencePiece
model is one line, never silent training on wrong data.

Only a directory holding this manifest and nothing but these files (or an
empty or missing one) is ever replaced: a `data.prepared_dir` that names the
corpus, a run directory or any other tree is refused (seq2seq.runs.owned).
Memory stays constant in the corpus size, except for the SentencePiece sample
(`data.spm_sample` sentences at most, drawn by reservoir sampling).

Ctrl-C or SIGTERM stops a preparation in every phase within a fraction of a
second, and the temporary directory goes with it: the streaming pass and the
encoding check between lines and chunks; SentencePiece, which holds its thread
until its training ends, trains a large sample in a child process that the
signal ends; encoding workers start deaf to signals and ignore a Ctrl-C (the
whole group gets it, and this process ends them). A preparation killed outright
leaves a temporary that the next `prepare` or `train` removes (seq2seq.runs.owned).
"""

from __future__ import annotations

import hashlib
import json
import logging
import multiprocessing
import multiprocessing.connection
import os
import random
import re
import signal
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

import numpy as np

from seq2seq import interrupt
from seq2seq.config import DataConfig
from seq2seq.errors import ConfigError, DataError, UserError
from seq2seq.runs.owned import (
    check_replaceable,
    is_regular_file,
    make_temporary,
    remove_abandoned,
    remove_temporary,
    replace_directory,
)
from seq2seq.text.corpus import (
    EMPTY,
    TOO_LONG_LINE,
    LongLine,
    dropped_as,
    find_file,
    no_pairs,
    split_files,
    split_pairs,
)
from seq2seq.text.tokenizer import (
    Tokenizer,
    read_spm_models,
    read_tokenizer,
    tag_line,
    tokenizer_files,
    train_tokenizer,
)
from seq2seq.text.vocab import EOS

log = logging.getLogger("seq2seq.text.prepare")
R = TypeVar("R")

FORMAT = 2  # 2: shard sizes and largest ids recorded
MANIFEST = "manifest.json"
OWN_FILES = re.compile(r"manifest\.json|spm(\.src|\.tgt)?\.model|shard\d+\.((src|tgt)\.(txt|txtoff|ids|off)|len|line)")
SHARD_FILES = (
    *(f"{side}.{kind}" for side in ("src", "tgt") for kind in ("txt", "txtoff", "ids", "off")),
    "len",
    "line",
)
SHARD_LINES = 1_000_000
CHUNK_LINES = 20_000  # lines one worker encodes at a time
POOL_MIN_LINES = 100_000  # smaller corpora are encoded in this process: starting workers would cost more
SPM_PROCESS_MIN = 5_000  # sampled pairs from which SentencePiece trains in a child process (below: a second or less)
CHECK_LINES = 1024  # the streaming pass checks for a signal every this many lines
SETTINGS = ("train", "src_lang", "tgt_lang", "vocab_size", "shared_vocab", "spm_model_type", "spm_sample", "max_len")
# Settings added later, with the value a manifest that lacks them was prepared with. The given
# SentencePiece models' paths are here, their content is the tokenizer's hash.
LATER_SETTINGS: dict[str, Any] = {
    "format": "text", "src_field": "src", "tgt_field": "tgt", "pretokenized": False,
    "spm_model": "", "spm_model_src": "", "spm_model_tgt": "",
}  # fmt: skip
VOCAB_SHORTFALL = 0.9  # fewer pieces than this share of data.vocab_size: the request was above what the data supports


def tokenizer_hash(tokenizer: Tokenizer) -> str:
    digest = hashlib.sha256(tokenizer.src_proto)
    digest.update(tokenizer.tgt_proto or b"")
    return digest.hexdigest()


def fingerprint(path: Path, blocks: int = 16, block: int = 1 << 16) -> str:
    """sha256 over the size and `blocks` evenly spaced blocks: cheap on any size, and it sees most edits."""
    size = path.stat().st_size
    digest = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        for k in range(blocks):
            f.seek(max(0, (size - block) * k // max(1, blocks - 1)))
            digest.update(f.read(block))
    return digest.hexdigest()


def describe_source(path: Path) -> dict[str, Any]:
    stat = path.stat()
    return {"path": str(path.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "fp": fingerprint(path)}


def read_manifest(directory: Path) -> dict[str, Any] | None:
    try:
        manifest: dict[str, Any] = json.loads((directory / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return manifest


def manifest_problem(manifest: Any) -> str:
    """What is wrong with a manifest's structure ('' if nothing): keys, types, shard entries."""
    if not isinstance(manifest, dict):
        return "not a JSON object"
    kinds = {"sources": list, "settings": dict, "tokenizer": str, "dtype": str, "shards": list, "pairs": int}
    for key, kind in kinds.items():
        if not isinstance(manifest.get(key), kind):
            return f"'{key}' is missing or not a {kind.__name__}"
    if manifest["dtype"] not in ("uint16", "uint32"):
        return f"'dtype' is {manifest['dtype']!r}"
    if not manifest["shards"]:
        return "no shards"
    for k, shard in enumerate(manifest["shards"]):
        problem = _shard_problem(shard, k)
        if problem:
            return f"shards[{k}]: {problem}"
    return ""


def _shard_problem(shard: Any, k: int) -> str:
    if not isinstance(shard, dict) or shard.get("name") != f"shard{k}":
        return f"not an object named shard{k}"
    counts = [shard.get(key) for key in ("pairs", "set", "lines")]
    if not all(_is_count(n) for n in counts):
        return "'pairs', 'set' or 'lines' is missing or not a count"
    sizes, max_id = shard.get("sizes"), shard.get("max_id")
    if not isinstance(sizes, dict) or sorted(sizes) != sorted(SHARD_FILES) or not all(map(_is_count, sizes.values())):
        return "'sizes' is missing or not a size per shard file"
    if not isinstance(max_id, list) or len(max_id) != 2 or not all(isinstance(n, int) for n in max_id):
        return "'max_id' is missing or not [source, target]"
    return ""


def _is_count(n: Any) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and n >= 0


NOT_PREPARED = "no prepared data"


def stale_reason(directory: Path, d: DataConfig, tokenizer: Tokenizer | None) -> str:
    """Why the prepared data in `directory` cannot be used for `d` ('' if it can)."""
    manifest = read_manifest(directory)
    if manifest is None or not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        return NOT_PREPARED
    problem = manifest_problem(manifest)
    if problem:
        return f"its {MANIFEST} is damaged ({problem})"
    old, new = {**LATER_SETTINGS, **manifest["settings"]}, settings(d)
    keys = (*SETTINGS, *LATER_SETTINGS, "pairs")
    changed = [f"data.{key} {old.get(key)!r} -> {new.get(key)!r}" for key in keys if old.get(key) != new.get(key)]
    if changed:
        return "changed: " + ", ".join(changed)
    if manifest["sources"] != [describe_source(path) for pair in training_files(d) for path in pair]:
        return "the training files changed"
    if tokenizer is not None and manifest["tokenizer"] != tokenizer_hash(tokenizer):
        return "the tokenizer differs"
    return ""


def training_files(d: DataConfig) -> list[tuple[Path, ...]]:
    """The file(s) of each training set: (source, target), or the one file of pairs (data.format); with
    data.pairs, each set of each pair, pair by pair."""
    if not d.pairs:
        return [split_files(d, name) for name, _ in d.train_sets()]
    return [(find_file(d.dir, name, src), find_file(d.dir, name, tgt)) for src, tgt, name, _ in training_sets(d)]


def training_sets(d: DataConfig) -> list[tuple[str, str, str, float]]:
    """(source language, target language, split name, weight) of each set the prepared data holds, in order."""
    return [(src, tgt, name, weight) for src, tgt in d.language_pairs() for name, weight in d.train_sets()]


def source_tags(d: DataConfig) -> list[str]:
    """The target language whose tag each training set's source lines get ("": none, one pair)."""
    return [tgt if d.pairs else "" for _, tgt, _, _ in training_sets(d)]


def settings(d: DataConfig) -> dict[str, Any]:
    """What the prepared data depends on; the upsampling weights are applied when batching, so not them.
    `pairs` only when set, so the data of one pair is described as before it existed."""
    names = [name for name, _ in d.train_sets()]
    out = {key: names if key == "train" else getattr(d, key) for key in (*SETTINGS, *LATER_SETTINGS)}
    return {**out, "pairs": list(d.pairs)} if d.pairs else out


def ensure_prepared(d: DataConfig, directory: Path, tokenizer: Tokenizer | None = None, workers: int = 0) -> None:
    """Prepare `directory` unless it already holds this data (with this tokenizer, when one is given);
    data it reuses is checked against its manifest first. Temporaries of an earlier preparation that was
    killed are removed first (one killed while swapping its result in finishes the swap)."""
    directory = _check_location(d, directory)
    remove_abandoned(directory)
    tokenizer = tokenizer or given_tokenizer(d)
    reason = stale_reason(directory, d, tokenizer)
    if reason:
        level = logging.DEBUG if reason == NOT_PREPARED else logging.INFO  # a rebuild says why
        log.log(level, "preparing %s again: %s", directory, reason)
        prepare(d, directory, tokenizer, workers)
    else:
        PreparedCorpus(directory)  # a damaged shard or a replaced tokenizer: one line now, not mid-training
        log.info("using the prepared data in %s", directory)


def _check_location(d: DataConfig, directory: Path) -> Path:
    """The prepared directory as an absolute path ("." included); refused if rebuilding it could take the corpus."""
    directory = Path(os.path.abspath(directory))
    corpus, prepared = Path(d.dir).resolve(), directory.resolve()
    if prepared == corpus or prepared in corpus.parents:
        raise ConfigError(
            f"data.prepared_dir={directory} is or contains data.dir={d.dir}: preparing there would replace "
            "the corpus; choose another data.prepared_dir"
        )
    return directory


def prepare(
    d: DataConfig,
    directory: Path,
    tokenizer: Tokenizer | None = None,
    workers: int = 0,
    shard_lines: int = SHARD_LINES,
    pool_min_lines: int = POOL_MIN_LINES,
) -> dict[str, Any]:
    """Build the prepared directory in a temporary one, then swap it in; returns the manifest.

    `directory` is replaced only if it is missing, empty or an earlier preparation (seq2seq.runs.owned)."""
    directory = _check_location(d, directory)
    check_replaceable(directory, MANIFEST, OWN_FILES, "data.prepared_dir", DataError)
    tmp = make_temporary(directory)
    try:
        manifest = _build(d, directory, tmp, tokenizer, workers, shard_lines, pool_min_lines)
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1), encoding="utf-8")
        check_replaceable(directory, MANIFEST, OWN_FILES, "data.prepared_dir", DataError)  # again: still ours?
        replace_directory(directory, tmp)
    finally:
        remove_temporary(tmp)
    shards, dropped = len(manifest["shards"]), manifest["dropped"]
    log.info("prepared %d pairs in %d shard(s) (dropped %d empty, %d over-long)", manifest["pairs"], shards,
             dropped["empty"], dropped["too_long"])  # fmt: skip
    return manifest


def _build(
    d: DataConfig,
    directory: Path,
    out: Path,
    tokenizer: Tokenizer | None,
    workers: int,
    shard_lines: int,
    pool_min_lines: int,
) -> dict[str, Any]:
    """Text shards, the tokenizer (unless given) and token shards in `out`, to replace `directory`; returns
    the manifest."""
    files = training_files(d)
    sources = [describe_source(path) for pair in files for path in pair]
    where = ", ".join(f"{d.dir}/{name}" for name, _ in d.train_sets())
    split = split_text(d, files, out, shard_lines, d.spm_sample // (2 if d.shared_vocab else 1), source_tags(d))
    read = split.lines + split.too_long
    log.info("preparing %d lines of %s into %s", read, where, directory)
    tokenizer = tokenizer or given_tokenizer(d) or _train(d, files, split.sample)
    tokenizer.save(out)
    pool = max(1, workers or os.cpu_count() or 1) if split.lines >= pool_min_lines else 1
    shards, dropped = encode_shards(out, split.shard_lines, tokenizer, d.max_len, pool)
    for shard, number, lines in zip(shards, split.shard_sets, split.shard_lines):
        sizes = {suffix: (out / f"{shard['name']}.{suffix}").stat().st_size for suffix in SHARD_FILES}
        shard.update(set=number, lines=lines, sizes=sizes)
    dropped["too_long"] += split.too_long
    pairs = sum(shard["pairs"] for shard in shards)
    if not pairs:
        raise DataError(f"{where}: no sentence pairs left after filtering")
    return {
        "format": FORMAT,
        "sources": sources,
        "settings": settings(d),
        "tokenizer": tokenizer_hash(tokenizer),
        "dtype": id_dtype(tokenizer).name,
        "shards": shards,
        "lines": read,
        "pairs": pairs,
        "dropped": dropped,
    }


def given_tokenizer(d: DataConfig) -> Tokenizer | None:
    """The SentencePiece model(s) data.spm_model (or _src, _tgt) names, or None to train one."""
    paths = d.given_spm_models()
    if not paths:
        return None
    tokenizer = read_spm_models(paths)
    sizes = sorted({tokenizer.src_vocab_size, tokenizer.tgt_vocab_size})
    log.info("using the SentencePiece model %s: %s pieces (its size, not data.vocab_size=%d)",
             " and ".join(paths), " and ".join(map(str, sizes)), d.vocab_size)  # fmt: skip
    return tokenizer


def _train(d: DataConfig, files: list[tuple[Path, ...]], sample: tuple[list[str], list[str]]) -> Tokenizer:
    """A SentencePiece vocabulary trained on the sample; a warning if the data supported far fewer pieces."""
    kind = "word" if d.pretokenized else d.spm_model_type  # SentencePiece's word model: whitespace-split tokens
    log.info("training a %s SentencePiece vocabulary of %d on %d sampled pairs", kind, d.vocab_size,
             len(sample[0]))  # fmt: skip
    source = " and ".join(str(path) for group in files for path in group)
    args = (*sample, d.vocab_size, d.shared_vocab, kind, source, d.target_tags())
    if len(sample[0]) < SPM_PROCESS_MIN:
        tokenizer = train_tokenizer(*args)
    else:  # minutes in C++, deaf to signals: in a process that a signal ends at once
        with Workers(1, "SentencePiece's training") as child:
            tokenizer = Tokenizer.from_state(next(child.map(_trained_state, [args])))
    built = min(tokenizer.src_vocab_size, tokenizer.tgt_vocab_size)
    if built < VOCAB_SHORTFALL * d.vocab_size:
        log.warning(
            "data.vocab_size asked for %d pieces, but SentencePiece built %d: the training text supports no more",
            d.vocab_size,
            built,
        )
    return tokenizer


def _trained_state(args: tuple[Any, ...]) -> dict[str, bytes | None]:
    """train_tokenizer(*args), as the state a parent rebuilds it from."""
    return train_tokenizer(*args).state()


def id_dtype(tokenizer: Tokenizer) -> np.dtype[Any]:
    largest = max(tokenizer.src_vocab_size, tokenizer.tgt_vocab_size)
    return np.dtype(np.uint16 if largest <= 1 << 16 else np.uint32)


# The streaming pass: raw files -> text shards, and the SentencePiece sample.


@dataclass
class SplitText:
    lines: int  # in the text shards
    shard_lines: list[int]
    shard_sets: list[int]  # which training set each shard holds
    sample: tuple[list[str], list[str]]
    too_long: int = 0  # pairs dropped for a line longer than data.MAX_LINE_BYTES, never read whole


def split_text(
    d: DataConfig, files: list[tuple[Path, ...]], out: Path, shard_lines: int, sample_size: int, tags: list[str]
) -> SplitText:
    """Copy the pairs of each training set into text shards, checking them; sample pairs uniformly.
    A pair with a line longer than 1 MiB is dropped with a warning naming FILE:LINE, and counted.

    `tags`: per set, the target language whose tag goes before its source lines ("": none)."""
    split = SplitText(0, [], [], ([], []))
    rng = random.Random(0)

    def dropped(line: LongLine) -> None:
        log.warning("%s: %s; its pair is dropped", line.where, TOO_LONG_LINE)
        split.too_long += 1

    for number, group in enumerate(files):
        writer: _TextShard | None = None
        with_text = any_line = False
        long_before = split.too_long
        for s, t in _tagged(split_pairs(d, group, dropped), tags[number]):
            if split.lines % CHECK_LINES == 0:
                interrupt.check()  # a safe point: the temporary directory is removed
            writer = writer or _TextShard(out, len(split.shard_lines))
            writer.add(s, t)
            with_text = with_text or bool(s.strip() and t.strip())
            any_line = any_line or bool(s.strip() or t.strip())
            split.lines += 1
            _reservoir(split.sample, sample_size, split.lines, rng, s, t)
            if writer.lines == shard_lines:
                split.shard_lines.append(writer.close())
                split.shard_sets.append(number)
                writer = None
        if writer is not None:
            split.shard_lines.append(writer.close())
            split.shard_sets.append(number)
        if not with_text:
            raise no_pairs(group, blank=not any_line and split.too_long == long_before)
    return split


def _tagged(pairs: Iterator[tuple[str, str]], lang: str) -> Iterator[tuple[str, str]]:
    """Pairs with the tag of `lang` before each source line; "": as they are."""
    return ((tag_line(s, lang), t) for s, t in pairs) if lang else pairs


def _reservoir(sample: tuple[list[str], list[str]], size: int, seen: int, rng: random.Random, s: str, t: str) -> None:
    """Algorithm R: after `seen` pairs, each of them is in the sample with the same probability."""
    if len(sample[0]) < size:
        sample[0].append(s)
        sample[1].append(t)
    elif (j := rng.randrange(seen)) < size:
        sample[0][j], sample[1][j] = s, t


class _TextShard:
    def __init__(self, out: Path, k: int) -> None:
        self.files = [open(out / f"shard{k}.{side}.txt", "wb") for side in ("src", "tgt")]
        self.offsets: list[list[int]] = [[0], [0]]
        self.out, self.k, self.lines = out, k, 0

    def add(self, src: str, tgt: str) -> None:
        for f, offsets, line in zip(self.files, self.offsets, (src, tgt)):
            data = line.encode("utf-8")
            f.write(data)
            offsets.append(offsets[-1] + len(data))
        self.lines += 1

    def close(self) -> int:
        for f, offsets, side in zip(self.files, self.offsets, ("src", "tgt")):
            f.close()
            np.asarray(offsets, dtype=np.int64).tofile(self.out / f"shard{self.k}.{side}.txtoff")
        return self.lines


# Encoding: chunks of a shard's text, in worker processes.

_worker_tokenizer: Tokenizer | None = None


def _init_worker(state: dict[str, bytes | None]) -> None:
    """Set up encoding (in a worker process, or in this one)."""
    global _worker_tokenizer
    _worker_tokenizer = Tokenizer.from_state(state)


def text_lines(directory: Path, name: str, side: str, start: int, end: int) -> list[str]:
    """Lines [start, end) of one side of a text shard, read through a memory map."""
    offsets = np.memmap(directory / f"{name}.{side}.txtoff", dtype=np.int64, mode="r")
    text = np.memmap(directory / f"{name}.{side}.txt", dtype=np.uint8, mode="r") if offsets[-1] else None
    bounds = offsets[start : end + 1].tolist()
    if text is None:
        return [""] * (end - start)
    data = bytes(text[bounds[0] : bounds[-1]])
    base = bounds[0]
    return [data[a - base : b - base].decode("utf-8") for a, b in zip(bounds[:-1], bounds[1:])]


def encode_chunk(task: tuple[Path, str, int, int, int, str]) -> tuple[np.ndarray, ...]:
    """(src ids, src lengths, tgt ids, tgt lengths, kept lines, [empty, too long]) of one chunk."""
    directory, name, start, end, max_len, dtype = task
    assert _worker_tokenizer is not None
    src = _worker_tokenizer.encode_src(text_lines(directory, name, "src", start, end))
    tgt = _worker_tokenizer.encode_tgt(text_lines(directory, name, "tgt", start, end))
    reasons = [dropped_as(s, t, max_len) for s, t in zip(src, tgt)]
    kept = [i for i, reason in enumerate(reasons) if not reason]
    empty = reasons.count(EMPTY)
    out: list[np.ndarray] = []
    for side in (src, tgt):
        out.append(np.fromiter((x for i in kept for x in side[i] + [EOS]), dtype=dtype))
        out.append(np.fromiter((len(side[i]) + 1 for i in kept), dtype=np.int64, count=len(kept)))
    kept_lines = np.asarray(kept, dtype=np.int64) + start
    return (*out, kept_lines, np.asarray([empty, len(src) - len(kept) - empty]))


def encode_shards(
    directory: Path, shard_lines: list[int], tokenizer: Tokenizer, max_len: int, workers: int
) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """Encode every shard's text (in `workers` processes when more than one) into token arrays."""
    dtype = id_dtype(tokenizer).name
    tasks = [
        (directory, f"shard{k}", start, min(start + CHUNK_LINES, lines), max_len, dtype)
        for k, lines in enumerate(shard_lines)
        for start in range(0, lines, CHUNK_LINES)
    ]
    if workers > 1:
        log.info("encoding %d lines in %d worker processes", sum(shard_lines), workers)
        with Workers(workers, "an encoding process", _init_worker, (tokenizer.state(),)) as pool:
            return _write_shards(directory, shard_lines, tasks, pool.map(encode_chunk, tasks))
    _init_worker(tokenizer.state())
    return _write_shards(directory, shard_lines, tasks, map(encode_chunk, tasks))


class Workers:
    """Worker processes that run fn(task) for a parent that stays in charge of signals.

    Each worker has a pipe of its own, so no lock is shared between processes: one killed from outside
    (SIGTERM to the group, the out-of-memory killer) is one line here, never a pool that waits forever for
    a lock the dead worker held (multiprocessing.Pool does). Workers start deaf to signals and ignore SIGINT
    (`seq2seq.interrupt.worker_signals`): a Ctrl-C reaches the whole group, and this process, waiting for
    results at safe points, ends them when it stops. Leaving the `with` block ends them at once.
    """

    def __init__(
        self, n: int, what: str, initializer: Callable[..., Any] | None = None, initargs: tuple[Any, ...] = ()
    ) -> None:
        self.what = what  # names a worker in errors: "an encoding process"
        context = multiprocessing.get_context("spawn")
        self.processes: list[Any] = []
        self.pipes: list[multiprocessing.connection.Connection] = []
        with interrupt.starting_workers():
            for _ in range(n):
                mine, theirs = context.Pipe()
                process = context.Process(target=_work, args=(theirs, initializer, initargs), daemon=True)
                process.start()
                theirs.close()
                self.processes.append(process)
                self.pipes.append(mine)

    def __enter__(self) -> Workers:
        return self

    def __exit__(self, kind: type[BaseException] | None, *exc: object) -> None:
        for pipe in self.pipes:
            pipe.close()  # an idle worker reads the end of its pipe, and ends
        for process in self.processes:
            if kind is not None:
                process.kill()  # a busy one would finish its task first, which no one waits for now
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
                process.join()

    def map(self, fn: Callable[[Any], R], tasks: list[Any]) -> Iterator[R]:
        """fn(task) for each task, in order; waiting for them checks for a signal every POLL seconds."""
        done: dict[int, R] = {}
        idle, running = list(range(len(self.processes))), {}  # worker -> its task's index
        given = 0
        for wanted in range(len(tasks)):
            while wanted not in done:
                while idle and given < len(tasks):
                    worker = idle.pop()
                    try:
                        self.pipes[worker].send((fn, tasks[given]))
                    except OSError:  # it died while idle
                        raise self._died(worker) from None
                    running[worker], given = given, given + 1
                ready = multiprocessing.connection.wait([self.pipes[w] for w in running], interrupt.POLL)
                interrupt.check()  # before a worker that died: it may have died of the same signal
                for worker in [w for w in running if self.pipes[w] in ready]:
                    done[running.pop(worker)] = self._answer(worker)
                    idle.append(worker)
            yield done.pop(wanted)

    def _answer(self, worker: int) -> Any:
        try:
            ok, value = self.pipes[worker].recv()
        except (EOFError, OSError):  # it died
            raise self._died(worker) from None
        if not ok:
            raise value
        return value

    def _died(self, worker: int) -> UserError:
        process = self.processes[worker]
        process.join()
        code = process.exitcode or 0
        try:
            how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        except ValueError:
            how = f"killed by signal {-code}"
        return UserError(f"{self.what} ended without finishing its work ({how}; out of memory?)")


def _work(
    pipe: multiprocessing.connection.Connection, initializer: Callable[..., Any] | None, args: tuple[Any, ...]
) -> None:
    """A worker of `Workers`: (fn, task) in, (True, fn(task)) or (False, the exception) out, until EOF."""
    interrupt.worker_signals()
    if initializer is not None:
        initializer(*args)
    while True:
        try:
            fn, task = pipe.recv()
        except (EOFError, OSError):  # the parent is done, or gone
            return
        try:
            answer = (True, fn(task))
        except Exception as e:  # for the parent to raise
            answer = (False, e)
        try:
            pipe.send(answer)
        except OSError:  # the parent is gone
            return
        except Exception as e:  # an exception that does not pickle
            pipe.send((False, RuntimeError(f"{answer[1]!r} (and it could not be sent: {e})")))


def _write_shards(
    directory: Path, shard_lines: list[int], tasks: list[Any], results: Iterator[tuple[np.ndarray, ...]]
) -> tuple[list[dict[str, Any]], dict[str, int]]:
    dropped = np.zeros(2, dtype=np.int64)
    parts: dict[str, list[list[np.ndarray]]] = {f"shard{k}": [[], [], []] for k in range(len(shard_lines))}
    max_ids = {name: [-1, -1] for name in parts}  # recorded, and checked against the ids when opened
    files: dict[str, list[BinaryIO]] = {}
    for (_, name, *_), (src, src_len, tgt, tgt_len, lines, drops) in zip(tasks, results):
        interrupt.check()  # a safe point between chunks: the temporary directory is removed
        if name not in files:
            files[name] = [open(directory / f"{name}.{side}.ids", "wb") for side in ("src", "tgt")]
        for side, (f, ids) in enumerate(zip(files[name], (src, tgt))):
            ids.tofile(f)
            max_ids[name][side] = max(max_ids[name][side], int(ids.max()) if len(ids) else -1)
        for store, array in zip(parts[name], (src_len, tgt_len, lines)):
            store.append(array)
        dropped += drops
    for f in (f for pair in files.values() for f in pair):
        f.close()
    shards = [{**_finish_shard(directory, name, *store), "max_id": max_ids[name]} for name, store in parts.items()]
    return shards, {"empty": int(dropped[0]), "too_long": int(dropped[1])}


def _finish_shard(
    directory: Path, name: str, src_len: list[Any], tgt_len: list[Any], lines: list[Any]
) -> dict[str, Any]:
    """Offsets, the length index and the kept lines of one shard, from its chunks' lengths."""
    lengths = [np.concatenate(side) for side in (src_len, tgt_len)]
    for side, length in zip(("src", "tgt"), lengths):
        np.concatenate([[0], np.cumsum(length)]).astype(np.int64).tofile(directory / f"{name}.{side}.off")
    np.maximum(*lengths).astype(np.uint16).tofile(directory / f"{name}.len")
    np.concatenate(lines).astype(np.uint32).tofile(directory / f"{name}.line")
    return {"name": name, "pairs": int(len(lengths[0]))}


# Reading: what training keeps in memory is the length index; the rest stays memory-mapped.


class PreparedCorpus:
    """The pairs of a prepared directory, addressed by a global index in corpus order.

    Opening checks the files against the manifest (`verify`: sizes, offsets, the largest ids, the tokenizer's
    hash), so damaged data is one line here. Pickles as its path, so DataLoader workers reopen the memory maps
    instead of copying them, without checking again.
    """

    def __init__(self, directory: str | Path, verify: bool = True) -> None:
        self.directory = Path(directory)
        manifest = self.manifest = _open_manifest(self.directory)
        self.names = [shard["name"] for shard in manifest["shards"]]
        self._maps: dict[str, np.ndarray] = {}
        self.tokenizer = _load_tokenizer(self.directory, manifest["tokenizer"])
        if verify:
            for shard in manifest["shards"]:
                self._verify_shard(shard)
        self.starts = np.cumsum([0] + [shard["pairs"] for shard in manifest["shards"]])
        self.lengths = np.concatenate([np.fromfile(self.directory / f"{n}.len", dtype=np.uint16) for n in self.names])
        sets = [shard.get("set", 0) for shard in manifest["shards"]]
        self.set_ranges = [  # [first, last + 1) pair of each training set: its shards are consecutive
            (int(self.starts[sets.index(k)]), int(self.starts[len(sets) - sets[::-1].index(k)]))
            for k in sorted(set(sets))
        ]

    def __len__(self) -> int:
        return int(self.starts[-1])

    @cached_property
    def side_lengths(self) -> tuple[np.ndarray, np.ndarray]:
        """(target lengths, source lengths), uint16 a pair each: bucketing's tie-breakers (seq2seq.text.corpus.bucket).

        Read from the offsets when first asked for, so DataLoader workers, which only collate, never load them.
        """
        sides = []
        for side in ("tgt", "src"):
            parts = [np.diff(self._map(f"{name}.{side}.off", np.int64)).astype(np.uint16) for name in self.names]
            sides.append(np.concatenate(parts))
        return sides[0], sides[1]

    def __getstate__(self) -> dict[str, Any]:
        return {"directory": self.directory}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["directory"], verify=False)  # type: ignore[misc]

    def _verify_shard(self, shard: dict[str, Any]) -> None:
        """Sizes as recorded, offsets that fit the ids, and the largest id as recorded and inside the vocabulary."""
        name = shard["name"]
        for suffix, size in shard["sizes"].items():
            path = self.directory / f"{name}.{suffix}"
            found = path.stat().st_size if is_regular_file(path) else None
            if found != size:
                what = "missing or not a regular file" if found is None else f"{found} bytes"
                raise self._damaged(path, f"{what}, but {MANIFEST} says {size} (truncated or replaced?)")
        vocab = (self.tokenizer.src_vocab_size, self.tokenizer.tgt_vocab_size)
        for side, recorded, limit in zip(("src", "tgt"), shard["max_id"], vocab):
            path = self.directory / f"{name}.{side}.ids"
            ids = self._map(path.name, self.manifest["dtype"]) if path.stat().st_size else np.zeros(0, np.uint16)
            offsets = self._map(f"{name}.{side}.off", np.int64)
            fits = len(offsets) == shard["pairs"] + 1 and offsets[0] == 0 and offsets[-1] == len(ids)
            if not fits or bool((np.diff(offsets) <= 0).any()):  # every pair holds at least its EOS
                raise self._damaged(path.with_suffix(".off"), f"its offsets do not fit {path.name} (garbage?)")
            largest = int(ids.max()) if len(ids) else -1
            if largest >= limit:
                raise self._damaged(path, f"token id {largest} is outside the vocabulary of {limit} (garbage ids?)")
            if largest != recorded:
                raise self._damaged(path, f"its largest token id is {largest}, but {MANIFEST} says {recorded}")

    def _damaged(self, path: Path, problem: str) -> DataError:
        return DataError(f"{path}: {problem}; delete {self.directory} and run `seq2seq prepare` to prepare it again")

    def _map(self, name: str, dtype: Any) -> np.ndarray:
        if name not in self._maps:
            self._maps[name] = np.memmap(self.directory / name, dtype=dtype, mode="r")
        return self._maps[name]

    def _locate(self, i: int) -> tuple[str, int]:
        k = int(np.searchsorted(self.starts, i, side="right")) - 1
        return self.names[k], i - int(self.starts[k])

    def ids(self, i: int) -> tuple[list[int], list[int]]:
        """The EOS-terminated source and target ids of pair i."""
        name, j = self._locate(i)
        out = []
        for side in ("src", "tgt"):
            offsets = self._map(f"{name}.{side}.off", np.int64)
            out.append(self._map(f"{name}.{side}.ids", self.manifest["dtype"])[offsets[j] : offsets[j + 1]].tolist())
        return out[0], out[1]

    def text(self, i: int) -> tuple[str, str]:
        """The source and target line of pair i, as read from the training files."""
        name, j = self._locate(i)
        line = int(self._map(f"{name}.line", np.uint32)[j])
        out = []
        for side in ("src", "tgt"):
            offsets = self._map(f"{name}.{side}.txtoff", np.int64)
            text = self._map(f"{name}.{side}.txt", np.uint8)
            out.append(bytes(text[offsets[line] : offsets[line + 1]]).decode("utf-8"))
        return out[0], out[1]


def _open_manifest(directory: Path) -> dict[str, Any]:
    """The manifest of a prepared directory, its structure checked; one line if it has none or a damaged one."""
    manifest = read_manifest(directory)
    if manifest is None:
        raise DataError(f"{directory}: no prepared data (run `seq2seq prepare`)")
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise DataError(f"{directory}: prepared by another version of seq2seq (run `seq2seq prepare` again)")
    problem = manifest_problem(manifest)
    if problem:
        raise DataError(f"{directory / MANIFEST}: {problem} (run `seq2seq prepare` to prepare the data again)")
    return manifest


def _load_tokenizer(directory: Path, expected: str) -> Tokenizer:
    """The SentencePiece model(s) of a prepared directory, checked against the hash its manifest records."""
    damaged = f"delete {directory} and run `seq2seq prepare` to prepare it again"
    tokenizer = read_tokenizer(directory, damaged, DataError)
    if tokenizer_hash(tokenizer) != expected:
        first = tokenizer_files(directory, damaged, DataError)[0]
        raise DataError(f"{first}: not the SentencePiece model the data was encoded with (replaced?); {damaged}")
    return tokenizer
