"""Router + 1 prefill and 2 decode workers in one process (local transfer backend, no
Ray): a drained decode worker's running requests move to the other with their KV
(router/migration.py, worker/moves.py) -- every stream the same as the engine's alone
(greedy and seeded), no retry, nothing prefilled again, no block left behind."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.sampling.sampling_params import SamplingParams
from pdserve.router.router import Router
from pdserve.router.types import FinalChunk, GenerateRequest, StreamChunk
from tests.inprocess import Pair, collect, run

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


def test_a_drained_decode_workers_requests_move_with_their_kv(
        pair_factory: Callable[..., Pair], tiny_model: Callable[[str], Path]) -> None:
    want = expected(tiny_model)
    pair = pair_factory(n_decode=2, decode_blocks=256)
    asked = counted_prefills(pair)

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
        cut = await router.drain_worker(source, timeout_s=60)
        assert cut == 0
        tails = await reading
        return source, [(h + t[0], t[2]) for h, t in zip(heads, tails, strict=True)]

    source, results = run(pair, body)  # type: ignore[misc]
    for (tokens, final), reference in zip(results, want, strict=True):
        assert tokens == reference
        assert final.num_retries == 0
        assert final.timings.worker != source  # every request ended on the other worker
    assert len(asked) == len(PROMPTS)  # no prompt prefilled again
    drained = next(d for d in pair.decode if d.worker_id == source)
    assert not drained.engine.requests
