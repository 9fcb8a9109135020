"""Router + prefill/decode/colocated workers in one process (local transfer backend,
no Ray): the serving path's logic, fast. The same worker objects the Ray actors hold are the
router's handles here."""

from __future__ import annotations

import asyncio
import contextlib
import re
import shutil
import threading
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.sampling.sampling_params import SamplingParams
from pdserve.failures import FailReason
from pdserve.kv_transfer import KVLayoutMismatch
from pdserve.kv_transfer.with_draft import DraftSender
from pdserve.messages import PrefillResult, PrefillTask, RequestDelta
from pdserve.router.router import Router, RouterConfig
from pdserve.router.types import ErrorKind, FinalChunk, GenerateRequest, RouterError, StreamChunk
from pdserve.worker.colocated import ColocatedWorker
from pdserve.worker.decode import DecodeWorker
from pdserve.worker.prefill import PrefillWorker
from tests.inprocess import GREEDY, Pair, collect, draft_first_work, generate_all, run
from tests.waiting import until, until_async


def test_each_worker_multiplies_on_its_loop_thread_with_its_threads(
        pair_factory: Callable[..., Pair], monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU engine's multi-threaded torch work all comes from its worker's loop thread
    (thread_loop.py: another thread's OpenMP pool would put the engine's to sleep
    between parallel regions): the engine is built there, and after a request's KV went
    through the channel threads (which set one thread for themselves) the loops still
    have the engine's count, also once the native kernels have run on them."""
    import torch

    import pdserve.worker.loop

    built_on: list[str] = []
    create = pdserve.worker.loop.create_engine

    def recording(*args: Any, **kwargs: Any) -> LLMEngine:
        built_on.append(threading.current_thread().name)
        return create(*args, **kwargs)

    monkeypatch.setattr(pdserve.worker.loop, "create_engine", recording)
    pair = pair_factory(prefill_engine={"num_threads": 2}, decode_engine={"num_threads": 2})
    assert built_on == ["prefill-prefill-0", "decode-decode-0"]
    [(tokens, _, final)] = generate_all(pair, [[5, 6, 7, 8] * 8])
    assert final.finish_reason == "length" and len(tokens) == GREEDY.max_tokens
    for w in pair.workers:
        assert w.loop.call(torch.get_num_threads).result(10) == 2, w.worker_id


@pytest.mark.parametrize("mode", ["pair", "colocated"])
def test_served_equals_the_engine(pair_factory: Callable[..., Pair],
                                  tiny_model: Callable[[str], Path], mode: str) -> None:
    pair = (pair_factory() if mode == "pair"
            else pair_factory(n_prefill=0, n_decode=0, n_colocated=1))
    eng = LLMEngine(tiny_model("llama-gqa"), EngineConfig(num_blocks=256))
    # No two share a first block: one whose KV landed first would let the decode worker
    # prefill another itself (no KV moved, no kv_transfer timing).
    prompts = [list(range(start, start + n)) for start, n in ((5, 3), (30, 16), (60, 17), (90, 50))]
    expected = eng.generate(prompts, GREEDY)

    for (tokens, text, final), exp in zip(generate_all(pair, prompts), expected, strict=True):
        assert tokens == exp.token_ids
        assert text == exp.text
        assert final.finish_reason == "length"
        assert final.usage.completion_tokens == 24 and final.num_retries == 0
        t = final.timings
        assert t.ttft is not None and t.prefill is not None and t.prefill_queue is not None
        assert t.router_queue is not None and t.e2e is not None and len(t.inter_token) == 23
        assert (t.kv_transfer is not None) == (mode == "pair")


@pytest.mark.parametrize("mode", ["pair", "colocated"])
def test_speculative_serving_equals_the_engine_without_it(
        pair_factory: Callable[..., Pair], tiny_model: Callable[[str], Path], mode: str) -> None:
    """n-gram speculation on the decode (or colocated) worker: the same tokens, several
    per step, the per-request acceptance in the timings, TPOT per token (not per step)."""
    spec = {"speculative_config": {"method": "ngram", "prompt_lookup_min": 1,
                                   "prompt_lookup_max": 3}}
    pair = (pair_factory(decode_engine=spec) if mode == "pair"
            else pair_factory(n_prefill=0, n_decode=0, n_colocated=1, colocated_engine=spec))
    eng = LLMEngine(tiny_model("llama-gqa"), EngineConfig(num_blocks=256))
    prompts = [[7 + (i * 13 + j) % 40 for j in range(30)] * 2 for i in range(3)]
    expected = eng.generate(prompts, GREEDY)
    accepted = 0
    for (tokens, text, final), exp in zip(generate_all(pair, prompts), expected, strict=True):
        assert tokens == exp.token_ids and text == exp.text
        t = final.timings
        assert t.spec_draft_tokens >= t.spec_accepted_tokens >= 0
        accepted += t.spec_accepted_tokens
        assert t.tokens_after_first == 23
        assert t.tpot == pytest.approx(sum(t.inter_token) / 23)
        # deliveries after the first: fewer than the tokens when drafts were accepted
        assert len(t.inter_token) <= 23
    assert accepted > 0


@pytest.mark.parametrize("mode", ["pair", "colocated"])
def test_a_predicted_output_is_drafted_where_nothing_else_speculates(
        pair_factory: Callable[..., Pair], tiny_model: Callable[[str], Path], mode: str) -> None:
    """A request's ``prediction`` drafts on a decode (or colocated) worker with no
    speculative config: the same tokens, and its usage counts the drafted tokens accepted
    and rejected. A prediction given as text (the HTTP API's) is tokenized by the router."""
    pair = (pair_factory() if mode == "pair"
            else pair_factory(n_prefill=0, n_decode=0, n_colocated=1))
    eng = LLMEngine(tiny_model("llama-gqa"), EngineConfig(num_blocks=256))
    prompts = [[7 + (i * 13 + j) % 40 for j in range(20)] for i in range(2)]
    expected = eng.generate(prompts, GREEDY)
    # the first: the true output; the second: the true output with a token changed
    predictions = [expected[0].token_ids,
                   [*expected[1].token_ids[:8], 1, *expected[1].token_ids[9:]]]

    async def body(router: Router) -> list[tuple[list[int], str, FinalChunk]]:
        runs = [collect(router.generate(GenerateRequest(
            f"p{i}", replace(GREEDY, prediction=tuple(pred)), prompt_token_ids=p)))
            for i, (p, pred) in enumerate(zip(prompts, predictions, strict=True))]
        runs.append(collect(router.generate(GenerateRequest(
            "text", GREEDY, prompt_token_ids=prompts[0], prediction=expected[0].text))))
        return await asyncio.gather(*runs)

    outcomes = run(pair, body)
    for (tokens, _, final), exp in zip(outcomes, [*expected, expected[0]],  # type: ignore[call-overload]
                                       strict=True):
        assert tokens == exp.token_ids
        accepted, rejected = final.usage.prediction_tokens
        assert accepted == final.timings.spec_accepted_tokens
        assert rejected == final.timings.spec_draft_tokens - accepted
    (_, _, whole), (_, _, edited), _ = outcomes  # type: ignore[misc]
    # every token after the first but a verification step's own (up to 8 drafted a step)
    assert whole.usage.prediction_tokens[0] >= 23 - 23 // 2 and whole.usage.prediction_tokens[1] == 0
    assert 0 < edited.usage.prediction_tokens[0] < 23 and edited.usage.prediction_tokens[1] > 0


@pytest.mark.usefixtures("free_draft")  # every step drafts, on any machine
@pytest.mark.parametrize("transfer", ["local", "torch"])
def test_a_draft_models_prompt_kv_moves_with_the_targets(
        pair_factory: Callable[..., Pair], tiny_model: Callable[[str], Path],
        transfer: str) -> None:
    """Speculation with a draft model, 1P+1D: the prefill worker computes the draft's
    prompt KV and it moves in the same transfer, so the decode worker's draft computes
    none of a prompt, only the tokens after it; the text is the engine's without
    speculation, token for token; the transfer's bytes count the draft's blocks."""
    spec = {"speculative_config": {"method": "draft_model", "num_speculative_tokens": 4,
                                   "model": str(tiny_model("llama-mha")),
                                   "disable_by_batch_size": 64}}  # every request drafts
    pair = pair_factory(prefill_engine=spec, decode_engine=spec, transfer=transfer)
    p = pair.prefill[0]
    assert isinstance(p.sender, DraftSender)
    first_work = draft_first_work(pair.decode[0])
    eng = LLMEngine(tiny_model("llama-gqa"), EngineConfig(num_blocks=256))
    prompts = [list(range(start, start + n)) for start, n in ((5, 20), (40, 33), (90, 50))]
    expected = eng.generate(prompts, GREEDY)
    drafted = 0
    for (tokens, text, final), exp in zip(generate_all(pair, prompts), expected, strict=True):
        assert tokens == exp.token_ids and text == exp.text
        assert final.timings.kv_transfer is not None
        drafted += final.timings.spec_draft_tokens
    assert drafted > 0
    assert len(first_work) == 3 and set(first_work.values()) == {1}, first_work
    until("P's counters", lambda: p.metrics().kv_transfers == 3)
    blocks = sum(-(-len(pr) // 16) for pr in prompts)
    assert p.metrics().kv_transfer_bytes == blocks * (
        p.layout.block_bytes + p.sender.draft_layout.block_bytes)


def test_pools_that_disagree_on_the_draft_model_do_not_connect(
        tiny_model: Callable[[str], Path]) -> None:
    spec = {"method": "draft_model", "model": str(tiny_model("llama-mha"))}
    model = tiny_model("llama-gqa")
    p = PrefillWorker("p", model, EngineConfig(role="prefill", num_blocks=64))
    d = DecodeWorker("d", model, EngineConfig(role="decode", num_blocks=64,
                                              speculative_config=spec))  # type: ignore[arg-type]

    async def connect() -> None:
        await p.connect("d", (await d.join_info()).kv_endpoint)  # type: ignore[arg-type]

    try:
        with pytest.raises(KVLayoutMismatch, match=r"draft: local=None peer='tiny'.*draft model"):
            asyncio.run(connect())
    finally:
        p.close()
        d.close()


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


def test_kv_sent_chunk_by_chunk(pair_factory: Callable[..., Pair],
                                tiny_model: Callable[[str], Path]) -> None:
    """Prompts prefilled in 32-token chunks go out block by block as the chunks are
    computed (the last send carries the rest and the first token): the decode side
    gets exactly the KV, and P sent every prompt block once."""
    pair = pair_factory(prefill_engine={"max_num_batched_tokens": 32})
    eng = LLMEngine(tiny_model("llama-gqa"), EngineConfig(num_blocks=256))
    prompts = [[7 + (i * 13 + j) % 400 for j in range(150)] for i in range(3)]
    expected = eng.generate(prompts, GREEDY)

    results = generate_all(pair, prompts)
    assert [tokens for tokens, _, _ in results] == [e.token_ids for e in expected]
    p = pair.prefill[0].metrics()
    assert p.kv_transfers == 3 and p.kv_sends > p.kv_transfers  # blocks went out early
    assert p.kv_transfer_bytes == 3 * 10 * pair.prefill[0].layout.block_bytes  # 10 blocks each


def test_stop_strings_are_cut_in_the_router(pair_factory: Callable[..., Pair],
                                            tiny_model: Callable[[str], Path]) -> None:
    """The decode worker streams token ids; the router's text processor finds the stop
    string, ends the stream there, and the request is aborted on the worker."""
    pair = pair_factory()
    eng = LLMEngine(tiny_model("llama-gqa"), EngineConfig(num_blocks=256))
    prompt = list(range(40, 60))
    full = eng.generate([prompt], SamplingParams(max_tokens=40, ignore_eos=True))[0]
    stop = full.text[len(full.text) // 2:][:3]
    params = SamplingParams(max_tokens=40, ignore_eos=True, stop=(stop,))
    expected = eng.generate([prompt], params)[0]
    assert expected.finish_reason == "stop" and len(expected.token_ids) < 40

    async def body(router: Router) -> tuple[list[int], str, FinalChunk]:
        got = await collect(router.generate(GenerateRequest("s", params, prompt_token_ids=prompt)))
        await until_async("the stopped request's blocks back",
                          lambda: not any(pair.used_blocks().values()))
        return got

    tokens, text, final = run(pair, body)  # type: ignore[misc]
    assert (tokens, text) == (expected.token_ids, expected.text)
    assert text == full.text[: full.text.index(stop)]
    assert final.finish_reason == "stop" and final.stop_reason == stop


def test_cancel_mid_stream_frees_blocks(pair_factory: Callable[..., Pair]) -> None:
    pair = pair_factory()

    async def body(router: Router) -> int:
        stream = router.generate(GenerateRequest(
            "c", SamplingParams(max_tokens=500, ignore_eos=True), prompt_token_ids=[5] * 40))
        got = 0
        async for item in stream:
            got += isinstance(item, StreamChunk)
            if got == 3:
                break
        assert pair.decode[0].engine.pool.num_used > 0  # it was running, holding blocks
        await stream.aclose()  # type: ignore[attr-defined]
        await until_async("blocks freed on both workers",
                          lambda: not any(pair.used_blocks().values()))
        return pair.decode[0].engine.stats().num_running

    assert run(pair, body) == 0


def test_bad_input_and_overload(pair_factory: Callable[..., Pair]) -> None:
    pair = pair_factory(decode_blocks=12, queue_timeout_s=0.3)

    async def body(router: Router) -> None:
        with pytest.raises(RouterError) as e:
            await collect(router.generate(GenerateRequest("e", GREEDY, prompt="")))
        assert e.value.kind is ErrorKind.INVALID
        with pytest.raises(RouterError) as e:
            await collect(router.generate(GenerateRequest(
                "m", GREEDY, messages=[{"role": "nobody"}])))
        assert e.value.kind is ErrorKind.INVALID
        # The engine's rules, checked before routing: no worker sees these.
        calls = pair.decode[0].blocks_granted
        for bad in (SamplingParams(stop_token_ids=[10**6]),
                    SamplingParams(logit_bias={10**6: 1.0}),
                    SamplingParams(max_tokens=10**6)):
            with pytest.raises(RouterError) as e:
                await collect(router.generate(GenerateRequest("v", bad, prompt_token_ids=[5])))
            assert e.value.kind is ErrorKind.INVALID, bad
            with pytest.raises(ValueError, match=re.escape(str(e.value)[:30])):
                pair.decode[0].engine.validate([5], bad)  # the same words from the engine
        assert pair.decode[0].blocks_granted == calls
        # Hold 10 of the decode worker's 12 blocks with a reservation whose KV never
        # comes: a 100-token prompt (7 blocks) must wait, then get 429.
        held = await pair.decode[0].reserve("hold", [7] * 150, GREEDY)
        assert held is not None
        with pytest.raises(RouterError) as e:
            await collect(router.generate(GenerateRequest(
                "b2", GREEDY, prompt_token_ids=[9] * 100)))
        assert e.value.kind is ErrorKind.OVERLOADED and e.value.retry_after_s
        await pair.decode[0].abort("hold")
        tokens, _, _ = await collect(router.generate(GenerateRequest(
            "ok", GREEDY, prompt_token_ids=[9] * 10)))
        assert len(tokens) == 24

    run(pair, body)


def test_cancel_while_waiting_for_room(pair_factory: Callable[..., Pair]) -> None:
    pair = pair_factory(decode_blocks=12, queue_timeout_s=60)

    async def body(router: Router) -> None:
        held = await pair.decode[0].reserve("hold", [7] * 150, GREEDY)  # 10 of 12 blocks
        assert held is not None
        waiting = asyncio.create_task(collect(router.generate(GenerateRequest(
            "w", GREEDY, prompt_token_ids=[9] * 100))))
        await until_async("the request waiting for room",
                          lambda: router.admission.num_waiting == 1)
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        assert router.admission.num_waiting == 0
        await pair.decode[0].abort("hold")
        await until_async("blocks freed", lambda: not any(pair.used_blocks().values()))

    run(pair, body)


def test_duplicate_request_id_in_flight_is_rejected(pair_factory: Callable[..., Pair]) -> None:
    pair = pair_factory()

    async def body(router: Router) -> None:
        long = SamplingParams(max_tokens=200, ignore_eos=True)
        first = router.generate(GenerateRequest("same", long, prompt_token_ids=[5] * 8))
        await first.__anext__()
        with pytest.raises(RouterError) as e:
            await collect(router.generate(GenerateRequest(
                "same", GREEDY, prompt_token_ids=[6] * 8)))
        assert e.value.kind is ErrorKind.INVALID and "in flight" in e.value.message
        await first.aclose()  # type: ignore[attr-defined]
        tokens, _, _ = await collect(router.generate(GenerateRequest(
            "same", GREEDY, prompt_token_ids=[6] * 8)))  # free again once finished
        assert len(tokens) == 24

    run(pair, body)


def test_burst_spreads_over_decode_workers(pair_factory: Callable[..., Pair]) -> None:
    """Admission counts its own reservations: a burst arriving at once (one load
    snapshot) does not pile onto the decode worker that looked emptiest."""
    pair = pair_factory(n_decode=2, stats_interval_s=60)  # no fresh snapshot in the burst

    async def body(router: Router) -> list[FinalChunk]:
        params = SamplingParams(max_tokens=4, ignore_eos=True)
        results = await asyncio.gather(*(
            collect(router.generate(GenerateRequest(f"b{i}", params, prompt_token_ids=[5 + i] * 40)))
            for i in range(8)))
        return [final for _, _, final in results]

    finals = run(pair, body)
    assert all(f.finish_reason == "length" for f in finals)  # type: ignore[attr-defined]
    served = [w.metrics().tokens_computed for w in pair.decode]
    assert all(n > 0 for n in served), f"decode tokens per worker: {served}"
    assert max(served) <= 3 * min(served), f"decode tokens per worker: {served}"


def test_file_sd_follows_live_workers(pair_factory: Callable[..., Pair], tmp_path: Path) -> None:
    import json

    from pdserve.cli.serve import _track_workers
    from pdserve.observability.file_sd import FileSD

    pair = pair_factory(n_prefill=2)
    for i, w in enumerate(pair.workers):  # deploy/ sets this where it serves /metrics
        w.metrics_at = ("127.0.0.1", 9001 + i)
    file_sd = FileSD(tmp_path / "sd.json")

    def listed() -> list[str]:
        if not file_sd.path.exists():
            return []
        return sorted(g["labels"]["worker"] for g in json.loads(file_sd.path.read_text()))

    async def body(router: Router) -> None:
        task = asyncio.create_task(_track_workers(file_sd, router, ("127.0.0.1", 8000),
                                                  interval_s=0.02))
        try:
            await until_async("every worker listed", lambda: listed() == [
                "decode-0", "prefill-0", "prefill-1", "router"])
            pair.prefill[1].close()  # its loop stops: the next probe says it is gone
            await until_async("the stopped worker dropped", lambda: listed() == [
                "decode-0", "prefill-0", "router"])
        finally:
            task.cancel()

    run(pair, body)
    pair.prefill.pop(1)  # closed above


def test_tokens_that_beat_admission_back_are_kept(pair_factory: Callable[..., Pair],
                                                  tiny_model: Callable[[str], Path]) -> None:
    """A colocated worker computes as soon as it admits, so its first tokens can reach
    the router before admit() returns there. Here admit() returns only after the
    router has been handed the request's tokens: none may be lost (they were, before
    the attempt's inbox opened ahead of admission)."""
    pair = pair_factory(n_prefill=0, n_decode=0, n_colocated=1)
    worker, router = pair.colocated[0], pair.router
    prompt = list(range(5, 25))
    want = LLMEngine(tiny_model("llama-gqa"), EngineConfig(num_blocks=256)).generate(
        [prompt], GREEDY)[0].token_ids
    delivered: list[str] = []
    deliver, admit = router.fanout.deliver, worker.admit

    def recording(batch: list[Any]) -> None:
        delivered.extend(d.request_id for d in batch if d.token_ids)
        deliver(batch)

    async def late_admit(request_id: str, *args: Any) -> bool:
        ok = await admit(request_id, *args)
        await until_async("the worker's first tokens at the router",
                          lambda: request_id in delivered)
        return ok

    router.fanout.deliver = recording  # type: ignore[method-assign]
    worker.admit = late_admit  # type: ignore[method-assign]
    (tokens, _, final), = generate_all(pair, [prompt])
    assert tokens == want and final.finish_reason == "length"


def test_a_caller_giving_up_cannot_cancel_a_prefill_under_the_loop(
        pair_factory: Callable[..., Pair]) -> None:
    """Once a prefill is on the worker's loop, only the loop resolves its result. A
    router that gave up (cancelling its wrapper) used to cancel it between the loop's
    done() check and its set_result: InvalidStateError, and the rest of that poll's
    send events were dropped with their pinned blocks (the flaky drain-timeout leak)."""
    pair = pair_factory()
    p, d = pair.prefill[0], pair.decode[0]
    prompt = list(range(5, 45))

    async def main() -> None:
        await p.connect("decode-0", (await d.join_info()).kv_endpoint)
        got = await d.reserve("r", prompt, GREEDY)
        assert got is not None
        blocks = got.blocks
        gate = threading.Event()
        p.transfer.post(gate.wait)  # no send goes out (and "r" stays in flight) until set
        try:
            call = asyncio.ensure_future(p.prefill(PrefillTask("r", prompt, GREEDY,
                                                               "decode-0", blocks)))
            await until_async("the prefill on the worker's loop", lambda: "r" in p._inflight)
            result = p._inflight["r"].future
            assert result.running()  # the loop owns it: cancel() cannot take it away
            call.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await call
        finally:
            gate.set()
        assert isinstance(await asyncio.wrap_future(result), PrefillResult)  # handed off
        await d.abort("r")
        await until_async("every block free", lambda: not any(pair.used_blocks().values()))

    asyncio.run(main())


@pytest.mark.parametrize("logprobs", [None, 2])
def test_first_token_streams_before_the_kv_hand_over(pair_factory: Callable[..., Pair],
                                                    tiny_model: Callable[[str], Path],
                                                    logprobs: int | None) -> None:
    """P's first token reaches the client while its KV cannot leave P (the channel
    thread held): the hand-over adds nothing to TTFT. Once it moves, the decode
    worker's copy of that token is dropped: the tokens (and logprobs) equal the
    engine's, none twice."""
    pair = pair_factory()
    p = pair.prefill[0]
    prompt = list(range(5, 45))  # 40 tokens: two full blocks and a partial one
    params = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=logprobs)
    want = LLMEngine(tiny_model("llama-gqa"), EngineConfig(num_blocks=64)).generate(
        [prompt], params)[0]

    async def body(router: Router) -> None:
        gate = threading.Event()
        stream = router.generate(GenerateRequest("r", params, prompt_token_ids=prompt))
        p.transfer.post(gate.wait)  # no KV send goes out until set
        try:
            first = await asyncio.wait_for(anext(stream), timeout=30)
            assert isinstance(first, StreamChunk) and first.token_ids == want.token_ids[:1]
            assert p._inflight[f"r#0@{router.workers.router_id}"].final_sent is not None  # the last send: still queued
        finally:
            gate.set()
        tokens, _, final = await collect(stream)
        assert first.token_ids + tokens == want.token_ids
        assert final.timings is not None and final.timings.kv_transfer is not None
        if logprobs:
            got = [lp.logprob for lp in first.logprobs]
            assert got == pytest.approx([lp.logprob for lp in want.logprobs[:1]], abs=1e-4)

    run(pair, body)


def lose_the_decode_worker_after_the_first_token(
        pair: Pair, tiny_model: Callable[[str], Path]) -> tuple[str, Any]:
    """Request "r" (a 40-token prompt, 12 tokens); its decode worker is failed once P's
    first token reached the client (its KV still held in P): the client sees every
    token once, as the engine makes them, after one retry. The lost worker's id and
    the final message."""
    p = pair.prefill[0]
    prompt = list(range(5, 45))
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    want = LLMEngine(tiny_model("llama-gqa"), EngineConfig(num_blocks=64)).generate(
        [prompt], params)[0]
    lost: list[tuple[str, Any]] = []

    async def body(router: Router) -> None:
        gate = threading.Event()
        stream = router.generate(GenerateRequest("r", params, prompt_token_ids=prompt))
        p.transfer.post(gate.wait)
        try:
            first = await asyncio.wait_for(anext(stream), timeout=30)
            assert isinstance(first, StreamChunk) and first.token_ids == want.token_ids[:1]
            (dead,) = {w for w in router.fanout.workers_of("r") if w.startswith("decode")}
            router.fanout.fail_worker(dead, FailReason.WORKER_DIED, "test: decode worker lost")
        finally:
            gate.set()
        tokens, _, final = await collect(stream)
        assert first.token_ids + tokens == want.token_ids
        assert final.num_retries == 1
        lost.append((dead, final))

    run(pair, body)
    return lost[0]


def test_a_retry_after_the_streamed_first_token_continues_after_it(
        pair_factory: Callable[..., Pair], tiny_model: Callable[[str], Path]) -> None:
    """The decode worker fails after P's first token reached the client: the retry
    prefills prompt + that token on the other pair and goes on."""
    lose_the_decode_worker_after_the_first_token(pair_factory(n_decode=2), tiny_model)


@pytest.mark.usefixtures("free_draft")  # every step drafts, on any machine
def test_a_retry_rebuilds_the_draft_models_state(
        pair_factory: Callable[..., Pair], tiny_model: Callable[[str], Path]) -> None:
    """Speculation with a draft model; the decode worker fails after the first token:
    the retry's decode worker gets the draft's prompt KV (prompt + that token) in the
    retry's transfer, so its draft too starts from one token; the lost worker's
    draft mirror and blocks go."""
    spec = {"speculative_config": {"method": "draft_model", "num_speculative_tokens": 4,
                                   "model": str(tiny_model("llama-mha")),
                                   "disable_by_batch_size": 64}}  # every request drafts
    pair = pair_factory(n_decode=2, prefill_engine=spec, decode_engine=spec)
    first_work = {d.worker_id: draft_first_work(d) for d in pair.decode}
    dead, final = lose_the_decode_worker_after_the_first_token(pair, tiny_model)
    assert final.timings.spec_draft_tokens > 0
    (lost,) = (d for d in pair.decode if d.worker_id == dead)
    (live,) = (d for d in pair.decode if d.worker_id != dead)
    assert list(first_work[live.worker_id].values()) == [1]  # the retry's attempt
    assert not first_work[lost.worker_id]  # its KV never landed
    until("the lost worker's draft frees the reservation",
          lambda: lost.engine.draft is not None and not lost.engine.draft.mirrors)


@pytest.mark.parametrize(("engine", "says"), [
    ({"block_size": 32}, "its KV block size is 32 tokens, the router's 16"),
    ({"max_model_len": 1024}, "at most 1024 tokens, the router admits 2048"),
])
def test_a_worker_that_disagrees_with_the_router_is_refused(
        pair_factory: Callable[..., Pair], caplog: pytest.LogCaptureFixture,
        engine: dict[str, object], says: str) -> None:
    """Block size and sequence limit come from each worker at join: one that disagrees
    with the router (which counts blocks and hashes prefixes at its block size) stays
    out of routing, named in the log, instead of being miscounted."""
    pair = pair_factory(decode_engine=engine)

    async def body(router: Router) -> None:
        states = {w.worker_id: w.state for w in router.workers.workers.values()}
        assert states == {"prefill-0": "serving", "decode-0": "refused"}
        assert "decode-0" not in pair.prefill[0]._peers  # no channel to it either

    run(pair, body)
    assert any("worker decode-0 (decode) refused" in r.getMessage() and says in r.getMessage()
               for r in caplog.records)


@pytest.mark.parametrize("mode", ["pair", "colocated"])
def test_two_routers_serve_the_same_workers_and_a_lost_routers_requests_end(
        pair_factory: Callable[..., Pair], tiny_model: Callable[[str], Path], mode: str) -> None:
    """Two routers over one set of workers (``pdserve serve --deployment`` twice): each
    gets its own requests' tokens, even under the same request id; when one router's
    streams end without it aborting anything (it died), the workers abort its requests
    at once and free their blocks, and the other router's requests go on."""
    pair = (pair_factory() if mode == "pair"
            else pair_factory(n_prefill=0, n_decode=0, n_colocated=1))
    tok = pair.workers[0].engine.tokenizer
    assert tok is not None
    other = Router(pair.router.model_name, tok, 2048, pair.workers, RouterConfig())
    eng = LLMEngine(tiny_model("llama-gqa"), EngineConfig(num_blocks=256))
    prompt_a, prompt_b = [5] * 40, list(range(7, 37))
    expected_b = eng.generate([prompt_b], GREEDY)[0].token_ids
    token_worker = pair.workers[-1]
    published: list[RequestDelta] = []
    publish = token_worker.outputs.publish

    def recording(batch: list[RequestDelta]) -> None:
        published.extend(batch)
        publish(batch)

    token_worker.outputs.publish = recording  # type: ignore[method-assign]

    async def main() -> None:
        await pair.router.start()
        await other.start()
        try:
            stream_a = pair.router.generate(GenerateRequest(
                "same-id", SamplingParams(max_tokens=2000, ignore_eos=True),
                prompt_token_ids=prompt_a))
            first = await anext(aiter(stream_a))
            assert isinstance(first, StreamChunk)
            task_b = asyncio.create_task(collect(other.generate(
                GenerateRequest("same-id", GREEDY, prompt_token_ids=prompt_b))))
            # b on the token worker beside a (a's 2000 tokens are far from done); b's
            # 24 may all be made between two polls, so wait for a token of b's, not for
            # both running at once
            await until_async("the other router's request on the token worker", lambda: any(
                d.request_id.endswith(f"@{other.workers.router_id}") for d in published))
            await pair.router.stop()  # its streams end; it aborts nothing
            await until_async("the lost router's request to be aborted",
                              lambda: token_worker.engine.stats().num_running <= 1)
            tokens, _, final = await task_b
            assert tokens == expected_b and final.finish_reason == "length"
            await until_async("every block free", lambda: not any(pair.used_blocks().values()))
            assert token_worker.outputs.num_assigned == 0
        finally:
            await other.stop()

    asyncio.run(main())
    lost = [d for d in published if d.request_id.endswith(f"@{pair.router.workers.router_id}")]
    assert lost and not any(d.finish_reason for d in lost)  # aborted, never finished
    assert sum(len(d.token_ids) for d in lost) < 2000


def test_hand_off_answers_nobody_takes_are_dropped(pair_factory: Callable[..., Pair],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A router that died between ``prefill`` and ``handoff`` never takes its answer:
    the prefill worker drops it ``HANDOFF_KEEP_S`` after it resolved (not before, and
    never one still pending), so a router's death leaks nothing on the prefill side."""
    from pdserve.worker import prefill as prefill_module

    pair = pair_factory()
    p, d = pair.prefill[0], pair.decode[0]

    async def prefill(rid: str, prompt: list[int]) -> None:
        got = await d.reserve(rid, prompt, GREEDY)
        assert got is not None
        await p.prefill(PrefillTask(rid, prompt, GREEDY, "decode-0", got.blocks))

    async def main() -> None:
        await p.connect("decode-0", (await d.join_info()).kv_endpoint)
        await prefill("orphan", list(range(5, 45)))  # nobody calls handoff("orphan")
        await until_async("its hand-off to resolve", lambda: p._handoffs["orphan"].done())
        await prefill("next", list(range(6, 46)))
        assert "orphan" in p._handoffs  # resolved just now: kept for its router
        monkeypatch.setattr(prefill_module, "HANDOFF_KEEP_S", 0.0)
        await prefill("third", list(range(7, 47)))
        assert "orphan" not in p._handoffs
        assert isinstance(await p.handoff("third"), PrefillResult)  # its own is taken
        for rid in ("orphan", "next", "third"):
            await d.abort(rid)
        await until_async("every block free", lambda: not any(pair.used_blocks().values()))

    asyncio.run(main())


def test_a_worker_of_another_model_is_refused(pair_factory: Callable[..., Pair],
                                              tiny_model: Callable[[str], Path],
                                              caplog: pytest.LogCaptureFixture,
                                              tmp_path: Path) -> None:
    """The model is part of what a worker reports at join: one serving another model
    (a stale deployment, a wrong --model) stays out of routing, named in the log,
    and the pair of the router's own model serves on."""
    pair = pair_factory()
    other = tmp_path / "another-model"
    shutil.copytree(tiny_model("llama-mha"), other)
    stranger = ColocatedWorker("colocated-0", other, EngineConfig(role="colocated",
                                                                  num_blocks=64))
    tok = pair.workers[0].engine.tokenizer
    assert tok is not None
    router = Router(pair.router.model_name, tok, 2048, [*pair.workers, stranger],
                    RouterConfig())

    async def main() -> None:
        await router.start()
        try:
            states = {w.worker_id: w.state for w in router.workers.workers.values()}
            assert states == {"prefill-0": "serving", "decode-0": "serving",
                              "colocated-0": "refused"}
            tokens, _, final = await collect(router.generate(
                GenerateRequest("r", GREEDY, prompt_token_ids=list(range(5, 25)))))
            assert len(tokens) == 24 and final.finish_reason == "length"
        finally:
            await router.stop()

    try:
        asyncio.run(main())
    finally:
        stranger.close()
    assert any("worker colocated-0 (colocated) refused: it serves model 'another-model', "
               "the router 'tiny'" in r.getMessage() for r in caplog.records)
