"""Dynamic batching: concurrent requests with the same decode settings are decoded together.

Requests wait in arrival order. The batcher takes the oldest one and every
later one with the same settings, up to a token budget, once the waiting
requests fill that budget or the oldest has waited `max_wait` seconds. One
worker thread decodes (torch already spreads each batch over the cores), so
the event loop stays free to accept requests and answer /health. Requests that
ask for other settings wait for a batch of their own: settings are never mixed.

When the server stops, `refuse` answers what is still waiting or being decoded
with Busy (a 503) and cancels the decoding, which stops at its next safe point
(between the translator's batches): a drain ends on time.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

from seq2seq import interrupt
from seq2seq.config import DecodeConfig
from seq2seq.decoding.translate import Translation
from seq2seq.serve.engine import Engine

log = logging.getLogger(__name__)
R = TypeVar("R")


class Busy(Exception):
    """Too many requests are waiting: the client should retry later (HTTP 503)."""


@dataclass
class _Job:
    lines: list[str]
    settings: DecodeConfig
    tokens: int
    arrived: float  # event-loop time
    result: asyncio.Future[list[Translation]]
    prefixes: list[str] | None = None  # one per line ("" for none), or None
    tgt_langs: list[str] | None = None  # one per line ("" for none), or None


class Batcher:
    def __init__(self, engine: Engine, max_tokens: int, max_wait: float, max_queue: int) -> None:
        self.engine = engine
        self.max_tokens = max_tokens
        self.max_wait = max_wait
        self.max_queue = max_queue
        self.in_flight = 0  # requests submitted and not yet answered
        self.batches = 0  # engine calls so far
        self.refused = 0  # requests answered Busy by `refuse`
        self._waiting: deque[_Job] = deque()
        self._decoding: list[_Job] = []  # the batch taken from the queue, until all of it is answered
        self._closed = ""  # why every request is refused now ("": none is)
        self._cancel = threading.Event()  # set: the decoding stops at its next safe point
        self._arrived = asyncio.Event()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="decode")
        self._task: asyncio.Task[None] | None = None

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="batcher")

    def refuse(self, reason: str) -> None:
        """Answer the requests waiting and those being decoded with Busy(reason) now, and every later one on
        arrival; the decoding stops at its next safe point."""
        self._closed = reason
        self._cancel.set()
        for job in (*self._waiting, *self._decoding):
            if not job.result.done():
                job.result.set_exception(Busy(reason))
                self.refused += 1
        self._waiting.clear()

    def cancel_decoding(self) -> None:
        """Stop the decoding at its next safe point (from any thread, the event loop gone or not)."""
        self._cancel.set()

    async def stop(self) -> None:
        """Stop taking batches; a batch being decoded stops at its next safe point (its thread cannot be
        interrupted inside a search step). Requests still unanswered get Busy."""
        self._cancel.set()
        unanswered = [*self._waiting, *self._decoding]
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for job in (*unanswered, *self._waiting):
            if not job.result.done():
                job.result.set_exception(Busy("the server is shutting down"))
        self._waiting.clear()
        await asyncio.get_running_loop().run_in_executor(None, self._executor.shutdown)

    async def translate(
        self,
        lines: list[str],
        settings: DecodeConfig,
        tokens: int,
        prefixes: list[str] | None = None,
        tgt_langs: list[str] | None = None,
    ) -> list[Translation]:
        """Queue `lines` (`tokens` source subwords in all; target `prefixes` and target languages, one per
        line, if any) and wait for their translations, in order."""
        if self._closed:
            raise Busy(self._closed)
        if len(self._waiting) >= self.max_queue:
            raise Busy(f"{len(self._waiting)} requests are waiting; retry later")
        loop = asyncio.get_running_loop()
        job = _Job(lines, settings, tokens, loop.time(), loop.create_future(), prefixes, tgt_langs)
        self._waiting.append(job)
        self._arrived.set()
        self.in_flight += 1
        try:
            return await job.result
        finally:
            self.in_flight -= 1

    async def call(self, fn: Callable[[], R]) -> R:
        """fn() in the decoding thread, between batches: work on the model (an attention pass) never runs
        beside a decode, and never on the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn)

    async def _run(self) -> None:
        while True:
            await self._gather()
            batch, self._waiting = take_batch(self._waiting, self.max_tokens)
            self._decoding = batch
            try:
                if batch:
                    await self._decode(batch)
            finally:
                self._decoding = []

    async def _gather(self) -> None:
        """Wait until requests fill the token budget, or the oldest has waited max_wait seconds."""
        loop = asyncio.get_running_loop()
        while not self._waiting:
            self._arrived.clear()
            await self._arrived.wait()
        deadline = self._waiting[0].arrived + self.max_wait
        while sum(job.tokens for job in self._waiting) < self.max_tokens and loop.time() < deadline:
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), deadline - loop.time())
            except asyncio.TimeoutError:
                break

    async def _decode(self, batch: list[_Job]) -> None:
        """Decode the batch in the worker thread and hand each request its own slice of the results.

        A batch that fails is decoded again one request at a time, so that only the request
        that fails gets the error: one request never fails another.
        """
        lines = [line for job in batch for line in job.lines]
        loop = asyncio.get_running_loop()
        self.batches += 1
        started = time.perf_counter()
        try:
            call = engine_call(self.engine, batch)
            results = await loop.run_in_executor(self._executor, _cancellable, self._cancel, call)
            log.debug(
                "batch %d: %d requests, %d lines, %.1f ms",
                *(self.batches, len(batch), len(lines), (time.perf_counter() - started) * 1000),
            )
        except interrupt.Cancelled:  # by `refuse` or `stop`, which answer the requests
            return
        except Exception as e:  # reported to the caller, who answers it (and logs an internal error)
            if len(batch) == 1:
                if not batch[0].result.done():
                    batch[0].result.set_exception(e)
                return
            log.info("batch %d failed (%s); decoding its %d requests one by one", self.batches, e, len(batch))
            for job in batch:
                if not job.result.done():
                    await self._decode([job])
            return
        start = 0
        for job in batch:
            if not job.result.done():
                job.result.set_result(results[start : start + len(job.lines)])
            start += len(job.lines)


def take_batch(waiting: deque[_Job], max_tokens: int) -> tuple[list[_Job], deque[_Job]]:
    """The oldest live request and the later ones with the same settings that fit the token budget; the rest."""
    batch: list[_Job] = []
    tokens = 0
    rest: deque[_Job] = deque()
    for job in waiting:
        if job.result.done():  # the client went away
            continue
        if not batch or (job.settings == batch[0].settings and tokens + job.tokens <= max_tokens):
            batch.append(job)
            tokens += job.tokens
        else:
            rest.append(job)
    return batch, rest


def engine_call(engine: Engine, batch: list[_Job]) -> Callable[[], list[Translation]]:
    """The engine's translation of the batch's lines, with their prefixes and target languages where any has some
    (requests with and without them share a batch)."""
    lines = [line for job in batch for line in job.lines]
    call = functools.partial(engine.translate, lines, batch[0].settings)
    if any(job.prefixes for job in batch):
        call = functools.partial(call, [p for job in batch for p in job.prefixes or [""] * len(job.lines)])
    if any(job.tgt_langs for job in batch):
        langs = [lang for job in batch for lang in job.tgt_langs or [""] * len(job.lines)]
        call = functools.partial(call, tgt_langs=langs)
    return call


def _cancellable(cancel: threading.Event, call: Callable[[], R]) -> R:
    """call() in the decoding thread, its safe points raising `interrupt.Cancelled` once `cancel` is set."""
    with interrupt.cancellable(cancel):
        return call()
