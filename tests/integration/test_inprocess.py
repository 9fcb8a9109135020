"""Router + prefill/decode/colocated workers in one process (local transfer backend,
no Ray): the serving path's logic, fast. The same worker objects the Ray actors hold are the
router's handles here. This file: what is served equals what the engine makes (threads,
speculation, predictions, a draft model's KV), KV sent chunk by chunk, stop strings cut
in the router, the first token streamed before the hand-over. Beside it:
test_inprocess_prefix.py (conversations and the prefix cache), test_inprocess_admission.py
(bad input, overload, cancels), test_inprocess_failover.py (retries, lost routers and
workers, refused workers)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.sampling.sampling_params import SamplingParams
from pdserve.kv_transfer import KVLayoutMismatch
from pdserve.kv_transfer.with_draft import DraftSender
from pdserve.router.router import Router
from pdserve.router.types import FinalChunk, GenerateRequest, StreamChunk
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
