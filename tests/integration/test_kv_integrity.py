"""A decode worker never decodes over KV blocks that hold nothing: a request whose
transfer "landed" with an empty block fails as a transport error (the router retries
it elsewhere) and is counted, instead of decoding the block's zeros -- silently wrong
tokens, and a wrong block in the prefix cache for every later request sharing it."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.sampling.sampling_params import SamplingParams
from pdserve.kv_transfer.factory import make_sender
from pdserve.worker.decode import DecodeWorker
from tests.waiting import until_async

PARAMS = SamplingParams(max_tokens=4, ignore_eos=True)
LONG = SamplingParams(max_tokens=1500, ignore_eos=True)  # decoding still when checked


def test_empty_blocks_are_those_no_kv_was_written_in(tiny_model: Callable[[str], Path]) -> None:
    engine = LLMEngine(tiny_model("llama-gqa"), EngineConfig(num_blocks=16))
    engine.add_request("r", list(range(5, 45)), PARAMS)  # 40 tokens: 3 blocks, the last partial
    engine.step()
    blocks = engine.block_ids("r")
    assert len(blocks) == 3 and engine.empty_blocks(blocks) == []
    unused = [b for b in range(16) if b not in blocks]
    assert engine.empty_blocks(unused) == unused


def test_kv_that_lands_with_an_empty_block_fails_the_request(
        tiny_model: Callable[[str], Path]) -> None:
    model = tiny_model("llama-gqa")
    dec = DecodeWorker("decode-0", model, EngineConfig(role="decode", num_blocks=128), "local")
    layout = dec.engine.kv_layout().model_wide()
    # a sender whose cache holds computed-looking KV everywhere but in its block 1
    kv = torch.ones(layout.kv_shape(4), dtype=dec.engine.kv_cache.dtype)
    kv[1] = 0
    sender = make_sender("local", kv, layout)

    async def main() -> None:
        peer = sender.connect((await dec.join_info()).kv_endpoint or {})
        for rid, src in (("good", [0, 2, 3]), ("bad", [0, 1, 3])):
            r = await dec.reserve(rid, list(range(5, 45)), LONG)
            assert r is not None and r.reused == 0
            sender.send(peer, rid, src, r.blocks, notify={"first_token": 7})
        await until_async("both requests to settle",
                          lambda: dec.publisher.counters.kv_empty_blocks == 1
                          and not dec.engine.has_request("bad"))
        assert dec.engine.has_request("good")  # decoding
        await dec.abort("good")
        await until_async("every block back", lambda: dec.engine.pool.num_used == 0)
        await dec.check_integrity()

    try:
        asyncio.run(main())
    finally:
        sender.close()
        dec.close()
