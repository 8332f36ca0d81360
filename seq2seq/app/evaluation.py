"""Evaluating a system on a test set: decode it (or take a file of translations) and score it with sacreBLEU."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from seq2seq.app.files import refuse_overwriting
from seq2seq.app.model import ModelOptions, open_translator
from seq2seq.app.progress import progress_bar
from seq2seq.errors import DataError, UsageError
from seq2seq.text.corpus import read_lines

if TYPE_CHECKING:
    from seq2seq.config import DataConfig
    from seq2seq.decoding.translate import TextTranslator
    from seq2seq.metrics import Report

log = logging.getLogger("seq2seq")

MAX_BOOTSTRAP = 100_000  # 1000 is usual; sacreBLEU keeps every resample in memory


@dataclass(frozen=True)
class EvaluateOptions:
    """hypotheses: score this file of translations instead of decoding; src/ref: the test set's files
    (default: the model's config's test split); tok_ref: a tokenized lower-cased reference for tokenized
    BLEU (default: the test split's, when it exists and `ref` is not given); lowercase: also lower-cased
    BLEU; bootstrap: resampled test sets for BLEU's 95% interval (1: none); save: write the translations here;
    tgt_lang: the target language, for a model of several pairs (one pair at a time).
    """

    hypotheses: str | None = None
    src: str | None = None
    ref: str | None = None
    tok_ref: str | None = None
    lowercase: bool = False
    bootstrap: int = 1
    save: str | None = None
    tgt_lang: str = ""


@dataclass(frozen=True)
class EvalSet:
    """What translations are scored against: a test set's sources and references."""

    sources: list[str]  # empty when the translations come from a file
    references: list[str]
    lang: str  # the target language, for tokenized BLEU ("": unknown)
    tokenized: Path | None = None  # the tokenized lower-cased reference, when there is one


@dataclass(frozen=True)
class Evaluation:
    """The translations scored and their scores."""

    hypotheses: list[str]
    report: Report

    def lines(self) -> list[str]:
        """The scores, one line each, in the order `seq2seq evaluate` prints them."""
        return [str(score) for score in self.report.scores()]

    def record(self) -> dict[str, object]:
        """The scores as `seq2seq evaluate --format json` prints them, for programs: each score's name, value,
        95% interval half-width (null without --bootstrap) and sacreBLEU signature, and the number of lines."""
        scores = [
            {"name": s.name, "score": s.score, "ci95": s.ci95, "signature": s.signature} for s in self.report.scores()
        ]
        return {"scores": scores, "sentences": len(self.hypotheses)}


def evaluate(options: EvaluateOptions, model: ModelOptions | None = None) -> Evaluation:
    """Decode the test set with `model`, or read `options.hypotheses`, and score the translations."""
    _check(options, model)
    o, paths = options, model.paths if model else ()
    if o.save:
        refuse_overwriting(Path(o.save), "--save", o.hypotheses, o.src, o.ref, o.tok_ref, *paths)
    if model is None:
        test, hyps = _hypotheses_eval_set(options)
    else:
        translator = open_translator(replace(model, token_scores=False))
        assert translator.data is not None  # loaded from a checkpoint or an export, which keep their config
        test = eval_set(translator.data, options.src, options.ref, options.tok_ref, options.tgt_lang)
        hyps = decode(translator, test.sources, options.tgt_lang)
    return score(hyps, test, options.bootstrap, options.lowercase, options.save)


def _check(options: EvaluateOptions, model: ModelOptions | None) -> None:
    if model is None and not options.hypotheses:
        raise UsageError("evaluate needs --checkpoint or --hypotheses")
    if model is not None and options.hypotheses:
        raise UsageError("evaluate takes --checkpoint or --hypotheses, not both")
    if options.bootstrap < 1:
        raise UsageError(f"--bootstrap must be at least 1, got {options.bootstrap}")
    if options.bootstrap > MAX_BOOTSTRAP:  # sacreBLEU draws every resample's indices at once
        raise UsageError(f"--bootstrap must be at most {MAX_BOOTSTRAP}, got {options.bootstrap}")


def _hypotheses_eval_set(options: EvaluateOptions) -> tuple[EvalSet, list[str]]:
    """A file of translations and its references; the language of tokenized BLEU from the tokenized
    reference's suffix (e.g. test_2016_flickr.lc.norm.tok.en)."""
    if not options.ref or not options.hypotheses:
        raise UsageError("evaluate --hypotheses needs --ref")
    hyps, refs = read_lines(options.hypotheses), read_lines(options.ref)
    tok_ref = Path(options.tok_ref) if options.tok_ref else None
    return EvalSet([], refs, tok_ref.suffix.lstrip(".") if tok_ref else "", tok_ref), hyps


def eval_set(
    data: DataConfig, src: str | None = None, ref: str | None = None, tok_ref: str | None = None, tgt_lang: str = ""
) -> EvalSet:
    """The source and reference files given, or else the config's test split (of the pair into `tgt_lang`,
    with data.pairs); the tokenized reference given, or else (unless another reference is given) the test
    split's, when the dataset has one."""
    tags = data.target_tags()
    tgt_lang = tgt_lang or (tags[0] if len(tags) == 1 else "")  # a model of one target language needs no name
    src_lang, ref_lang = default_pair(data, tgt_lang) if not (src and ref) else (data.src_lang, tgt_lang)
    tokenized = Path(tok_ref) if tok_ref else None
    if tokenized is None and ref is None:
        tokenized = default_tok_ref(data, ref_lang)
    sources, references = test_sides(data, src, ref, (src_lang, ref_lang))
    return EvalSet(sources, references, ref_lang or data.tgt_lang, tokenized)


def test_sides(
    data: DataConfig, src: str | None, ref: str | None, langs: tuple[str, str]
) -> tuple[list[str], list[str]]:
    """The lines of the given source and reference files, the test split's (in data.format, or of the
    languages `langs`) for those not given."""
    from seq2seq.text.corpus import find_file, read_split

    if data.format != "text" and (src is None or ref is None):
        split_src, split_ref = read_split(data, data.test)
        return read_lines(src) if src else split_src, read_lines(ref) if ref else split_ref
    src_path = src or find_file(data.dir, data.test, langs[0])
    ref_path = ref or find_file(data.dir, data.test, langs[1])
    return read_lines(src_path), read_lines(ref_path)


def default_pair(data: DataConfig, tgt_lang: str) -> tuple[str, str]:
    """The languages of the default test split: data.src_lang-tgt_lang, or the one pair of data.pairs into
    `tgt_lang`."""
    if not data.pairs:
        return data.src_lang, data.tgt_lang
    if not tgt_lang:
        raise UsageError(f"this model translates several pairs ({', '.join(data.pairs)}): give --tgt-lang")
    pairs = [(src, tgt) for src, tgt in data.language_pairs() if tgt == tgt_lang]
    if len(pairs) != 1:
        which = "no pair" if not pairs else f"{len(pairs)} pairs"
        raise UsageError(
            f"{which} of {', '.join(data.pairs)} translate into {tgt_lang}: give --src and --ref for the test set"
        )
    return pairs[0]


def default_tok_ref(data: DataConfig, lang: str = "") -> Path | None:
    """The test split's tokenized reference (in `lang`, default data.tgt_lang), when the dataset has one and
    sacremoses can use it."""
    import importlib.util

    from seq2seq.text.download import tokenized_reference

    path = tokenized_reference(data.dir, data.test, lang or data.tgt_lang)
    if not path.is_file():
        return None
    if importlib.util.find_spec("sacremoses") is None:
        log.info("no tokenized BLEU against %s: it needs sacremoses (pip install 'seq2seq[recipes]')", path)
        return None
    return path


def decode(translator: TextTranslator, sources: Sequence[str], tgt_lang: str = "") -> list[str]:
    """The best translation of each source (into `tgt_lang`), with a progress bar on a terminal."""
    bar = progress_bar(None, total=len(sources))
    try:
        return translator.translate(sources, progress=None if bar is None else bar.update, tgt_lang=tgt_lang)
    finally:
        if bar is not None:
            bar.close()


def score(
    hypotheses: list[str], test: EvalSet, bootstrap: int = 1, lowercase: bool = False, save: str | Path | None = None
) -> Evaluation:
    """The scores of the translations against the test set (written to `save` first, when given)."""
    from seq2seq import metrics

    if len(hypotheses) != len(test.references):
        raise DataError(f"{len(hypotheses)} hypotheses but {len(test.references)} references")
    if not test.references:  # sacreBLEU fails on an empty corpus with an IndexError
        raise DataError("nothing to score: the test set has no references")
    if save:
        Path(save).write_text("".join(h + "\n" for h in hypotheses), encoding="utf-8")
    tok_refs = read_lines(test.tokenized) if test.tokenized else None
    report = metrics.report(hypotheses, test.references, bootstrap, lowercase, tok_refs, test.lang)
    return Evaluation(hypotheses, report)
