"""Chaos over a real local Ray cluster (2 prefill + 2 decode workers, torch transfer,
restarts on): kill -9 and SIGSTOP of prefill and decode actors mid-prefill, mid-transfer
(KV goes out chunk by chunk while prompts prefill) and mid-decode; transfer timeouts;
clients giving up at every stage. For each: every request ends with all its tokens
or a clear ``RouterError`` (never a hang: every wait has a deadline), no block is
leaked on any worker (integrity check + every block free), and every worker is back
in routing -- a killed one restarted by Ray with a new incarnation, a stopped one
rejoined after SIGCONT. Bug regression (issue 11, high #2): a decode stall that times
out transfers never takes a healthy prefill worker out of routing."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from pdserve.cluster.cluster import Cluster
from pdserve.cluster.config import ClusterConfig
from pdserve.router.router import Router
from pdserve.router.types import RouterError
from tests.integration.chaos import (
    check_outcomes,
    empty_kv_blocks,
    greedy,
    prompt,
    recovered,
    request,
    settle,
    with_router,
)
from tests.integration.chaos_summary import SUMMARY, Case
from tests.waiting import until_async

pytestmark = pytest.mark.usefixtures("ray_address")


@pytest.fixture(scope="module")
def cluster(tiny_model: Callable[[str], Path]) -> Iterator[Cluster]:
    cfg = ClusterConfig.from_dict({
        "model": str(tiny_model("llama-gqa")), "transfer": "torch",
        # a stall longer than this breaks a torch channel: it must be reopened
        "transfer_options": {"peer_timeout_s": 2},
        "prefill": {"workers": 2, "num_cpus": 1,
                    "engine": {"num_blocks": 512, "max_num_batched_tokens": 32}},
        "decode": {"workers": 2, "num_cpus": 1, "engine": {"num_blocks": 512}},
        "router": {"queue_timeout_s": 20, "max_retries": 3, "stats_interval_s": 0.1,
                   "placement": "static",  # faults on the prefill side need prompts there
                   "probe_timeout_s": 0.5, "health_timeout_s": 2},
        "kv_timeout_s": 3, "max_restarts": 10, "restart_backoff_s": 0.1,
    })
    c = Cluster(cfg)
    c.start()
    try:
        yield c
    finally:
        c.shutdown()


def record(router: Router, case: str, results: list[Any], want: list[list[int]],
           recovered_workers: int, fault_at: float) -> int:
    """Check the outcomes against the engine's tokens ``want`` (hung requests fail the
    test before: every wait is bounded) and note the case for the summary; returns how
    many finished."""
    ok = check_outcomes(results, want)
    SUMMARY[case] = Case(ok, len(results) - ok, 0, recovered_workers,
                         time.monotonic() - fault_at, empty_kv_blocks(router))
    return ok


def busy_worker(router: Router, role: str) -> str | None:
    busy = [w.worker_id for w in router.workers.live(role) if w.outstanding_requests]
    return busy[0] if busy else None


async def kill9(cluster: Cluster, router: Router, wid: str) -> dict[str, str]:
    before = router.workers.workers[wid].incarnation
    assert before is not None
    os.kill(await asyncio.to_thread(cluster.pid, wid), signal.SIGKILL)
    return {wid: before}


async def kill9_and_settle(cluster: Cluster, router: Router, wid: str,
                           tasks: list[asyncio.Task[Any]]) -> tuple[list[Any], float]:
    """kill -9 ``wid`` while ``tasks`` run; wait (bounded) for every task to end and the
    killed worker to be back in routing. Returns the tasks' results and the fault time."""
    restarted = await kill9(cluster, router, wid)
    fault_at = time.monotonic()
    results = await settle(cluster, router, tasks)
    await recovered(router, cluster, restarted)
    return results, fault_at


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_kill9_mid_prefill_and_transfer(cluster: Cluster, role: str) -> None:
    """Prompts are being prefilled and their KV is on the way (chunk by chunk) when
    the prefill worker -- or the decode worker receiving it -- is killed."""
    async def body(router: Router) -> None:
        tasks = [asyncio.create_task(request(router, f"kp-{role}-{i}", prompt(i), 8))
                 for i in range(6)]
        victim: list[str] = []

        def transferring() -> bool:
            """A victim with KV on the way: a prefill worker holding blocks for sends not
            yet acknowledged, or a decode worker expecting KV (as its loads say)."""
            loads = {w.worker_id: w.load for w in router.workers.live(role)}
            victim[:] = [wid for wid, load in loads.items() if load is not None and (
                load.metrics is not None and load.metrics.blocks_in_flight > 0
                if role == "prefill" else load.num_waiting_for_kv > 0)][:1]
            return bool(victim)

        await until_async(f"a {role} worker with KV in flight", transferring)
        results, fault_at = await kill9_and_settle(cluster, router, victim[0], tasks)
        assert record(router, f"kill -9 {role} mid-prefill/transfer", results,
                      greedy(cluster, [prompt(i) for i in range(6)], 8), 1, fault_at) >= 1

    with_router(cluster, body)


def test_kill9_mid_decode(cluster: Cluster) -> None:
    async def body(router: Router) -> None:
        tasks = [asyncio.create_task(request(router, f"kd-{i}", prompt(i, 40), 300))
                 for i in range(4)]
        victim: list[str] = []

        def decoding() -> bool:
            victim[:] = [w.worker_id for w in router.workers.live("decode")
                         if w.outstanding_requests and w.load and w.load.num_running][:1]
            return bool(victim)

        await until_async("a decode worker decoding", decoding)
        results, fault_at = await kill9_and_settle(cluster, router, victim[0], tasks)
        # the other pair takes them all over
        assert record(router, "kill -9 decode mid-decode", results,
                      greedy(cluster, [prompt(i, 40) for i in range(4)], 300), 1, fault_at) == 4

    with_router(cluster, body)


@pytest.mark.parametrize("role", ["decode", "prefill"])
def test_sigstop_past_the_timeouts(cluster: Cluster, role: str) -> None:
    """A stalled worker: transfers to/from it time out (request-level failures,
    retried elsewhere); it leaves routing only after its health probes failed for
    health_timeout_s; after SIGCONT it rejoins. No other worker ever leaves routing
    (the regression: a decode stall used to remove the healthy prefill worker for
    good)."""
    async def body(router: Router) -> None:
        tasks = [asyncio.create_task(request(router, f"ss-{role}-{i}", prompt(i), 8))
                 for i in range(8)]
        victim: list[str] = []

        def busy() -> bool:
            victim[:] = [w for w in [busy_worker(router, role)] if w]
            return bool(victim)

        await until_async(f"a busy {role} worker", busy)
        pid = await asyncio.to_thread(cluster.pid, victim[0])
        others = [w for w in router.worker_states() if w != victim[0]]
        os.kill(pid, signal.SIGSTOP)
        try:
            await until_async("the stalled worker out of routing",
                              lambda: not router.worker_states()[victim[0]], 30)
            assert all(router.worker_states()[w] for w in others), router.worker_states()
            results = await settle(cluster, router, tasks)
            assert all(router.worker_states()[w] for w in others), router.worker_states()
        finally:
            os.kill(pid, signal.SIGCONT)
        fault_at = time.monotonic()  # recovery counts from SIGCONT
        await recovered(router, cluster, {})
        assert record(router, f"SIGSTOP {role} past KV + health timeouts", results,
                      greedy(cluster, [prompt(i) for i in range(8)], 8), 1, fault_at) >= 1
        tokens = await request(router, f"after-{role}", prompt(99, 64), 8)
        assert not isinstance(tokens, RouterError) and len(tokens) == 8

    with_router(cluster, body)


def test_clients_give_up_at_every_stage(cluster: Cluster) -> None:
    """Cancelled while prefilling, while its KV moves, while decoding: each request is
    aborted on both workers and every block comes back (waiting for room: see
    test_inprocess.test_cancel_while_waiting_for_room)."""
    async def body(router: Router) -> None:
        decoding = [asyncio.create_task(request(router, f"cd-{i}", prompt(i, 40), 2000))
                    for i in range(2)]
        await until_async("decodes under way", lambda: any(
            w.load and w.load.num_running for w in router.workers.live("decode")))
        prefilling = [asyncio.create_task(request(router, f"cp-{i}", prompt(i), 8))
                      for i in range(4)]
        await until_async("prefills under way", lambda: bool(busy_worker(router, "prefill")))
        for t in [*prefilling, *decoding]:
            t.cancel()
        fault_at = time.monotonic()
        await asyncio.gather(*prefilling, *decoding, return_exceptions=True)
        await recovered(router, cluster, {})
        SUMMARY["clients give up mid-prefill/transfer/decode"] = Case(
            cancelled=6, recovery_s=time.monotonic() - fault_at)

    with_router(cluster, body)
