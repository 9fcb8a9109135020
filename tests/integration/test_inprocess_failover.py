"""Router + prefill/decode/colocated workers in one process (local transfer backend,
no Ray): failures -- a retry after the streamed first token continues after it (and
rebuilds a draft model's state), workers that disagree with the router or serve another
model are refused, two routers share workers and a lost router's requests end, hand-off
answers nobody takes are dropped."""

from __future__ import annotations

import asyncio
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.sampling.sampling_params import SamplingParams
from pdserve.failures import FailReason
from pdserve.messages import PrefillResult, PrefillTask, RequestDelta
from pdserve.router.router import Router, RouterConfig
from pdserve.router.types import GenerateRequest, StreamChunk
from pdserve.worker.colocated import ColocatedWorker
from tests.inprocess import GREEDY, Pair, collect, draft_first_work, run
from tests.waiting import until, until_async


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
