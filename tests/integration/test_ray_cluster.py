"""A real local Ray cluster: prefill and decode actor pools, KV over the transfer
backends, the router in front. Golden outputs, concurrency, cancellation, faults."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Callable
from pathlib import Path

import pytest

from pdserve.cluster.cluster import Cluster
from pdserve.cluster.config import ClusterConfig
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.sampling.sampling_params import SamplingParams
from pdserve.router.router import Router
from pdserve.router.types import FinalChunk, GenerateRequest, StreamChunk
from tests.integration.clusters import GREEDY, run_one, start
from tests.waiting import until_async

BACKENDS = ["torch", "ray", "nixl"]


pytestmark = pytest.mark.usefixtures("ray_address")  # the session's shared Ray cluster


def with_router(cluster: Cluster, body: Callable[[Router], object]) -> object:
    async def main() -> object:
        router = cluster.make_router()
        await router.start()
        try:
            return await body(router)  # type: ignore[misc]
        finally:
            await router.stop()

    return asyncio.run(main())


def mixed_prompts(n: int) -> list[list[int]]:
    lengths = [3, 16, 17, 40, 100, 1, 33, 64]
    return [[5 + (i * 7 + j) % 500 for j in range(lengths[i % len(lengths)])] for i in range(n)]


@pytest.mark.parametrize("transfer", BACKENDS)
def test_golden_disaggregated_equals_colocated(tiny_model: Callable[[str], Path],
                                               transfer: str) -> None:
    model = tiny_model("llama-gqa")
    # < 1 block, 1 block, 3 blocks; no two share a first block (the decode worker would
    # prefill the later one itself once the earlier's KV is in its prefix cache)
    prompts = [list(range(start, start + n)) for start, n in ((5, 3), (30, 16), (60, 48))]
    expected = LLMEngine(model, EngineConfig(num_blocks=256, dtype="auto")).generate(prompts, GREEDY)
    cluster = start(model, transfer)
    try:
        pids = {w: cluster.pid(w) for w in cluster.handles}
        for pid in pids.values():  # each worker's thread stacks into its log, nothing more
            os.kill(pid, signal.SIGUSR1)

        async def body(router: Router) -> list[tuple[list[int], str, FinalChunk]]:
            return await asyncio.gather(*(run_one(router, f"g{i}", p)
                                          for i, p in enumerate(prompts)))

        results = with_router(cluster, body)
        assert {w: cluster.pid(w) for w in cluster.handles} == pids  # none died of it
        for (tokens, text, final), exp in zip(results, expected, strict=True):  # type: ignore[call-overload]
            t = final.timings
            assert tokens == exp.token_ids and text == exp.text, (
                f"{tokens} != {exp.token_ids}: {t.placement} to {t.worker}, "
                f"{final.num_retries} retries")
            assert final.timings.kv_transfer is not None
        cluster.check_integrity()
    finally:
        cluster.shutdown()


@pytest.mark.parametrize("prefill_workers", [1, 2])
def test_64_concurrent_requests(tiny_model: Callable[[str], Path], prefill_workers: int) -> None:
    model = tiny_model("llama-gqa")
    prompts = mixed_prompts(64)
    expected = LLMEngine(model, EngineConfig(num_blocks=1024, dtype="auto")).generate(prompts, GREEDY)
    cluster = start(model, "torch", prefill=prefill_workers)
    try:
        async def body(router: Router) -> list[tuple[list[int], str, FinalChunk]]:
            return await asyncio.gather(*(run_one(router, f"c{i}", p)
                                          for i, p in enumerate(prompts)))

        results = with_router(cluster, body)
        for (tokens, _, _), exp in zip(results, expected, strict=True):  # type: ignore[call-overload]
            assert tokens == exp.token_ids
        cluster.check_integrity()
        stats = cluster.stats()
        assert all(s.num_free_blocks == s.num_blocks for s in stats.values())
        if prefill_workers == 2:
            assert all(s.kv_transfers > 0 for w, s in stats.items() if w.startswith("prefill"))
    finally:
        cluster.shutdown()


def test_cancel_killed_decode_and_killed_prefill(tiny_model: Callable[[str], Path]) -> None:
    model = tiny_model("llama-gqa")
    cluster = start(model, "torch", prefill=2, decode=2)
    long = SamplingParams(max_tokens=400, ignore_eos=True)
    try:
        async def body(router: Router) -> None:
            # 1. Cancellation mid-stream frees the blocks on both workers.
            stream = router.generate(GenerateRequest("cancel", long, prompt_token_ids=[5] * 30))
            n = 0
            async for item in stream:
                n += isinstance(item, StreamChunk)
                if n == 3:
                    break
            await stream.aclose()  # type: ignore[attr-defined]

            # 2. Kill the decode worker serving a stream: the request moves to the other
            # pair and continues without repeating a token.
            expected = LLMEngine(model, EngineConfig(num_blocks=256, dtype="auto")).generate(
                [[6] * 30], SamplingParams(max_tokens=60, ignore_eos=True))[0].token_ids
            stream = router.generate(GenerateRequest(
                "kd", SamplingParams(max_tokens=60, ignore_eos=True),
                prompt_token_ids=[6] * 30))
            tokens: list[int] = []
            final = None
            killed: list[str] = []
            async for item in stream:
                if isinstance(item, StreamChunk):
                    tokens += item.token_ids
                    serving = sorted(w for w in router.fanout.workers_of("kd")
                                     if w.startswith("decode"))
                    if len(tokens) >= 5 and not killed and serving:
                        cluster.kill(serving[0])
                        killed.append(serving[0])
                else:
                    final = item
            assert killed and final is not None and final.num_retries >= 1
            assert tokens == expected  # greedy: the retry continues exactly

            # 3. Kill a prefill worker while requests are in its queue: every request
            # finishes on the other prefill worker, with all its tokens.
            prompts = mixed_prompts(8)
            tasks = [asyncio.create_task(run_one(router, f"kp{i}", p, long))
                     for i, p in enumerate(prompts)]
            busy: list[str] = []

            def prefilling() -> bool:
                busy[:] = [w.worker_id for w in router.workers.live("prefill")
                           if w.outstanding_requests]
                return bool(busy)

            await until_async("a prefill worker with requests", prefilling)
            cluster.kill(busy[0])
            results = await asyncio.wait_for(asyncio.gather(*tasks), timeout=300)
            assert all(len(tokens) == 400 for tokens, _, _ in results)
            assert any(final.num_retries for _, _, final in results)
            assert not router.worker_states()[busy[0]]  # killed for good: out of routing

        with_router(cluster, body)
        cluster.check_integrity()  # dead workers are skipped; live ones hold nothing
        for wid, s in cluster.stats().items():
            assert s.num_free_blocks == s.num_blocks, f"{wid} leaked blocks"
    finally:
        cluster.shutdown()


def test_cluster_config_rejects_unknown_keys(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("prefill: {workers: 2, gpus: 1}\n")
    with pytest.raises(ValueError, match="gpus"):
        ClusterConfig.load(cfg, {})
    with pytest.raises(ValueError, match="transfer"):
        ClusterConfig.from_dict({"transfer": "carrier-pigeon"})
    assert ClusterConfig.load(None, {"prefill.workers": 3}).prefill.workers == 3
    assert os.environ.get("RAY_ADDRESS") is None


def test_golden_default_model_over_nixl(default_model_dir: Path) -> None:
    """The real default model once, over the default transfer backend."""
    tok_prompt = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    eng = LLMEngine(default_model_dir, EngineConfig(num_blocks=64, dtype="auto"))  # the pools default
    assert eng.tokenizer is not None
    prompt = eng.tokenizer.encode(tok_prompt)
    params = SamplingParams(max_tokens=24)
    expected = eng.generate([prompt], params)[0]
    del eng
    cluster = start(default_model_dir, "nixl", decode_engine={"num_blocks": 64})
    try:
        async def body(router: Router) -> tuple[list[int], str, FinalChunk]:
            return await run_one(router, "smol", prompt, params)

        tokens, text, final = with_router(cluster, body)  # type: ignore[misc]
        assert tokens == expected.token_ids and text == expected.text
        assert "Paris" in text and final.finish_reason == expected.finish_reason
        cluster.check_integrity()
    finally:
        cluster.shutdown()
