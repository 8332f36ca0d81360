"""Text in, text out: the one path used by `seq2seq translate`, `evaluate` and validation BLEU.

Sentences are sorted by length, grouped into batches by a token budget,
searched, detokenized and put back in input order.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from seq2seq.checkpoint import load_checkpoint
from seq2seq.config import DecodeConfig, ExperimentConfig
from seq2seq.data import make_batches, pad
from seq2seq.model import Seq2SeqTransformer
from seq2seq.search import Hypothesis, search
from seq2seq.tokenizer import EOS, PAD, Tokenizer

log = logging.getLogger(__name__)


@dataclass
class Translation:
    source: str
    hypotheses: list[Hypothesis]  # best first; empty for an empty input line
    texts: list[str]  # detokenized hypotheses

    @property
    def text(self) -> str:
        return self.texts[0] if self.texts else ""


class Translator:
    """A model, its tokenizer and decoding settings, ready to translate strings.

    >>> translator = Translator.from_checkpoint("runs/quickstart/checkpoint_best.pt")
    >>> translator.translate(["Ein Hund läuft im Schnee."])
    ['A dog is running in the snow.']
    """

    def __init__(
        self, model: Seq2SeqTransformer, tokenizer: Tokenizer, decode: DecodeConfig, device: str | torch.device = "cpu",
        config: ExperimentConfig | None = None,
    ) -> None:  # fmt: skip
        self.config = config  # the experiment the model came from, when loaded from a checkpoint
        self.model = model
        self.tokenizer = tokenizer
        self.decode = decode
        self.device = torch.device(device)

    @classmethod
    def from_checkpoint(cls, path: str | Path, device: str | torch.device = "cpu", **decode: object) -> Translator:
        """Load a checkpoint; keyword arguments override its stored decode settings."""
        loaded = load_checkpoint(path, device)
        return cls(loaded.model, loaded.tokenizer, replace(loaded.config.decode, **decode), device, loaded.config)

    def translate(self, lines: Sequence[str], strategy: str | None = None) -> list[str]:
        """Best translation of each line."""
        return [t.text for t in self.translate_full(lines, strategy)]

    def translate_full(self, lines: Sequence[str], strategy: str | None = None) -> list[Translation]:
        """Translations with n-best hypotheses, scores and token log-probabilities, in input order."""
        ids = self._encode(lines)
        results: list[list[Hypothesis]] = [[] for _ in lines]
        todo = [i for i, seq in enumerate(ids) if len(seq) > 1]  # empty lines translate to ""
        was_training = self.model.training
        self.model.eval()
        try:
            for batch in make_batches([len(ids[i]) for i in todo], self.decode.max_tokens):
                indices = [todo[j] for j in batch]
                src = pad([ids[i] for i in indices]).to(self.device)
                hyps = search(self.model, src, src == PAD, self.decode, self.model.max_positions - 1, strategy)
                for i, h in zip(indices, hyps):
                    results[i] = h
        finally:
            self.model.train(was_training)
        return [
            Translation(line, hyps, [self.tokenizer.decode_tgt(h.tokens) for h in hyps])
            for line, hyps in zip(lines, results)
        ]

    def _encode(self, lines: Sequence[str]) -> list[list[int]]:
        limit = self.decode.max_input_len or self.model.max_positions - 1
        limit = min(limit, self.model.max_positions - 1)
        encoded = []
        for number, seq in enumerate(self.tokenizer.encode_src([line.strip() for line in lines]), start=1):
            if len(seq) + 1 > limit:
                log.warning("input line %d has %d subwords; truncated to %d", number, len(seq), limit - 1)
                seq = seq[: limit - 1]
            encoded.append(seq + [EOS])
        return encoded
