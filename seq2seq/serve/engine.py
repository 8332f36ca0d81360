"""What the server needs from a translation engine, and the PyTorch `Translator` as one.

Another engine (e.g. an exported CTranslate2 model) plugs in by implementing
`Engine`: the batcher and the routes know nothing else about the model.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from seq2seq.config import DecodeConfig, to_dict
from seq2seq.translate import Translation, Translator


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

    def translate(
        self, lines: Sequence[str], settings: DecodeConfig, prefixes: Sequence[str] | None = None
    ) -> list[Translation]:
        """Translations in input order; called from one worker thread, never from the event loop.

        `prefixes` (one per line, "" for none) start the translations; the batcher passes
        them only when a request has some, so an engine without prefixes may leave them out.
        """
        ...

    def describe(self) -> dict[str, Any]:
        """What GET /info tells about the model."""
        ...


class TorchEngine:
    """The PyTorch `Translator`, the same path as `seq2seq translate` (so the answers are the same)."""

    def __init__(self, translator: Translator) -> None:
        self._translator = translator

    @property
    def defaults(self) -> DecodeConfig:
        return self._translator.decode

    def settings(self, changes: Mapping[str, Any]) -> DecodeConfig:
        return self._translator.with_decode(**changes).decode

    def source_lengths(self, lines: Sequence[str]) -> list[int]:
        return [len(ids) + 1 for ids in self._translator.tokenizer.encode_src([line.strip() for line in lines])]

    def translate(
        self, lines: Sequence[str], settings: DecodeConfig, prefixes: Sequence[str] | None = None
    ) -> list[Translation]:
        t = self._translator
        translator = Translator(t.model, t.tokenizer, settings, t.device, t.data, t.search_fn)
        return translator.translate_full(lines, prefixes=prefixes)

    def describe(self) -> dict[str, Any]:
        t = self._translator
        data = t.data
        return {
            "engine": "pytorch",
            "device": str(t.device),
            "source_language": data.src_lang if data else None,
            "target_language": data.tgt_lang if data else None,
            "parameters": sum(p.numel() for p in t.model.parameters()),
            "max_positions": t.model.max_positions,
            "decode": to_dict(t.decode),
        }
