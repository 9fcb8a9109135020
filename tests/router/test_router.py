"""The router's retry and leave-routing rules over real in-process workers (local
transfer): a failed attempt is retried on another pair and costs no worker; a worker
that is gone leaves routing and its requests continue elsewhere; the retry budget and
the deadline end a request with a clear, typed error; nothing leaks."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable
from pathlib import Path

import jsonschema
import pytest
from prometheus_client import CollectorRegistry

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.sampling.sampling_params import SamplingParams
from pdserve.engine.sampling.structured import StructuredOutput
from pdserve.router.metrics import RouterMetrics
from pdserve.router.router import Router
from pdserve.router.types import ErrorKind, GenerateRequest, RouterError, StreamChunk
from tests.inprocess import Pair, collect, run
from tests.waiting import until_async

PARAMS = SamplingParams(max_tokens=30, ignore_eos=True)
PROMPT = list(range(20, 60))


def failed(registry: CollectorRegistry, reason: str) -> float:
    value = registry.get_sample_value("pdserve_failed_attempts_total",
                                      {"model": "tiny", "role": "router", "reason": reason})
    return float(value or 0)


def stall(worker: object) -> threading.Event:
    """Block a worker's engine loop until the returned event is set (a stuck step)."""
    gate = threading.Event()
    worker.loop.call(gate.wait)  # type: ignore[attr-defined]
    return gate


def test_failed_attempt_is_retried_elsewhere_and_costs_no_worker(
        pair_factory: Callable[..., Pair], tiny_model: Callable[[str], Path]) -> None:
    # prefill-0 is stuck: decode's KV expectation for the first attempt times out
    # (a request-level failure); the retry goes to prefill-1.
    pair = pair_factory(n_prefill=2, kv_timeout_s=1)
    registry = CollectorRegistry()
    pair.router.metrics = RouterMetrics(registry, "tiny")
    expected = LLMEngine(tiny_model("llama-gqa"), EngineConfig(num_blocks=64)).generate(
        [PROMPT], PARAMS)[0].token_ids
    async def body(router: Router) -> None:
        gate = stall(pair.prefill[0])
        try:
            tokens, _, final = await collect(router.generate(
                GenerateRequest("r", PARAMS, prompt_token_ids=PROMPT)))
        finally:
            gate.set()
        assert tokens == expected and final.num_retries == 1
        assert all(router.worker_states().values()), router.worker_states()
        assert failed(registry, "timeout") == 1
        await until_async("blocks freed", lambda: not any(pair.used_blocks().values()))

    run(pair, body)


async def stream_losing_its_decode_worker(router: Router, pair: Pair, req: GenerateRequest,
                                          after: int) -> tuple[list[int], str, str]:
    """Stream ``req``, closing the decode worker serving it once ``after`` tokens came
    (its loop and token stream stop: it is gone); the tokens, text and that worker."""
    tokens: list[int] = []
    text = ""
    closed: list[str] = []
    async for item in router.generate(req):
        if not isinstance(item, StreamChunk):
            assert item.num_retries == 1
            continue
        tokens += item.token_ids
        text += item.text
        if len(tokens) >= after and not closed:
            (serving,) = [w for w in router.fanout.workers_of(req.request_id)
                          if w.startswith("decode")]
            next(w for w in pair.decode if w.worker_id == serving).close()
            closed.append(serving)
    pair.decode = [w for w in pair.decode if w.worker_id != closed[0]]
    return tokens, text, closed[0]


def test_gone_worker_leaves_routing_and_its_stream_continues_elsewhere(
        pair_factory: Callable[..., Pair], tiny_model: Callable[[str], Path]) -> None:
    pair = pair_factory(n_decode=2)
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    expected = LLMEngine(tiny_model("llama-gqa"), EngineConfig(num_blocks=64)).generate(
        [PROMPT], params)[0].token_ids

    async def body(router: Router) -> None:
        tokens, _, closed = await stream_losing_its_decode_worker(
            router, pair, GenerateRequest("g", params, prompt_token_ids=PROMPT), after=5)
        assert tokens == expected  # continued on the other decode worker, exactly
        assert router.worker_states()[closed] is False and router.ready()

    run(pair, body)


def test_speculating_seeded_stream_moved_mid_way_is_exact(
        pair_factory: Callable[..., Pair], tiny_model: Callable[[str], Path]) -> None:
    """Decode workers speculate (n-gram); the one serving a seeded random stream goes
    away: the retry rebuilds the proposer from prompt + tokens sent and continues the
    random stream, and the client gets exactly what one unspeculated engine makes."""
    spec = {"speculative_config": {"method": "ngram", "prompt_lookup_min": 1}}
    pair = pair_factory(n_decode=2, decode_engine=spec)
    prompt = PROMPT[:12] * 4
    params = SamplingParams(max_tokens=60, temperature=0.3, top_k=2, seed=11, ignore_eos=True)
    decode = list(pair.decode)
    expected = LLMEngine(tiny_model("llama-gqa"), EngineConfig(num_blocks=64)).generate(
        [prompt], params)[0].token_ids

    async def body(router: Router) -> None:
        tokens, _, _ = await stream_losing_its_decode_worker(
            router, pair, GenerateRequest("s", params, prompt_token_ids=prompt), after=12)
        assert tokens == expected
        accepted = sum(w.engine.stats().spec.num_accepted_tokens  # type: ignore[union-attr]
                       for w in decode)
        assert accepted > 0

    run(pair, body)


def test_structured_stream_moved_mid_json_stays_valid_and_exact(
        pair_factory: Callable[..., Pair], tiny_model: Callable[[str], Path]) -> None:
    """The decode worker of a seeded, schema-constrained stream goes away mid-JSON: the
    retry resumes the grammar and the random stream after the tokens already sent, so
    the client gets the very JSON an uninterrupted run makes."""
    pair = pair_factory(n_decode=2)
    schema = {"type": "object",
              "properties": {"name": {"type": "string", "maxLength": 10},
                             "n": {"type": "integer", "minimum": 0, "maximum": 999},
                             "tags": {"type": "array", "items": {"enum": ["a", "b"]},
                                      "maxItems": 4}},
              "required": ["name", "n", "tags"], "additionalProperties": False}
    params = SamplingParams(max_tokens=120, temperature=0.8, seed=3,
                            structured=StructuredOutput.json_schema(schema))
    expected = LLMEngine(tiny_model("llama-gqa"), EngineConfig(num_blocks=64)).generate(
        [PROMPT], params)[0]

    async def body(router: Router) -> None:
        tokens, text, _ = await stream_losing_its_decode_worker(
            router, pair, GenerateRequest("j", params, prompt_token_ids=PROMPT), after=4)
        assert tokens == expected.token_ids and text == expected.text
        jsonschema.validate(json.loads(text), schema)

    run(pair, body)


def test_retry_budget_ends_with_a_clear_error(pair_factory: Callable[..., Pair]) -> None:
    pair = pair_factory(kv_timeout_s=0.5, max_retries=1)

    async def body(router: Router) -> None:
        gate = stall(pair.prefill[0])
        try:
            with pytest.raises(RouterError) as e:
                await collect(router.generate(GenerateRequest("b", PARAMS, prompt_token_ids=PROMPT)))
        finally:
            gate.set()
        assert e.value.kind is ErrorKind.INTERNAL
        assert e.value.message == "request failed after 2 attempt(s): timeout, timeout"
        assert all(router.worker_states().values())  # failed requests cost no worker
        await until_async("blocks freed", lambda: not any(pair.used_blocks().values()))
        tokens, _, _ = await collect(router.generate(
            GenerateRequest("after", PARAMS, prompt_token_ids=PROMPT)))
        assert len(tokens) == 30

    run(pair, body)


def test_deadline_ends_a_stuck_request(pair_factory: Callable[..., Pair]) -> None:
    pair = pair_factory()

    async def body(router: Router) -> None:
        gate = stall(pair.prefill[0])
        try:
            with pytest.raises(RouterError) as e:
                await collect(router.generate(GenerateRequest(
                    "d", PARAMS, prompt_token_ids=PROMPT, timeout_s=0.5)))
        finally:
            gate.set()
        assert e.value.kind is ErrorKind.DEADLINE
        await until_async("blocks freed", lambda: not any(pair.used_blocks().values()))

    run(pair, body)


def test_colocated_and_pairs_side_by_side(pair_factory: Callable[..., Pair]) -> None:
    """Routing picks a pair or a colocated worker; both serve, and a request whose
    colocated worker is gone continues on a pair."""
    pair = pair_factory(n_colocated=1)

    async def body(router: Router) -> set[str]:
        served: set[str] = set()

        async def one(i: int) -> None:
            stream = router.generate(GenerateRequest(f"m{i}", PARAMS, prompt_token_ids=[9 + i] * 30))
            async for item in stream:
                served.update(w.split("-")[0] for w in router.fanout.workers_of(f"m{i}"))
                if not isinstance(item, StreamChunk):
                    assert item.finish_reason == "length"

        await asyncio.gather(*(one(i) for i in range(6)))
        return served

    assert run(pair, body) >= {"colocated", "decode"}
    assert pair.prefill[0].metrics().kv_transfers > 0  # the pairs' prefill worker served


def test_overload_burst_gets_429s_and_recovers(pair_factory: Callable[..., Pair]) -> None:
    """10x what the decode worker can hold at once: admission keeps at most
    ``max_waiting`` requests waiting and refuses the rest with OVERLOADED (429);
    every admitted one finishes; afterwards nothing of the burst remains."""
    # 24 blocks hold 4 requests of 5 blocks (40 prompt + 30 new tokens).
    pair = pair_factory(decode_blocks=24, max_waiting=8, queue_timeout_s=30)
    params = SamplingParams(max_tokens=30, ignore_eos=True)

    async def body(router: Router) -> None:
        peak = 0

        async def one(i: int) -> str:
            nonlocal peak
            try:
                async for _ in router.generate(GenerateRequest(
                        f"o{i}", params, prompt_token_ids=[5 + i] * 40)):
                    peak = max(peak, len(router.fanout) + router.admission.num_waiting)
            except RouterError as exc:
                return exc.kind.value
            return "ok"

        outcomes = await asyncio.gather(*(one(i) for i in range(40)))
        assert set(outcomes) == {"ok", "overloaded"}, outcomes
        assert outcomes.count("ok") >= 8  # at least every one let into the queue
        assert peak <= 4 + 8  # memory bound: attempts in flight + waiting, never the burst
        assert len(router.fanout) == 0 and router.admission.num_waiting == 0
        await until_async("blocks freed", lambda: not any(pair.used_blocks().values()))
        tokens, _, _ = await collect(router.generate(
            GenerateRequest("after", params, prompt_token_ids=[5] * 40)))
        assert len(tokens) == 30

    run(pair, body)


def test_a_prefill_worker_that_leaves_is_forgotten_by_prefix_affinity(
        pair_factory: Callable[..., Pair]) -> None:
    pair = pair_factory(n_prefill=2)

    async def body(router: Router) -> None:
        await collect(router.generate(GenerateRequest("p", PARAMS, prompt_token_ids=PROMPT)))
        (owner,) = set(router.prefix.view().values())  # who prefilled PROMPT's full blocks
        next(w for w in pair.prefill if w.worker_id == owner).close()
        await until_async("the worker left routing",
                          lambda: router.worker_states()[owner] is False)
        assert owner not in router.prefix.view().values()
        pair.prefill = [w for w in pair.prefill if w.worker_id != owner]

    run(pair, body)
