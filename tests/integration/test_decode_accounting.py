"""Decode-side block accounting under aborts (issue 11, high severity #1): a request
aborted while its KV may still land keeps its blocks until the receiver confirms that
no late write can reach them, so a later reservation never gets blocks another
request's KV is still expected in -- no "blocks ... are expected by another request"
error (an HTTP 400 for a valid request), no leaked blocks."""

from __future__ import annotations

import importlib.util
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from pdserve.decode_worker.worker import DecodeWorker
from pdserve.engine.config import EngineConfig
from pdserve.engine.sampling_params import SamplingParams
from pdserve.prefill_worker.worker import PrefillWorker

PARAMS = SamplingParams(max_tokens=4, ignore_eos=True)
NIXL = any(importlib.util.find_spec(m) for m in ("nixl", "nixl_cu12"))


def until(what: str, ok: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not ok():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


@pytest.fixture
def workers(tiny_model: Callable[[str], Path]) -> Iterator[tuple[PrefillWorker, DecodeWorker]]:
    model = tiny_model("llama-gqa")
    # nixl: D cannot stop P's one-sided writes, so D's abort is a handshake with P.
    dec = DecodeWorker("decode-0", model, EngineConfig(role="decode", num_blocks=8), "nixl",
                       kv_timeout_s=30)
    pre = PrefillWorker("prefill-0", model, EngineConfig(role="prefill", num_blocks=64), "nixl")
    try:
        pre.connect(dec.worker_id, dec.endpoint().result()).result()
        yield pre, dec
    finally:
        pre.close()
        dec.close()


@pytest.mark.skipif(not NIXL, reason="nixl not installed")
def test_aborted_reservation_keeps_its_blocks_until_the_receiver_lets_go(
        workers: tuple[PrefillWorker, DecodeWorker]) -> None:
    pre, dec = workers
    gate = threading.Event()
    pre.call(gate.wait)  # P busy (a long prefill step): it answers D's abort late
    try:
        held = dec.reserve("a", [5] * 100, PARAMS).result()  # 7 of the 8 blocks
        assert held is not None
        dec.abort("a")  # the client left during prefill
        # While P has not confirmed, a's blocks are not free: no room, never an error.
        assert dec.reserve("b", [5] * 100, PARAMS).result() is None
    finally:
        gate.set()

    def used() -> int:
        return dec.call(lambda: dec.engine.pool.num_used).result()

    until("a's blocks to come back", lambda: used() == 0)
    blocks = dec.reserve("c", [5] * 100, PARAMS).result()
    assert blocks is not None and len(blocks) == len(held)
    dec.abort("c")
    until("c's blocks to come back", lambda: used() == 0)
    dec.check_integrity().result()
    assert dec.receiver.num_pending == 0
