"""Text in, text out: the one path used by `seq2seq translate`, `evaluate` and validation BLEU.

Sentences are sorted by length, grouped into batches by a token budget
(decode.max_tokens source tokens), searched, detokenized and put back in input
order. Search is batch-invariant, so the grouping changes speed, not output.
Inputs longer than decode.max_input_len (or the model's positions) are
truncated with a warning; empty lines translate to empty lines.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from seq2seq.checkpoint import load_checkpoint
from seq2seq.config import DataConfig, DecodeConfig, from_dict, replace_checked, to_dict
from seq2seq.data import make_batches, pad
from seq2seq.ensemble import Ensemble
from seq2seq.model import Seq2SeqModel
from seq2seq.search import Hypothesis, search
from seq2seq.tokenizer import Tokenizer
from seq2seq.vocab import EOS, PAD

log = logging.getLogger(__name__)

Progress = Callable[[int], None]
"""Called with the number of lines just translated (e.g. a progress bar's `update`)."""

SearchFn = Callable[[Any, Tensor, Tensor, DecodeConfig, int], list[list[Hypothesis]]]
"""(model, src (B, S), src_pad_mask (B, S), settings, limit) -> hypotheses per sentence, as `search.search`."""


@dataclass
class Translation:
    source: str
    hypotheses: list[Hypothesis]  # best first; empty for an empty input line
    texts: list[str]  # detokenized hypotheses
    pieces: list[list[str]]  # the subwords of each hypothesis, one per token score

    @property
    def text(self) -> str:
        return self.texts[0] if self.texts else ""


class Translator:
    """A model, its tokenizer and decoding settings, ready to translate strings.

    >>> translator = Translator.from_checkpoint("runs/quickstart/checkpoint_best.pt")
    >>> translator.translate(["Ein Hund läuft im Schnee."])
    ['A dog is running in the snow.']

    `decode` is the one place that holds the search settings. `data`, when the
    model comes from a checkpoint, is its experiment's data section (languages
    and splits): `seq2seq evaluate` finds its default test set there.
    """

    def __init__(
        self,
        model: Seq2SeqModel | Ensemble,
        tokenizer: Tokenizer,
        decode: DecodeConfig,
        device: str | torch.device = "cpu",
        data: DataConfig | None = None,
        search_fn: SearchFn = search,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.decode = decode
        self.device = torch.device(device)
        self.data = data
        self.search_fn = search_fn  # scripts/bench_decode.py swaps in seq2seq.uncached.uncached_search

    @classmethod
    def from_checkpoint(cls, path: str | Path, device: str | torch.device = "cpu", **decode: Any) -> Translator:
        """Load a checkpoint; keyword arguments override its stored decode settings."""
        loaded = load_checkpoint(path, device)
        raw = to_dict(loaded.config)
        raw["decode"].update(decode)
        config = from_dict(raw, source="Translator.from_checkpoint")  # the same checks as a config file
        return cls(loaded.model, loaded.tokenizer, config.decode, device, config.data)

    def with_decode(self, **changes: Any) -> Translator:
        """The same model and tokenizer with some decode settings changed (and checked again)."""
        translator = copy.copy(self)
        translator.decode = replace_checked(self.decode, changes, "decode settings", "decode.")
        return translator

    def translate(self, lines: Sequence[str], progress: Progress | None = None) -> list[str]:
        """Best translation of each line."""
        return [t.text for t in self.translate_full(lines, progress=progress)]

    def translate_full(
        self, lines: Sequence[str], first_line: int = 1, progress: Progress | None = None
    ) -> list[Translation]:
        """Translations with n-best hypotheses, scores and token log-probabilities, in input order.

        `first_line` numbers the lines in warnings (for input read in chunks);
        `progress` is told how many more lines are done after each batch.
        """
        ids = self._encode(lines, first_line)
        results: list[list[Hypothesis]] = [[] for _ in lines]
        todo = [i for i, seq in enumerate(ids) if len(seq) > 1]  # empty lines translate to ""
        if progress is not None and len(todo) < len(lines):
            progress(len(lines) - len(todo))
        was_training = self.model.training
        self.model.eval()
        try:
            for batch in make_batches([len(ids[i]) for i in todo], self.decode.max_tokens):
                indices = [todo[j] for j in batch]
                src = pad([ids[i] for i in indices]).to(self.device)
                hyps = self.search_fn(self.model, src, src == PAD, self.decode, self.model.max_positions - 1)
                for i, h in zip(indices, hyps):
                    results[i] = h
                if progress is not None:
                    progress(len(indices))
        finally:
            self.model.train(was_training)
        return [
            Translation(
                line,
                hyps,
                [self.tokenizer.decode_tgt(h.tokens) for h in hyps],
                [self.tokenizer.tgt_pieces(h.tokens) for h in hyps],
            )
            for line, hyps in zip(lines, results)
        ]

    def _encode(self, lines: Sequence[str], first_line: int = 1) -> list[list[int]]:
        """Subword ids + EOS, truncated to fit decode.max_input_len and the model's positions."""
        limit = min(self.decode.max_input_len or self.model.max_positions, self.model.max_positions)
        encoded = []
        for number, seq in enumerate(self.tokenizer.encode_src([line.strip() for line in lines]), start=first_line):
            if len(seq) + 1 > limit:
                log.warning("input line %d has %d subwords; truncated to the first %d", number, len(seq), limit - 1)
                seq = seq[: limit - 1]
            encoded.append(seq + [EOS])
        return encoded
