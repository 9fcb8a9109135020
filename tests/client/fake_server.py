"""A tiny OpenAI-compatible streaming server for the bench tests (loopback, port 0).

It streams ``max_tokens`` words (one SSE chunk each) after a first-token delay,
optionally one request at a time (``serial``: a queueing server, whose TTFT grows
with the request rate), reports usage, answers every ``fail_every``-th request with HTTP 429, lists one
model with ``max_model_len``, and serves ``/metrics`` from a fresh Prometheus
registry holding the pdserve stage histograms (fixed observations per request).
It runs its own event loop on a thread so synchronous code (the CLI) can call it.
"""

from __future__ import annotations

import asyncio
import json
import threading
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from pdserve.client.server_metrics import STAGE_HISTOGRAMS

# Seconds observed per request for each stage histogram (TTFT/TPOT/E2E measured).
STAGE_VALUES = {
    "pdserve_request_queue_seconds": 0.0007,
    "pdserve_prefill_queue_seconds": 0.0012,
    "pdserve_prefill_seconds": 0.003,
    "pdserve_kv_transfer_seconds": 0.0008,
    "pdserve_decode_queue_seconds": 0.0006,
}


@dataclass
class FakeConfig:
    model: str = "tiny-model"
    max_model_len: int = 1024
    ttft_s: float = 0.004
    token_gap_s: float = 0.001
    fail_every: int = 0  # 0: never fail
    api_key: str | None = None
    usage: bool = True  # send the usage chunk when asked
    serial: bool = False  # serve one request at a time (the others queue)


@dataclass
class FakeServer:
    cfg: FakeConfig = field(default_factory=FakeConfig)
    bodies: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    port: int = 0

    def __post_init__(self) -> None:
        self.registry = CollectorRegistry()
        self.hists = {name: Histogram(name, name, ["model", "role"], registry=self.registry)
                      .labels(model=self.cfg.model, role="router") for name in STAGE_HISTOGRAMS}
        self._count = 0
        self._serial = asyncio.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> FakeServer:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(timeout=10)
        return self

    def stop(self) -> None:
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._generate)
        app.router.add_post("/v1/chat/completions", self._generate)
        app.router.add_get("/metrics", self._metrics)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = self._runner.addresses[0][1]

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.cfg.model, "object": "model", "max_model_len": self.cfg.max_model_len}]})

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.registry), content_type="text/plain")

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        self.headers.append(dict(request.headers))
        self._count += 1
        if self.cfg.api_key and request.headers.get("Authorization") != \
                f"Bearer {self.cfg.api_key}":
            return web.json_response({"error": {"message": "bad key"}}, status=401)
        if self.cfg.fail_every and self._count % self.cfg.fail_every == 0:
            return web.json_response({"error": {"message": "server overloaded"}}, status=429)
        if self.cfg.serial:
            async with self._serial:
                return await self._stream(request, body)
        return await self._stream(request, body)

    async def _stream(self, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        chat = "messages" in body
        prompt = body["messages"][0]["content"] if chat else body["prompt"]
        n = int(body.get("max_tokens", 16))
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await asyncio.sleep(self.cfg.ttft_s)
        first = loop.time()
        for i in range(n):
            if i:
                await asyncio.sleep(self.cfg.token_gap_s)
            choice: dict[str, Any] = ({"index": 0, "delta": {"content": " tok"}} if chat
                                      else {"index": 0, "text": " tok"})
            choice["finish_reason"] = "length" if i == n - 1 else None
            await resp.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
        end = loop.time()
        if self.cfg.usage and (body.get("stream_options") or {}).get("include_usage"):
            # The prompts are stable word tokens: one word = one token.
            usage = {"prompt_tokens": len(prompt.split()), "completion_tokens": n}
            await resp.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        for name, value in STAGE_VALUES.items():
            self.hists[name].observe(value)
        self.hists["pdserve_time_to_first_token_seconds"].observe(first - t0)
        if n > 1:
            self.hists["pdserve_time_per_output_token_seconds"].observe((end - first) / (n - 1))
        self.hists["pdserve_e2e_request_latency_seconds"].observe(end - t0)
        await resp.write_eof()
        return resp
