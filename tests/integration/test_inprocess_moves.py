"""Router + 1 prefill and 2 decode workers in one process (local transfer backend, no
Ray): a drained decode worker's running requests move to the other with their KV
(router/migration.py, worker/moves.py) -- every stream the same as the engine's alone
(greedy and seeded), no retry, nothing prefilled again, no block left behind."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.sampling.sampling_params import SamplingParams
from pdserve.failures import FailReason, WorkerGone
from pdserve.router.router import Router
from pdserve.router.types import FinalChunk, GenerateRequest, StreamChunk
from pdserve.worker.decode import DecodeWorker
from tests.inprocess import Pair, collect, run
from tests.waiting import until

PROMPTS = [list(range(5, 45)), list(range(7, 60)), list(range(100, 130))]
PARAMS = [SamplingParams(max_tokens=900, ignore_eos=True),
          SamplingParams(max_tokens=900, ignore_eos=True, temperature=1.0, seed=7),
          SamplingParams(max_tokens=900, ignore_eos=True, temperature=0.8, top_p=0.9,
                         seed=11, repetition_penalty=1.2)]


def expected(tiny_model: Callable[[str], Path]) -> list[list[int]]:
    engine = LLMEngine(tiny_model("llama-gqa"), EngineConfig(num_blocks=512))
    return [engine.generate([p], params)[0].token_ids for p, params in zip(PROMPTS, PARAMS,
                                                                        strict=True)]


def counted_prefills(pair: Pair) -> list[str]:
    """Filled as the prefill worker is asked for prompts: their request ids."""
    asked: list[str] = []
    p = pair.prefill[0]
    prefill = p.prefill

    async def counting(task):  # type: ignore[no-untyped-def]
        asked.append(task.request_id)
        return await prefill(task)

    p.prefill = counting  # type: ignore[method-assign]
    return asked


@pytest.mark.parametrize("transfer", ["local", "torch"])
def test_a_drained_decode_workers_requests_move_with_their_kv(
        pair_factory: Callable[..., Pair], tiny_model: Callable[[str], Path],
        transfer: str) -> None:
    """(nixl: the served check, docs/operations.md; in one process UCX's teardown
    needs a child of its own, as tests/integration/test_decode_accounting.py's.)"""
    pair = pair_factory(n_decode=2, decode_blocks=256, transfer=transfer)
    asked = counted_prefills(pair)

    def kv_landed(source: str) -> None:  # the source leaves only once its sends are over
        (target,) = (d for d in pair.decode if d.worker_id != source)
        assert not target._incoming

    source, finals = drain_mid_stream(pair, tiny_model, kv_landed)
    for final in finals:
        assert final.num_retries == 0
        assert final.timings.worker != source  # every request ended on the other worker
    assert len(asked) == len(PROMPTS)  # no prompt prefilled again
    drained = next(d for d in pair.decode if d.worker_id == source)
    assert not drained.engine.requests


def fail_once(worker: object, method: str, after: bool,
              then: Callable[[], None]) -> list[str]:
    """``worker.method`` fails once, as the Ray proxy says a dead worker's call did
    (``WorkerGone``): before the call or ``after`` it ran; ``then`` first (the router
    learns the worker is gone). The ids it failed for."""
    real = getattr(worker, method)
    failed: list[str] = []

    async def failing(request_id: str, *args: object) -> object:
        if failed:
            return await real(request_id, *args)
        failed.append(request_id)
        if after:
            await real(request_id, *args)
        then()
        raise WorkerGone(f"test: {method} lost")

    setattr(worker, method, failing)
    return failed


def test_a_move_whose_target_is_lost_before_the_stop_leaves_the_request_where_it_was(
        pair_factory: Callable[..., Pair], tiny_model: Callable[[str], Path]) -> None:
    """The target is lost as it reserves: the move is given up, the request decodes on
    where it was, and the (live) target's reservation goes."""
    pair = pair_factory(n_decode=2, decode_blocks=256)
    router = pair.router
    lost: list[str] = []
    for d in pair.decode:  # every reservation there is lost (no move may get through first)
        real = d.reserve_moved

        async def lose(*args: object, d: DecodeWorker = d, real: Any = real) -> object:
            await real(*args)
            lost.append(d.worker_id)
            router.workers.gone(d.worker_id, "test")
            raise WorkerGone("test: reserve_moved lost")

        d.reserve_moved = lose  # type: ignore[method-assign]
    source, finals = drain_mid_stream(pair, tiny_model)
    assert finals[0].num_retries == 0 and finals[0].timings.worker == source
    (target,) = (d for d in pair.decode if d.worker_id != source)
    assert set(lost) == {target.worker_id}
    until("the target's reservation is freed", lambda: target.engine.pool.num_used == 0)


def test_a_move_whose_source_dies_after_the_stop_fails_over(
        pair_factory: Callable[..., Pair], tiny_model: Callable[[str], Path]) -> None:
    """The source lets the request go, sends the rest and dies: the attempt fails and
    retries as any other (from the tokens the client has), the target's reservation
    freed."""
    pair = pair_factory(n_decode=2, decode_blocks=256)
    router = pair.router
    died: list[str] = []
    for d in pair.decode:
        fail_once(d, "move_stop", after=True, then=lambda d=d: (  # type: ignore[misc]
            died.append(d.worker_id),
            router.fanout.fail_worker(d.worker_id, FailReason.WORKER_DIED, "test")))
    _, finals = drain_mid_stream(pair, tiny_model)
    assert len(died) == 1
    assert any(f.num_retries == 1 for f in finals)


def drain_mid_stream(pair: Pair, tiny_model: Callable[[str], Path],
                     drained: Callable[[str], None] = lambda _: None,
                     ) -> tuple[str, list[FinalChunk]]:
    """The three requests decode, then the decode worker of "r0" is drained while a
    client reads on (``drained(its id)`` is called as the drain returns): every stream
    is the engine's alone, whatever happened to the moves. The drained worker's id and
    the final chunks."""
    want = expected(tiny_model)

    async def body(router: Router) -> tuple[str, list[tuple[list[int], FinalChunk]]]:
        streams = [router.generate(GenerateRequest(f"r{i}", params, prompt_token_ids=p))
                   for i, (p, params) in enumerate(zip(PROMPTS, PARAMS, strict=True))]
        heads: list[list[int]] = []
        for s in streams:  # a few tokens each: every one is decoding
            got: list[int] = []
            while len(got) < 24:
                item = await asyncio.wait_for(anext(s), timeout=30)
                assert isinstance(item, StreamChunk)
                got += item.token_ids
            heads.append(got)
        source = next(w for w in router.fanout.workers_of("r0") if w.startswith("decode"))
        reading = asyncio.gather(*(collect(s) for s in streams))  # (a client reads on)
        assert await router.drain_worker(source, timeout_s=60) == 0
        drained(source)
        tails = await reading
        return source, [(h + t[0], t[2]) for h, t in zip(heads, tails, strict=True)]

    source, results = run(pair, body)  # type: ignore[misc]
    for (tokens, _), reference in zip(results, want, strict=True):
        assert tokens == reference
    return source, [final for _, final in results]


def test_rebalancing_moves_requests_to_a_decode_worker_that_joined(
        pair_factory: Callable[..., Pair], tiny_model: Callable[[str], Path]) -> None:
    """Every request on decode-0; decode-1 joins: with ``rebalance`` on, some of
    decode-0's requests move to it with their KV, every stream the engine's alone."""
    want = expected(tiny_model)
    pair = pair_factory(n_decode=1, decode_blocks=256, rebalance=True,
                        rebalance_interval_s=0.05, rebalance_min_excess=1)
    late = DecodeWorker("decode-1", tiny_model("llama-gqa"),
                        EngineConfig(role="decode", num_blocks=256), "local", kv_timeout_s=5)
    pair.decode.append(late)  # (closed and checked with the others)

    async def body(router: Router) -> list[tuple[list[int], str, FinalChunk]]:
        streams = [router.generate(GenerateRequest(f"r{i}", params, prompt_token_ids=p))
                   for i, (p, params) in enumerate(zip(PROMPTS, PARAMS, strict=True))]
        firsts = [await asyncio.wait_for(anext(s), timeout=30) for s in streams]
        reading = asyncio.gather(*(collect(s) for s in streams))
        await router.add_worker(late)
        rest = await reading
        return [([*f.token_ids, *t], x, final)  # type: ignore[union-attr]
                for f, (t, x, final) in zip(firsts, rest, strict=True)]

    results = run(pair, body)  # type: ignore[misc]
    for (tokens, _, final), reference in zip(results, want, strict=True):  # type: ignore[misc]
        assert tokens == reference
        assert final.num_retries == 0
    assert any(final.timings.worker == "decode-1" for _, _, final in results)  # type: ignore[misc]


def test_a_decode_worker_with_a_draft_model_keeps_its_requests(
        pair_factory: Callable[..., Pair], tiny_model: Callable[[str], Path]) -> None:
    """Moves between decode workers with a draft model are refused (its state does not
    travel yet): a drained one finishes its requests itself, nothing moved or failed."""
    spec = {"speculative_config": {"method": "draft_model", "num_speculative_tokens": 4,
                                   "model": str(tiny_model("llama-mha"))}}
    pair = pair_factory(n_decode=2, decode_blocks=256, prefill_engine=spec,
                        decode_engine=spec)
    source, finals = drain_mid_stream(pair, tiny_model)
    assert finals[0].num_retries == 0 and finals[0].timings.worker == source
    assert all(f.num_retries == 0 for f in finals)


def test_a_stop_whose_send_cannot_start_leaves_the_request_running(
        pair_factory: Callable[..., Pair], tiny_model: Callable[[str], Path]) -> None:
    """The source's channel to the target is gone when it is asked to stop (its peer
    was dropped after a failure): the request is not taken out of its engine, and it
    decodes on there to the end -- no retry, nothing lost."""
    pair = pair_factory(n_decode=2, decode_blocks=256)
    for d in pair.decode:
        real = d.move_stop

        async def stop(*args: object, d: DecodeWorker = d, real: Any = real) -> object:
            assert d._mover is not None
            d._mover._peers.clear()
            return await real(*args)

        d.move_stop = stop  # type: ignore[method-assign]
    source, finals = drain_mid_stream(pair, tiny_model)
    assert finals[0].num_retries == 0 and finals[0].timings.worker == source
