"""Validation scores: loss and perplexity by teacher forcing, BLEU by decoding.

BLEU goes through `Translator`, the path `seq2seq translate` uses, and is
computed by sacreBLEU on detokenized text, so validation BLEU and
`seq2seq evaluate` measure the same thing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from seq2seq import metrics
from seq2seq.config import DecodeConfig
from seq2seq.decoding.translate import Translator
from seq2seq.device import autocast
from seq2seq.model import Seq2SeqModel, kernel_scope, training_kernel
from seq2seq.text.corpus import EncodedCorpus, collate, make_batches
from seq2seq.text.tokenizer import Tokenizer
from seq2seq.training.loss import batch_loss


@torch.no_grad()
def loss_scores(
    model: Seq2SeqModel,
    data: EncodedCorpus,
    max_tokens: int,
    epsilon: float,
    precision: str,
    device: torch.device,
) -> dict[str, float]:
    """Per-token smoothed loss, NLL and perplexity over a corpus; the sums stay on the device until the end."""
    was_training = model.training
    model.eval()
    sums = torch.zeros(2, dtype=torch.float64, device=device)  # loss, nll
    tokens = 0
    kernel = training_kernel(device, precision)  # training's: on CUDA, never cuDNN's graph per batch shape
    try:
        for indices in make_batches(data.lengths(), max_tokens):
            batch = collate(data, indices).to(device)
            with autocast(precision, device), kernel_scope(kernel):
                loss, nll = batch_loss(model, batch, epsilon)
            sums += torch.stack([loss.detach(), nll]).double()
            tokens += batch.n_tokens
    finally:
        model.train(was_training)
    loss_sum, nll_sum = sums.tolist()
    return {"loss": loss_sum / tokens, "nll": nll_sum / tokens, "ppl": math.exp(min(nll_sum / tokens, 50))}


def translations(
    model: Seq2SeqModel,
    tokenizer: Tokenizer,
    decode: DecodeConfig,
    sources: Sequence[str],
    device: torch.device,
    langs: Sequence[str] | None = None,
) -> list[str]:
    """Detokenized translations with `decode.valid_strategy` (greedy or beam); `langs`: the target
    language of each source, for a model of several pairs.

    nbest=1: only the best hypothesis is scored, and decode.nbest was checked against decode.strategy's beam only;
    decode.quantize is for translating, not for scoring the model being trained.
    """
    valid = replace(decode, strategy=decode.valid_strategy, nbest=1, quantize="none")  # the float32 model trained
    return [t.text for t in Translator(model, tokenizer, valid, device).translate_full(sources, tgt_langs=langs)]


def bleu(hypotheses: Sequence[str], references: Sequence[str]) -> float:
    return metrics.bleu(hypotheses, references).score


def examples(sources: Sequence[str], hypotheses: Sequence[str], references: Sequence[str], n: int = 3) -> str:
    """A few translations beside their sources and references, as TensorBoard text (markdown)."""
    rows = [f"    {s}\n    -> {h}\n    (ref) {r}" for s, h, r in list(zip(sources, hypotheses, references))[:n]]
    return "\n\n".join(rows)


class Validator:
    """Scores the model on the validation set: loss always, BLEU by decoding when asked."""

    def __init__(
        self,
        model: Seq2SeqModel,
        tokenizer: Tokenizer,
        corpus: EncodedCorpus,
        text: tuple[Sequence[str], Sequence[str]],  # (sources, references)
        decode: DecodeConfig,
        max_tokens: int,
        label_smoothing: float,
        precision: str,
        device: torch.device,
        with_bleu: bool = True,
        pairs: Sequence[ValidPair] = (),
    ) -> None:
        self.model, self.tokenizer, self.corpus, self.text, self.decode = model, tokenizer, corpus, text, decode
        self.max_tokens, self.label_smoothing, self.precision, self.device = (
            max_tokens,
            label_smoothing,
            precision,
            device,
        )
        self.with_bleu = with_bleu
        self.pairs = pairs
        self.examples = ""  # a few translations of the last validation, as markdown

    def __call__(self) -> dict[str, float]:
        """Loss, NLL, perplexity and (with_bleu) BLEU."""
        budget = max(self.max_tokens, self.decode.max_tokens)  # no gradients to keep: batches as large as decoding's
        scores = loss_scores(self.model, self.corpus, budget, self.label_smoothing, self.precision, self.device)
        if self.with_bleu:
            sources, references = self.text
            langs = [p.tgt for p in self.pairs for _ in p.lines] if self.pairs else None
            hypotheses = translations(self.model, self.tokenizer, self.decode, sources, self.device, langs)
            scores.update(pair_bleu(hypotheses, references, self.pairs))
            self.examples = examples(sources, hypotheses, references)
        return scores


@dataclass(frozen=True)
class ValidPair:
    """The lines of one language pair in a validation set of several pairs (data.pairs), one after another."""

    name: str  # e.g. de-en
    tgt: str
    lines: range


def pair_bleu(hypotheses: Sequence[str], references: Sequence[str], pairs: Sequence[ValidPair]) -> dict[str, float]:
    """BLEU; with several pairs, each pair's (bleu_de-en, ...) and their mean as `bleu`, what selects the best
    checkpoint: every pair counts the same, however many lines its validation set has."""
    if not pairs:
        return {"bleu": bleu(hypotheses, references)}
    out = {f"bleu_{p.name}": bleu([hypotheses[i] for i in p.lines], [references[i] for i in p.lines]) for p in pairs}
    return {"bleu": sum(out.values()) / len(out), **out}
