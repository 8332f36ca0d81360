"""What the server needs from a translation engine, and this project's translators as one.

`TranslatorEngine` serves the PyTorch `Translator` (a checkpoint or an ensemble)
and an exported CTranslate2 model alike; another engine plugs in by implementing
`Engine`: the batcher and the routes know nothing else about the model.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from seq2seq.app.model import ModelOptions, open_translator
from seq2seq.config import DecodeConfig, to_dict
from seq2seq.decoding.alignment import AttentionMap, LayerChoice, require_attention
from seq2seq.decoding.translate import TextTranslator, Translation, Translator
from seq2seq.errors import AttentionError, DataError


class Engine(Protocol):
    @property
    def defaults(self) -> DecodeConfig:
        """The decode settings a request gets when it asks for none."""
        ...

    def settings(self, changes: Mapping[str, Any]) -> DecodeConfig:
        """The defaults with some fields changed, checked like a config file's values (ConfigError)."""
        ...

    def source_lengths(self, lines: Sequence[str]) -> list[int]:
        """Source subwords of each line (EOS included): what a batch's token budget counts."""
        ...

    def check_prefixes(self, prefixes: Sequence[str]) -> None:
        """DataError (a UserError) naming the first prefix the model cannot take: checked per request,
        before batching, so that one request's prefix never fails the others in its batch."""
        ...

    def check_tgt_langs(self, lines: Sequence[str], tgt_langs: Sequence[str]) -> None:
        """DataError naming a target language the model does not translate into, or saying that it needs
        one: checked per request, before batching, like the prefixes."""
        ...

    def translate(
        self,
        lines: Sequence[str],
        settings: DecodeConfig,
        prefixes: Sequence[str] | None = None,
        tgt_langs: Sequence[str] | None = None,
    ) -> list[Translation]:
        """Translations in input order; called from one worker thread, never from the event loop.

        `prefixes` (one per line, "" for none) start the translations; the batcher passes
        them only when a request has some, so an engine without prefixes may leave them out.
        `tgt_langs` (one per line, "" for none) likewise, for a model of several target languages.
        """
        ...

    def describe(self) -> dict[str, Any]:
        """What GET /info tells about the model."""
        ...

    def check_attention(self, layer: LayerChoice) -> str | None:
        """None when the model gives the cross-attention of `layer`; a note saying why not when it has none
        to give (the answer then has the translations and the note); AttentionError for a layer it lacks."""
        ...

    def attention(
        self, translations: Sequence[Translation], layer: LayerChoice, heads: str
    ) -> list[list[AttentionMap | None]]:
        """The cross-attention of every hypothesis of each translation, as `seq2seq translate --alignment`
        computes the best one's; called from the decoding thread, after `check_attention`."""
        ...


class TranslatorEngine:
    """A translator, the same path as `seq2seq translate` (so the answers are the same)."""

    def __init__(self, translator: TextTranslator) -> None:
        self._translator = translator

    @property
    def defaults(self) -> DecodeConfig:
        return self._translator.decode

    def settings(self, changes: Mapping[str, Any]) -> DecodeConfig:
        return self._translator.with_decode(**changes).decode

    def source_lengths(self, lines: Sequence[str]) -> list[int]:
        return [len(ids) + 1 for ids in self._translator.tokenizer.encode_src([line.strip() for line in lines])]

    def check_prefixes(self, prefixes: Sequence[str]) -> None:
        t = self._translator
        limit = t.max_positions - 1  # as `translate_full` allows: room for EOS
        for i, ids in enumerate(t.tokenizer.encode_tgt([prefix.strip() for prefix in prefixes])):
            if len(ids) > limit:
                raise DataError(f"prefix[{i}] has {len(ids)} subwords; the model allows {limit}")

    def check_tgt_langs(self, lines: Sequence[str], tgt_langs: Sequence[str]) -> None:
        self._translator.tagged(lines, tgt_langs)

    def translate(
        self,
        lines: Sequence[str],
        settings: DecodeConfig,
        prefixes: Sequence[str] | None = None,
        tgt_langs: Sequence[str] | None = None,
    ) -> list[Translation]:
        translator = copy.copy(self._translator)  # settings were checked by `settings`
        translator.decode = settings
        return translator.translate_full(lines, prefixes=prefixes, tgt_langs=tgt_langs)

    def describe(self) -> dict[str, Any]:
        t = self._translator
        data = t.data
        return {
            **t.engine_info(),
            "source_language": data.src_lang if data else None,
            "target_language": data.tgt_lang if data else None,
            "target_languages": list(t.tokenizer.target_langs),  # a model of several pairs: tgt_lang takes these
            "max_positions": t.max_positions,
            "decode": to_dict(t.decode),
        }

    def check_attention(self, layer: LayerChoice) -> str | None:
        t = self._translator
        if not isinstance(t, Translator):
            return "CTranslate2 gives no attention weights: serve the checkpoint file (--engine torch) to see them"
        try:
            require_attention(t.model)
        except AttentionError as e:  # no attention at all: the translations come with this note
            return str(e)
        require_attention(t.model, layer)
        return None

    def attention(
        self, translations: Sequence[Translation], layer: LayerChoice, heads: str
    ) -> list[list[AttentionMap | None]]:
        t = self._translator
        assert isinstance(t, Translator), "check_attention says when there is none"
        each = [  # one translation per hypothesis: `Translator.attention` takes the best of each
            dataclasses.replace(r, hypotheses=[h], texts=[text], pieces=[pieces])
            for r in translations
            for h, text, pieces in zip(r.hypotheses, r.texts, r.pieces)
        ]
        maps, start, grouped = t.attention(each, layer, heads), 0, []
        for r in translations:
            grouped.append(maps[start : start + len(r.hypotheses)])
            start += len(r.hypotheses)
        return grouped


def open_engine(model: ModelOptions) -> TranslatorEngine:
    """The model opened as `seq2seq translate` opens it (token scores included: a request may ask for them)."""
    return TranslatorEngine(open_translator(model))
