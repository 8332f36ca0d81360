"""Start and stop the service: the port, the model, uvicorn, the signals.

The port is bound first and the model loaded second, both before anything
listens, so that a busy port or an unusable checkpoint ends with one line and
a non-zero exit. SIGTERM or SIGINT closes the listening socket, lets the
requests in flight finish (for at most --shutdown-timeout seconds), and then
the command exits 0: stopping a server is its normal end.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import signal
import socket
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from types import FrameType

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from seq2seq.errors import UserError
from seq2seq.serve.app import create_app
from seq2seq.serve.batcher import Batcher
from seq2seq.serve.engine import Engine
from seq2seq.serve.options import ServeOptions

log = logging.getLogger("seq2seq.serve")


def serve(load_engines: Callable[[], Mapping[str, Engine]], options: ServeOptions) -> int:
    """Serve until SIGTERM/SIGINT; `load_engines` (the models by name) runs after the port is bound,
    before it listens."""
    with bind(options.host, options.port) as sock:
        batchers = {name: _batcher(engine, options) for name, engine in load_engines().items()}
        config = uvicorn.Config(
            create_app(batchers, options),
            log_config=None,
            access_log=False,
            timeout_graceful_shutdown=options.shutdown_timeout,
            http=_with_head_timeout(options.read_timeout),
        )
        server = _Server(config, list(batchers.values()))
        with _signals_noted():
            server.run(sockets=[sock])
    log.info("stopped")
    return 0


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


@contextmanager
def _signals_noted() -> Iterator[None]:
    """SIGTERM/SIGINT only noted, outside uvicorn's own handlers.

    uvicorn handles both while it serves, then raises them again once it has
    stopped, which would end the process with the signal's status after a
    clean shutdown. Here they land in a handler that keeps the exit normal.
    """
    signals = (signal.SIGINT, signal.SIGTERM)
    previous = {sig: signal.signal(sig, _note) for sig in signals}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _note(sig: int, frame: FrameType | None) -> None:
    log.debug("%s received after the server stopped", signal.Signals(sig).name)


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
    """uvicorn's server, saying in the log when it listens and when a signal stops it."""

    def __init__(self, config: uvicorn.Config, batchers: list[Batcher]) -> None:
        super().__init__(config)
        self.batchers = batchers

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        for sock in (sockets or []) if self.started else []:
            host, port = sock.getsockname()[:2]
            host = f"[{host}]" if ":" in host else host  # IPv6
            log.info("serving on http://%s:%d (explorer: GET /; POST /translate, GET /health, GET /info)", host, port)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if not self.should_exit:
            log.info(
                "%s: no new connections; finishing %d request(s) in flight (at most %d s)",
                signal.Signals(sig).name,
                sum(b.in_flight for b in self.batchers),
                self.config.timeout_graceful_shutdown,
            )
        super().handle_exit(sig, frame)
