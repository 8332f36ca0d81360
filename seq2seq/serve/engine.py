"""What the server needs from a translation engine, and this project's translators as one.

`TranslatorEngine` serves the PyTorch `Translator` (a checkpoint or an ensemble)
and an exported CTranslate2 model alike; another engine plugs in by implementing
`Engine`: the batcher and the routes know nothing else about the model.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from seq2seq.app.model import ModelOptions, open_translator
from seq2seq.config import DecodeConfig, to_dict
from seq2seq.errors import DataError
from seq2seq.translate import TextTranslator, Translation


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


def open_engine(model: ModelOptions) -> TranslatorEngine:
    """The model opened as `seq2seq translate` opens it (token scores included: a request may ask for them)."""
    return TranslatorEngine(open_translator(model))
