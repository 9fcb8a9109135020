"""Router + prefill/decode workers in one process (local transfer backend, no Ray):
admission and cancels -- a cancel mid-stream or while waiting for room frees
everything, bad input and overload are refused, duplicate ids in flight too, a burst
spreads over decode workers, file service discovery follows live workers, tokens that
beat admission back are kept, a caller giving up cannot cancel a prefill under the loop."""

from __future__ import annotations

import asyncio
import contextlib
import re
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.sampling.sampling_params import SamplingParams
from pdserve.messages import PrefillResult, PrefillTask
from pdserve.router.router import Router
from pdserve.router.types import ErrorKind, FinalChunk, GenerateRequest, RouterError, StreamChunk
from tests.inprocess import GREEDY, Pair, collect, generate_all, run
from tests.waiting import until_async


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
