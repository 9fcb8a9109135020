"""Pools in different weight formats behind one router: the KV layout is the same
(the cache keeps the engine's dtype), so a float prefill pool feeds an int4 decode
pool, and every combination equals the engine doing the same thing itself."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.sampling.sampling_params import SamplingParams
from pdserve.router.types import GenerateRequest
from tests.engine.handoff import hand_off
from tests.inprocess import Pair, collect

GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)


def prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(17)
    return [torch.randint(3, 500, (20 + 9 * i,), generator=g).tolist() for i in range(n)]


def served(pair: Pair, ps: list[list[int]]) -> list[list[int]]:
    async def run() -> list[list[int]]:
        await pair.router.start()
        try:
            outs = await asyncio.gather(*(collect(pair.router.generate(GenerateRequest(
                f"r{i}", GREEDY, prompt_token_ids=p))) for i, p in enumerate(ps)))
            return [tokens for tokens, _, _ in outs]
        finally:
            await pair.router.stop()
    return asyncio.run(run())


def handed_off(model: Path, prompt: list[int], prefill: dict[str, object],
               decode: dict[str, object]) -> list[int]:
    """What a P/D pair computes, done with two engines by hand: P's prompt KV and
    first token, then D's decode on that KV."""
    p = LLMEngine(model, EngineConfig(**{"role": "prefill", "num_blocks": 64, **prefill}))  # type: ignore[arg-type]
    d = LLMEngine(model, EngineConfig(**{"role": "decode", "num_blocks": 64, **decode}))  # type: ignore[arg-type]
    p.add_request("r", prompt, GREEDY)
    outs = []
    while not outs:
        outs = p.step().outputs
    first = outs[0].new_token_ids[0]
    dest = d.reserve("r", prompt, GREEDY)
    assert dest is not None
    hand_off(p, "r", d, dest)
    p.release("r")
    tokens = [first]
    d.start_decode("r", first)
    while d.has_unfinished():
        for o in d.step().outputs:
            tokens.extend(o.new_token_ids)
    return tokens


def through_pair(model: Path, ps: list[list[int]], prefill: dict[str, object],
                 decode: dict[str, object]) -> list[list[int]]:
    pair = Pair(model, prefill_engine=prefill, decode_engine=decode)
    try:
        return served(pair, ps)
    finally:
        pair.close()


def colocated(model: Path, ps: list[list[int]], engine: dict[str, object]) -> list[list[int]]:
    eng = LLMEngine(model, EngineConfig(num_blocks=256, **engine))  # type: ignore[arg-type]
    return [o.token_ids for o in eng.generate(ps, GREEDY)]


def test_quantized_decode_pool_behind_a_float_prefill_pool(
        tiny_model: Callable[[str], Path]) -> None:
    model = tiny_model("llama-gqa")
    ps = prompts(4)
    int4 = {"quantization": "int4"}
    # both pools int4 == one int4 engine doing both phases
    assert through_pair(model, ps, int4, int4) == colocated(model, ps, int4)
    # float prefill, int4 decode == the same hand-off done with two engines
    assert through_pair(model, ps, {}, int4) == [handed_off(model, p, {}, int4) for p in ps]


def test_int8_kv_pools_equal_the_int8_engine(tiny_model: Callable[[str], Path]) -> None:
    """Both pools on int8 KV caches: the blocks (values and scales) move through the
    channel and decode as one engine with an int8 cache computes."""
    model = tiny_model("llama-gqa")
    ps = prompts(4)
    int8 = {"kv_cache_dtype": "int8"}
    assert through_pair(model, ps, int8, int8) == colocated(model, ps, int8)
