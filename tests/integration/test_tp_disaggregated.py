"""Prefill and decode workers of different tensor-parallel degrees, in process: every
rank moves its own KV heads over a channel of its own (``kv_transfer.sharded``: torch
/ gloo here, nixl on Ray), one to many and many to one. Every combination gives one
colocated rank's greedy tokens and leaks no block."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Callable
from pathlib import Path

import pytest

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.sampling.sampling_params import SamplingParams
from pdserve.router.router import Router
from pdserve.router.types import GenerateRequest
from tests.inprocess import (
    GREEDY,
    Pair,
    collect,
    draft_first_work,
    generate_all,
    run,
)
from tests.waiting import until_async

PROMPTS = [[5 + (i * 11 + j) % 300 for j in range(5 + 17 * i)] for i in range(4)]


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(2, 1), (1, 2), (2, 2)])
def test_tp_pairs_equal_one_colocated_rank(pair_factory: Callable[..., Pair],
                                           tiny_model: Callable[[str], Path],
                                           prefill_tp: int, decode_tp: int) -> None:
    model = tiny_model("llama-gqa")
    want = [o.token_ids for o in LLMEngine(model, EngineConfig(num_blocks=256)).generate(
        PROMPTS, GREEDY)]
    pair = pair_factory(
        prefill_engine={"tensor_parallel_size": prefill_tp, "num_threads": 1},
        decode_engine={"tensor_parallel_size": decode_tp, "num_threads": 1}, transfer="torch")
    got = generate_all(pair, PROMPTS)
    assert [tokens for tokens, _, _ in got] == want
    assert all(f.num_retries == 0 for _, _, f in got)


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(2, 1), (1, 2), (2, 2)])
def test_a_draft_model_with_tp_pools(pair_factory: Callable[..., Pair],
                                     tiny_model: Callable[[str], Path],
                                     prefill_tp: int, decode_tp: int) -> None:
    """Speculation with a draft model between pools of any tensor-parallel degrees:
    rank 0 of each holds the draft, its prompt KV moves beside rank 0's target KV, so
    the decode worker's draft computes only the tokens after each prompt, and the
    tokens are one colocated rank's without speculation."""
    model = tiny_model("llama-gqa")
    want = [o.token_ids for o in LLMEngine(model, EngineConfig(num_blocks=256)).generate(
        PROMPTS, GREEDY)]
    spec = {"method": "draft_model", "num_speculative_tokens": 4, "model": str(model),
            "disable_by_batch_size": 64}  # every request drafts
    pair = pair_factory(
        prefill_engine={"tensor_parallel_size": prefill_tp, "num_threads": 1,
                        "speculative_config": spec},
        decode_engine={"tensor_parallel_size": decode_tp, "num_threads": 1,
                       "speculative_config": spec}, transfer="torch")
    first_work = draft_first_work(pair.decode[0])
    got = generate_all(pair, PROMPTS)
    assert [tokens for tokens, _, _ in got] == want
    assert sum(f.timings.spec_accepted_tokens for _, _, f in got) > 0
    assert len(first_work) == len(PROMPTS) and set(first_work.values()) == {1}, first_work


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_lost_rank_takes_its_worker_out(pair_factory: Callable[..., Pair],
                                          tiny_model: Callable[[str], Path]) -> None:
    """decode-0 is two ranks; its follower dies mid-request: decode-0's loop fails, it
    leaves routing, and its requests finish on decode-1 with the right tokens."""
    model = tiny_model("llama-gqa")
    long = SamplingParams(max_tokens=120, ignore_eos=True)
    want = [o.token_ids for o in LLMEngine(model, EngineConfig(num_blocks=256)).generate(
        PROMPTS, long)]
    pair = pair_factory(n_decode=2, decode_engine={"tensor_parallel_size": 2, "num_threads": 1},
                        transfer="torch")
    tp_worker = pair.decode[0]

    async def body(router: Router) -> None:
        tasks = [asyncio.create_task(collect(router.generate(GenerateRequest(
            f"r{i}", long, prompt_token_ids=p)))) for i, p in enumerate(PROMPTS)]
        await until_async("a request decoding on decode-0",
                          lambda: router.workers.workers["decode-0"].outstanding_requests > 0
                          and any(r.num_output_tokens > 3
                                  for r in tp_worker.engine.requests.values()))
        tp_worker.engine._followers[0].kill()
        results = await asyncio.gather(*tasks)
        assert [tokens for tokens, _, _ in results] == want
        assert any(f.num_retries for _, _, f in results)
        assert not router.workers.workers["decode-0"].alive
        await wait_freed_except(pair, tp_worker)

    run(pair, body)
    assert tp_worker.loop.error is not None and "rank 1" in str(tp_worker.loop.error)
    pair.decode.remove(tp_worker)  # its loop is gone: nothing to check on it
    tp_worker.close()


async def wait_freed_except(pair: Pair, dead: object) -> None:
    await until_async("blocks freed on the live workers", lambda: all(
        w.engine.pool.num_used == 0 for w in pair.workers if w is not dead))


def followers(pid: int) -> list[int]:
    """The tensor-parallel ranks process ``pid`` spawned (multiprocessing children)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes()
        except OSError:
            continue
        if int(fields[1]) == pid and b"spawn_main" in cmdline:
            out.append(int(stat.parent.name))
    return out


@pytest.mark.usefixtures("ray_address")
def test_ray_pools_of_different_tp_and_a_rank_lost(tiny_model: Callable[[str], Path]) -> None:
    """On Ray: a 2-rank prefill worker (one actor, its follower process beside it) feeds a
    1-rank decode worker over nixl with the engine's tokens; killing the follower ends
    the actor, Ray restarts it whole and it serves again."""
    from pdserve.cluster.cluster import Cluster
    from pdserve.cluster.config import ClusterConfig
    from tests.integration.clusters import run_one

    model = tiny_model("llama-gqa")
    want = [o.token_ids for o in LLMEngine(model, EngineConfig(num_blocks=256, dtype="auto"))
            .generate(PROMPTS, GREEDY)]
    cfg = ClusterConfig.from_dict({
        "model": str(model), "transfer": "nixl", "restart_backoff_s": 0.2,
        "prefill": {"workers": 1, "num_cpus": 2, "tensor_parallel_size": 2,
                    "engine": {"num_blocks": 128}},
        "decode": {"workers": 1, "num_cpus": 1, "engine": {"num_blocks": 256}},
        "router": {"health_timeout_s": 5, "queue_timeout_s": 60, "placement": "static"}})
    cluster = Cluster(cfg)
    cluster.start()

    async def body() -> None:
        router = cluster.make_router()
        await router.start()
        try:
            async def all_prompts(tag: str) -> list[list[int]]:
                return [t for t, _, _ in await asyncio.gather(*(
                    run_one(router, f"{tag}{i}", p, GREEDY) for i, p in enumerate(PROMPTS)))]

            assert await all_prompts("a") == want
            pid = await asyncio.to_thread(cluster.pid, "prefill-0")
            (follower,) = followers(pid)
            os.kill(follower, signal.SIGKILL)
            await until_async("prefill-0 to restart and rejoin",
                              lambda: router.workers.workers["prefill-0"].restarts >= 1
                              and router.ready(), 120)
            assert await all_prompts("b") == want
        finally:
            await router.stop()

    try:
        asyncio.run(body())
        cluster.check_integrity()
    finally:
        cluster.shutdown()
