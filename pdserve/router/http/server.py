"""Running an ASGI app on uvicorn inside an asyncio loop that someone else owns
(``pdserve serve``, tests): binding (port 0 = ephemeral, the bound port is
returned), startup, bounds on connections, and a graceful stop.

Bounds, so that one client cannot hold the server's sockets: at most
``max_connections`` connections and requests at once (beyond: uvicorn's 503), and a
connection waiting for a request head (new, or idle between keep-alive requests) gets
``header_timeout_s`` to send a whole one, or it is closed (uvicorn's own keep-alive
timer stops at the first byte, so a client sending a byte at a time would hold it
forever). The body's own deadline is ``http.middleware.BODY_TIMEOUT_S`` (a 408).

Stop rule for an app from ``http.app.build_app`` (``app.state.pdserve_api``): open
requests are ended first (a 503, or an SSE error event and ``[DONE]``), so that
uvicorn's wait for open connections is short and never has to cancel a handler;
then the stop waits for the aborts of those requests to reach the workers.

The host process keeps its signal handlers: uvicorn's own are not installed.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Callable, Generator
from typing import Any, Protocol

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

MAX_CONNECTIONS = 2048  # well under a default 20k open-files limit
HEADER_TIMEOUT_S = 10.0


class _Drainable(Protocol):
    tasks: set[asyncio.Task[None]]  # router streams still running or cleaning up

    def begin_shutdown(self) -> None: ...


class _HeadDeadlineProtocol(H11Protocol):
    """uvicorn's h11 protocol with the request-head deadline (see the module doc)."""

    header_timeout_s = HEADER_TIMEOUT_S
    _head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
        super().connection_lost(exc)

    def _arm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
        self._head_timer = self.loop.call_later(self.header_timeout_s, self._head_late,
                                                self.cycle)

    def _head_late(self, waiting_after: object) -> None:
        if self.cycle is waiting_after:  # no new request head arrived in time
            self.timeout_keep_alive_handler()


class _EmbeddedServer(uvicorn.Server):
    """uvicorn in a loop someone else owns: the host process keeps its signal handlers."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


class HttpServer:
    """A started server; ``await stop()`` ends it (open streams get ``grace`` seconds)."""

    def __init__(self, server: uvicorn.Server, task: asyncio.Task[None], grace_s: float,
                 api: _Drainable | None):
        self._server, self._task = server, task
        self._grace_s = grace_s
        self._api = api

    def connections(self) -> list[socket.socket]:
        """The sockets of the connections open now."""
        return [c.transport.get_extra_info("socket")
                for c in self._server.server_state.connections]

    async def stop(self) -> None:
        if self._api is not None:
            self._api.begin_shutdown()
        self._server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        # Requests cut off by the stop may still be aborting on their workers.
        if self._api is not None and self._api.tasks:
            await asyncio.wait(set(self._api.tasks), timeout=self._grace_s)


async def start_http_server(app: Callable[..., Any], host: str, port: int, *,
                            grace_s: float = 2.0, max_connections: int = MAX_CONNECTIONS,
                            header_timeout_s: float = HEADER_TIMEOUT_S,
                            ) -> tuple[HttpServer, int]:
    """Serve ``app`` on ``host:port`` (0 = ephemeral) in the running loop; returns the
    server handle and the bound port. Raises OSError when the address is taken."""
    # Bind here, not in uvicorn: a taken port raises here (uvicorn would sys.exit),
    # and the bound port is known before serving starts.
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # Protocol TCP, not 0: asyncio turns Nagle's algorithm off only on such sockets,
    # and with it on a stream's first event after the response head waited for the
    # client's delayed ACK (~40 ms of TTFT on a keep-alive connection).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    protocol = type("HeadDeadlineProtocol", (_HeadDeadlineProtocol,),
                    {"header_timeout_s": header_timeout_s})
    config = uvicorn.Config(app, log_config=None, access_log=False, lifespan="off",
                            timeout_graceful_shutdown=max(1, round(grace_s)), http=protocol,
                            limit_concurrency=max_connections)
    server = _EmbeddedServer(config)
    task = asyncio.create_task(server.serve(sockets=[sock]), name="http-server")
    while not server.started:
        if task.done():  # failed during startup
            sock.close()
            task.result()
            raise RuntimeError("HTTP server stopped during startup")
        await asyncio.sleep(0.01)
    api = getattr(getattr(app, "state", None), "pdserve_api", None)
    return HttpServer(server, task, grace_s, api), int(sock.getsockname()[1])
