"""What the gRPC front end's tests share: a scripted router (RouterLike) that plays
chunks, a final chunk or errors, the server on port 0 around a scenario, and calls."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import pytest

from pdserve.protos import pb_grpc
from pdserve.router.grpc.server import (
    start_grpc_server,
)
from pdserve.router.types import (
    ErrorKind,
    FinalChunk,
    GenerateRequest,
    ModelInfo,
    RouterError,
    StageTimings,
    StreamChunk,
    TokenLogprob,
    Usage,
)
from tests.router.http_helpers import LEAKY

HOST = "127.0.0.1"
class ScriptedRouter:
    """Echoes the prompt's token ids back one chunk each. Magic text prompts:
    ``error:<kind>`` raises before the stream, ``midstream:<kind>`` after one chunk,
    ``leak:<kind>`` raises with a message full of server internals, ``hang`` blocks
    after one chunk, ``crash`` raises a non-RouterError."""

    tokenizer: Any = None

    def __init__(self) -> None:
        self.is_ready = True
        self.requests: list[GenerateRequest] = []
        self.exits: dict[str, str] = {}  # request id -> how its generator ended

    def models(self) -> list[ModelInfo]:
        return [ModelInfo(id="tiny", max_model_len=2048)]

    def ready(self) -> bool:
        return self.is_ready

    async def generate(self, req: GenerateRequest) -> AsyncIterator[StreamChunk | FinalChunk]:
        self.requests.append(req)
        how = "finished"
        try:
            text = req.prompt or ""
            if text.startswith("error:"):
                raise RouterError(ErrorKind(text[6:]), f"scripted {text[6:]}", retry_after_s=2.5)
            if text.startswith("leak:"):
                raise RouterError(ErrorKind(text[5:]), LEAKY)
            if text == "crash":
                raise KeyError("bug")
            ids = req.prompt_token_ids or [ord(c) for c in text]
            for i in ids:
                logprobs = []
                if req.params.logprobs is not None:
                    logprobs = [TokenLogprob(i, -0.5, [(i, -0.5), (0, -1.5)])]
                yield StreamChunk([i], chr(i), logprobs)
                if text.startswith("midstream:"):
                    raise RouterError(ErrorKind(text[10:]), "scripted midstream")
                if text == "hang":
                    await asyncio.Event().wait()
            timings = StageTimings(router_queue=0.001, prefill=0.02, ttft=0.03, e2e=0.1)
            timings.inter_token, timings.tokens_after_first = [0.01, 0.03], 2
            timings.spec_draft_tokens, timings.spec_accepted_tokens = 6, 4
            usage = Usage(prompt_tokens=len(ids), completion_tokens=len(ids), cached_tokens=1)
            yield FinalChunk("stop", usage, stop_reason=7, timings=timings, num_retries=1)
        except GeneratorExit:
            how = "aclose"
            raise
        except asyncio.CancelledError:
            how = "cancelled"
            raise
        finally:
            self.exits[req.request_id] = how


Scenario = Callable[[grpc.aio.Channel], Awaitable[None]]


def serve(router: ScriptedRouter, scenario: Scenario, **server_kw: Any) -> None:
    async def main() -> None:
        server, port = await start_grpc_server(router, HOST, 0, health_interval_s=0.02,
                                               **server_kw)
        assert port > 0
        try:
            async with grpc.aio.insecure_channel(f"{HOST}:{port}") as channel:
                await asyncio.wait_for(scenario(channel), timeout=10)
        finally:
            await server.stop(None)

    asyncio.run(main())


async def collect(channel: grpc.aio.Channel, request: Any, **kw: Any) -> list[Any]:
    stub = pb_grpc.GenerationStub(channel)
    return [r async for r in stub.Generate(request, **kw)]


async def expect_status(channel: grpc.aio.Channel, request: Any) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await collect(channel, request)
    return info.value
