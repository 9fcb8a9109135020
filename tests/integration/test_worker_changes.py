"""Workers added and drained at runtime (``WorkerSet.add`` / ``drain``), in process:
the router's side of scaling. A drained worker finishes what it has and takes nothing
new; what a drain timeout cuts off fails over and still ends with the right tokens."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.sampling.sampling_params import SamplingParams
from pdserve.router.router import Router
from pdserve.router.types import GenerateRequest
from pdserve.worker.decode import DecodeWorker
from pdserve.worker.prefill import PrefillWorker
from tests.inprocess import GREEDY, Pair, collect, run
from tests.router.http_helpers import wait_freed
from tests.waiting import until_async

PROMPTS = [[5 + (i * 7 + j) % 300 for j in range(8 + 5 * i)] for i in range(8)]


def expected(model: Path, params: SamplingParams = GREEDY) -> list[list[int]]:
    engine = LLMEngine(model, EngineConfig(num_blocks=256))
    return [o.token_ids for o in engine.generate(PROMPTS, params)]


def new_decode(pair: Pair, model: Path, wid: str) -> DecodeWorker:
    w = DecodeWorker(wid, model, EngineConfig(role="decode", num_blocks=128), "local",
                     kv_timeout_s=5)
    pair.decode.append(w)  # closed (and checked for leaks) with the pair
    return w


def generate(router: Router, prefix: str, params: SamplingParams = GREEDY,
             ) -> list[asyncio.Task[tuple[list[int], str, object]]]:
    return [asyncio.create_task(collect(router.generate(GenerateRequest(
        f"{prefix}{i}", params, prompt_token_ids=p)))) for i, p in enumerate(PROMPTS)]


def test_add_then_drain_under_load(pair_factory: Callable[..., Pair],
                                   tiny_model: Callable[[str], Path]) -> None:
    model = tiny_model("llama-gqa")
    pair = pair_factory()
    want = expected(model)
    extra_p = PrefillWorker("prefill-1", model, EngineConfig(role="prefill", num_blocks=128),
                            "local")
    pair.prefill.append(extra_p)

    async def body(router: Router) -> None:
        await router.add_worker(new_decode(pair, model, "decode-1"))
        await router.add_worker(extra_p)
        states = {w["id"]: w["state"] for w in router.worker_info()}
        assert states == dict.fromkeys(["prefill-0", "decode-0", "decode-1", "prefill-1"],
                                       "serving")
        # New decode worker's channel opened on demand: it serves requests.
        first = generate(router, "a")
        await until_async("requests on both decode workers", lambda: all(
            router.workers.workers[d].outstanding_requests for d in ("decode-0", "decode-1")))
        # Drain the original pair's decode and prefill while their requests run.
        cut = await asyncio.gather(router.drain_worker("decode-0", 60),
                                   router.drain_worker("prefill-0", 60))
        assert cut == [0, 0]
        results = await asyncio.gather(*first)
        assert [t for t, _, _ in results] == want
        # Nothing failed over: a drained prefill worker's finished prefills no longer
        # tie their requests to it.
        assert all(f.num_retries == 0 for _, _, f in results)  # type: ignore[attr-defined]
        assert set(router.workers.workers) == {"decode-1", "prefill-1"}
        assert pair.decode[0].engine.pool.num_used == 0  # nothing left on the drained one
        # After the drain everything runs on the new pair.
        second = await asyncio.gather(*generate(router, "b"))
        assert [t for t, _, _ in second] == want
        assert all(f.num_retries == 0 for _, _, f in second)  # type: ignore[attr-defined]

    run(pair, body)


def test_drain_timeout_fails_over_without_losing_tokens(pair_factory: Callable[..., Pair],
                                                        tiny_model: Callable[[str], Path]) -> None:
    model = tiny_model("llama-gqa")
    pair = pair_factory()
    long = SamplingParams(max_tokens=200, ignore_eos=True)
    want = expected(model, long)

    async def body(router: Router) -> None:
        await router.add_worker(new_decode(pair, model, "decode-1"))
        tasks = generate(router, "c", long)
        await until_async("a request on decode-0",
                          lambda: router.workers.workers["decode-0"].outstanding_requests > 0)
        cut = await router.drain_worker("decode-0", timeout_s=0.001)
        assert cut > 0  # still busy at the timeout: those attempts failed over
        results = await asyncio.gather(*tasks)
        assert [t for t, _, _ in results] == want  # retried on decode-1, nothing lost
        assert any(f.num_retries for _, _, f in results)  # type: ignore[attr-defined]
        assert "decode-0" not in router.workers.workers
        await wait_freed(pair)  # the failed-over attempts' blocks, on every worker

    run(pair, body)
