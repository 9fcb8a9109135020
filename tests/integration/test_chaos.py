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

from pdserve.deploy.cluster import Cluster
from pdserve.deploy.config import ClusterConfig
from pdserve.engine.sampling_params import SamplingParams
from pdserve.router.router import Router
from pdserve.router.types import ErrorKind, GenerateRequest, RouterError, StreamChunk
from tests.integration.chaos_summary import SUMMARY, Case
from tests.waiting import until_async

pytestmark = pytest.mark.usefixtures("ray_address")

LONG_PROMPT = 1200  # tokens: 38 chunks of 32 on the prefill side, KV sent as they go
BOUND_S = 120.0  # every request of a case must end within this
CLEAR = {ErrorKind.INTERNAL, ErrorKind.OVERLOADED, ErrorKind.NOT_READY, ErrorKind.DEADLINE}


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
                   "probe_timeout_s": 0.5, "health_timeout_s": 2},
        "kv_timeout_s": 3, "max_restarts": 10, "restart_backoff_s": 0.1,
    })
    c = Cluster(cfg)
    c.start()
    try:
        yield c
    finally:
        c.shutdown()


def prompt(i: int, n: int = LONG_PROMPT) -> list[int]:
    return [5 + (i * 31 + j) % 400 for j in range(n)]


async def request(router: Router, rid: str, ids: list[int], max_tokens: int) -> Any:
    """All the request's tokens, or the RouterError it ended with."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    tokens: list[int] = []
    try:
        async for item in router.generate(GenerateRequest(rid, params, prompt_token_ids=ids)):
            if isinstance(item, StreamChunk):
                tokens += item.token_ids
    except RouterError as exc:
        return exc
    return tokens


def check_outcomes(results: list[Any], max_tokens: int) -> int:
    """Each request finished with every token or a clear error; returns how many finished."""
    ok = 0
    for r in results:
        if isinstance(r, RouterError):
            assert r.kind in CLEAR and r.message, r
        else:
            assert len(r) == max_tokens, f"{len(r)} of {max_tokens} tokens"
            ok += 1
    return ok


def record(case: str, results: list[Any], max_tokens: int, recovered_workers: int,
           fault_at: float) -> int:
    """Check the outcomes (hung requests fail the test before: every wait is bounded)
    and note the case for the summary; returns how many finished."""
    ok = check_outcomes(results, max_tokens)
    SUMMARY[case] = Case(ok, len(results) - ok, 0, recovered_workers, time.monotonic() - fault_at)
    return ok


def busy_worker(router: Router, role: str) -> str | None:
    busy = [w.worker_id for w in router.workers.live(role) if w.outstanding_requests]
    return busy[0] if busy else None


async def recovered(router: Router, cluster: Cluster, incarnations: dict[str, str]) -> None:
    """Every worker in routing again (killed ones with a new incarnation), every block
    free on every worker, and every block pool consistent."""
    await until_async("every worker back in routing",
                      lambda: all(router.worker_states().values()), 90)
    for wid, before in incarnations.items():
        w = router.workers.workers[wid]
        assert w.incarnation is not None and w.incarnation != before, f"{wid} not restarted"

    def used() -> dict[str, int]:  # from the workers' loads, as the probes see them
        loads = {wid: w.load for wid, w in router.workers.workers.items()}
        return {wid: (load.num_blocks - load.num_free_blocks) if load else -1
                for wid, load in loads.items() if load is None or load.num_free_blocks
                != load.num_blocks or load.num_running or load.num_waiting_for_kv}

    try:
        await until_async("every block free on every worker", lambda: not used(), 60)
    except AssertionError as exc:
        raise AssertionError(f"{exc}; blocks in use: {used()}") from None
    await asyncio.to_thread(cluster.check_integrity)  # blocking Ray calls: off the loop


def with_router(cluster: Cluster, body: Callable[[Router], Any]) -> Any:
    async def main() -> Any:
        router = cluster.make_router()
        await router.start()
        try:
            await until_async("all workers joined", lambda: all(router.worker_states().values()))
            return await body(router)
        finally:
            await router.stop()

    return asyncio.run(main())


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
    results = await asyncio.wait_for(asyncio.gather(*tasks), BOUND_S)
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
            victim[:] = [w for w in [busy_worker(router, "prefill")] if w]
            if role == "decode" and victim:
                victim[:] = [w.worker_id for w in router.workers.live("decode")
                             if w.outstanding_requests][:1]
            return bool(victim)

        await until_async("a worker mid-prefill", transferring)
        results, fault_at = await kill9_and_settle(cluster, router, victim[0], tasks)
        assert record(f"kill -9 {role} mid-prefill/transfer", results, 8, 1, fault_at) >= 1

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
        assert record("kill -9 decode mid-decode", results, 300, 1, fault_at) == 4

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
            results = await asyncio.wait_for(asyncio.gather(*tasks), BOUND_S)
            assert all(router.worker_states()[w] for w in others), router.worker_states()
        finally:
            os.kill(pid, signal.SIGCONT)
        fault_at = time.monotonic()  # recovery counts from SIGCONT
        await recovered(router, cluster, {})
        assert record(f"SIGSTOP {role} past KV + health timeouts", results, 8, 1,
                      fault_at) >= 1
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
                   "probe_timeout_s": 0.5, "health_timeout_s": 2},
        "kv_timeout_s": 600, "max_restarts": 0,
    })

    async def body(router: Router) -> None:
        decoding = [asyncio.create_task(request(router, f"sd-{i}", prompt(i, 40), 300))
                    for i in range(4)]
        victim: list[str] = []

        def busy() -> bool:
            victim[:] = [w.worker_id for w in router.workers.live("decode")
                         if w.load and w.load.num_running][:1]
            return bool(victim)

        await until_async("a decode worker decoding", busy)
        moving = [asyncio.create_task(request(router, f"sm-{i}", prompt(10 + i), 8))
                  for i in range(4)]
        await until_async("KV on the way to it", lambda: any(
            w.load and w.load.num_waiting_for_kv for w in router.workers.live("decode")))
        pid = await asyncio.to_thread(cluster.pid, victim[0])
        os.kill(pid, signal.SIGSTOP)
        try:
            await until_async("the stalled worker out of routing",
                              lambda: not router.worker_states()[victim[0]], 30)
            results = await asyncio.wait_for(asyncio.gather(*decoding, *moving), BOUND_S)
        finally:
            os.kill(pid, signal.SIGCONT)
        assert check_outcomes(results[:4], 300) == 4
        assert check_outcomes(results[4:], 8) == 4
        await recovered(router, cluster, {})

    cluster = Cluster(cfg)
    cluster.start()
    try:
        with_router(cluster, body)
    finally:
        cluster.shutdown()
