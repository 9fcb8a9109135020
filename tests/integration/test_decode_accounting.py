"""Decode-side block accounting under aborts (issue 11, high severity #1): a request
aborted while its KV may still land keeps its blocks until the receiver confirms that
no late write can reach them, so a later reservation never gets blocks another
request's KV is still expected in -- no "blocks ... are expected by another request"
error (an HTTP 400 for a valid request), no leaked blocks.

The workers use nixl in one process, so the test body runs in a spawned child that
leaves with ``os._exit`` once it has reported: UCX's teardown at interpreter exit can
crash a process that made NIXL agents (seen with and without this change).
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import threading
import traceback
from collections.abc import Callable
from pathlib import Path

import pytest

from pdserve.engine.config import EngineConfig
from pdserve.engine.sampling.sampling_params import SamplingParams
from pdserve.messages import PrefillTask
from pdserve.worker.decode import DecodeWorker
from pdserve.worker.prefill import PrefillWorker
from tests.deps import has_nixl
from tests.waiting import until_async

PARAMS = SamplingParams(max_tokens=4, ignore_eos=True)
NIXL = has_nixl()


@pytest.mark.skipif(not NIXL, reason="no nixl wheel for this platform")
def test_aborted_reservation_keeps_its_blocks_until_the_receiver_lets_go(
        tiny_model: Callable[[str], Path]) -> None:
    ctx = multiprocessing.get_context("spawn")
    results: multiprocessing.Queue[str] = ctx.Queue()
    child = ctx.Process(target=_child, args=(str(tiny_model("llama-gqa")), results))
    child.start()
    try:
        outcome = results.get(timeout=120)
    finally:
        child.join(30)
        if child.is_alive():
            child.kill()
    assert outcome == "ok", outcome


def _child(model: str, results: multiprocessing.Queue[str]) -> None:
    try:
        _scenario(Path(model))
        results.put("ok")
    except BaseException:
        results.put(traceback.format_exc())
    results.close()
    results.join_thread()  # the report is out before the process ends
    os._exit(0)


def _scenario(model: Path) -> None:
    # nixl: D cannot stop P's one-sided writes, so D's abort is a handshake with P.
    dec = DecodeWorker("decode-0", model, EngineConfig(role="decode", num_blocks=8), "nixl",
                       kv_timeout_s=30)
    pre = PrefillWorker("prefill-0", model, EngineConfig(role="prefill", num_blocks=64), "nixl")
    gate = threading.Event()

    def used() -> int:
        return dec.engine.pool.num_used

    async def main() -> None:
        await pre.connect(dec.worker_id, (await dec.join_info()).kv_endpoint or {})
        # One whole hand-off first: D now knows P as a sender it must ask on abort.
        warm = await dec.reserve("warm", [6] * 20, PARAMS)
        assert warm is not None
        await pre.prefill(PrefillTask("warm", [6] * 20, PARAMS, dec.worker_id, warm.blocks))
        await until_async("the warm-up request to finish", lambda: used() == 0)
        # P's transfer thread busy (a stalled channel): it answers D's abort late.
        pre.transfer.call(gate.wait)
        try:
            held = await dec.reserve("a", [5] * 100, PARAMS)  # 7 of the 8 blocks
            assert held is not None
            await dec.abort("a")  # the client left during prefill
            # While P has not confirmed, a's blocks are not free: no room, never an error.
            assert await dec.reserve("b", [5] * 100, PARAMS) is None
            assert used() == len(held.blocks)
        finally:
            gate.set()
        await until_async("a's blocks to come back", lambda: used() == 0)
        blocks = await dec.reserve("c", [5] * 100, PARAMS)
        assert blocks is not None and len(blocks.blocks) == len(held.blocks)
        await dec.abort("c")
        await until_async("c's blocks to come back", lambda: used() == 0)
        await dec.check_integrity()
        assert dec.receiver.num_pending == 0

    try:
        asyncio.run(main())
    finally:
        pre.close()
        dec.close()
