"""The HTTP routes: POST /translate, GET /health, GET /info.

Every answer is JSON. A request the server will not take (malformed, over a
limit, an unknown or invalid option) gets a 4xx naming the problem; anything
else that fails gets a 500 with an error id that is also in the log, and never
a stack trace. No route reads or writes a file.
"""

from __future__ import annotations

import asyncio
import contextlib
import difflib
import json
import logging
import math
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from seq2seq import __version__
from seq2seq.config import DecodeConfig
from seq2seq.errors import ConfigError, UserError
from seq2seq.serve.batcher import Batcher, Busy
from seq2seq.serve.options import ServeOptions
from seq2seq.translate import Translation

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
OPTIONS = (*DECODE_OPTIONS, "scores")
FIELDS = ("text", "prefix", "tgt_lang", "options")


class Rejected(Exception):
    """A request the server will not take: answered with `status` and the message, as JSON."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class TranslateRequest:
    lines: list[str]
    settings: DecodeConfig
    scores: bool  # add each hypothesis' score to the answer
    prefixes: list[str] | None = None  # target prefixes, one per line ("" for none)
    tgt_lang: str = ""  # the target language of every line, for a model of several ("": none)


Handler = Callable[[Request], Awaitable[Response]]


def create_app(batcher: Batcher, options: ServeOptions) -> Starlette:
    """The application; the batcher runs from startup to shutdown (after the last in-flight request)."""
    service = _Service(batcher, options)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        batcher.start()
        yield
        await batcher.stop()

    return Starlette(
        routes=[
            Route("/translate", _guarded(service.translate), methods=["POST"]),
            Route("/health", _guarded(service.health), methods=["GET"]),
            Route("/info", _guarded(service.info), methods=["GET"]),
        ],
        exception_handlers={HTTPException: _http_error},  # 404, 405: JSON like every other answer
        lifespan=lifespan,
    )


class _Service:
    def __init__(self, batcher: Batcher, options: ServeOptions) -> None:
        self.batcher = batcher
        self.engine = batcher.engine
        self.options = options

    async def translate(self, request: Request) -> Response:
        body = await _read_body(request, self.options.max_body, self.options.read_timeout)
        parsed = self.parse(body)
        tokens = sum(self.engine.source_lengths(parsed.lines))
        try:
            if parsed.prefixes is not None:
                self.engine.check_prefixes(parsed.prefixes)  # before batching: never another request's failure
            langs = [parsed.tgt_lang] * len(parsed.lines)
            self.engine.check_tgt_langs(parsed.lines, langs)
            results = await self.batcher.translate(
                parsed.lines, parsed.settings, tokens, parsed.prefixes, langs if parsed.tgt_lang else None
            )
        except Busy as e:
            raise Rejected(503, f"server busy: {e}") from None
        except UserError as e:  # this request's own input, found by the engine
            raise Rejected(400, str(e)) from None
        nbest = parsed.settings.nbest
        return JSONResponse({"translations": [_render(r, parsed.scores, nbest) for r in results]})

    async def health(self, request: Request) -> Response:
        b = self.batcher
        return JSONResponse({"status": "ok", "in_flight": b.in_flight, "waiting": b.waiting, "batches": b.batches})

    async def info(self, request: Request) -> Response:
        o = self.options
        return JSONResponse(
            {
                "version": __version__,
                "model": self.engine.describe(),
                "options": list(OPTIONS),
                "limits": {
                    "max_lines": o.max_lines,
                    "max_chars": o.max_chars,
                    "max_body": o.max_body,
                    "read_timeout_s": o.read_timeout,
                },
                "batching": {"max_tokens": self.batcher.max_tokens, "max_wait_ms": self.batcher.max_wait * 1000},
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
        settings, scores = self._options(raw.get("options", {}))
        return TranslateRequest(lines, settings, scores, prefixes, lang)

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
        return text

    def _options(self, raw: Any) -> tuple[DecodeConfig, bool]:
        if not isinstance(raw, dict):
            raise Rejected(400, '"options" must be a JSON object')
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
        try:
            settings = self.engine.settings({k: v for k, v in raw.items() if k != "scores"})
        except ConfigError as e:
            raise Rejected(400, str(e)) from None
        if settings.beam_size > self.options.max_beam:
            raise Rejected(
                400, f"option 'beam_size' is {settings.beam_size}; this server allows up to {self.options.max_beam}"
            )
        return settings, scores


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
            return JSONResponse({"error": str(e)}, status_code=e.status, headers=close)
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
