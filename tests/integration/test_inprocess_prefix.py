"""Router + prefill/decode workers in one process (local transfer backend, no Ray):
conversations and the prefix cache -- only the blocks decode lacks are sent, a short new
turn is prefilled on the decode worker, an abort mid-transfer keeps shared blocks
exact, a retry onto a worker without the prefix sends it all, prefix affinity keeps a
conversation on its decode worker."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.sampling.sampling_params import SamplingParams
from pdserve.failures import FailReason
from pdserve.router.router import Router
from pdserve.router.types import GenerateRequest, StreamChunk
from tests.inprocess import GREEDY, Pair, collect, run
from tests.waiting import until_async


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_conversation_sends_only_the_blocks_decode_lacks(
        pair_factory: Callable[..., Pair], tiny_model: Callable[[str], Path], dtype: str) -> None:
    """Each turn resends the whole history, as chat clients do: the decode worker keeps
    the earlier turns' blocks (the prompts it received, the answers it computed) and
    reserves fresh blocks only for the rest, and the prefill worker sends only those.
    The answers are a colocated engine's (which reuses its prefix cache the same way),
    in bfloat16 too: the prefill worker recomputes an earlier answer's KV in a prefill
    step, bit for bit what the decode steps that produced it wrote."""
    pair = pair_factory(prefill_engine={"dtype": dtype}, decode_engine={"dtype": dtype},
                        local_prefill_max_tokens=0)  # every turn through the prefill worker
    eng = LLMEngine(tiny_model("llama-gqa"), EngineConfig(num_blocks=256, dtype=dtype))
    history = [7 + (j * 13) % 400 for j in range(40)]
    expected: list[list[int]] = []
    for turn in range(3):
        (out,) = eng.generate([history], GREEDY)
        expected.append(out.token_ids)
        history = history + out.token_ids + [11 + turn + (j * 7) % 300 for j in range(10)]
    p, d = pair.prefill[0], pair.decode[0]
    block_bytes = p.layout.block_bytes

    async def body(router: Router) -> None:
        history = [7 + (j * 13) % 400 for j in range(40)]
        for turn in range(3):
            sent_before = p.metrics().kv_transfer_bytes
            tokens, _, _ = await collect(router.generate(GenerateRequest(
                f"t{turn}", GREEDY, prompt_token_ids=history)))
            assert tokens == expected[turn]
            await until_async("P's counters",
                              lambda n=turn + 1: p.metrics().kv_transfers == n)
            sent = (p.metrics().kv_transfer_bytes - sent_before) // block_bytes
            full = -(-len(history) // 16)
            if turn == 0:
                assert sent == full
            else:  # the earlier turns' full blocks stayed on D
                assert sent <= full - (len(history) - 10 - 24) // 16 + 1, (turn, sent, full)
            history = history + tokens + [11 + turn + (j * 7) % 300 for j in range(10)]
        await until_async("D's counters", lambda: d.metrics().prefix_hits > 0)

    run(pair, body)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_short_new_turn_is_prefilled_on_the_decode_worker(
        pair_factory: Callable[..., Pair], tiny_model: Callable[[str], Path], dtype: str) -> None:
    """A conversation's next turn whose uncached part (on the decode worker that holds
    the earlier turns) is at most ``local_prefill_max_tokens`` is computed there: the
    prefill worker never sees it, no KV moves, the first token comes from the decode
    worker with its prefill stages. Answers are a colocated engine's; a prompt asking
    for prompt logprobs, or a longer suffix, still goes through the prefill worker."""
    pair = pair_factory(prefill_engine={"dtype": dtype}, decode_engine={"dtype": dtype},
                        local_prefill_max_tokens=40)
    eng = LLMEngine(tiny_model("llama-gqa"), EngineConfig(num_blocks=256, dtype=dtype))
    p, d = pair.prefill[0], pair.decode[0]

    def turns(n: int, reply: Callable[[list[int]], list[int]]) -> list[list[int]]:
        history, prompts = [7 + (j * 13) % 400 for j in range(40)], []
        for turn in range(n):
            prompts.append(history)
            history = history + reply(history) + [11 + turn + (j * 7) % 300 for j in range(10)]
        return prompts

    expected: dict[int, list[int]] = {}

    def colocated(history: list[int]) -> list[int]:
        expected[len(expected)] = eng.generate([history], GREEDY)[0].token_ids
        return expected[len(expected) - 1]

    prompts = turns(3, colocated)

    async def body(router: Router) -> None:
        for turn, prompt in enumerate(prompts):
            tokens, _, final = await collect(router.generate(GenerateRequest(
                f"t{turn}", GREEDY, prompt_token_ids=prompt)))
            assert tokens == expected[turn]
            assert final.timings.prefill is not None and final.timings.ttft is not None
            if turn:  # D held the earlier turns: a 26-token suffix, computed there
                assert final.timings.kv_bytes is None and final.usage.cached_tokens >= 48
        await until_async("D's counters", lambda: d.metrics().local_prefills == 2)
        assert p.metrics().kv_transfers == 1  # turns 1 and 2 never reached P
        # prompt logprobs need every position computed: the prefill worker's
        longer = prompts[2] + expected[2] + list(range(30, 90))  # a 60+-token suffix
        for rid, params, prompt in (
                ("lp", SamplingParams(max_tokens=4, prompt_logprobs=0), prompts[2]),
                ("long", GREEDY, longer)):
            await collect(router.generate(GenerateRequest(rid, params, prompt_token_ids=prompt)))
        await until_async("P's counters", lambda: p.metrics().kv_transfers == 3)
        assert d.metrics().local_prefills == 2
        await d.check_integrity()

    run(pair, body)


def _two_turns(eng: LLMEngine) -> tuple[list[int], list[int], list[int]]:
    """A first turn, the second turn's prompt (first + answer + 10 new tokens), and
    the second turn's answer, as a colocated engine gives them."""
    first = [7 + (j * 13) % 400 for j in range(40)]
    (a1,) = eng.generate([first], GREEDY)
    second = first + a1.token_ids + [11 + (j * 7) % 300 for j in range(10)]
    (a2,) = eng.generate([second], GREEDY)
    return first, second, a2.token_ids


def test_an_abort_mid_transfer_keeps_the_shared_blocks_exact(
        pair_factory: Callable[..., Pair], tiny_model: Callable[[str], Path]) -> None:
    """A second turn shares the first turn's blocks on the decode worker; the client
    gives up after P's first token, with the KV still held in P. Its fresh blocks
    are freed once the receiver reports it, the shared ones keep only the cache's
    claim on them, and the same turn sent again shares them once more."""
    pair = pair_factory(local_prefill_max_tokens=0)
    eng = LLMEngine(tiny_model("llama-gqa"), EngineConfig(num_blocks=256))
    first, second, want = _two_turns(eng)
    p, d = pair.prefill[0], pair.decode[0]

    async def body(router: Router) -> None:
        await collect(router.generate(GenerateRequest("t0", GREEDY, prompt_token_ids=first)))
        hits = d.engine.pool.prefix_hits
        gate = threading.Event()
        p.transfer.post(gate.wait)  # no KV send goes out until set
        stream = router.generate(GenerateRequest("t1", GREEDY, prompt_token_ids=second))
        try:
            got = await asyncio.wait_for(anext(stream), timeout=30)
            assert isinstance(got, StreamChunk) and got.token_ids == want[:1]
            assert d.engine.pool.prefix_hits == hits + 3  # the first turn's full blocks
            await stream.aclose()  # type: ignore[attr-defined]
        finally:
            gate.set()
        await until_async("blocks freed on both workers",
                          lambda: not any(pair.used_blocks().values()))
        await d.check_integrity()
        await p.check_integrity()
        tokens, _, _ = await collect(router.generate(GenerateRequest(
            "t1-again", GREEDY, prompt_token_ids=second)))
        assert tokens == want and d.engine.pool.prefix_hits >= hits + 6

    run(pair, body)


def test_a_retry_onto_a_decode_worker_without_the_prefix_sends_it_all(
        pair_factory: Callable[..., Pair], tiny_model: Callable[[str], Path]) -> None:
    """The decode worker holding a conversation's first turn fails during the second
    turn's hand-over: the retry goes to the other decode worker, whose cache has none
    of it, so P sends every block there; the answer is still the colocated one."""
    pair = pair_factory(n_decode=2, policy="prefix_affinity", local_prefill_max_tokens=0)
    eng = LLMEngine(tiny_model("llama-gqa"), EngineConfig(num_blocks=256))
    first, second, want = _two_turns(eng)
    p = pair.prefill[0]

    async def body(router: Router) -> None:
        await collect(router.generate(GenerateRequest("t0", GREEDY, prompt_token_ids=first)))
        held = next(d for d in pair.decode if d.engine.pool.num_cached > 0)
        other = next(d for d in pair.decode if d is not held)
        await until_async("P's counters", lambda: p.metrics().kv_transfers == 1)
        sent_before = p.metrics().kv_transfer_bytes
        gate = threading.Event()
        p.transfer.post(gate.wait)
        stream = router.generate(GenerateRequest("t1", GREEDY, prompt_token_ids=second))
        try:
            got = await asyncio.wait_for(anext(stream), timeout=30)
            assert isinstance(got, StreamChunk) and got.token_ids == want[:1]
            assert set(router.fanout.workers_of("t1")) >= {held.worker_id}
            router.fanout.fail_worker(held.worker_id, FailReason.WORKER_DIED,
                                      "test: decode worker lost")
        finally:
            gate.set()
        tokens, _, final = await collect(stream)
        assert got.token_ids + tokens == want and final.num_retries == 1
        await until_async("P's counters", lambda: p.metrics().kv_transfers >= 2)
        # the retry's prompt is the second turn plus the streamed token: every block of
        # it went to `other` (what `held` shared is not there)
        full = -(-(len(second) + 1) // 16)
        sent = (p.metrics().kv_transfer_bytes - sent_before) // p.layout.block_bytes
        assert sent >= full and other.engine.pool.prefix_hits == 0
        await other.check_integrity()

    run(pair, body)


def test_prefix_affinity_keeps_a_conversation_on_its_decode_worker(
        pair_factory: Callable[..., Pair]) -> None:
    """Two decode workers, the one that served the first turn now the fuller: with
    prefix_affinity the next turn still goes there (it holds the earlier turn) and
    only the new blocks are sent."""
    pair = pair_factory(n_decode=2, policy="prefix_affinity", local_prefill_max_tokens=0)
    p = pair.prefill[0]
    first = [7 + (j * 13) % 400 for j in range(40)]

    async def body(router: Router) -> None:
        tokens, _, _ = await collect(router.generate(GenerateRequest(
            "t0", GREEDY, prompt_token_ids=first)))
        served = next(d for d in pair.decode if d.engine.pool.num_cached > 0)
        other = next(d for d in pair.decode if d is not served)
        await served.reserve("hold", [3] * 200, GREEDY)  # now the fuller one

        def free(worker_id: str) -> int:
            w = next(w for w in router.workers.live("decode") if w.worker_id == worker_id)
            return w.load.num_free_blocks if w.load is not None else 0

        await until_async("the router to see it fuller",
                          lambda: free(served.worker_id) < free(other.worker_id))
        await until_async("P's counters", lambda: p.metrics().kv_transfers == 1)
        sent_before = p.metrics().kv_transfer_bytes
        second = first + tokens + [11 + (j * 7) % 300 for j in range(10)]
        await collect(router.generate(GenerateRequest("t1", GREEDY, prompt_token_ids=second)))
        await until_async("P's counters", lambda: p.metrics().kv_transfers == 2)
        sent = (p.metrics().kv_transfer_bytes - sent_before) // p.layout.block_bytes
        assert sent < -(-len(second) // 16)  # the earlier turn stayed on `served`
        assert served.engine.pool.prefix_hits > 0 and other.engine.pool.num_cached == 0
        await served.abort("hold")  # still expecting KV: freed via the transfer thread
        await until_async("blocks freed", lambda: not any(pair.used_blocks().values()))

    run(pair, body)
