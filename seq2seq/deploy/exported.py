"""Translate with a CTranslate2 model directory written by `seq2seq export`.

The text pipeline is the PyTorch path's (seq2seq.decoding.translate.TextTranslator):
the same tokenization, truncation, batching, prefixes, empty lines, n-best,
scores and JSONL output; only the search runs in CTranslate2. The decode
settings map onto its options:

    strategy, beam_size, nbest      beam_size and num_hypotheses; beam search returns its whole beam,
                                    re-ranked with GNMT's length penalty, then cut to nbest
    beam_stop                       patience: first_k is CTranslate2's own rule (1); exact runs its beam
                                    on to the length limit (`beam_patience`), which finds the same best
    max_len_a, max_len_b, max_len   max_decoding_length, per group of sentences with the same limit
    min_len                         min_decoding_length
    no_repeat_ngram                 no_repeat_ngram_size
    suppress_unk (and PAD, BOS)     suppress_sequences
    temperature, top_k, top_p       sampling_temperature, sampling_topk (0: the whole vocabulary), sampling_topp
    seed                            ctranslate2.set_random_seed, once, before the model loads (its generator:
                                    other samples than PyTorch's; a later seed change cannot reach it)
    max_tokens, max_input_len       this module's batching and truncation, as the PyTorch path

Two settings cannot be honoured exactly: CTranslate2's beam search prunes with
length**alpha, not GNMT's ((5 + length) / 6)**alpha, so with length_penalty != 0
its beam may keep other hypotheses; and a seed changed after loading (with_decode,
a server request) does not reseed it. A warning says so when the user asks for
such a setting (an override, a request); the exported defaults load quietly, the
caveat in the debug log (-v). Token
log-probabilities (JSONL output) come from CTranslate2 scoring each hypothesis.

The directory is checked before it loads: `seq2seq-manifest.json`, written by
the export, records the size and sha256 of every file the engine and the
tokenizer read (model.bin, config.json, the vocabularies, the SentencePiece
model(s)) and the model settings; a file that differs, or a `seq2seq.yaml` whose
model settings (max_positions...) differ from the exported model's, is one line.
A file may be a symbolic link, as model stores (the Hugging Face cache among
them) keep files as links to blobs: the link is followed and its target checked.
A directory exported before the manifest existed loads with a warning that its
files are not checked.

`ctranslate2` is an optional extra (`pip install -e ".[export]"`), imported only here and in seq2seq.deploy.export.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any, TypeVar

import torch

from seq2seq.config import DecodeConfig, ExperimentConfig, dotted, from_dict, load_config, migrate_model, to_dict
from seq2seq.decoding.search import Hypothesis, length_penalty, max_lengths
from seq2seq.decoding.translate import TextTranslator
from seq2seq.errors import UserError
from seq2seq.runs.owned import sha256_file
from seq2seq.text.corpus import pad
from seq2seq.text.tokenizer import Tokenizer, read_tokenizer, tokenizer_files
from seq2seq.text.vocab import BOS, EOS, PAD, UNK

log = logging.getLogger(__name__)

CONFIG = "seq2seq.yaml"  # the checkpoint's experiment config, beside CTranslate2's config.json
MANIFEST = "seq2seq-manifest.json"  # sizes and hashes of the exported files, and the model settings
MANIFEST_FORMAT = 1
EXPORT_AGAIN = "export the model again"
VOCABULARIES = ("shared_vocabulary", "source_vocabulary", "target_vocabulary")  # CTranslate2's, .json or .txt
T = TypeVar("T", bound="CTranslate2Translator")


def import_ctranslate2() -> Any:
    """The `ctranslate2` module, loaded so that it keeps its own OpenMP runtime (Linux: RTLD_DEEPBIND).

    Its wheel ships a libgomp of its own, but torch (imported first, always) has put its libgomp in the
    process's global symbol scope, and a plain import binds CTranslate2's OpenMP calls to torch's copy.
    The two then share one runtime, and once CTranslate2's worker thread has run a parallel region, that
    runtime counts more threads than CPUs and throttles every thread's spinning: each of PyTorch's parallel
    regions then waits for its threads to wake (a tiny int8 beam batch at 1.8x its time, docs/results.md).
    """
    loaded = sys.modules.get("ctranslate2")
    if loaded is not None:
        return loaded
    flags = sys.getdlopenflags()
    sys.setdlopenflags(flags | getattr(os, "RTLD_DEEPBIND", 0))  # its own libraries' symbols first
    try:
        import ctranslate2
    except ImportError:
        raise UserError(
            'CTranslate2 is not installed: pip install -e ".[export]" (or pip install ctranslate2)'
        ) from None
    finally:
        sys.setdlopenflags(flags)
    return ctranslate2


def is_exported(path: str | Path) -> bool:
    """Whether `path` is a CTranslate2 model directory (rather than a checkpoint file)."""
    return Path(path).is_dir() and (Path(path) / "model.bin").is_file()


class CTranslate2Translator(TextTranslator):
    """An exported model in CTranslate2, with the tokenizer and settings it was exported with.

    >>> translator = CTranslate2Translator.from_directory("exported/quickstart-int8")
    >>> translator.translate(["Ein Hund läuft im Schnee."])
    ['A dog is running in the snow.']

    `token_scores`: also score each hypothesis token by token (for JSONL output), a second pass.
    """

    def __init__(
        self,
        engine: Any,
        tokenizer: Tokenizer,
        config: ExperimentConfig,
        token_scores: bool = False,
    ) -> None:
        super().__init__(tokenizer, config.decode, config.data)
        self.engine = engine
        self._max_positions = config.model.max_positions
        self.token_scores = token_scores
        self.seed = config.decode.seed  # what the engine's generator was seeded with
        self.quantize = config.decode.quantize  # what the engine was loaded with: int8 is its compute type int8

    @classmethod
    def from_directory(
        cls,
        path: str | Path,
        device: str = "cpu",
        threads: int = 0,
        token_scores: bool = False,
        overrides: list[str] | tuple[str, ...] = (),
        **decode: Any,
    ) -> CTranslate2Translator:
        """Load an exported directory; `overrides` ("decode.beam_size=2") and keyword arguments
        (beam_size=2) change its stored decode settings. device: cpu, cuda or auto."""
        ctranslate2 = import_ctranslate2()
        path = Path(path)
        if not is_exported(path):
            raise UserError(f"{path} is not a CTranslate2 model directory (no model.bin); seq2seq export writes one")
        config = _read_config(path, list(overrides))
        check_files(path, config)
        tokenizer = read_tokenizer(path, EXPORT_AGAIN)
        _check_vocabulary_sizes(path, tokenizer)
        if decode:
            raw = to_dict(config)
            raw["decode"].update(decode)
            config = from_dict(raw, source="CTranslate2Translator.from_directory")
        asked = {key.partition("=")[0].removeprefix("decode.") for key in overrides} | set(decode)
        if device == "auto":
            device = "cuda" if ctranslate2.get_cuda_device_count() > 0 else "cpu"
        ctranslate2.set_random_seed(config.decode.seed)  # each worker thread seeds its generator when it starts
        try:
            compute_type = "int8" if config.decode.quantize == "int8" else "default"  # default: as exported
            engine = ctranslate2.Translator(
                str(path), device=device, compute_type=compute_type, intra_threads=threads, inter_threads=1
            )
        except (RuntimeError, ValueError) as e:  # a damaged model.bin, a device CTranslate2 was not built for
            raise UserError(f"CTranslate2 cannot load {path}: {str(e).splitlines()[0]}") from None
        translator = cls(engine, tokenizer, config, token_scores)
        for key, message in translator._unhonoured():
            log.log(logging.WARNING if key in asked else logging.DEBUG, message)
        return translator

    @property
    def max_positions(self) -> int:
        return self._max_positions

    def engine_info(self) -> dict[str, Any]:
        e = self.engine
        return {"engine": "ctranslate2", "device": e.device, "compute_type": e.compute_type, "parameters": None}

    def with_decode(self: T, **changes: Any) -> T:
        """Warns about a setting it cannot honour only when the change brings it (a server asks per request)."""
        translator = super().with_decode(**changes)
        known = self._unhonoured()
        for item in translator._unhonoured():
            if item not in known:
                log.warning(item[1])
        return translator

    def _unhonoured(self) -> list[tuple[str, str]]:
        """(decode key, one line) per decode setting that CTranslate2 cannot honour exactly."""
        cfg, messages = self.decode, []
        if cfg.strategy == "beam" and cfg.length_penalty != 0:
            messages.append((
                "length_penalty",
                f"decode.length_penalty={cfg.length_penalty:g}: CTranslate2's beam prunes with length**alpha, not "
                "GNMT's ((5 + length) / 6)**alpha, so beam results can differ from the PyTorch path's",
            ))  # fmt: skip
        if cfg.quantize != self.quantize:
            messages.append((
                "quantize",
                f"decode.quantize={cfg.quantize}: CTranslate2 loaded this model with decode.quantize={self.quantize} "
                f"(compute type {self.engine.compute_type}) and cannot change it; load the model again with it",
            ))  # fmt: skip
        if cfg.strategy == "sample" and cfg.seed != self.seed:
            messages.append((
                "seed",
                f"decode.seed={cfg.seed}: CTranslate2's generator was seeded with {self.seed} when the model loaded "
                "and cannot be reseeded; load the model again with this seed",
            ))  # fmt: skip
        return messages

    def _search(self, sources: list[list[int]], prefixes: list[list[int]] | None) -> list[list[Hypothesis]]:
        cfg = self.decode
        limits = _limits(sources, prefixes, cfg, self.max_positions - 1)
        # CTranslate2 takes one length limit per call. A limit changes what a beam keeps, so beam search
        # makes one call per limit; greedy and sampling choose each token without looking ahead, so one
        # call up to the batch's largest limit, each hypothesis cut at its own, finds the same tokens.
        groups: dict[int, list[int]] = defaultdict(list)
        longest = max(limits)
        for i, limit in enumerate(limits):
            groups[limit if cfg.strategy == "beam" else longest].append(i)
        src = [self.tokenizer.src_pieces(seq[:-1]) for seq in sources]  # CTranslate2 appends EOS
        found: list[list[list[str]]] = [[] for _ in sources]  # pieces of each hypothesis, without EOS
        scores: list[list[float | None]] = [[] for _ in sources]  # None: to be scored again
        options = engine_options(self.decode, self.tokenizer)
        for limit, rows in groups.items():
            prefix = [self.tokenizer.tgt_pieces(prefixes[i]) or None for i in rows] if prefixes else None
            results = self.engine.translate_batch(
                [src[i] for i in rows],
                prefix,
                max_decoding_length=limit,
                patience=beam_patience(cfg, limit),
                return_scores=True,
                **options,
            )
            for i, result in zip(rows, results):
                for pieces, score in zip(result.hypotheses, result.scores):
                    cut = len(pieces) >= limits[i]  # no EOS yet: the PyTorch path forces it here, and scores it
                    found[i].append(pieces[: limits[i]])
                    scores[i].append(None if cut else score)
        rescore = [(i, k) for i, s in enumerate(scores) for k, x in enumerate(s) if self.token_scores or x is None]
        logprobs: dict[tuple[int, int], list[float]] = {}
        if rescore:  # one call for the batch: each hypothesis's token log-probabilities, EOS included
            scored = self.engine.score_batch([src[i] for i, _ in rescore], [found[i][k] for i, k in rescore])
            logprobs = {key: list(result.log_probs) for key, result in zip(rescore, scored)}
        return [
            hypotheses(found[i], scores[i], [logprobs.get((i, k)) for k in range(len(found[i]))], cfg, self.tokenizer)
            for i in range(len(sources))
        ]


def beam_patience(cfg: DecodeConfig, limit: int) -> float:
    """CTranslate2's beam `patience` for `decode.beam_stop`: its search stops once beam_size * patience
    hypotheses have finished. `first_k` is its own rule (patience 1). `exact` cannot be said to it as a
    bound, so its beam runs on to the length limit `limit` (no more than 2 * beam_size hypotheses
    finish a step, so it never collects that many sooner): the same best list as the PyTorch path's
    exact rule, which stops as soon as that list can no longer change, at the cost of the steps after."""
    return 1.0 if cfg.strategy != "beam" or cfg.beam_stop == "first_k" else 2.0 * (limit + 1)


def engine_options(cfg: DecodeConfig, tokenizer: Tokenizer) -> dict[str, Any]:
    """`translate_batch`'s options for the decode settings `cfg`."""
    suppressed = [PAD, BOS, UNK] if cfg.suppress_unk else [PAD, BOS]
    options: dict[str, Any] = {
        "beam_size": cfg.beam_size if cfg.strategy == "beam" else 1,
        "num_hypotheses": cfg.beam_size if cfg.strategy == "beam" else 1,
        "length_penalty": cfg.length_penalty,
        "min_decoding_length": cfg.min_len,
        "no_repeat_ngram_size": cfg.no_repeat_ngram,
        "suppress_sequences": [tokenizer.tgt_pieces([i]) for i in suppressed],
        "max_input_length": 0,  # truncated before, as decode.max_input_len says
    }
    if cfg.strategy == "sample":
        top_k = min(cfg.top_k, tokenizer.tgt_vocab_size)  # CTranslate2 refuses more; torch takes the min too
        options.update(sampling_topk=top_k, sampling_topp=cfg.top_p, sampling_temperature=cfg.temperature)
    return options


def hypotheses(
    found: list[list[str]],
    scores: list[float | None],
    logprobs: list[list[float] | None],
    cfg: DecodeConfig,
    tokenizer: Tokenizer,
) -> list[Hypothesis]:
    """CTranslate2's hypotheses as this project's: token ids ending with EOS, GNMT-normalised scores, the best
    that `cfg` keeps."""
    alpha = cfg.length_penalty
    out = []
    for pieces, score, per_token in zip(found, scores, logprobs):
        ids = [tokenizer.tgt.piece_to_id(p) for p in pieces] + [EOS]
        if per_token is not None:
            total = sum(per_token)
        else:  # CTranslate2's score is the sum over length**alpha, EOS counted
            assert score is not None
            total = score * len(ids) ** alpha
        out.append(Hypothesis(ids, total / float(length_penalty(len(ids), alpha)), per_token or []))
    out.sort(key=lambda h: -h.score)
    return out[: cfg.nbest if cfg.strategy == "beam" else 1]


def _limits(sources: list[list[int]], prefixes: list[list[int]] | None, cfg: DecodeConfig, limit: int) -> list[int]:
    """Tokens allowed before EOS per sentence, as seq2seq.decoding.search.max_lengths computes them."""
    lengths = torch.tensor([len(s) for s in sources])
    pad_mask = torch.arange(int(lengths.max()))[None, :] >= lengths[:, None]  # (B, S)
    prefix = pad([p or [PAD] for p in prefixes]) if prefixes else None
    return [int(n) for n in max_lengths(pad_mask, cfg, limit, prefix)]


def _read_config(path: Path, overrides: list[str]) -> ExperimentConfig:
    if not (path / CONFIG).is_file():
        raise UserError(f"{path} has no {CONFIG} (exported by an older seq2seq?): export the checkpoint again")
    return load_config(path / CONFIG, overrides)


def _vocabulary_files(path: Path) -> list[Path]:
    return [
        path / f"{name}.{ext}" for name in VOCABULARIES for ext in ("json", "txt") if (path / f"{name}.{ext}").exists()
    ]


def write_manifest(path: Path, config: ExperimentConfig) -> None:
    """Record the size and sha256 of every file in an export (but the editable seq2seq.yaml), and its model."""
    files = {
        file.name: {"size": file.stat().st_size, "sha256": sha256_file(file)}
        for file in sorted(path.iterdir())
        if file.name not in (CONFIG, MANIFEST) and not file.name.startswith(".")  # not a temporary's marker
    }
    manifest = {"format": MANIFEST_FORMAT, "files": files, "model": to_dict(config)["model"]}
    (path / MANIFEST).write_text(json.dumps(manifest, indent=1), encoding="utf-8")


def check_files(path: Path, config: ExperimentConfig) -> None:
    """The files the engine and the tokenizer read, as exported; the model settings, as the model's."""
    if not (path / MANIFEST).exists():
        log.warning("%s has no %s (exported by an older seq2seq): its files are not checked; export it again to "
                    "have them checked", path, MANIFEST)  # fmt: skip
        return
    manifest = _read_manifest(path)
    read = [path / "model.bin", path / "config.json", *tokenizer_files(path, EXPORT_AGAIN), *_vocabulary_files(path)]
    for file in read:
        entry = manifest["files"].get(file.name)
        if entry is None:
            raise UserError(f"{file} is not one of the files {path / MANIFEST} lists; export the model again")
        _check_file(file, entry)
    model = dotted(to_dict(config)["model"])
    exported_model = migrate_model(manifest["model"], str(path / MANIFEST))  # exports of the flat layout too
    for key, exported in dotted(exported_model).items():
        value = model.get(key)
        if value != exported:
            raise UserError(
                f"{path / CONFIG}: model.{key} is {value}, but the exported model has {exported}; "
                f"set it back to {exported}"
            )


def _read_manifest(path: Path) -> dict[str, Any]:
    where = path / MANIFEST
    try:
        manifest = json.loads(where.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise UserError(f"{where}: not readable ({str(e)[:80]}); export the model again") from None
    valid = (
        isinstance(manifest, dict)
        and manifest.get("format") == MANIFEST_FORMAT
        and isinstance(manifest.get("model"), dict)
        and isinstance(manifest.get("files"), dict)
        and all(
            isinstance(e, dict) and isinstance(e.get("size"), int) and isinstance(e.get("sha256"), str)
            for e in manifest["files"].values()
        )
    )
    if not valid:
        raise UserError(f"{where}: not a manifest of this seq2seq version (missing keys?); export the model again")
    return manifest


def _check_file(file: Path, entry: dict[str, Any]) -> None:
    """The file (or the target of a link to one) as the manifest describes it."""
    if not file.is_file():
        what = "a link to nothing" if file.is_symlink() and not file.exists() else "not a regular file"
        raise UserError(f"{file} is {what}; export the model again")
    if file.stat().st_size != entry["size"] or sha256_file(file) != entry["sha256"]:
        raise UserError(f"{file} does not match {MANIFEST} (damaged or replaced since the export); export it again")


def _check_vocabulary_sizes(path: Path, tokenizer: Tokenizer) -> None:
    """CTranslate2's vocabularies hold one entry per SentencePiece piece (checked for old exports too)."""
    sizes = {"shared": tokenizer.src_vocab_size, "source": tokenizer.src_vocab_size, "target": tokenizer.tgt_vocab_size}
    for file in _vocabulary_files(path):
        try:
            text = file.read_text(encoding="utf-8")
            entries = len(json.loads(text)) if file.suffix == ".json" else len(text.splitlines())
        except (OSError, ValueError, TypeError) as e:
            raise UserError(f"{file}: not a readable vocabulary ({str(e)[:80]}); export the model again") from None
        expected = sizes[file.stem.removesuffix("_vocabulary")]
        if entries != expected:
            raise UserError(f"{file} has {entries} entries, the SentencePiece model {expected}; export the model again")
