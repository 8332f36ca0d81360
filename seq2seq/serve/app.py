"""The HTTP routes: POST /translate, GET /health, GET /info, and the attention explorer at GET /.

Every API answer is JSON. A request the server will not take (malformed, over a
limit, an unknown or invalid option) gets a 4xx naming the problem; anything
else that fails gets a 500 with an error id that is also in the log, and never
a stack trace. No route reads or writes a file: the explorer's page (static/)
is read once, when the application is made.
"""

from __future__ import annotations

import asyncio
import contextlib
import difflib
import functools
import json
import logging
import math
import typing
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from importlib import resources
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from seq2seq import __version__
from seq2seq.app.streams import alignment_fields
from seq2seq.config import DecodeConfig
from seq2seq.decoding.alignment import HEAD_CHOICES, AttentionMap, LayerChoice
from seq2seq.decoding.translate import Translation
from seq2seq.errors import ConfigError, UserError
from seq2seq.serve.batcher import Batcher, Busy
from seq2seq.serve.engine import Engine
from seq2seq.serve.options import ServeOptions
from seq2seq.text.corpus import lone_surrogate

log = logging.getLogger("seq2seq.serve")

DECODE_OPTIONS = (
    "strategy",
    "beam_size",
    "nbest",
    "length_penalty",
    "max_len_a",
    "max_len_b",
    "min_len",
    "no_repeat_ngram",
    "suppress_unk",
    "temperature",
    "top_k",
    "top_p",
    "seed",
)
"""The decode settings a request may change. The rest (batch sizes, input truncation, max_len) are the server's."""
FLOAT_OPTIONS = frozenset(k for k in DECODE_OPTIONS if typing.get_type_hints(DecodeConfig)[k] is float)
ATTENTION_OPTIONS = ("attention", "attention_layer", "attention_heads")
OPTIONS = (*DECODE_OPTIONS, "scores", *ATTENTION_OPTIONS)
FIELDS = ("text", "prefix", "tgt_lang", "model", "options")
PAGE = {"/": "index.html", "/explorer.js": "explorer.js", "/explorer.css": "explorer.css"}
"""The explorer's files (seq2seq/serve/static/), by the path that serves each."""
MEDIA = {"html": "text/html; charset=utf-8", "js": "text/javascript; charset=utf-8", "css": "text/css; charset=utf-8"}
DECIMALS = 4  # attention weights are rounded to this many decimals in answers


class Rejected(Exception):
    """A request the server will not take: answered with `status` and the message, as JSON."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class AttentionAsk:
    """Which cross-attention an answer carries: a decoder layer from 1, "last" or "all"; heads "mean" or "each"."""

    layer: LayerChoice = "last"
    heads: str = "mean"


@dataclass
class TranslateRequest:
    lines: list[str]
    settings: DecodeConfig
    scores: bool  # add each hypothesis' score to the answer
    prefixes: list[str] | None = None  # target prefixes, one per line ("" for none)
    tgt_lang: str = ""  # the target language of every line, for a model of several ("": none)
    model: str = ""  # which of the served models ("": the first)
    attention: AttentionAsk | None = None  # add each hypothesis' cross-attention to the answer


Handler = Callable[[Request], Awaitable[Response]]


def create_app(models: Batcher | Mapping[str, Batcher], options: ServeOptions) -> Starlette:
    """The application for one model's batcher, or several by name (the first answers requests that name
    none); each batcher runs from startup to shutdown (after the last in-flight request)."""
    batchers = {"default": models} if isinstance(models, Batcher) else dict(models)
    service = _Service(batchers, options)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        for batcher in batchers.values():
            batcher.start()
        yield
        await asyncio.gather(*(batcher.stop() for batcher in batchers.values()))

    page = [Route(path, _static_file(name), methods=["GET"]) for path, name in PAGE.items()]
    return Starlette(
        routes=[
            Route("/translate", _guarded(service.translate), methods=["POST"]),
            Route("/health", _guarded(service.health), methods=["GET"]),
            Route("/info", _guarded(service.info), methods=["GET"]),
            *page,
        ],
        exception_handlers={HTTPException: _http_error},  # 404, 405: JSON like every other answer
        lifespan=lifespan,
    )


class _Service:
    def __init__(self, batchers: dict[str, Batcher], options: ServeOptions) -> None:
        self.batchers = batchers
        self.options = options

    async def translate(self, request: Request) -> Response:
        body = await _read_body(request, self.options.max_body, self.options.read_timeout)
        parsed = self.parse(body)
        batcher = self.batchers[parsed.model]
        engine = batcher.engine
        tokens = sum(engine.source_lengths(parsed.lines))
        try:
            if parsed.prefixes is not None:
                engine.check_prefixes(parsed.prefixes)  # before batching: never another request's failure
            langs = [parsed.tgt_lang] * len(parsed.lines)
            engine.check_tgt_langs(parsed.lines, langs)
            note = engine.check_attention(parsed.attention.layer) if parsed.attention else None
            results = await batcher.translate(
                parsed.lines, parsed.settings, tokens, parsed.prefixes, langs if parsed.tgt_lang else None
            )
        except Busy as e:
            raise Rejected(503, f"server busy: {e}") from None
        except UserError as e:  # this request's own input, found by the engine
            raise Rejected(400, str(e)) from None
        answers = [_render(r, parsed.scores, parsed.settings.nbest) for r in results]
        if parsed.attention is None:
            return JSONResponse({"translations": answers})
        if note is not None:
            return JSONResponse({"translations": [_with(a, "attention", None) for a in answers], "note": note})
        ask = parsed.attention
        self._check_size(_fewest_weights(results), at_least=True)  # before the pass that would make them
        try:
            maps = await batcher.call(functools.partial(engine.attention, results, ask.layer, ask.heads))
        except UserError as e:  # e.g. an ensemble whose members show different numbers of layers or heads
            raise Rejected(400, str(e)) from None
        self._check_size(sum(m.weights.numel() for hypotheses in maps for m in hypotheses if m is not None))
        return JSONResponse({"translations": [_with(a, "attention", _maps(m)) for a, m in zip(answers, maps)]})

    def _check_size(self, size: int, at_least: bool = False) -> None:
        """413 for an answer with more attention weights than the server sends, saying how to ask for fewer."""
        if size > self.options.max_attention:
            raise Rejected(
                413,
                f"the attention asked for has {'at least ' if at_least else ''}{size} weights; this server sends up "
                f"to {self.options.max_attention}: ask for one layer (attention_layer), averaged heads "
                '(attention_heads: "mean"), fewer hypotheses or fewer lines',
            )

    async def health(self, request: Request) -> Response:
        b = self.batchers.values()
        return JSONResponse(
            {
                "status": "ok",
                "in_flight": sum(x.in_flight for x in b),
                "waiting": sum(x.waiting for x in b),
                "batches": sum(x.batches for x in b),
            }
        )

    async def info(self, request: Request) -> Response:
        o = self.options
        first = next(iter(self.batchers.values()))
        return JSONResponse(
            {
                "version": __version__,
                "model": first.engine.describe(),
                "models": {name: b.engine.describe() for name, b in self.batchers.items()},
                "options": list(OPTIONS),
                "limits": {
                    "max_lines": o.max_lines,
                    "max_chars": o.max_chars,
                    "max_body": o.max_body,
                    "max_beam": o.max_beam,
                    "max_attention": o.max_attention,
                    "read_timeout_s": o.read_timeout,
                },
                "batching": {"max_tokens": first.max_tokens, "max_wait_ms": first.max_wait * 1000},
            }
        )

    def parse(self, body: bytes) -> TranslateRequest:
        """The request's lines and decode settings, or Rejected naming what is wrong."""
        try:
            raw = json.loads(body)
        except (ValueError, RecursionError):  # JSONDecodeError, UnicodeDecodeError, an integer of 4,300+ digits
            raise Rejected(400, 'the body must be JSON, e.g. {"text": ["a sentence"]}') from None
        if not isinstance(raw, dict):
            raise Rejected(400, 'the body must be a JSON object with a "text" list')
        for key in raw:
            if key not in FIELDS:
                raise Rejected(400, f"unknown field {key!r} (fields: {', '.join(FIELDS)})")
        lines = self._lines(raw.get("text"))
        prefixes = self._lines(raw["prefix"], "prefix") if "prefix" in raw else None
        if prefixes is not None and len(prefixes) != len(lines):
            raise Rejected(400, f'"prefix" has {len(prefixes)} items for {len(lines)} lines of "text"; give one each')
        lang = raw.get("tgt_lang", "")
        if not isinstance(lang, str) or len(lang) > 64:
            raise Rejected(400, '"tgt_lang" must be a language name, e.g. "en"')
        _require_unicode(lang, '"tgt_lang"')
        model = self._model(raw.get("model"))
        options = raw.get("options", {})
        if not isinstance(options, dict):
            raise Rejected(400, '"options" must be a JSON object')
        settings, scores = self._options(options, self.batchers[model].engine)
        return TranslateRequest(lines, settings, scores, prefixes, lang, model, _attention(options))

    def _model(self, name: Any) -> str:
        """The served model a request names; the first when it names none."""
        if name is None:
            return next(iter(self.batchers))
        if not isinstance(name, str) or name not in self.batchers:
            raise Rejected(400, f'unknown "model" {name!r} (models: {", ".join(self.batchers)})')
        return name

    def _lines(self, text: Any, name: str = "text") -> list[str]:
        o = self.options
        if not isinstance(text, list) or not all(isinstance(line, str) for line in text):
            raise Rejected(400, f'"{name}" must be a list of strings, one sentence each')
        if len(text) > o.max_lines:
            raise Rejected(413, f"{len(text)} lines in one request; the limit is {o.max_lines}")
        for i, line in enumerate(text):
            if len(line) > o.max_chars:
                raise Rejected(413, f"{name}[{i}] has {len(line)} characters; the limit is {o.max_chars}")
            if "\n" in line or "\r" in line:
                raise Rejected(400, f"{name}[{i}] contains a line break; send one sentence per list item")
            _require_unicode(line, f"{name}[{i}]")
        return text

    def _options(self, raw: dict[str, Any], engine: Engine) -> tuple[DecodeConfig, bool]:
        for key in raw:
            if key in DecodeConfig.__dataclass_fields__ and key not in OPTIONS:
                raise Rejected(400, f"option {key!r} is the server's to set, not a request's")
            if key not in OPTIONS:
                close = difflib.get_close_matches(str(key), OPTIONS, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else f" (options: {', '.join(OPTIONS)})"
                raise Rejected(400, f"unknown option {key!r}{hint}")
        scores = raw.get("scores", False)
        if not isinstance(scores, bool):
            raise Rejected(400, f"option 'scores' must be true or false; got {scores!r}")
        for key in FLOAT_OPTIONS & raw.keys():  # JSON has numbers: a string is not one, whatever float() makes of it
            if not isinstance(raw[key], int | float) or isinstance(raw[key], bool):
                raise Rejected(400, f"option {key!r} must be a number; got {raw[key]!r}")
        try:
            settings = engine.settings({k: v for k, v in raw.items() if k in DECODE_OPTIONS})
        except ConfigError as e:
            raise Rejected(400, str(e)) from None
        if settings.beam_size > self.options.max_beam:
            raise Rejected(
                400, f"option 'beam_size' is {settings.beam_size}; this server allows up to {self.options.max_beam}"
            )
        return settings, scores


def _fewest_weights(results: list[Translation]) -> int:
    """The attention weights of these translations' hypotheses with one layer and the heads averaged: target
    subwords x source subwords, EOS included on both sides. More layers or heads only multiply it, so an answer
    this count already puts over the limit is refused before the teacher-forced pass that would compute it."""
    return sum(len(h.tokens) * len(r.source_tokens) for r in results if r.source_tokens for h in r.hypotheses)


def _require_unicode(text: str, name: str) -> None:
    """A 400 for text the tokenizer and the answer's UTF-8 would both fail on (`lone_surrogate`)."""
    at = lone_surrogate(text)
    if at is not None:
        raise Rejected(400, f"{name} is not valid Unicode: a lone surrogate at character {at}")


async def _read_body(request: Request, limit: int, timeout: float) -> bytes:
    """The body, refused (413) as soon as it is known to exceed `limit` bytes: no more of it is read;
    and 408 when it has not all arrived within `timeout` seconds, so a stalled client holds nothing."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and (len(declared) > 18 or int(declared) > limit):  # int() refuses 4,300+ digits
        raise Rejected(413, f"the body has {declared} bytes; the limit is {limit}")

    async def read() -> bytes:
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise Rejected(413, f"the body exceeds the limit of {limit} bytes")
        return bytes(body)

    try:
        return await asyncio.wait_for(read(), timeout)
    except asyncio.TimeoutError:
        raise Rejected(408, f"the body did not arrive within {timeout:g} s") from None


def _render(result: Translation, scores: bool, nbest: int) -> Any:
    """The best translation as a string, or an object when scores or n-best hypotheses were asked for."""
    if not scores and nbest == 1:
        return result.text
    answer: dict[str, Any] = {"text": result.text}
    if scores:
        answer["score"] = _number(result.hypotheses[0].score) if result.hypotheses else None
    if nbest > 1:
        answer["nbest"] = [
            {"text": text, **({"score": _number(h.score)} if scores else {})}
            for text, h in zip(result.texts, result.hypotheses)
        ]
    return answer


def _attention(options: dict[str, Any]) -> AttentionAsk | None:
    """The attention a request's options ask for (None: none), or Rejected naming the option that is wrong."""
    asked = options.get("attention", False)
    if not isinstance(asked, bool):
        raise Rejected(400, f"option 'attention' must be true or false; got {asked!r}")
    layer, heads = options.get("attention_layer", "last"), options.get("attention_heads", "mean")
    if not asked:
        for key in ATTENTION_OPTIONS[1:]:
            if key in options:
                raise Rejected(400, f'option {key!r} goes with "attention": true')
        return None
    number = isinstance(layer, int) and not isinstance(layer, bool) and layer >= 1
    if not number and layer not in ("last", "all"):
        raise Rejected(400, f"option 'attention_layer' must be last, all or a layer number from 1; got {layer!r}")
    if heads not in HEAD_CHOICES:
        raise Rejected(400, f"option 'attention_heads' must be {' or '.join(HEAD_CHOICES)}; got {heads!r}")
    return AttentionAsk(layer, heads)


def _with(answer: Any, key: str, value: Any) -> dict[str, Any]:
    """A rendered translation (a string, or an object) as an object with one more field."""
    return {**({"text": answer} if isinstance(answer, str) else answer), key: value}


def _maps(maps: list[AttentionMap | None]) -> list[dict[str, Any]]:
    """One translation's hypotheses' attention, best first (none for an empty line), as JSON.

    weights[layer][head][target][source], with the subwords, the names of the layers and heads shown,
    and the alignments `seq2seq translate --alignment` writes for the same layers.
    """
    return [
        {
            "source": m.source,
            "target": m.target,
            "layers": m.layers,
            "heads": m.heads,
            "weights": m.weights.double().round(decimals=DECIMALS).tolist(),
            **{k: v for k, v in alignment_fields(m).items() if k != "source_pieces"},
        }
        for m in maps
        if m is not None
    ]


def _static_file(name: str) -> Handler:
    """A route answering with one of the explorer's files, read now, once."""
    content = (resources.files("seq2seq.serve") / "static" / name).read_bytes()
    media = MEDIA[name.rsplit(".", 1)[1]]

    async def serve_file(request: Request) -> Response:
        return Response(content, media_type=media, headers={"cache-control": "no-cache"})

    return serve_file


def _number(x: float) -> float | None:
    """JSON has no infinity or NaN."""
    return x if math.isfinite(x) else None


def _guarded(handler: Handler) -> Handler:
    """Rejected becomes its 4xx/503; any other exception a 500 with an id that is also logged with its traceback."""

    async def guarded(request: Request) -> Response:
        try:
            return await handler(request)
        except Rejected as e:
            close = {"connection": "close"} if e.status == 408 else None  # the rest of its body may still come
            message = str(e).encode("utf-8", "backslashreplace").decode("utf-8")  # a request's text quoted in it
            return JSONResponse({"error": message}, status_code=e.status, headers=close)
        except ClientDisconnect:  # nobody is left to answer: one line, not an internal error
            log.info("client disconnected during %s %s", request.method, request.url.path)
            return Response(status_code=400)
        except Exception:
            error_id = uuid.uuid4().hex[:12]
            log.exception("internal error %s on %s %s", error_id, request.method, request.url.path)
            return JSONResponse({"error": "internal error", "id": error_id}, status_code=500)

    return guarded


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    return JSONResponse({"error": exc.detail}, status_code=exc.status_code, headers=exc.headers)
