"""The per-request disaggregation decision, served (router + workers in one process,
local transfer): where each prompt is computed, why, counted in the metrics and
shown in the request's timings -- and the same tokens wherever it was computed."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from pdserve.engine.config import EngineConfig
from pdserve.engine.sampling.sampling_params import SamplingParams
from pdserve.router.metrics import RouterMetrics, metrics_text
from pdserve.router.placement import Slo
from pdserve.router.router import Router, RouterConfig
from pdserve.router.types import FinalChunk, GenerateRequest, StreamChunk
from pdserve.worker.core_share import CoreShare
from pdserve.worker.decode import DecodeWorker
from pdserve.worker.prefill import PrefillWorker
from tests.inprocess import Pair, collect

GREEDY = SamplingParams(max_tokens=16, ignore_eos=True)


@pytest.fixture
def pairs(tiny_model: Callable[[str], Path], tmp_path: Path) -> Iterator[Callable[..., Pair]]:
    """1P+1D sharing a core group (worker/core_share.py), as on one node; a registry of
    router metrics beside."""
    made: list[Pair] = []

    def make(slo: Slo | None = None, **router_kw: object) -> Pair:
        pair = Pair.__new__(Pair)
        path, cores = tiny_model("llama-gqa"), tmp_path / f"cores-{len(made)}"
        pair.prefill = [PrefillWorker("prefill-0", path, EngineConfig(
            role="prefill", num_blocks=128, num_threads=2), "local", cores=CoreShare(1, 2, cores))]
        pair.decode = [DecodeWorker("decode-0", path, EngineConfig(
            role="decode", num_blocks=128, num_threads=2), "local", cores=CoreShare(1, 2, cores))]
        pair.colocated = []
        tok = pair.workers[0].engine.tokenizer
        assert tok is not None
        registry = CollectorRegistry()
        pair.router = Router(path.name, tok, 2048, pair.workers,
                             RouterConfig(**router_kw), RouterMetrics(registry, "tiny"),  # type: ignore[arg-type]
                             slo)
        pair.registry = registry  # type: ignore[attr-defined]
        made.append(pair)
        return pair

    yield make
    for pair in made:
        pair.close()


IN_TIME = Slo(ttft_s=30.0)  # any prompt of these is in time either way: local on a shared node


def prompt(n: int, seed: int) -> list[int]:
    return [3 + (seed * 7919 + i * 104729) % 200 for i in range(n)]


async def finish(stream: AsyncIterator[StreamChunk | FinalChunk],
                 ) -> tuple[list[int], FinalChunk]:
    """A request's tokens and final chunk, its stream run to its end (so its attempt's
    counts are settled before the next request is placed)."""
    tokens, _, final = await collect(stream)
    async for _ in stream:
        raise AssertionError("a chunk after the final one")
    return tokens, final


def serve(pair: Pair, requests: list[tuple[list[int], SamplingParams]],
          ) -> list[tuple[list[int], FinalChunk]]:
    async def main() -> list[tuple[list[int], FinalChunk]]:
        await pair.router.start()
        try:
            return [await finish(pair.router.generate(  # one after another
                GenerateRequest(f"r{i}", params, prompt_token_ids=ids)))
                for i, (ids, params) in enumerate(requests)]
        finally:
            await pair.router.stop()

    return asyncio.run(main())


def test_a_shared_node_computes_prompts_where_they_decode(pairs) -> None:  # type: ignore[no-untyped-def]
    measured, static = pairs(IN_TIME), pairs(IN_TIME, placement="static")
    reqs = [(prompt(40, s), GREEDY) for s in range(3)]
    got = serve(measured, reqs)
    want = serve(static, reqs)
    for (tokens, final), (tokens_static, final_static) in zip(got, want, strict=True):
        assert tokens == tokens_static  # the same answer wherever the prompt was computed
        t = final.timings
        assert t.placement == "local" and t.placement_reason in ("faster_here", "within_ttft_slo")
        assert t.kv_transfer is None and t.prefill is not None
        assert (final_static.timings.placement, final_static.timings.placement_reason) == (
            "remote", "static")
        assert final_static.timings.kv_transfer is not None
    text = metrics_text(measured.registry).decode()
    counted = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                  if line.startswith("pdserve_prompt_placements_total{") and 'where="local"' in line)
    assert counted == 3
    assert measured.decode[0].publisher.counters.local_prefills == 3


def test_prompt_logprobs_are_computed_by_the_prefill_worker(pairs) -> None:  # type: ignore[no-untyped-def]
    pair = pairs(IN_TIME)

    async def main() -> tuple[list[StreamChunk], FinalChunk]:
        await pair.router.start()
        try:
            chunks: list[StreamChunk] = []
            async for item in pair.router.generate(GenerateRequest(
                    "r", SamplingParams(max_tokens=4, prompt_logprobs=1),
                    prompt_token_ids=prompt(30, 1))):
                if isinstance(item, FinalChunk):
                    return chunks, item
                chunks.append(item)
            raise AssertionError("no final chunk")
        finally:
            await pair.router.stop()

    chunks, final = asyncio.run(main())
    assert (final.timings.placement, final.timings.placement_reason) == (
        "remote", "prompt_logprobs")
    assert len(chunks[0].prompt_logprobs or []) == 30


def test_decoding_requests_keep_their_tpot_target(pairs) -> None:  # type: ignore[no-untyped-def]
    """A TPOT target no decode step could keep: while the decode worker has requests
    running, every new prompt goes to the prefill worker; alone, it stays local."""
    pair = pairs(Slo(ttft_s=30.0, tpot_s=1e-6))

    async def main() -> tuple[FinalChunk, FinalChunk, FinalChunk]:
        await pair.router.start()
        try:
            long = pair.router.generate(GenerateRequest(
                "long", SamplingParams(max_tokens=400, ignore_eos=True),
                prompt_token_ids=prompt(20, 9)))
            first = await anext(long)  # it decodes now
            assert isinstance(first, StreamChunk) and first.token_ids
            _, during = await finish(pair.router.generate(
                GenerateRequest("during", GREEDY, prompt_token_ids=prompt(50, 3))))
            _, ended = await finish(long)
            _, after = await finish(pair.router.generate(
                GenerateRequest("after", GREEDY, prompt_token_ids=prompt(50, 4))))
            return during, ended, after
        finally:
            await pair.router.stop()

    during, ended, after = asyncio.run(main())
    assert (during.timings.placement, during.timings.placement_reason) == (
        "remote", "protects_tpot")
    assert ended.timings.placement == after.timings.placement == "local"
