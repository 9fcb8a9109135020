"""What the chaos tests share: their prompts, a request that returns its tokens or its
error, the outcome check and the recovery check (every worker in routing, every block
free, every pool consistent)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Callable
from typing import Any

from pdserve.cluster.cluster import Cluster
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.sampling.sampling_params import SamplingParams
from pdserve.router.router import Router
from pdserve.router.types import (
    ErrorKind,
    FinalChunk,
    GenerateRequest,
    RouterError,
    StreamChunk,
)
from tests.waiting import until_async

LONG_PROMPT = 1200  # tokens: 38 chunks of 32 on the prefill side, KV sent as they go
BOUND_S = 120.0  # every request of a case must end within this
CLEAR = {ErrorKind.INTERNAL, ErrorKind.OVERLOADED, ErrorKind.NOT_READY, ErrorKind.DEADLINE}


def prompt(i: int, n: int = LONG_PROMPT) -> list[int]:
    return [5 + (i * 31 + j) % 400 for j in range(n)]


class Tokens(list[int]):
    """A request's tokens (equal to the plain list), and where they came from: what a
    mismatch's report needs to tell a wrong worker from a wrong path."""

    path = ""


async def request(router: Router, rid: str, ids: list[int], max_tokens: int) -> Any:
    """All the request's tokens (``Tokens``), or the RouterError it ended with."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    tokens = Tokens()
    if (task := asyncio.current_task()) is not None:
        task.set_name(rid)  # a hung one is named in settle()'s report
    try:
        async for item in router.generate(GenerateRequest(rid, params, prompt_token_ids=ids)):
            if isinstance(item, StreamChunk):
                tokens += item.token_ids
            elif isinstance(item, FinalChunk):
                t = item.timings
                tokens.path = (f"{t.placement} ({t.placement_reason}) to {t.worker}, "
                               f"{item.num_retries} retries, {item.usage.cached_tokens} "
                               f"cached prompt tokens")
    except RouterError as exc:
        return exc
    return tokens


def greedy(cluster: Cluster, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """The engine's own greedy tokens for ``prompts`` (computed here, in one batch)."""
    assert cluster.model_dir is not None
    engine = LLMEngine(cluster.model_dir, EngineConfig(num_blocks=1024, dtype="auto"))
    return [o.token_ids for o in engine.generate(
        prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))]


async def settle(cluster: Cluster, router: Router, tasks: list[asyncio.Task[Any]],
                 bound_s: float = BOUND_S) -> list[Any]:
    """Every task's result, in order; an AssertionError naming the requests still
    running after ``bound_s`` (cancelled then) and the workers' states, with every
    running worker's thread stacks in its log (SIGUSR1) for where it was stuck."""
    _, pending = await asyncio.wait(tasks, timeout=bound_s)
    if pending:
        for t in pending:
            t.cancel()
        busy = {w.worker_id: w.outstanding_requests
                for w in router.workers.workers.values() if w.outstanding_requests}
        for wid in busy:
            with contextlib.suppress(Exception):  # gone, stopped: no stacks from it
                os.kill(await asyncio.to_thread(cluster.pid, wid), signal.SIGUSR1)
        raise AssertionError(f"{len(pending)} requests hung past {bound_s:.0f} s: "
                             f"{sorted(t.get_name() for t in pending)}; in routing: "
                             f"{router.worker_states()}; outstanding: {busy}")
    return [t.result() for t in tasks]


def empty_kv_blocks(router: Router) -> int:
    """KV blocks the live workers found empty where KV must be (sent or arrived so;
    WorkerMetrics.kv_empty_blocks): each one a bug the decode side turned into a retry."""
    loads = [w.load for w in router.workers.workers.values()]
    return sum(load.metrics.kv_empty_blocks for load in loads
               if load is not None and load.metrics is not None)


def check_outcomes(results: list[Any], want: list[list[int]]) -> int:
    """Each request finished with the engine's greedy tokens (``want``, in the same
    order: a retry continues exactly) or a clear error; returns how many finished."""
    ok = 0
    for i, (r, w) in enumerate(zip(results, want, strict=True)):
        if isinstance(r, RouterError):
            assert r.kind in CLEAR and r.message, r
        else:
            assert r == w, (f"request {i}: {len(r)} tokens {r} != the engine's {w}; "
                            f"{getattr(r, 'path', '')}")
            ok += 1
    return ok


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
