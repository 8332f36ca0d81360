"""Text in, text out: the one path used by `seq2seq translate`, `evaluate` and validation BLEU.

Sentences are sorted by length, grouped into batches by a token budget
(decode.max_tokens source tokens), searched, detokenized and put back in input
order. Search is batch-invariant, so the grouping changes speed, not output.
Inputs longer than decode.max_input_len (or the model's positions) are
truncated with a warning; empty lines translate to empty lines. A line may come
with a target prefix, which its translation starts with (seq2seq.decoding.search).
"""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, TypeVar

import torch
from torch import Tensor

from seq2seq import interrupt
from seq2seq.config import DataConfig, DecodeConfig, from_dict, replace_checked, to_dict
from seq2seq.decoding.alignment import AttentionMap, LayerChoice, model_attention, require_attention
from seq2seq.decoding.ensemble import Ensemble
from seq2seq.decoding.search import Hypothesis, search
from seq2seq.errors import ConfigError, DataError
from seq2seq.model import Seq2SeqModel, Seq2SeqRNN
from seq2seq.model.session import Decodable
from seq2seq.runs.checkpoint import load_checkpoint
from seq2seq.text.corpus import make_batches, pad
from seq2seq.text.tokenizer import Tokenizer, tag_line
from seq2seq.text.vocab import EOS, PAD, UNK

log = logging.getLogger(__name__)

TranslateProgress = Callable[[int], None]
"""Called with the number of lines just translated (e.g. a progress bar's `update`)."""


class SearchFn(Protocol):
    """(model, src (B, S), src_pad_mask (B, S), settings, limit, prefix (B, P) or None) -> hypotheses
    per sentence, as `search.search`."""

    def __call__(
        self,
        model: Decodable,
        src: Tensor,
        src_pad_mask: Tensor,
        cfg: DecodeConfig,
        limit: int,
        prefix: Tensor | None = None,
    ) -> list[list[Hypothesis]]: ...


@dataclass
class Translation:
    source: str
    hypotheses: list[Hypothesis]  # best first; empty for an empty input line
    texts: list[str]  # detokenized hypotheses
    pieces: list[list[str]]  # the subwords of each hypothesis, one per token score
    source_tokens: list[int] = field(default_factory=list)  # the subword ids the model read, EOS included
    prefix: str = ""  # the target prefix the hypotheses start with ("": none)

    @property
    def text(self) -> str:
        return self.texts[0] if self.texts else ""


T = TypeVar("T", bound="TextTranslator")
TT = TypeVar("TT", bound="Translator")


class TextTranslator:
    """Text in, text out around a search engine: tokenization, truncation, prefixes, empty lines,
    batching by decode.max_tokens, detokenization and input order.

    Subclasses search batches of subword ids: `Translator` with this project's
    models, `seq2seq.deploy.exported.CTranslate2Translator` with an exported model.
    `decode` is the one place that holds the search settings; `data`, when the
    model comes from a checkpoint, is its experiment's data section (languages
    and splits): `seq2seq evaluate` finds its default test set there.
    """

    def __init__(self, tokenizer: Tokenizer, decode: DecodeConfig, data: DataConfig | None = None) -> None:
        self.tokenizer = tokenizer
        self.decode = decode
        self.data = data

    @property
    def max_positions(self) -> int:
        """Positions the model has: source subwords (EOS included), and target tokens (BOS included)."""
        raise NotImplementedError

    def engine_info(self) -> dict[str, object]:
        """What runs the search (engine, device, parameters), for `seq2seq serve`'s GET /info."""
        raise NotImplementedError

    def with_decode(self: T, **changes: object) -> T:
        """The same model and tokenizer with some decode settings changed (and checked again)."""
        translator = copy.copy(self)
        translator.decode = replace_checked(self.decode, changes, "decode settings", "decode.")
        return translator

    def translate(
        self, lines: Sequence[str], progress: TranslateProgress | None = None, tgt_lang: str = ""
    ) -> list[str]:
        """Best translation of each line (into `tgt_lang`, for a model of several target languages)."""
        return [t.text for t in self.translate_full(lines, progress=progress, tgt_langs=[tgt_lang] * len(lines))]

    def translate_full(
        self,
        lines: Sequence[str],
        first_line: int = 1,
        prefixes: Sequence[str] | None = None,
        progress: TranslateProgress | None = None,
        tgt_langs: Sequence[str] | None = None,
    ) -> list[Translation]:
        """Translations with n-best hypotheses, scores and token log-probabilities, in input order.

        `first_line` numbers the lines in warnings (for input read in chunks).
        `prefixes`, one per line ("" for none), are forced at the start of each
        translation and scored like the rest (seq2seq.decoding.search).
        `progress` is told how many more lines are done after each batch.
        `tgt_langs`, one per line ("" for none), are the target languages (`tagged` checks them).
        """
        if prefixes is not None and len(prefixes) != len(lines):
            raise DataError(f"{len(prefixes)} prefixes for {len(lines)} lines; give one per line")
        ids = self._encode(self.tagged(lines, tgt_langs or [""] * len(lines), first_line), first_line)
        forced = self._encode_prefixes(prefixes, first_line) if prefixes is not None else None
        results: list[list[Hypothesis]] = [[] for _ in lines]
        todo = [i for i, seq in enumerate(ids) if len(seq) > 1]  # empty lines translate to ""
        if progress is not None and len(todo) < len(lines):
            progress(len(lines) - len(todo))
        with self._running():
            for batch in make_batches([len(ids[i]) for i in todo], self.decode.max_tokens):
                interrupt.check()  # a safe point between batches
                indices = [todo[j] for j in batch]
                batch_prefixes = None
                if forced is not None and any(forced[i] for i in indices):
                    batch_prefixes = [forced[i] for i in indices]
                for i, h in zip(indices, self._search([ids[i] for i in indices], batch_prefixes)):
                    results[i] = h
                if progress is not None:
                    progress(len(indices))
        return [
            Translation(
                line,
                hyps,
                [self.tokenizer.decode_tgt(h.tokens) for h in hyps],
                [self.tokenizer.tgt_pieces(h.tokens) for h in hyps],
                seq,
                prefixes[i] if prefixes is not None else "",
            )
            for i, (line, hyps, seq) in enumerate(zip(lines, results, ids))
        ]

    def tagged(self, lines: Sequence[str], langs: Sequence[str], first_line: int = 1) -> list[str]:
        """Each line as the model reads it: with the tag of its target language when the model knows several
        (the only one when it knows one and none is asked for); a language the model does not translate
        into, or none of several, is refused with the languages it knows."""
        known = self.tokenizer.target_langs
        if len(langs) != len(lines):
            raise DataError(f"{len(langs)} target languages for {len(lines)} lines; give one per line")
        if not known:  # one language pair, no tags
            own = self.data.tgt_lang if self.data is not None else ""
            for number, lang in enumerate(langs, start=first_line):
                if lang and lang != own:
                    into = own or "one language"
                    raise DataError(f"line {number}: this model translates only into {into}, not {lang}")
            return list(lines)
        out = []
        for number, (line, lang) in enumerate(zip(lines, langs), start=first_line):
            lang = lang or (known[0] if len(known) == 1 else "")
            if lang not in known and line.strip():
                asked = f"not {lang}" if lang else "give the target language (--tgt-lang, or tgt_lang)"
                raise DataError(f"line {number}: this model translates into {', '.join(known)}: {asked}")
            out.append(tag_line(line, lang) if lang in known else line)
        return out

    def _search(self, sources: list[list[int]], prefixes: list[list[int]] | None) -> list[list[Hypothesis]]:
        """Hypotheses of each source (subword ids, EOS included), best first; `prefixes`: target ids
        forced at the start of each ([]: none)."""
        raise NotImplementedError

    def _running(self) -> contextlib.AbstractContextManager[None]:
        """Held while a call translates."""
        return contextlib.nullcontext()

    def _encode_prefixes(self, prefixes: Sequence[str], first_line: int) -> list[list[int]]:
        """Target subword ids of each prefix (no EOS); one that leaves no room for EOS is refused, and one with
        text the target vocabulary cannot spell (`<unk>`, which no translation shows) is warned about."""
        limit = self.max_positions - 1
        encoded = self.tokenizer.encode_tgt([prefix.strip() for prefix in prefixes])
        for number, seq in enumerate(encoded, start=first_line):
            if len(seq) > limit:
                raise DataError(f"the prefix of line {number} has {len(seq)} subwords; the model allows {limit}")
            if UNK in seq:
                log.warning(
                    "the prefix of line %d has characters the target vocabulary lacks: the translation starts "
                    "with the rest of it",
                    number,
                )
        return encoded

    def _encode(self, lines: Sequence[str], first_line: int = 1) -> list[list[int]]:
        """Subword ids + EOS, truncated to fit decode.max_input_len and the model's positions."""
        limit = min(self.decode.max_input_len or self.max_positions, self.max_positions)
        encoded = []
        for number, seq in enumerate(self.tokenizer.encode_src([line.strip() for line in lines]), start=first_line):
            if len(seq) + 1 > limit:
                log.warning("input line %d has %d subwords; truncated to the first %d", number, len(seq), limit - 1)
                seq = seq[: limit - 1]
            encoded.append(seq + [EOS])
        return encoded


def quantized(model: Seq2SeqModel | Ensemble, quantize: str) -> Seq2SeqModel | Ensemble:
    """`model` as `decode.quantize` says it decodes: itself (`none`), or sharing its weights with int8 linears
    in its decoder (`Seq2SeqTransformer.quantized`; an ensemble's members each). One line refuses a model int8
    cannot run (an RNN, CUDA)."""
    if quantize == "none":
        return model
    if isinstance(model, Ensemble):
        return Ensemble([_quantized(member, quantize) for member in model.models]).train(model.training)
    return _quantized(model, quantize)


def _quantized(model: Seq2SeqModel, quantize: str) -> Seq2SeqModel:
    if isinstance(model, Seq2SeqRNN):
        raise ConfigError(f"decode.quantize={quantize} quantizes a Transformer, not an RNN: use decode.quantize=none")
    return model.quantized(quantize)


class Translator(TextTranslator):
    """This project's model (or an ensemble), its tokenizer and decoding settings, ready to translate strings.

    >>> translator = Translator.from_checkpoint("runs/quickstart/checkpoint_best.pt")
    >>> translator.translate(["Ein Hund läuft im Schnee."])
    ['A dog is running in the snow.']
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
        super().__init__(tokenizer, decode, data)
        self.float_model = model  # as loaded: float32 (or as trained), whatever decode.quantize says
        self.model = quantized(model, decode.quantize)  # what decodes
        self.device = torch.device(device)
        self.search_fn = search_fn  # scripts/bench/bench_decode.py swaps in seq2seq.decoding.uncached.uncached_search

    @classmethod
    def from_checkpoint(cls, path: str | Path, device: str | torch.device = "cpu", **decode: object) -> Translator:
        """Load a checkpoint; keyword arguments override its stored decode settings."""
        loaded = load_checkpoint(path, device)
        raw = to_dict(loaded.config)
        raw["decode"].update(decode)
        config = from_dict(raw, source="Translator.from_checkpoint")  # the same checks as a config file
        return cls(loaded.model, loaded.tokenizer, config.decode, device, config.data)

    @property
    def max_positions(self) -> int:
        return self.model.max_positions

    def engine_info(self) -> dict[str, object]:
        parameters = sum(p.numel() for p in self.model.parameters())
        return {
            "engine": "pytorch",
            "device": str(self.device),
            "parameters": parameters,
            "quantize": self.decode.quantize,
        }

    def with_decode(self: TT, **changes: object) -> TT:
        """As `TextTranslator.with_decode`; a changed decode.quantize decodes the loaded model anew."""
        translator = super().with_decode(**changes)
        if translator.decode.quantize != self.decode.quantize:
            translator.model = quantized(self.float_model, translator.decode.quantize)
        return translator

    def _search(self, sources: list[list[int]], prefixes: list[list[int]] | None) -> list[list[Hypothesis]]:
        src = pad(sources).to(self.device)
        prefix = None if prefixes is None else pad([p or [PAD] for p in prefixes]).to(self.device)  # PAD: none
        return self.search_fn(self.model, src, src == PAD, self.decode, self.model.max_positions - 1, prefix)

    def _running(self) -> contextlib.AbstractContextManager[None]:
        return self._eval_mode()

    def attention(
        self, translations: Sequence[Translation], layer: LayerChoice = "last", heads: str = "mean"
    ) -> list[AttentionMap | None]:
        """The cross-attention of each translation's best hypothesis (None for an empty line).

        `layer`: a decoder layer from 1, "last" or "all"; `heads`: "mean" (averaged)
        or "each". The hypothesis is re-scored by a teacher-forced pass
        (seq2seq.decoding.alignment says why), batched like translation.
        """
        require_attention(self.model, layer)
        maps: list[AttentionMap | None] = [None for _ in translations]
        todo = [i for i, t in enumerate(translations) if t.hypotheses and t.source_tokens]
        with self._eval_mode():
            for batch in make_batches([len(translations[i].source_tokens) for i in todo], self.decode.max_tokens):
                chosen = [translations[todo[j]] for j in batch]
                src = pad([t.source_tokens for t in chosen]).to(self.device)
                tgt = pad([t.hypotheses[0].tokens for t in chosen]).to(self.device)
                weights, layers, head_names = model_attention(self.model, src, src == PAD, tgt, layer, heads)
                for row, (j, t) in enumerate(zip(batch, chosen)):
                    S, T = len(t.source_tokens), len(t.hypotheses[0].tokens)
                    maps[todo[j]] = AttentionMap(
                        self.tokenizer.src_pieces(t.source_tokens),
                        t.pieces[0],
                        weights[row, :T, :, :, :S].permute(1, 2, 0, 3).float().cpu(),  # (L', H', T, S)
                        layers,
                        head_names,
                    )
        return maps

    @contextlib.contextmanager
    def _eval_mode(self) -> Iterator[None]:
        """The model in eval mode (no dropout) for a while; validation calls this between training updates.

        A model already wholly in eval mode (translate, serve) is left alone: switching its modules costs
        about 1.3 ms a call, 8% of a one-sentence translation of the quickstart model."""
        if not any(module.training for module in self.model.modules()):
            yield
            return
        was_training = self.model.training
        self.model.eval()
        try:
            yield
        finally:
            self.model.train(was_training)
