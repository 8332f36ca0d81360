"""Corpus scores with sacreBLEU, always on detokenized text.

`tokenized_bleu` reproduces the convention of most published Multi30k
numbers (Moses-normalized, Moses-tokenized, lower-cased text scored without
further tokenization) so that our scores can be compared with theirs; the
headline score stays sacreBLEU's default (cased, detokenized, 13a).
`report` is the one set of scores `seq2seq evaluate` prints and
`seq2seq recipe` records (through `evaluate --format json`'s record).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import sacrebleu

from seq2seq.errors import UserError


@dataclass
class Score:
    name: str
    score: float
    signature: str
    ci95: float | None = None  # half-width of the 95% bootstrap interval, when resampled

    def __str__(self) -> str:
        interval = f" ± {self.ci95:.2f} (95% bootstrap)" if self.ci95 is not None else ""
        return f"{self.name} = {self.score:.2f}{interval}  ({self.signature})"


def _bleu_score(name: str, metric: sacrebleu.BLEU, hyps: list[str], refs: list[str], n_bootstrap: int) -> Score:
    """The corpus score; with n_bootstrap > 1 also how much it moves over resampled test sets
    (sacreBLEU's resampling, seeded, so reruns agree): a 1,000-sentence test set is small."""
    result = metric.corpus_score(hyps, [refs], n_bootstrap=n_bootstrap)
    ci95 = float(result._ci) if n_bootstrap > 1 else None
    return Score(name, result.score, str(metric.get_signature()), ci95)


def _check(hypotheses: Sequence[str], references: Sequence[str]) -> None:
    if len(hypotheses) != len(references):
        raise UserError(f"{len(hypotheses)} hypotheses but {len(references)} references")


def bleu(hypotheses: Sequence[str], references: Sequence[str], lowercase: bool = False, n_bootstrap: int = 1) -> Score:
    _check(hypotheses, references)
    name = "BLEU" + (" (lowercase)" if lowercase else "")
    return _bleu_score(name, sacrebleu.BLEU(lowercase=lowercase), list(hypotheses), list(references), n_bootstrap)


def chrf(hypotheses: Sequence[str], references: Sequence[str]) -> Score:
    _check(hypotheses, references)
    metric = sacrebleu.CHRF()
    return Score("chrF", metric.corpus_score(list(hypotheses), [list(references)]).score, str(metric.get_signature()))


def ter(hypotheses: Sequence[str], references: Sequence[str]) -> Score:
    _check(hypotheses, references)
    metric = sacrebleu.TER()
    return Score("TER", metric.corpus_score(list(hypotheses), [list(references)]).score, str(metric.get_signature()))


def moses_lowercase_tokenize(lines: Sequence[str], lang: str) -> list[str]:
    """Lower-case, Moses punctuation normalization, Moses tokenization (the Multi30k `lc.norm.tok` recipe)."""
    try:
        from sacremoses import MosesPunctNormalizer, MosesTokenizer
    except ImportError:
        raise UserError("tokenized BLEU needs sacremoses: pip install 'seq2seq[recipes]'") from None
    normalizer = MosesPunctNormalizer(lang=lang)
    tokenizer = MosesTokenizer(lang=lang)
    return [tokenizer.tokenize(normalizer.normalize(line.lower()), return_str=True, escape=True) for line in lines]


def tokenized_bleu(
    hypotheses: Sequence[str], tokenized_references: Sequence[str], lang: str, n_bootstrap: int = 1
) -> Score:
    """BLEU of Moses-tokenized lower-cased hypotheses against already tokenized references."""
    _check(hypotheses, tokenized_references)
    metric = sacrebleu.BLEU(tokenize="none", force=True)
    hyps = moses_lowercase_tokenize(hypotheses, lang)
    return _bleu_score("BLEU (lc, Moses-tokenized)", metric, hyps, list(tokenized_references), n_bootstrap)


@dataclass
class Report:
    bleu: Score
    chrf: Score
    ter: Score
    lowercase_bleu: Score | None = None
    tokenized_bleu: Score | None = None

    def scores(self) -> list[Score]:
        """The scores computed, in the order `seq2seq evaluate` prints them."""
        every = (self.bleu, self.chrf, self.ter, self.lowercase_bleu, self.tokenized_bleu)
        return [score for score in every if score is not None]


def report(
    hypotheses: Sequence[str],
    references: Sequence[str],
    n_bootstrap: int = 1,
    lowercase: bool = False,
    tokenized_references: Sequence[str] | None = None,
    lang: str = "",
) -> Report:
    """BLEU, chrF and TER; lower-cased BLEU if asked; tokenized BLEU (in language `lang`) given its references.

    Each BLEU gets a 95% bootstrap interval from `n_bootstrap` resampled test sets when n_bootstrap > 1.
    """
    if n_bootstrap < 1:
        raise UserError(f"n_bootstrap must be at least 1, got {n_bootstrap}")
    return Report(
        bleu(hypotheses, references, n_bootstrap=n_bootstrap),
        chrf(hypotheses, references),
        ter(hypotheses, references),
        bleu(hypotheses, references, lowercase=True, n_bootstrap=n_bootstrap) if lowercase else None,
        None
        if tokenized_references is None
        else tokenized_bleu(hypotheses, tokenized_references, lang, n_bootstrap=n_bootstrap),
    )
