"""Start and stop the service: the port, the model, uvicorn, the signals.

The port is bound first and the model loaded second, both before anything
listens, so that a busy port or an unusable checkpoint ends with one line and
a non-zero exit; a signal while the model loads ends it there, as any
command's. SIGTERM or SIGINT closes the listening socket and lets the requests
in flight finish; those not done after --shutdown-timeout seconds, or at a
second signal, are answered 503 and their decoding stops at its next search
step. Then the command says so in one line and exits 143 or 130, like every
command a signal stops. The signals stay with the command's
`seq2seq.interrupt.Interrupts` (uvicorn's own handlers would raise them again
after the drain), which the server reads between its ticks.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import signal
import socket
import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from seq2seq import interrupt
from seq2seq.errors import UserError
from seq2seq.serve.app import create_app
from seq2seq.serve.batcher import Batcher
from seq2seq.serve.engine import Engine
from seq2seq.serve.options import ServeOptions

log = logging.getLogger("seq2seq.serve")
TICK = 0.1  # seconds between looks for a second signal while draining
BACKSTOP = 1  # second after the drain limit at which uvicorn cancels what is left (nothing, normally)


def serve(load_engines: Callable[[], Mapping[str, Engine]], options: ServeOptions) -> int:
    """Serve until SIGTERM/SIGINT, then drain; `load_engines` (the models by name) runs after the port is
    bound, before it listens. Returns the exit code: the signal's (130, 143)."""
    with bind(options.host, options.port) as sock:
        batchers = {name: _batcher(engine, options) for name, engine in load_engines().items()}
        interrupt.check()  # a signal while the models loaded: stop before listening
        config = uvicorn.Config(
            create_app(batchers, options),
            log_config=None,
            access_log=False,
            timeout_graceful_shutdown=options.shutdown_timeout + BACKSTOP,
            http=_with_head_timeout(options.read_timeout),
        )
        # The decoding thread's safe points must not raise the signal (the drain lets its batch finish), and
        # neither may a second signal where it lands: it ends the drain at once, through the server.
        with interrupt.Interrupts(library_checks=False, raise_repeated=False) as interrupts:
            server = _Server(config, list(batchers.values()), interrupts, options.shutdown_timeout)
            try:
                server.run(sockets=[sock])
            finally:  # whatever ended the loop, the decoding thread must not hold the exit
                for batcher in batchers.values():
                    batcher.cancel_decoding()
    received = interrupts.received
    if received is None:  # uvicorn stopped on its own
        return 0
    refused = sum(batcher.refused for batcher in batchers.values())
    done = f"{refused} request(s) unfinished at {server.cut_by} answered 503" if refused else "all requests answered"
    print(f"seq2seq: stopped by {received.name}; {done}", file=sys.stderr)
    return 128 + received


def _batcher(engine: Engine, options: ServeOptions) -> Batcher:
    budget = options.batch_tokens or engine.defaults.max_tokens
    return Batcher(engine, budget, options.batch_wait_ms / 1000, options.max_queue)


def bind(host: str, port: int) -> socket.socket:
    """A socket bound to host:port and not yet listening; UserError (one line) when the address cannot be had."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as e:
        raise UserError(f"--host {host}: {e.strerror}") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart need not wait for TIME_WAIT
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        hint = "; another server uses it: stop it or choose another --port" if e.errno == errno.EADDRINUSE else ""
        raise UserError(f"cannot listen on {host}:{port}: {e.strerror}{hint}") from None
    return sock


def _with_head_timeout(seconds: float) -> type[H11Protocol]:
    """uvicorn's HTTP/1.1 with a deadline for each request's head.

    uvicorn times out only the idle time after a response, and any byte resets
    that; a client that connects and sends nothing, or its headers a byte at a
    time, would hold its connection forever. (The body has its own deadline in
    the app: a 408.)
    """

    class HeadTimeout(H11Protocol):
        _deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
            super().connection_lost(exc)

        def _arm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
            self._deadline = self.loop.call_later(seconds, self._expired)

        def _expired(self) -> None:
            idle = self.cycle is None or self.cycle.response_complete  # no request in progress: no head yet
            if idle and not self.transport.is_closing():
                log.info("closed a connection that sent no request within %g s", seconds)
                self.timeout_keep_alive_handler()

    return HeadTimeout


class _Server(uvicorn.Server):
    """uvicorn's server, saying in the log when it listens and when a signal stops it; the drain it starts
    ends after `drain_limit` seconds, the requests still unanswered refused (503)."""

    def __init__(
        self, config: uvicorn.Config, batchers: list[Batcher], interrupts: interrupt.Interrupts, drain_limit: float
    ) -> None:
        super().__init__(config)
        self.batchers = batchers
        self.interrupts = interrupts
        self.drain_limit = drain_limit
        self.cut_by = ""  # what ended the drain before every request was done

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        for sock in (sockets or []) if self.started else []:
            host, port = sock.getsockname()[:2]
            host = f"[{host}]" if ":" in host else host  # IPv6
            log.info("serving on http://%s:%d (explorer: GET /; POST /translate, GET /health, GET /info)", host, port)

    @contextmanager
    def capture_signals(self) -> Iterator[None]:
        """Nothing: the command's `Interrupts` records SIGINT and SIGTERM, and `on_tick` reads it."""
        yield

    async def on_tick(self, counter: int) -> bool:
        """Every 0.1 s while serving: a signal received starts the drain."""
        if self.interrupts.received is not None and not self.should_exit:
            self._drain(self.interrupts.received)
        return await super().on_tick(counter)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        """uvicorn's drain, watched for a second signal: that ends it at once, as its time limit would."""
        watch = asyncio.get_running_loop().create_task(self._second_signal())
        try:
            await super().shutdown(sockets)
        finally:
            watch.cancel()

    async def _second_signal(self) -> None:
        while not self.interrupts.repeated:
            await asyncio.sleep(TICK)
        log.info("a second signal: the requests in flight are answered 503 now")
        self._refuse("a second signal", "the server was stopped before this request was done")

    def _drain(self, sig: signal.Signals) -> None:
        log.info(
            "%s: no new connections; finishing %d request(s) in flight (at most %g s)",
            sig.name,
            sum(b.in_flight for b in self.batchers),
            self.drain_limit,
        )
        self.should_exit = True
        limit = f"--shutdown-timeout ({self.drain_limit:g} s)"
        reason = f"the server is stopping and this request was not done within {self.drain_limit:g} s"
        asyncio.get_running_loop().call_later(self.drain_limit, self._refuse, limit, reason)

    def _refuse(self, cut_by: str, reason: str) -> None:
        """Answer every request not yet done with a 503 (`reason`), now."""
        self.cut_by = self.cut_by or cut_by
        for batcher in self.batchers:
            batcher.refuse(reason)
