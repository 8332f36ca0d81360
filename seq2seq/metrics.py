"""Corpus scores with sacreBLEU, always on detokenized text.

`tokenized_bleu` reproduces the convention of most published Multi30k
numbers (Moses-normalized, Moses-tokenized, lower-cased text scored without
further tokenization) so that our scores can be compared with theirs; the
headline score stays sacreBLEU's default (cased, detokenized, 13a).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import sacrebleu

from seq2seq.config import UserError


@dataclass
class Score:
    name: str
    score: float
    signature: str

    def __str__(self) -> str:
        return f"{self.name} = {self.score:.2f}  ({self.signature})"


def _check(hypotheses: Sequence[str], references: Sequence[str]) -> None:
    if len(hypotheses) != len(references):
        raise UserError(f"{len(hypotheses)} hypotheses but {len(references)} references")


def bleu(hypotheses: Sequence[str], references: Sequence[str], lowercase: bool = False) -> Score:
    _check(hypotheses, references)
    metric = sacrebleu.BLEU(lowercase=lowercase)
    result = metric.corpus_score(list(hypotheses), [list(references)])
    return Score("BLEU" + (" (lowercase)" if lowercase else ""), result.score, str(metric.get_signature()))


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


def tokenized_bleu(hypotheses: Sequence[str], tokenized_references: Sequence[str], lang: str) -> Score:
    """BLEU of Moses-tokenized lower-cased hypotheses against already tokenized references."""
    _check(hypotheses, tokenized_references)
    metric = sacrebleu.BLEU(tokenize="none", force=True)
    hyps = moses_lowercase_tokenize(hypotheses, lang)
    result = metric.corpus_score(hyps, [list(tokenized_references)])
    return Score("BLEU (lc, Moses-tokenized)", result.score, str(metric.get_signature()))
