"""What the HTTP API's tests share: the app on uvicorn (port 0) over a router, a
streamed response's events, and a scripted router for the error kinds that a
healthy cluster does not produce on demand."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx2
from prometheus_client import CollectorRegistry

from pdserve.engine.tokenizer import Tokenizer
from pdserve.router.http.app import build_app, start_http_server
from pdserve.router.metrics import RouterMetrics
from pdserve.router.types import (
    FinalChunk,
    GenerateRequest,
    ModelInfo,
    RouterError,
    StreamChunk,
)
from tests.inprocess import Pair
from tests.waiting import until_async

Client = httpx2.AsyncClient
GREEDY = {"model": "tiny", "temperature": 0, "ignore_eos": True}
LEAKY = ("ray::PrefillActor.prefill() (pid=4242, ip=10.1.2.3, actor_id=8d1a2c3b4e5f60718293a4b5)"
         ' File "/opt/pdserve/pdserve/worker.py", line 7: \x1b[31mValueError\x1b[0m')

# A tool call in the Hermes syntax, as a model writes it
HERMES_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def serve(router: Any, body: Callable[[Client], Awaitable[None]], **app_kw: Any) -> None:
    """Start ``router`` (when real) and the app on port 0, run ``body``, stop both."""

    async def main() -> None:
        if isinstance(router, Pair):
            await router.router.start()
        real = router.router if isinstance(router, Pair) else router
        registry = CollectorRegistry()
        if isinstance(router, Pair):
            real.metrics = RouterMetrics(registry, "tiny")
        server, port = await start_http_server(build_app(real, "tiny", registry, **app_kw),
                                               "127.0.0.1", 0)
        try:
            async with Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
                await body(client)
        finally:
            await server.stop()
            if isinstance(router, Pair):
                await router.router.stop()

    asyncio.run(main())


async def sse(client: Client, path: str, body: dict[str, Any]) -> list[Any]:
    """The decoded ``data:`` events of one streamed response ("[DONE]" kept as is)."""
    async with client.stream("POST", path, json=body) as r:
        assert r.status_code == 200, await r.aread()
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line async for line in r.aiter_lines() if line.startswith("data: ")]
    return [line[6:] if line == "data: [DONE]" else json.loads(line[6:]) for line in lines]


async def wait_freed(pair: Pair) -> None:
    """Until every block is free (aborts reach the workers' loops asynchronously)."""
    await until_async("every block freed", lambda: all(
        w.engine.pool.num_used == 0 for w in [*pair.prefill, *pair.decode]))


class ScriptedRouter:
    """A RouterLike whose ``generate`` plays a script: chunks, then a final chunk or
    a RouterError (before or after some chunks)."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.script: list[StreamChunk | FinalChunk | RouterError] = []
        self.is_ready = True

    async def generate(self, req: GenerateRequest) -> AsyncIterator[StreamChunk | FinalChunk]:
        for item in self.script:
            if isinstance(item, RouterError):
                raise item
            yield item

    def models(self) -> list[ModelInfo]:
        return [ModelInfo("tiny", 2048)]

    def ready(self) -> bool:
        return self.is_ready


class ChoicesRouter(ScriptedRouter):
    """A ScriptedRouter that records its requests, plays ``scripts[request id]`` when
    there is one (a float item: sleep that long) and notes the streams it closed."""

    def __init__(self, tokenizer: Tokenizer):
        super().__init__(tokenizer)
        self.scripts: dict[str, list[Any]] = {}
        self.seen: list[GenerateRequest] = []
        self.closed: list[str] = []

    async def generate(self, req: GenerateRequest) -> AsyncIterator[StreamChunk | FinalChunk]:
        self.seen.append(req)
        try:
            for item in self.scripts.get(req.request_id, self.script):
                if isinstance(item, RouterError):
                    raise item
                if isinstance(item, float):
                    await asyncio.sleep(item)
                    continue
                yield item
        finally:
            self.closed.append(req.request_id)
