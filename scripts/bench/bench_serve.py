"""Serving throughput and latency: N concurrent HTTP clients, each sending one sentence per request.

Starts `seq2seq serve` on a free loopback port (or uses --url), then for each
client count (default 1, 8, 64) runs that many clients, each sending up to
--requests single-sentence requests one after another (a client waits for its
answer before it sends the next), for at most --seconds per level. Reports
sentences/s, p50/p99 latency and errors, and each level's throughput as a
ratio to one client's. The machine's speed drifts (it may be shared), so with
--rounds R the levels are interleaved R times and each ratio is the median of
the ratios within a round.

    .venv/bin/python scripts/bench/bench_serve.py -c runs/quickstart/checkpoint_best.pt \\
        --input data/multi30k/test_2016_flickr.de --threads 2 --rounds 2

Needs the serve extra (starlette, uvicorn, aiohttp): pip install -e '.[serve]'.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from seq2seq.errors import run_script

try:
    import aiohttp
except ModuleNotFoundError:
    sys.exit("bench_serve.py needs aiohttp: pip install -e '.[serve]'")

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = aiohttp.ClientTimeout(total=120)


@dataclass
class Level:
    clients: int
    seconds: float = 0.0
    latencies: list[float] = field(default_factory=list)  # of the answered requests, in seconds
    errors: list[str] = field(default_factory=list)

    @property
    def throughput(self) -> float:
        return len(self.latencies) / self.seconds if self.seconds else 0.0

    def percentile(self, q: float) -> float:
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def main() -> None:
    args = _args()
    sentences = [line.strip() for line in Path(args.input).read_text(encoding="utf-8").splitlines() if line.strip()]
    server = _Server(args) if args.checkpoint else None
    url = server.url if server else args.url.rstrip("/")
    try:
        asyncio.run(_warm_up(url, sentences))
        rounds = [[asyncio.run(_level(url, n, sentences, args)) for n in args.clients] for _ in range(args.rounds)]
    finally:
        if server:
            server.stop()
    _report(rounds, args)


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--checkpoint", "-c", help="start `seq2seq serve` with this checkpoint")
    target.add_argument("--url", help="an already running server, e.g. http://127.0.0.1:8080")
    p.add_argument("--input", "-i", required=True, help="sentences to send, one per line (cycled)")
    p.add_argument("--clients", type=int, nargs="+", default=[1, 8, 64], help="concurrent clients per level")
    p.add_argument("--requests", type=int, default=200, help="requests per client at most (default: 200)")
    p.add_argument("--seconds", type=float, default=30, help="time per level at most (default: 30)")
    p.add_argument("--rounds", type=int, default=1, help="times to run every level, interleaved")
    p.add_argument("--threads", type=int, default=0, help="the server's --threads (default: torch's choice)")
    p.add_argument("--options", default="{}", help="per-request options as JSON, e.g. '{\"beam_size\": 1}'")
    p.add_argument("--verbose", "-v", action="store_true", help="the server logs every batch")
    p.add_argument("server_args", nargs="*", help="more `seq2seq serve` arguments, e.g. decode.beam_size=4")
    return p.parse_args()


class _Server:
    """`seq2seq serve` in a subprocess on a free port."""

    def __init__(self, args: argparse.Namespace) -> None:
        command = [sys.executable, "-m", "seq2seq", *(["-v"] if args.verbose else []), "serve", "-c", args.checkpoint]
        command += ["--port", "0"]
        command += ["--threads", str(args.threads), *args.server_args]
        self.process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, cwd=ROOT)
        assert self.process.stderr is not None
        for line in self.process.stderr:
            print(line, end="", file=sys.stderr)
            if match := re.search(r"serving on (http://\S+)", line):
                self.url = match.group(1)
                break
        else:
            sys.exit(f"the server did not start (exit {self.process.wait()})")
        threading.Thread(target=self._echo, daemon=True).start()

    def _echo(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            print(line, end="", file=sys.stderr)

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=60)


async def _warm_up(url: str, sentences: list[str]) -> None:
    async with aiohttp.ClientSession(url, timeout=TIMEOUT) as session:
        for sentence in sentences[:8]:
            async with session.post("/translate", json={"text": [sentence]}) as response:
                response.raise_for_status()


async def _level(url: str, clients: int, sentences: list[str], args: argparse.Namespace) -> Level:
    """`clients` concurrent clients, each sending its requests one after another, until done or out of time."""
    level = Level(clients)
    options: dict[str, Any] = json.loads(args.options)
    connector = aiohttp.TCPConnector(limit=clients)
    async with aiohttp.ClientSession(url, connector=connector, timeout=TIMEOUT) as session:
        start = time.perf_counter()
        deadline = start + args.seconds

        async def one_client(k: int) -> None:
            for i in range(args.requests):
                if time.perf_counter() >= deadline:
                    return
                sentence = sentences[(k * args.requests + i) % len(sentences)]
                sent = time.perf_counter()
                try:
                    async with session.post("/translate", json={"text": [sentence], "options": options}) as response:
                        body = await response.text()
                    if response.status == 200 and len(json.loads(body)["translations"]) == 1:
                        level.latencies.append(time.perf_counter() - sent)
                    else:
                        level.errors.append(f"{response.status} {body[:200]}")
                except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                    level.errors.append(f"{type(e).__name__}: {e}")

        await asyncio.gather(*(one_client(k) for k in range(clients)))
        level.seconds = time.perf_counter() - start
    print(
        f"{clients} clients: {len(level.latencies)} sentences in {level.seconds:.1f} s, {level.throughput:.1f}/s, "
        f"{len(level.errors)} errors",
        file=sys.stderr,
    )
    return level


def _report(rounds: list[list[Level]], args: argparse.Namespace) -> None:
    base = f"x {args.clients[0]} client" + ("s" if args.clients[0] > 1 else "")
    print(f"| clients | sentences/s | {base} | p50 ms | p99 ms | requests | errors |")
    print("|---|---|---|---|---|---|---|")
    for j, clients in enumerate(args.clients):
        levels = [r[j] for r in rounds]
        ratios = [r[j].throughput / r[0].throughput for r in rounds if r[0].throughput]
        merged = Level(clients, sum(x.seconds for x in levels), [t for x in levels for t in x.latencies])
        errors = [e for x in levels for e in x.errors]
        print(
            f"| {clients} | {merged.throughput:.1f} | {statistics.median(ratios):.2f} | "
            f"{merged.percentile(0.5) * 1000:.0f} | {merged.percentile(0.99) * 1000:.0f} | "
            f"{len(merged.latencies)} | {len(errors)} |"
        )
        for error in sorted(set(errors))[:5]:
            print(f"    error: {error}")


if __name__ == "__main__":
    run_script("bench_serve", main)
