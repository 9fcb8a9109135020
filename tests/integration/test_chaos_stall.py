"""Issue 23 item 6 over a real local Ray cluster of its own (1 prefill + 2 decode workers,
no restarts, ``kv_timeout_s`` far beyond every bound): a decode worker's blocks are freed
once it knows the transfers to it were abandoned, not at the KV timeout. A module of its
own because test_chaos.py's module-wide cluster holds the local cluster's CPUs while its
tests run."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Callable
from pathlib import Path

import pytest

from pdserve.cluster.cluster import Cluster
from pdserve.cluster.config import ClusterConfig
from pdserve.router.router import Router
from tests.integration import chaos
from tests.waiting import until_async

pytestmark = pytest.mark.usefixtures("ray_address")


@pytest.mark.parametrize("transfer", ["nixl", "torch"])
def test_a_stall_frees_its_blocks_once_known_not_at_the_kv_timeout(
        tiny_model: Callable[[str], Path], transfer: str) -> None:
    """Issue 23 item 6: a decode worker is stopped with KV on the way to it and requests
    decoding there; the router gives up on them and they finish on the other pair. Once
    the worker resumes and learns that (the router's aborts, its lost output stream, the
    sender's answers), every block it reserved is free again -- with ``kv_timeout_s``
    far beyond every bound here, only the abandonment itself can free them."""
    cfg = ClusterConfig.from_dict({
        "model": str(tiny_model("llama-gqa")), "transfer": transfer,
        "transfer_options": {"peer_timeout_s": 2} if transfer == "torch" else {},
        "prefill": {"workers": 1, "num_cpus": 1,
                    "engine": {"num_blocks": 512, "max_num_batched_tokens": 32}},
        "decode": {"workers": 2, "num_cpus": 1, "engine": {"num_blocks": 512}},
        "router": {"queue_timeout_s": 20, "max_retries": 3, "stats_interval_s": 0.1,
                   "placement": "static",  # stalls on the prefill side need prompts there
                   "probe_timeout_s": 0.5, "health_timeout_s": 2},
        "kv_timeout_s": 600, "max_restarts": 0,
    })

    async def body(router: Router) -> None:
        decoding = [asyncio.create_task(chaos.request(router, f"sd-{i}", chaos.prompt(i, 40), 300))
                    for i in range(4)]
        victim: list[str] = []

        def busy() -> bool:
            victim[:] = [w.worker_id for w in router.workers.live("decode")
                         if w.load and w.load.num_running][:1]
            return bool(victim)

        await until_async("a decode worker decoding", busy)
        moving = [asyncio.create_task(chaos.request(router, f"sm-{i}", chaos.prompt(10 + i), 8))
                  for i in range(4)]
        await until_async("KV on the way to it", lambda: any(
            w.load and w.load.num_waiting_for_kv for w in router.workers.live("decode")))
        pid = await asyncio.to_thread(cluster.pid, victim[0])
        os.kill(pid, signal.SIGSTOP)
        try:
            await until_async("the stalled worker out of routing",
                              lambda: not router.worker_states()[victim[0]], 30)
            results = await asyncio.wait_for(asyncio.gather(*decoding, *moving), chaos.BOUND_S)
        finally:
            os.kill(pid, signal.SIGCONT)
        want = chaos.greedy(cluster, [chaos.prompt(i, 40) for i in range(4)], 300)
        assert chaos.check_outcomes(results[:4], want) == 4
        moved = chaos.greedy(cluster, [chaos.prompt(10 + i) for i in range(4)], 8)
        assert chaos.check_outcomes(results[4:], moved) == 4
        await chaos.recovered(router, cluster, {})

    cluster = Cluster(cfg)
    cluster.start()
    try:
        chaos.with_router(cluster, body)
    finally:
        cluster.shutdown()
