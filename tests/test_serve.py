"""`seq2seq serve`: the real server in a subprocess on a free loopback port, and its batcher in-process.

Answers must equal `seq2seq translate` on the same lines (search is batch-invariant,
so batching changes speed, never output). Load comes from one "heavy" request: many
lines forced to ~99 tokens each, which keeps the decoder busy for a second or more.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from conftest import single_thread_env

from seq2seq.cli import main
from seq2seq.config import DecodeConfig, replace_checked
from seq2seq.decoding.translate import Translation, Translator

pytest.importorskip("starlette", reason="seq2seq serve needs the serve extra: pip install -e '.[serve]'")
pytest.importorskip("uvicorn", reason="seq2seq serve needs the serve extra: pip install -e '.[serve]'")

from seq2seq.serve.app import create_app  # noqa: E402  (after the skip)
from seq2seq.serve.batcher import Batcher  # noqa: E402
from seq2seq.serve.options import ServeOptions  # noqa: E402

LIMITS = ["--max-lines", "64", "--max-chars", "100", "--max-body", "20000", "--max-beam", "8"]
HEAVY = {"min_len": 90, "max_len_a": 0, "max_len_b": 99, "beam_size": 4}  # every hypothesis ~99 tokens
STARTUP = 120.0  # seconds; loading torch on two busy cores can be slow


class Server:
    """`seq2seq serve` in a subprocess, its stderr collected line by line."""

    def __init__(self, checkpoint: Path, *args: str) -> None:
        command = [sys.executable, "-m", "seq2seq", "serve", "-c", str(checkpoint), "--port", "0", "--threads", "1"]
        self.process = subprocess.Popen(
            [*command, *args], stderr=subprocess.PIPE, text=True, env=single_thread_env(), encoding="utf-8"
        )
        self.lines: list[str] = []
        threading.Thread(target=self._collect, daemon=True).start()
        found = self.wait_for(r"serving on http://(127\.0\.0\.1:\d+)", STARTUP)
        self.url = f"http://{found.group(1)}"

    def _collect(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self.lines.append(line.rstrip("\n"))

    def wait_for(self, pattern: str, timeout: float) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if match := re.search(pattern, line):
                    return match
            if self.process.poll() is not None:
                time.sleep(0.2)  # the reader thread may still hold the last lines
                if found := [m for line in self.lines if (m := re.search(pattern, line))]:
                    return found[0]
                break
            time.sleep(0.05)
        raise AssertionError(f"no {pattern!r} in the server's stderr: {self.lines}")

    def post(self, payload: Any, path: str = "/translate", timeout: float = 60) -> tuple[int, Any]:
        data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        return self.request(urllib.request.Request(self.url + path, data, method="POST"), timeout)

    def get(self, path: str, timeout: float = 60) -> tuple[int, Any]:
        return self.request(urllib.request.Request(self.url + path), timeout)

    @staticmethod
    def request(request: urllib.request.Request, timeout: float) -> tuple[int, Any]:
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                return response.status, json.load(response)
        except urllib.error.HTTPError as e:
            return e.code, json.load(e)

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=60)


@pytest.fixture(scope="module")
def checkpoint(trained_run: Path) -> Path:
    return trained_run / "checkpoint_best.pt"


@pytest.fixture(scope="module")
def server(checkpoint: Path) -> Iterator[Server]:
    running = Server(checkpoint, *LIMITS)
    yield running
    assert running.stop() == 143, running.lines


def test_answers_equal_translate(server: Server, checkpoint: Path, corpus: Path, tmp_path: Path) -> None:
    """One request with many lines, and many one-line requests at once: both as `seq2seq translate` writes."""
    lines = (corpus / "test.src").read_text(encoding="utf-8").splitlines()[:40] + ["", "  red   cat  "]
    source, output = tmp_path / "in.txt", tmp_path / "out.txt"
    source.write_text("\n".join(lines) + "\n", encoding="utf-8")
    for options, overrides in (({}, []), ({"strategy": "greedy"}, ["decode.strategy=greedy"])):
        assert (
            main(
                ["translate", "-c", str(checkpoint), "--threads", "1", "-i", str(source), "-o", str(output)] + overrides
            )
            == 0
        )
        expected = output.read_text(encoding="utf-8").splitlines()
        assert server.post({"text": lines, "options": options}) == (200, {"translations": expected})
        requests = [{"text": [line], "options": options} for line in lines]
        with ThreadPoolExecutor(16) as pool:
            answers = list(pool.map(server.post, requests))
        assert answers == [(200, {"translations": [e]}) for e in expected]


def test_scores_and_nbest(server: Server, checkpoint: Path) -> None:
    status, body = server.post({"text": ["red cat dog", ""], "options": {"nbest": 2, "scores": True}})
    assert status == 200
    best, empty = body["translations"]
    [expected] = Translator.from_checkpoint(checkpoint, nbest=2).translate_full(["red cat dog"])
    assert [h["text"] for h in best["nbest"]] == expected.texts and best["text"] == expected.text
    assert [h["score"] for h in best["nbest"]] == pytest.approx([h.score for h in expected.hypotheses], abs=1e-4)
    assert best["score"] == best["nbest"][0]["score"] >= best["nbest"][1]["score"]
    assert empty == {"text": "", "score": None, "nbest": []}
    status, body = server.post({"text": ["red cat"], "options": {"scores": True}})
    [alone] = body["translations"]
    assert status == 200 and alone["text"] == Translator.from_checkpoint(checkpoint).translate(["red cat"])[0]
    assert "nbest" not in alone and isinstance(alone["score"], float)


def test_prefixes_start_the_translations_as_with_translate(server: Server, checkpoint: Path, tmp_path: Path) -> None:
    lines, prefixes = ["red cat dog", "sun moon tree", "", "car bird"], ["sun", "", "fish", "bird bird"]
    (tmp_path / "in.txt").write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    (tmp_path / "prefix.txt").write_text("".join(p + "\n" for p in prefixes), encoding="utf-8")
    argv = ["translate", "-c", str(checkpoint), "--threads", "1", "-i", str(tmp_path / "in.txt")]
    assert main([*argv, "--prefix-file", str(tmp_path / "prefix.txt"), "-o", str(tmp_path / "out.txt")]) == 0
    expected = (tmp_path / "out.txt").read_text(encoding="utf-8").splitlines()
    assert expected[0].startswith("sun ") and expected[3].startswith("bird bird")
    assert server.post({"text": lines, "prefix": prefixes}) == (200, {"translations": expected})
    with ThreadPoolExecutor(4) as pool:  # with and without prefixes, perhaps in one batch
        requests = [{"text": [line], "prefix": [p]} if p else {"text": [line]} for line, p in zip(lines, prefixes)]
        assert list(pool.map(server.post, requests)) == [(200, {"translations": [e]}) for e in expected]


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        (b"{not json", 400, "must be JSON"),
        (b"\xff\xfe", 400, "must be JSON"),
        ([1, 2], 400, "JSON object"),
        ({"text": "red cat"}, 400, "list of strings"),
        ({"text": ["red", 3]}, 400, "list of strings"),
        ({"text": ["red"], "lines": 1}, 400, "unknown field 'lines'"),
        ({"text": ["red"], "options": []}, 400, "must be a JSON object"),
        ({"text": ["red"], "options": {"beam": 2}}, 400, "unknown option 'beam' (did you mean 'beam_size'?)"),
        ({"text": ["red"], "options": {"max_tokens": 9}}, 400, "'max_tokens' is the server's to set"),
        ({"text": ["red"], "options": {"beam_size": "2"}}, 400, "decode.beam_size must be int; got '2'"),
        ({"text": ["red"], "options": {"beam_size": 2.5}}, 400, "decode.beam_size must be int"),
        ({"text": ["red"], "options": {"beam_size": 0}}, 400, "decode.beam_size must be at least 1"),
        ({"text": ["red"], "options": {"nbest": 3, "beam_size": 2}}, 400, "decode.nbest (3) must not exceed"),
        ({"text": ["red"], "options": {"strategy": "fast"}}, 400, "decode.strategy must be one of"),
        ({"text": ["red"], "options": {"scores": "yes"}}, 400, "'scores' must be true or false"),
        ({"text": ["red"], "options": {"beam_size": 9}}, 400, "'beam_size' is 9; this server allows up to 8"),
        ({"text": ["red cat"] * 65}, 413, "65 lines in one request; the limit is 64"),
        ({"text": ["red", "a" * 101]}, 413, "text[1] has 101 characters; the limit is 100"),
        ({"text": ["red\ncat"]}, 400, "text[0] contains a line break"),
        ({"text": ["red"], "prefix": "cat"}, 400, '"prefix" must be a list of strings'),
        ({"text": ["red"], "prefix": ["a", "b"]}, 400, '"prefix" has 2 items for 1 lines of "text"'),
        ({"text": ["red"], "prefix": ["a" * 101]}, 413, "prefix[0] has 101 characters; the limit is 100"),
        (b'{"text": ["red"]' + b" " * 20000 + b"}", 413, "the limit is 20000"),
    ],
)
def test_bad_requests_get_a_4xx_naming_the_problem(server: Server, body: Any, status: int, message: str) -> None:
    code, answer = server.post(body)
    assert code == status and message in answer["error"], answer


def test_unknown_routes_and_methods_answer_json(server: Server) -> None:
    assert server.get("/nowhere") == (404, {"error": "Not Found"})
    assert server.get("/translate") == (405, {"error": "Method Not Allowed"})
    assert server.post({}, "/health")[0] == 405


def test_info(server: Server) -> None:
    status, info = server.get("/info")
    assert status == 200
    assert info["model"]["source_language"] == "src" and info["model"]["target_language"] == "tgt"
    assert info["model"]["parameters"] > 0 and info["model"]["decode"]["beam_size"] == 2
    assert "beam_size" in info["options"] and "max_tokens" not in info["options"]
    assert info["limits"]["max_lines"] == 64


def test_health_answers_during_load_and_waiting_requests_share_batches(server: Server) -> None:
    """While the decoder works on a heavy request, /health answers and the one-line requests sent meanwhile
    wait for it, then go through the engine together: fewer batches than requests."""
    with ThreadPoolExecutor(17) as pool:
        heavy = pool.submit(server.post, {"text": ["red cat dog"] * 48, "options": HEAVY})
        health = _health_while(server, lambda h: h["in_flight"] >= 1 and h["waiting"] == 0)
        before = health["batches"]
        singles = [pool.submit(server.post, {"text": [f"red {w} dog"]}) for w in ("cat", "sun", "moon", "tree") * 4]
        _health_while(server, lambda h: h["waiting"] >= 16 or not heavy.running())
        assert heavy.result()[0] == 200
        assert [s.result()[0] for s in singles] == [200] * 16
    status, after = server.get("/health")
    assert status == 200 and after["in_flight"] == 0
    assert after["batches"] - before < 1 + 16  # the heavy one, then the singles in fewer than 16 batches


def _health_while(server: Server, condition: Any, timeout: float = 60) -> dict[str, Any]:
    """Poll /health until `condition` holds on its answer; every poll must succeed."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status, health = server.get("/health", timeout=10)
        assert status == 200 and health["status"] == "ok"
        if condition(health):
            return health
        time.sleep(0.02)
    raise AssertionError("condition not reached")


def _heavy_requests(pool: ThreadPoolExecutor, server: Server, beams: range) -> list[Future[tuple[int, Any]]]:
    """One heavy request per beam size (settings that differ: a batch each), all admitted when this returns."""
    heavy = [pool.submit(server.post, {"text": ["red cat dog"] * 64, "options": {**HEAVY, "beam_size": beam}})
             for beam in beams]  # fmt: skip
    _health_while(server, lambda h: h["in_flight"] == len(beams))
    return heavy


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=lambda s: s.name)
def test_a_signal_finishes_the_requests_in_flight_then_exits_with_its_code(
    checkpoint: Path, sig: signal.Signals
) -> None:
    """The drain: no new connections, each request admitted answered in full, then one line and 143 (130)."""
    running = Server(checkpoint, "--shutdown-timeout", "600")
    try:
        with ThreadPoolExecutor(3) as pool:
            heavy = _heavy_requests(pool, running, range(2, 5))
            running.process.send_signal(sig)
            running.wait_for(f"{sig.name}: no new connections; finishing 3 request", 30)
            _wait_until_refused(running.url)
            answers = [request.result() for request in heavy]
        for status, body in answers:
            assert status == 200 and len(body["translations"]) == 64
            assert all(t.strip() for t in body["translations"])
        assert running.process.wait(timeout=60) == 128 + sig
        assert running.lines[-1] == f"seq2seq: stopped by {sig.name}; all requests answered"
        assert not any("Traceback" in line for line in running.lines), running.lines
    finally:
        running.process.kill()


def test_requests_unfinished_at_the_drain_limit_get_a_503_and_the_server_exits(checkpoint: Path) -> None:
    """--shutdown-timeout 0: what is still waiting or decoding when SIGTERM arrives is answered 503 (its
    decoding stops between two search steps), never a 500; then one line and 143."""
    running = Server(checkpoint, "--shutdown-timeout", "0")
    try:
        with ThreadPoolExecutor(3) as pool:
            heavy = _heavy_requests(pool, running, range(2, 5))
            running.process.send_signal(signal.SIGTERM)
            answers = [request.result() for request in heavy]
        assert running.process.wait(timeout=60) == 143
    finally:
        running.process.kill()
    statuses = [status for status, _ in answers]
    assert set(statuses) <= {200, 503} and 503 in statuses, answers
    assert all("the server is stopping" in body["error"] for status, body in answers if status == 503), answers
    refused = statuses.count(503)
    assert running.lines[-1] == (
        f"seq2seq: stopped by SIGTERM; {refused} request(s) unfinished at --shutdown-timeout (0 s) answered 503"
    )
    assert not any("Traceback" in line for line in running.lines), running.lines


def test_a_second_signal_ends_the_drain_at_once(checkpoint: Path) -> None:
    """Past the grace period a second Ctrl-C answers the requests still in flight 503 now, however long the
    drain limit: one line and 130, no traceback."""
    running = Server(checkpoint, "--shutdown-timeout", "600")
    try:
        with ThreadPoolExecutor(6) as pool:
            heavy = _heavy_requests(pool, running, range(2, 8))
            running.process.send_signal(signal.SIGINT)
            running.wait_for("SIGINT: no new connections", 30)
            time.sleep(2.5)  # more than the grace period, in which a second signal is the same request
            running.process.send_signal(signal.SIGINT)
            answers = [request.result() for request in heavy]
        assert running.process.wait(timeout=60) == 130
    finally:
        running.process.kill()
    assert {status for status, _ in answers} <= {200, 503}, answers
    assert running.lines[-1].startswith("seq2seq: stopped by SIGINT; "), running.lines
    assert not any("Traceback" in line for line in running.lines), running.lines


def _wait_until_refused(url: str, timeout: float = 30) -> None:
    host, port = url.removeprefix("http://").split(":")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection((host, int(port)), timeout=5).close()
        except ConnectionRefusedError:
            return
        time.sleep(0.05)
    raise AssertionError("the server still accepts connections")


def _serve_fails(*args: str) -> tuple[int, list[str]]:
    command = [sys.executable, "-m", "seq2seq", "serve", *args]
    done = subprocess.run(command, capture_output=True, text=True, env=single_thread_env(), timeout=120)
    return done.returncode, done.stderr.strip().splitlines()


def test_busy_port_is_one_line_before_loading(checkpoint: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, err = _serve_fails("-c", str(checkpoint), "--port", str(port))
    assert code == 1 and len(err) == 1, err
    assert err[0].startswith(f"seq2seq: error: cannot listen on 127.0.0.1:{port}: Address already in use")


def test_unloadable_checkpoint_is_one_line_and_nothing_listens(tmp_path: Path) -> None:
    bad = tmp_path / "model.pt"
    bad.write_bytes(b"not a checkpoint")
    with socket.socket() as probe:  # a port that was free a moment ago
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    code, err = _serve_fails("-c", str(bad), "--port", str(port))
    assert code == 1 and len(err) == 1 and err[0].startswith("seq2seq: error: "), err
    assert str(bad) in err[0]


def test_bad_server_option_is_a_config_error() -> None:
    code, err = _serve_fails("-c", "model.pt", "--max-lines", "0")
    assert code == 2 and err == ["seq2seq: usage error: --max-lines must be at least 1"]


# The batcher and the error path, in-process with engines that record or fail.


@dataclass
class RecordingEngine:
    """Translates a line to "line|beam_size" and records each call's lines and settings."""

    calls: list[tuple[list[str], DecodeConfig]] = field(default_factory=list)
    prefixes: list[list[str] | None] = field(default_factory=list)  # each call's prefixes
    fail: bool = False

    @property
    def defaults(self) -> DecodeConfig:
        return DecodeConfig()

    def settings(self, changes: dict[str, Any]) -> DecodeConfig:
        return replace_checked(DecodeConfig(), changes, "options", "decode.")

    def source_lengths(self, lines: list[str]) -> list[int]:
        return [len(line.split()) + 1 for line in lines]

    def check_prefixes(self, prefixes: list[str]) -> None:
        pass

    def check_tgt_langs(self, lines: list[str], tgt_langs: list[str]) -> None:
        pass

    def translate(
        self, lines: list[str], settings: DecodeConfig, prefixes: list[str] | None = None
    ) -> list[Translation]:
        if self.fail:
            raise RuntimeError("the engine broke")
        self.calls.append((list(lines), settings))
        self.prefixes.append(prefixes)
        return [Translation(line, [], [f"{line}|{settings.beam_size}"], [[]]) for line in lines]

    def describe(self) -> dict[str, Any]:
        return {}


def test_batcher_groups_by_settings_within_the_budget_and_answers_each_caller() -> None:
    engine = RecordingEngine()
    beams = [1, 2, 1, 2, 1, 1]
    requests = [[f"r{i} a b", f"r{i} c d"] for i in range(len(beams))]  # 2 lines of 4 tokens: 8 per request

    async def run() -> list[list[Translation]]:
        batcher = Batcher(engine, max_tokens=20, max_wait=0.5, max_queue=100)
        batcher.start()
        try:
            return await asyncio.gather(
                *(batcher.translate(r, engine.settings({"beam_size": b}), 8) for r, b in zip(requests, beams))
            )
        finally:
            await batcher.stop()

    answers = asyncio.run(run())
    assert [[t.text for t in a] for a in answers] == [[f"{x}|{b}" for x in r] for r, b in zip(requests, beams)]
    assert [([line[:2] for line in lines][::2], s.beam_size) for lines, s in engine.calls] == [
        (["r0", "r2"], 1),  # the oldest, and the next with its settings (a third would pass 20 tokens)
        (["r1", "r3"], 2),
        (["r4", "r5"], 1),
    ]


def test_requests_with_and_without_prefixes_share_a_batch() -> None:
    engine = RecordingEngine()

    async def run() -> None:
        batcher = Batcher(engine, max_tokens=100, max_wait=0.5, max_queue=100)
        batcher.start()
        try:
            settings = engine.settings({})
            await asyncio.gather(
                batcher.translate(["a b", "c d"], settings, 6),
                batcher.translate(["e f"], settings, 3, ["x"]),
                batcher.translate(["g h"], settings, 3),
            )
            await batcher.translate(["i j"], settings, 3)
        finally:
            await batcher.stop()

    asyncio.run(run())
    assert [lines for lines, _ in engine.calls] == [["a b", "c d", "e f", "g h"], ["i j"]]
    assert engine.prefixes == [["", "", "x", ""], None]  # an engine without prefixes is never given any


def test_internal_error_is_a_500_with_an_id_that_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    batcher = Batcher(RecordingEngine(fail=True), max_tokens=100, max_wait=0, max_queue=10)
    app = create_app(batcher, ServeOptions())

    async def run() -> tuple[int, bytes]:
        batcher.start()
        try:
            return await asgi_post(app, "/translate", b'{"text": ["red cat"]}')
        finally:
            await batcher.stop()

    with caplog.at_level(logging.ERROR):
        status, raw = asyncio.run(run())
    body = json.loads(raw)
    assert status == 500 and body == {"error": "internal error", "id": body["id"]}
    assert re.fullmatch(r"[0-9a-f]{12}", body["id"])
    logged = [r for r in caplog.records if body["id"] in r.getMessage()]
    assert logged and "the engine broke" in str(logged[0].exc_text)  # the traceback goes to the log only
    assert b"Traceback" not in raw and b"the engine broke" not in raw


async def asgi(app: Any, method: str, path: str, body: bytes = b"") -> tuple[int, dict[str, str], bytes]:
    """One request straight through the ASGI interface, as a server would make it: status, headers, body."""
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http"}
    scope |= {"path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "", "headers": []}
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await app(scope, receive, send)
    headers = {k.decode(): v.decode() for k, v in sent[0]["headers"]}
    return sent[0]["status"], headers, b"".join(m.get("body", b"") for m in sent[1:])


async def asgi_post(app: Any, path: str, body: bytes) -> tuple[int, bytes]:
    """A POST through `asgi`: its status and body."""
    status, _, raw = await asgi(app, "POST", path, body)
    return status, raw
