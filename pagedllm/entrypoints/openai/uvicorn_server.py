"""uvicorn, hardened for `pagedllm serve`: a read timeout on request headers, and a shutdown that
answers what outlives the grace period instead of cutting it off.

uvicorn (with h11) arms no timer while a connection sends its request headers, so a client that
opens a socket and trickles bytes (slowloris) holds it forever; `ReadTimeoutH11Protocol` closes a
connection whose headers are not complete within the read timeout. After the grace period uvicorn
cancels the request tasks, and a cancelled handler answers a text/plain 500 (or cuts a stream
short); `GracefulServer` ends the engine's requests first, so each handler answers itself: a 503 in
OpenAI's shape, or a stream's error event followed by `data: [DONE]`.

If the engine core dies, the requests in flight have already been answered with errors (503, or a
stream's error event) by the engine; the server then answers /health with 503 for a moment, so a load
balancer sees it, and shuts down, and `pagedllm serve` exits with status 1 for a supervisor to restart
it (vLLM's behaviour too). It does not restart the core itself: a core that crashed once would
likely crash again on the same input, and a supervisor sees and counts restarts.
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from pagedllm.engine.async_engine import AsyncLLMEngine
from pagedllm.entrypoints.openai.server import ABORT_CONNECTION

# after the engine's requests were ended, how long handlers get to send their answers
ANSWER_GRACE_S = 5.0
# after the engine core died: how long /health answers 503 before the server shuts down
ENGINE_DEAD_EXIT_DELAY_S = 2.0


class ReadTimeoutH11Protocol(H11Protocol):
    read_timeout: float = 30.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._headers_timer: asyncio.TimerHandle | None = None
        self._watch_headers()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._watch_headers()
        if self.cycle is not None:
            # lets the app drop a stalled client's connection at once (ConnectionGuardMiddleware):
            # close() would first try to flush what the client never reads
            self.cycle.scope.setdefault("extensions", {})[ABORT_CONNECTION] = self.transport.abort

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_headers_timer()
        super().connection_lost(exc)

    def _awaiting_headers(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _watch_headers(self) -> None:
        # armed once per request, not reset by each byte: trickling does not buy time
        if not self._awaiting_headers():
            self._stop_headers_timer()
        elif self._headers_timer is None:
            self._headers_timer = self.loop.call_later(self.read_timeout, self._headers_timed_out)

    def _stop_headers_timer(self) -> None:
        if getattr(self, "_headers_timer", None) is not None:
            self._headers_timer.cancel()
            self._headers_timer = None

    def _headers_timed_out(self) -> None:
        self._headers_timer = None
        if self._awaiting_headers() and not self.transport.is_closing():
            self.logger.debug("closed a connection that sent no complete request headers in %.0f s",
                                self.read_timeout)
            self.transport.close()


def protocol_with_read_timeout(read_timeout: float) -> type[H11Protocol]:
    return type("ReadTimeoutH11Protocol", (ReadTimeoutH11Protocol,), {"read_timeout": read_timeout})


class GracefulServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, engine: AsyncLLMEngine, grace_period: float) -> None:
        super().__init__(config)
        self.engine = engine
        self.grace_period = grace_period

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        timer = asyncio.get_running_loop().call_later(self.grace_period, self.engine.begin_shutdown)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()


def bind_socket(host: str, port: int) -> socket.socket:
    """The server's listening socket, bound before the model loads, so that a port in use fails at once
    (OSError) instead of after the load; uvicorn listens on it (GracefulServer.run(sockets=[...]))."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: past TIME_WAIT
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def make_server(app: Any, engine: AsyncLLMEngine, host: str, port: int, log_level: str,
                grace_period: float, read_timeout: float, keep_alive_timeout: float) -> GracefulServer:
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False,
                            http=protocol_with_read_timeout(read_timeout),
                            timeout_keep_alive=keep_alive_timeout,
                            # uvicorn's own cut-off comes after ours, for handlers that cannot answer
                            timeout_graceful_shutdown=grace_period + ANSWER_GRACE_S)
    server = GracefulServer(config, engine, grace_period)

    def on_engine_dead() -> None:
        def stop() -> None:
            server.should_exit = True

        asyncio.get_running_loop().call_later(ENGINE_DEAD_EXIT_DELAY_S, stop)

    engine.dead_callbacks.append(on_engine_dead)
    return server
