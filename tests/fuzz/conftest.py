"""The fuzz suite's server: a real router over tiny in-process prefill and decode
workers (local transfer), its HTTP and gRPC front doors on loopback port 0 with
an API key, all on one event loop in a thread of its own so that synchronous
clients (schemathesis' requests, grpc's blocking stubs) can drive it.

Bounds: the served context is `CONTEXT` tokens, so no request, however generated,
decodes for long; every call has a client-side deadline (`CALL_TIMEOUT_S`) that
only a hang reaches. At the end of the session every worker's blocks must all be
free again and its pool must pass its integrity check (``Pair.close``).
"""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import grpc
import pytest
from prometheus_client import CollectorRegistry

from pdserve.router.api_keys import ApiKeys
from pdserve.router.grpc_server import start_grpc_server
from pdserve.router.http_api import build_app, start_http_server
from tests.integration.test_inprocess import Pair
from tests.router.test_http_api import wait_freed

KEY = "fuzz-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
GRPC_AUTH = (("authorization", f"Bearer {KEY}"),)
CONTEXT = 64  # tokens: prompt + output of any one request
CALL_TIMEOUT_S = 30.0  # a call still open after this long has hung
T = TypeVar("T")


@dataclass
class FuzzStats:
    """Cases tried and answers seen, per suite (printed at the end of the run)."""

    cases: Counter[str] = field(default_factory=Counter)
    answers: dict[str, Counter[str]] = field(default_factory=dict)

    def record(self, suite: str, answer: str) -> None:
        self.cases[suite] += 1
        self.answers.setdefault(suite, Counter())[answer] += 1

    def lines(self) -> list[str]:
        return [f"{suite}: {n} cases; answers {dict(sorted(self.answers[suite].items()))}"
                for suite, n in sorted(self.cases.items())]


STATS = FuzzStats()


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if STATS.cases:
        terminalreporter.section("fuzz cases")
        for line in STATS.lines():
            terminalreporter.write_line(line)


class LiveServer:
    """The router and both front doors, served from a background event loop."""

    def __init__(self, model: Path):
        self.pair = Pair(model)
        self.pair.router.max_model_len = CONTEXT
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
        keys = ApiKeys([KEY])
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


@pytest.fixture(scope="package")
def live(tiny_model: Callable[[str], Path]) -> Iterator[LiveServer]:
    with LiveServer(tiny_model("llama-gqa")) as server:
        yield server


@pytest.fixture(scope="package")
def grpc_channel(live: LiveServer) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(live.grpc_target) as channel:
        yield channel
