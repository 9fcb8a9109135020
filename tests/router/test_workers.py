"""``WorkerSet`` on its own, over a real prefill worker: probing, joining, leaving
(logged as an error unless drained) and stopping."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path

import pytest

from pdserve.engine.config import EngineConfig
from pdserve.messages import ServingLimits, WorkerLoad
from pdserve.router.fanout import Fanout
from pdserve.router.workers import HealthConfig, WorkerSet
from pdserve.worker.prefill import PrefillWorker
from tests.waiting import until_async


def limits(model: Path) -> ServingLimits:
    """A router's limits that the tiny model's workers (16, 2048) agree with."""
    return ServingLimits(block_size=16, max_model_len=256, model=model.name)


def test_stop_ends_a_probe_loop_whose_cancellation_was_lost(
        tiny_model: Callable[[str], Path]) -> None:
    """Python 3.11's wait_for returns the inner result instead of raising
    CancelledError when the two land in one loop iteration (gh-86296). A probe whose
    load() answered just as stop() cancelled it went on probing, and stop() waited for
    it forever (a router hung on shutdown). Here the answer and the stop land together,
    every time: the probe's timeout must not lose the cancellation (asyncio.timeout),
    and the loop must end on stop() anyway."""
    model = tiny_model("llama-gqa")
    worker = PrefillWorker("prefill-0", model,
                           EngineConfig(role="prefill", num_blocks=16), "local")
    try:
        ws = WorkerSet([worker], Fanout(), HealthConfig(interval_s=0.02), limits(model))
        stopping: list[asyncio.Task[None]] = []
        answer = worker.load

        async def load() -> WorkerLoad:
            got = await answer()
            if ws.workers["prefill-0"].alive and not stopping:
                # stop() starts now: its cancel reaches the probe before wait_for sees
                # this answer.
                stopping.append(asyncio.ensure_future(ws.stop()))
            return got

        async def main() -> None:
            await ws.start()
            assert ws.workers["prefill-0"].alive
            worker.load = load  # type: ignore[method-assign]
            await until_async("stop() started by a probe's answer", lambda: bool(stopping))
            # Not wait_for: cancelling stop() would end the stuck probe for it.
            await asyncio.wait(stopping, timeout=30)
            assert stopping[0].done(), "stop() still waits for a probe loop"
            stopping[0].result()

        asyncio.run(main())
    finally:
        worker.close()


def test_a_drain_leaves_routing_at_info_a_failure_at_error(
        tiny_model: Callable[[str], Path], caplog: pytest.LogCaptureFixture) -> None:
    model = tiny_model("llama-gqa")
    worker = PrefillWorker("prefill-0", model,
                           EngineConfig(role="prefill", num_blocks=16), "local")
    caplog.set_level(logging.INFO, logger="pdserve.router")
    try:
        ws = WorkerSet([worker], Fanout(), HealthConfig(interval_s=0.02), limits(model))

        async def main() -> None:
            await ws.start()
            ws.gone("prefill-0", "its actor died")
            await until_async("rejoined", lambda: ws.workers["prefill-0"].alive)
            assert await ws.drain("prefill-0", timeout_s=5) == 0
            await ws.stop()

        asyncio.run(main())
    finally:
        worker.close()
    left = [(r.levelno, r.getMessage()) for r in caplog.records if "leaves routing" in r.getMessage()]
    assert left == [
        (logging.ERROR, "worker prefill-0 (prefill) leaves routing: its actor died"),
        (logging.INFO, "worker prefill-0 (prefill) leaves routing: removed (drained)")]
