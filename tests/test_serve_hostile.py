"""`seq2seq serve` under hostile input, both engines: one request never fails another,
bad values are a 4xx and never a traceback, stalled and vanishing clients cost one line.

The real server runs in a subprocess (the `Server` of test_serve.py); the batch retry
path is also driven in-process with an engine that fails on one line.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from conftest import WORDS
from test_serve import RecordingEngine, Server, _serve_fails, asgi_post

from seq2seq.cli import main
from seq2seq.config import DecodeConfig
from seq2seq.decoding.translate import Translation
from seq2seq.errors import DataError

pytest.importorskip("starlette", reason="seq2seq serve needs the serve extra: pip install -e '.[serve]'")
pytest.importorskip("uvicorn", reason="seq2seq serve needs the serve extra: pip install -e '.[serve]'")

from seq2seq.serve.app import create_app  # noqa: E402  (after the skip)
from seq2seq.serve.batcher import Batcher  # noqa: E402
from seq2seq.serve.options import ServeOptions  # noqa: E402

ENGINES = ["torch", "ctranslate2"]
OPTIONS = ["--max-chars", "2000", "--max-beam", "8", "--batch-wait-ms", "300", "--read-timeout", "1"]
LONG_PREFIX = " ".join(WORDS[i % len(WORDS)] for i in range(200))  # 200 words: past the tiny model's 127


@pytest.fixture(scope="module", params=ENGINES)
def server(trained_run: Path, request: pytest.FixtureRequest) -> Iterator[Server]:
    running = Server(trained_run / "checkpoint_best.pt", "--engine", request.param, *OPTIONS)
    yield running
    assert running.stop() == 143, running.lines  # SIGTERM's code, after the drain


def test_a_bad_prefix_fails_only_its_own_request(server: Server) -> None:
    good = [["red cat", "blue dog sun"], ["green bird"], ["moon tree fish"]]
    alone = [server.post({"text": lines})[1]["translations"] for lines in good]  # the answers without company
    bad = {"text": ["red cat"], "prefix": [LONG_PREFIX]}
    batches = server.get("/health")[1]["batches"]
    with ThreadPoolExecutor(len(good) + 1) as pool:  # within --batch-wait-ms: one batch if nothing is refused
        answers = list(pool.map(server.post, [bad, *({"text": lines} for lines in good)]))
    (status, body), *rest = answers
    assert status == 400 and "prefix[0] has" in body["error"] and "the model allows 127" in body["error"]
    assert rest == [(200, {"translations": translations}) for translations in alone]
    assert server.get("/health")[1]["batches"] - batches <= len(good)
    assert not any("Traceback" in line or "internal error" in line for line in server.lines)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"strategy": "sample", "temperature": 1e-300}, "decode.temperature must be in [1e-06, 1e+06]"),
        ({"strategy": "sample", "temperature": 1e308}, "decode.temperature must be in [1e-06, 1e+06]"),
        ({"length_penalty": 1e308}, "decode.length_penalty must be in [-5, 5]"),
        ({"length_penalty": -1e308}, "decode.length_penalty must be in [-5, 5]"),
        ({"max_len_a": 1e308}, "decode.max_len_a must be in [0, 65536]"),
        ({"max_len_b": 2**62}, "decode.max_len_b must be at most 65536"),
        ({"top_k": 2**62}, "decode.top_k must be at most 16777216"),
        ({"no_repeat_ngram": 2**62}, "decode.no_repeat_ngram must be at most 65536"),
        ({"nbest": 2**62, "strategy": "sample"}, "decode.nbest must be at most 1024"),
        ({"seed": 2**64}, "decode.seed"),
        ({"beam_size": 10**4000}, "decode.beam_size is out of range"),
        ({"strategy": "sample", "temperature": "0.5"}, "option 'temperature' must be a number; got '0.5'"),
        ({"length_penalty": "1_0"}, "option 'length_penalty' must be a number; got '1_0'"),
    ],
)
def test_bad_values_get_a_4xx_without_a_traceback(server: Server, options: dict[str, Any], message: str) -> None:
    status, body = server.post({"text": ["red cat"], "options": options})
    assert status == 400 and message in body["error"], body
    assert not any("Traceback" in line or "internal error" in line for line in server.lines)


@pytest.mark.parametrize(
    "options",
    [
        {"strategy": "sample", "temperature": 1e-6, "top_k": 2**24},
        {"strategy": "sample", "temperature": 1e6, "no_repeat_ngram": 65536},
        {"length_penalty": 5.0, "max_len_a": 65536.0, "max_len_b": 65536},
        {"length_penalty": -5.0, "nbest": 2, "scores": True},
    ],
)
def test_values_at_the_bounds_are_answered(server: Server, options: dict[str, Any]) -> None:
    status, body = server.post({"text": ["red cat", "blue dog sun"], "options": options})
    assert status == 200 and len(body["translations"]) == 2, (body, "\n".join(server.lines[-6:]))


@pytest.mark.parametrize(
    "override, message",
    [
        ("decode.temperature=1e-300", "decode.temperature must be in [1e-06, 1e+06]; got 1e-300"),
        ("decode.length_penalty=1e308", "decode.length_penalty must be in [-5, 5]; got 1e+308"),
    ],
)
def test_the_same_bounds_hold_for_translate(
    trained_run: Path, override: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    checkpoint = str(trained_run / "checkpoint_best.pt")
    assert main(["translate", "-c", checkpoint, "--threads", "1", "decode.strategy=sample", override]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and message in err[0], err


@pytest.mark.parametrize(
    "body, message",
    [
        (b'{"text": ["red cat"], "model": [1]}', 'unknown "model" [1]'),
        (b'{"text": ["red cat"], "model": {"a": 1}}', "unknown \"model\" {'a': 1}"),
        (b'{"text": ["red \\ud800 cat"]}', "text[0] is not valid Unicode: a lone surrogate at character 4"),
        (b'{"text": ["red cat"], "prefix": ["a\\udfff"]}', "prefix[0] is not valid Unicode"),
        (b'{"text": ["red cat"], "tgt_lang": "\\ud800"}', '"tgt_lang" is not valid Unicode'),
    ],
)
def test_fields_json_can_spell_but_no_model_can_take_get_a_400(server: Server, body: bytes, message: str) -> None:
    """A model name that is a list or an object, and a lone UTF-16 surrogate, which JSON's escapes allow and
    the tokenizer and UTF-8 refuse: each was a 500."""
    status, answer = server.post(body)
    assert status == 400 and message in answer["error"], answer
    assert server.post({"text": ["red cat"]})[0] == 200
    assert not any("Traceback" in line or "internal error" in line for line in server.lines)


def test_a_5000_digit_integer_is_a_400(server: Server) -> None:
    raw = b'{"text": ["red cat"], "options": {"beam_size": ' + b"9" * 5000 + b"}}"
    assert server.post(raw) == (400, {"error": 'the body must be JSON, e.g. {"text": ["a sentence"]}'})


def test_a_stalled_body_is_cut_off_after_the_timeout(server: Server) -> None:
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        started = time.monotonic()
        sock.sendall(_head(100) + b'{"text": ')  # 9 of the 100 bytes promised, then nothing
        answer = _read_all(sock)
        waited = time.monotonic() - started
    assert answer.startswith(b"HTTP/1.1 408 "), answer
    assert b'"error":"the body did not arrive within 1 s"' in answer
    assert 0.9 <= waited < 4  # answered and closed at once, not after uvicorn's 5 s keep-alive
    assert server.get("/health")[0] == 200  # the server still answers


@pytest.mark.parametrize("sent", [b"", b"POST /translate HTTP/1.1\r\nHost: x\r\n"])
def test_a_stalled_head_is_disconnected_after_the_timeout(server: Server, sent: bytes) -> None:
    """Nothing at all, or half the headers: uvicorn alone would keep such a connection forever."""
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        started = time.monotonic()
        sock.sendall(sent)
        time.sleep(0.5)
        sock.sendall(b"X-Slow: 1\r\n" if sent else b"")  # a byte now and then does not reset the deadline
        assert _read_all(sock) == b""  # closed, nothing answered
        waited = time.monotonic() - started
    assert 0.9 <= waited < 4
    server.wait_for(r"closed a connection that sent no request within 1 s", 10)


def test_a_client_gone_mid_body_is_one_log_line(server: Server) -> None:
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(_head(100) + b'{"text": ')
        time.sleep(0.2)  # the body is being read
    server.wait_for(r"client disconnected during POST /translate", 10)
    assert server.get("/health")[0] == 200
    assert sum("client disconnected" in line for line in server.lines) == 1
    assert not any("Traceback" in line or "internal error" in line for line in server.lines)


@pytest.mark.parametrize("value", ["0", "nan", "3601"])
def test_a_bad_read_timeout_is_a_config_error(value: str) -> None:
    code, err = _serve_fails("-c", "model.pt", "--read-timeout", value)
    assert code == 2 and err == ["seq2seq: usage error: --read-timeout must be in (0, 3600]"]


def _head(length: int) -> bytes:
    return f"POST /translate HTTP/1.1\r\nHost: x\r\nContent-Length: {length}\r\n\r\n".encode()


def _read_all(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


# The retry path in-process: an engine that fails any batch holding the line "boom".


class FailingEngine(RecordingEngine):
    def translate(
        self, lines: list[str], settings: DecodeConfig, prefixes: list[str] | None = None
    ) -> list[Translation]:
        if "boom" in lines:
            raise DataError("line 'boom' cannot be translated") if "user" in lines else RuntimeError("the engine broke")
        return super().translate(lines, settings, prefixes)


@pytest.mark.parametrize("kind, status", [("user", 400), ("internal", 500)])
def test_a_failing_batch_is_decoded_again_one_request_at_a_time(
    kind: str, status: int, caplog: pytest.LogCaptureFixture
) -> None:
    engine = FailingEngine()
    batcher = Batcher(engine, max_tokens=100, max_wait=0.5, max_queue=10)
    app = create_app(batcher, ServeOptions())
    bodies = [b'{"text": ["a b"]}', b'{"text": ["boom", "%s"]}' % kind.encode(), b'{"text": ["c d"]}']

    async def run() -> list[tuple[int, bytes]]:
        batcher.start()
        try:
            return await asyncio.gather(*(asgi_post(app, "/translate", body) for body in bodies))
        finally:
            await batcher.stop()

    with caplog.at_level(logging.INFO):
        answers = asyncio.run(run())
    assert answers[0] == (200, b'{"translations":["a b|5"]}') and answers[2] == (200, b'{"translations":["c d|5"]}')
    assert answers[1][0] == status
    assert [lines for lines, _ in engine.calls] == [["a b"], ["c d"]]  # the failed batch of 4 lines is not there
    errors = [r for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == (status == 500)  # a user's error is no internal error
