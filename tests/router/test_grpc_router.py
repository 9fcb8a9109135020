"""The gRPC front door over a real router with tiny in-process prefill and decode
workers (local transfer): what a client gets is what the engine computes, every
error a real router raises has its status, and a client that leaves (cancel,
deadline) frees its blocks on both workers.

(A deadline that passes *before* the prefill finishes is left out: at the time of
writing, cancelling the prefill future kills the prefill worker's engine loop
(``InvalidStateError`` setting a result on the cancelled future), a worker bug
reported to its owner.)"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.sampling.sampling_params import SamplingParams
from pdserve.protos import pb, pb_grpc
from pdserve.router.grpc.server import REQUEST_ID_KEY, RETRY_AFTER_KEY, start_grpc_server
from tests.inprocess import Pair
from tests.router.http_helpers import wait_freed
from tests.waiting import until_async

HOST = "127.0.0.1"
GREEDY = pb.SamplingParameters(max_tokens=12, temperature=0, ignore_eos=True)
Scenario = Callable[[pb_grpc.GenerationStub], Awaitable[None]]


def serve(pair: Pair, scenario: Scenario) -> None:
    async def main() -> None:
        await pair.router.start()
        server, port = await start_grpc_server(pair.router, HOST, 0, health_interval_s=0.05)
        try:
            async with grpc.aio.insecure_channel(f"{HOST}:{port}") as channel:
                await asyncio.wait_for(scenario(pb_grpc.GenerationStub(channel)), timeout=120)
                health = health_pb2_grpc.HealthStub(channel)
                reply = await health.Check(health_pb2.HealthCheckRequest(service=""))
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
            await wait_freed(pair)
        finally:
            await server.stop(None)
            await pair.router.stop()

    asyncio.run(main())


async def generate(stub: pb_grpc.GenerationStub, request: Any) -> tuple[list[int], str, Any]:
    """(token ids, text, Final) of one call."""
    ids: list[int] = []
    text = ""
    async for r in stub.Generate(request):
        if r.WhichOneof("kind") == "chunk":
            ids += r.chunk.token_ids
            text += r.chunk.text
        else:
            return ids, text, r.final
    raise AssertionError("no final message")


async def status_of(stub: pb_grpc.GenerationStub, request: Any) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await generate(stub, request)
    return info.value


def test_streams_what_the_engine_computes(pair_factory: Callable[..., Pair],
                                          tiny_model: Callable[[str], Path]) -> None:
    pair = pair_factory()
    # No two share a first block: one whose KV landed on the decode worker first would
    # let the other be prefilled there (no prefill worker, no KV moved, no kv_transfer_s).
    prompts = [list(range(start, start + n)) for start, n in ((5, 3), (30, 17), (60, 40))]
    engine = LLMEngine(tiny_model("llama-gqa"), EngineConfig(num_blocks=256))
    expected = engine.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
    tok = pair.router.tokenizer

    async def scenario(stub: pb_grpc.GenerationStub) -> None:
        results = await asyncio.gather(*(generate(stub, pb.GenerateRequest(
            request_id=f"g{i}", token_ids=pb.TokenIds(ids=p), params=GREEDY))
            for i, p in enumerate(prompts)))
        for (ids, text, final), exp, prompt in zip(results, expected, prompts, strict=True):
            assert ids == exp.token_ids and text == exp.text
            assert final.finish_reason == "length" and final.num_retries == 0
            assert (final.usage.prompt_tokens, final.usage.completion_tokens) == (len(prompt), 12)
            t = final.timings
            assert 0 < t.ttft_s <= t.e2e_s and t.prefill_s > 0 and t.tpot_s > 0
            assert t.HasField("kv_transfer_s") and t.HasField("router_queue_s")
            assert (t.placement, t.placement_reason) == ("remote", "static")
        # Text and chat prompts go through the router's tokenizer and chat template.
        call = stub.Generate(pb.GenerateRequest(request_id="t1", text="hello", params=GREEDY))
        assert dict(await call.initial_metadata())[REQUEST_ID_KEY] == "t1"
        finals = [r.final async for r in call if r.WhichOneof("kind") == "final"]
        assert finals[0].usage.prompt_tokens == len(tok.encode("hello"))
        messages = [pb.ChatMessage(role="user", content="hi")]
        _, _, final = await generate(stub, pb.GenerateRequest(
            chat=pb.ChatMessages(messages=messages), params=GREEDY))
        assert final.usage.prompt_tokens == len(tok.apply_chat_template(
            [{"role": "user", "content": "hi"}]))
        # The chat extras: an assistant prefill continued is the completion of its prompt.
        prefill = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure,"}]
        _, text, final = await generate(stub, pb.GenerateRequest(
            chat=pb.ChatMessages(messages=[pb.ChatMessage(**m) for m in prefill]),
            add_generation_prompt=False, continue_final_message=True, params=GREEDY))
        ids = tok.apply_chat_template(prefill, add_generation_prompt=False,
                                      continue_final_message=True)
        assert final.usage.prompt_tokens == len(ids)
        assert (await generate(stub, pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids),
                                                        params=GREEDY)))[1] == text
        # Logprobs: one entry per token, the sampled token among the top ones.
        params = pb.SamplingParameters(max_tokens=4, temperature=0, ignore_eos=True, logprobs=2)
        chunks = [r.chunk async for r in stub.Generate(pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=[5, 6]), params=params)) if r.WhichOneof("kind") == "chunk"]
        lps = [lp for c in chunks for lp in c.logprobs]
        assert len(lps) == 4 and all(lp.token_id == lp.top[0].token_id for lp in lps)

    serve(pair, scenario)


def test_a_prediction_drafts_and_usage_counts_it(pair_factory: Callable[..., Pair],
                                                 tiny_model: Callable[[str], Path]) -> None:
    """``prediction_token_ids`` / ``prediction_text`` (OpenAI's predicted outputs): the
    same tokens as without, and ``Usage`` counts the drafted tokens accepted and
    rejected (unset without a prediction); a prediction outside the vocabulary is
    INVALID_ARGUMENT naming it."""
    pair = pair_factory()
    prompt = [7 + j % 40 for j in range(20)]
    eng = LLMEngine(tiny_model("llama-gqa"), EngineConfig(num_blocks=256))
    exp = eng.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True))[0]
    vocab = pair.router.tokenizer.vocab_size

    async def scenario(stub: pb_grpc.GenerationStub) -> None:
        ids, _, plain = await generate(stub, pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=prompt), params=GREEDY))
        assert ids == exp.token_ids
        assert not plain.usage.HasField("accepted_prediction_tokens")
        assert not plain.usage.HasField("rejected_prediction_tokens")
        whole = pb.TokenIds(ids=exp.token_ids)
        edited = pb.TokenIds(ids=[*exp.token_ids[:5], 1, *exp.token_ids[6:]])
        for given in ({"prediction_token_ids": whole}, {"prediction_token_ids": edited},
                      {"prediction_text": exp.text}):
            ids, _, final = await generate(stub, pb.GenerateRequest(
                token_ids=pb.TokenIds(ids=prompt), params=GREEDY, **given))
            assert ids == exp.token_ids, given
            u, t = final.usage, final.timings
            assert u.HasField("accepted_prediction_tokens"), given
            assert u.accepted_prediction_tokens == t.spec_accepted_tokens > 0
            assert u.rejected_prediction_tokens == t.spec_draft_tokens - t.spec_accepted_tokens
            if "prediction_token_ids" in given:  # (the tiny model's text may encode otherwise)
                assert (u.rejected_prediction_tokens > 0) == (given["prediction_token_ids"]
                                                              is edited)
        err = await status_of(stub, pb.GenerateRequest(
            text="x", params=GREEDY, prediction_token_ids=pb.TokenIds(ids=[vocab])))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "prediction" in err.details()

    serve(pair, scenario)


def test_a_real_routers_errors_have_their_status(
        pair_factory: Callable[..., Pair]) -> None:
    pair = pair_factory(decode_blocks=110, queue_timeout_s=0.3)
    vocab = pair.router.tokenizer.vocab_size
    limit = pair.router.max_model_len

    async def scenario(stub: pb_grpc.GenerationStub) -> None:
        invalid = [
            pb.GenerateRequest(text=""),  # empty prompt
            pb.GenerateRequest(token_ids=pb.TokenIds(ids=[vocab])),  # outside the vocabulary
            pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5] * limit)),  # fills the context
            pb.GenerateRequest(text="x", params=pb.SamplingParameters(max_tokens=limit)),
            pb.GenerateRequest(chat=pb.ChatMessages(messages=[pb.ChatMessage(role="nobody")])),
        ]
        for request in invalid:
            err = await status_of(stub, request)
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (request, err)
        err = await status_of(stub, pb.GenerateRequest(text="x", model="gpt-4"))
        assert err.code() == grpc.StatusCode.NOT_FOUND
        # Overload: A (100-token prompt, 1500 new tokens) runs and grows; B's 1700-token
        # prompt needs 107 of the decode worker's 110 blocks, waits the 0.3 s queue
        # timeout while A only grows, and gets RESOURCE_EXHAUSTED.
        a = stub.Generate(pb.GenerateRequest(request_id="a", token_ids=pb.TokenIds(ids=[5] * 100),
                                             params=pb.SamplingParameters(
                                                 max_tokens=1500, ignore_eos=True)))
        await a.read()
        err = await status_of(stub, pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=[6] * 1700), params=GREEDY))
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert dict(err.trailing_metadata() or ())[RETRY_AFTER_KEY]
        # The same id again while A runs: refused.
        err = await status_of(stub, pb.GenerateRequest(request_id="a", text="x", params=GREEDY))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "in flight" in err.details()
        a.cancel()  # (its blocks must come back: checked after the scenario)

    serve(pair, scenario)


class HeldDecode:
    """Within ``with``, the decode workers' engine steps wait (their loop threads, up to
    60 s) until the block ends: a request's deadline then passes mid-decode however
    fast this machine decodes (a fast one finished 1,500 tokens inside a 1 s deadline)."""

    def __init__(self, pair: Pair) -> None:
        self.holding, self.released = threading.Event(), threading.Event()
        for w in pair.decode:
            step = w.engine.step

            def held(step: Callable[[], Any] = step) -> Any:
                if self.holding.is_set():
                    self.released.wait(60)
                return step()

            w.engine.step = held  # type: ignore[method-assign]

    def __enter__(self) -> None:
        self.released.clear()
        self.holding.set()

    def __exit__(self, *exc: object) -> None:
        self.holding.clear()
        self.released.set()


async def error_of(call: Any) -> grpc.aio.AioRpcError:
    """The error that ends a streaming call (reading on until it comes)."""
    with pytest.raises(grpc.aio.AioRpcError) as info:
        while await call.read() is not grpc.aio.EOF:
            pass
    return info.value


def test_leaving_clients_free_their_blocks(pair_factory: Callable[..., Pair]) -> None:
    pair = pair_factory()
    long = pb.SamplingParameters(max_tokens=1500, ignore_eos=True)
    held = HeldDecode(pair)

    async def running() -> None:  # the request reaches the decode worker asynchronously
        await until_async("the request to run on the decode worker",
                          lambda: any(w.engine.pool.num_used for w in pair.decode))

    async def scenario(stub: pb_grpc.GenerationStub) -> None:
        call = stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5] * 40),
                                                params=long))
        for _ in range(3):
            await call.read()
        await running()
        call.cancel()
        await wait_freed(pair)
        # A gRPC deadline that passes mid-stream ends the request the same way.
        call = stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[6] * 40),
                                                params=long), timeout=2.0)
        await call.read()
        await running()
        with held:
            assert await call.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        await wait_freed(pair)
        # So does the request's own deadline (timeout_s), mid-decode.
        call = stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[7] * 40),
                                                params=long, timeout_s=1.0))
        await call.read()
        await running()
        with held:
            err = await error_of(call)
        assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "passed its deadline" in err.details()
        await wait_freed(pair)
        _, _, final = await generate(stub, pb.GenerateRequest(text="ok", params=GREEDY))
        assert final.usage.completion_tokens == 12

    serve(pair, scenario)
