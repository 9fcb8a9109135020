"""A real router over tiny in-process workers (``Pair``: local transfer), its HTTP and
gRPC front doors on loopback port 0, all on one event loop in a thread of its own so
that synchronous clients (schemathesis, grpc's blocking stubs, lm-eval, the openai
package) can drive it. On exit every worker's blocks must be free again and its pool
must pass its integrity check."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

from prometheus_client import CollectorRegistry

from pdserve.router.api.keys import ApiKeys
from pdserve.router.grpc.server import start_grpc_server
from pdserve.router.http.app import build_app, start_http_server
from tests.inprocess import Pair
from tests.router.http_helpers import wait_freed

CALL_TIMEOUT_S = 30.0  # a call still open after this long has hung
T = TypeVar("T")


class LiveServer:
    """The router and both front doors, served from a background event loop."""

    def __init__(self, model: Path, context: int | None = None,
                 api_keys: list[str] | None = None, **pair_kw: Any):
        self.pair = Pair(model, **pair_kw)
        if context is not None:
            self.pair.router.max_model_len = context
        self.api_keys = ApiKeys(api_keys) if api_keys else None
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="fuzz-server",
                                       daemon=True)
        self.http_url = ""
        self.grpc_target = ""
        self._stops: list[Callable[[], Coroutine[Any, Any, Any]]] = []

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = CALL_TIMEOUT_S) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _start(self) -> None:
        router = self.pair.router
        await router.start()
        self._stops.append(router.stop)
        keys = self.api_keys
        grpc_server, grpc_port = await start_grpc_server(router, "127.0.0.1", 0, api_keys=keys)
        self._stops.append(lambda: grpc_server.stop(None))
        app = build_app(router, "tiny", CollectorRegistry(), api_keys=keys)
        http_server, http_port = await start_http_server(app, "127.0.0.1", 0)
        self._stops.append(http_server.stop)
        self.http_url = f"http://127.0.0.1:{http_port}"
        self.grpc_target = f"127.0.0.1:{grpc_port}"

    async def _stop(self) -> None:
        for stop in reversed(self._stops):
            await stop()

    def __enter__(self) -> LiveServer:
        self.thread.start()
        self.run(self._start())
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.run(wait_freed(self.pair))  # every fuzzed request gave its blocks back
            self.run(self._stop())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=CALL_TIMEOUT_S)
            self.loop.close()
            self.pair.close()  # integrity check on every worker, no block in use
