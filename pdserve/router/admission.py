"""Admission: where a request's tokens will be made, and whether there is room now.

A token worker (decode, or colocated) must take the request: ``reserve`` allocates
the prompt's KV blocks on a decode worker, ``admit`` queues the prompt on a colocated
one; ``None``/``False`` means no room now. Candidates are ranked by the routing policy
from a snapshot in which each worker's free blocks are its last reported ones minus
what this router has reserved there since (``Claims``): a burst of concurrent
admissions sees its own reservations and spreads, instead of piling onto the worker
that looked emptiest 0.25 s ago. With no room anywhere the request waits (at most
``max_waiting`` of them, each up to ``queue_timeout_s``), woken whenever a request
ends or a worker joins; then OVERLOADED (HTTP 429 / RESOURCE_EXHAUSTED).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass

from pdserve.engine.sampling_params import SamplingParams
from pdserve.failures import AttemptFailed, FailReason, WorkerGone
from pdserve.router.policies import ClusterSnapshot, Policy, PrefixIndex, RouteInput, WorkerView
from pdserve.router.types import ErrorKind, RouterError
from pdserve.router.workers import WorkerSet, WorkerState


@dataclass
class Target:
    """Where one attempt's tokens come from."""

    worker: WorkerState  # a decode or colocated worker
    blocks: list[int] | None  # decode: the reserved blocks; colocated: None


class Claims:
    """Blocks this router reserved per worker: granted in total (compared with the
    worker's ``WorkerLoad.blocks_granted``) and asked for, not answered yet."""

    def __init__(self) -> None:
        self._granted: dict[tuple[str, str | None], int] = {}  # (worker, incarnation)
        self._asking: dict[str, int] = {}

    def ask(self, w: WorkerState, blocks: int) -> None:
        self._asking[w.worker_id] = self._asking.get(w.worker_id, 0) + blocks

    def answered(self, w: WorkerState, blocks: int, granted: bool) -> None:
        self._asking[w.worker_id] -= blocks
        if granted:
            key = (w.worker_id, w.incarnation)
            self._granted[key] = self._granted.get(key, 0) + blocks

    def unseen(self, w: WorkerState) -> int:
        """Blocks reserved on ``w`` that its last reported load does not show yet."""
        seen = w.load.blocks_granted if w.load is not None else 0
        granted = self._granted.get((w.worker_id, w.incarnation), 0)
        return max(0, granted - seen) + self._asking.get(w.worker_id, 0)


class Admission:
    def __init__(self, workers: WorkerSet, policy: Policy, prefix: PrefixIndex,
                 max_waiting: int, queue_timeout_s: float, block_size: int) -> None:
        self._workers = workers
        self._policy = policy
        self._prefix = prefix
        self.max_waiting = max_waiting
        self.queue_timeout_s = queue_timeout_s
        self._block_size = block_size
        self.claims = Claims()
        self.num_waiting = 0
        self._capacity = asyncio.Event()  # set whenever room may have appeared
        self._sequence = 0

    def wake(self) -> None:
        """Room may have appeared (a request ended, a worker joined)."""
        self._capacity.set()

    def watch(self) -> None:
        """Start watching for ``wake``: call before checking what ``wait_for_change``
        waits for, so that no wake in between is missed."""
        self._capacity.clear()

    async def wait_for_change(self, timeout_s: float) -> None:
        """Until ``wake`` since the last ``watch``, at most ``timeout_s`` (and 0.5 s)."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(min(timeout_s, 0.5)):
                await self._capacity.wait()

    def full(self) -> bool:
        return self.num_waiting >= self.max_waiting

    async def admit(self, attempt_id: str, ids: list[int], params: SamplingParams,
                    hashes: list[int], deadline: float, avoid: frozenset[str] = frozenset(),
                    ) -> Target:
        """``avoid``: workers this request already failed on (tried last)."""
        give_up = min(deadline, time.monotonic() + self.queue_timeout_s)
        need = -(-len(ids) // self._block_size)
        self.num_waiting += 1
        try:
            while True:
                self.watch()
                for w in self.rank(RouteInput(len(ids), hashes), avoid):
                    target = await self._try(w, attempt_id, ids, params, need)
                    if target is not None:
                        return target
                remaining = give_up - time.monotonic()
                if remaining <= 0:
                    if not self._workers.ready():
                        raise RouterError(ErrorKind.NOT_READY, "no worker is serving right now",
                                          retry_after_s=1.0)
                    raise RouterError(ErrorKind.OVERLOADED,
                                      "no decode worker has room for this request",
                                      retry_after_s=1.0)
                await self.wait_for_change(remaining)
        finally:
            self.num_waiting -= 1

    async def _try(self, w: WorkerState, attempt_id: str, ids: list[int],
                   params: SamplingParams, need: int) -> Target | None:
        self.claims.ask(w, need)
        w.outstanding_requests += 1
        granted = False
        try:
            if w.role == "decode":
                blocks = await self._workers.call(w, w.handle.reserve(attempt_id, ids, params))
                granted = blocks is not None
                return Target(w, blocks) if granted else None
            granted = bool(await self._workers.call(w, w.handle.admit(attempt_id, ids, params)))
            return Target(w, None) if granted else None
        except ValueError as exc:  # the worker can never serve it: the request's fault
            raise RouterError(ErrorKind.INVALID, str(exc)) from exc
        except WorkerGone as exc:
            self._workers.gone(w.worker_id, str(exc))
            return None
        except AttemptFailed:
            await w.handle.abort(attempt_id)  # it may still reserve: free that (never waits)
            raise
        except Exception as exc:  # a transport error: this attempt fails, probes judge w
            raise AttemptFailed(FailReason.TRANSPORT,
                                f"admission on {w.worker_id}: {exc!r}") from exc
        finally:
            self.claims.answered(w, need, granted)
            if not granted:
                w.outstanding_requests -= 1
                self._workers.attempt_ended()

    def rank(self, req: RouteInput, avoid: frozenset[str] = frozenset()) -> list[WorkerState]:
        """Live token workers in the policy's order of preference (``avoid`` last)."""
        tokens = self._workers.live("decode", "colocated")
        self._sequence += 1
        snap = ClusterSnapshot(prefill=[], decode=[self._view(w) for w in tokens],
                               sequence=self._sequence)
        _, order = self._policy(snap, req)
        by_id = {w.worker_id: w for w in tokens}
        # A decode worker without a connected prefill worker cannot be served now.
        ranked = [by_id[i] for i in order
                  if by_id[i].role == "colocated" or self._workers.prefill_for(i)]
        return sorted(ranked, key=lambda w: w.worker_id in avoid)  # stable

    def pick_prefill(self, decode_id: str, req: RouteInput,
                     avoid: frozenset[str] = frozenset()) -> WorkerState | None:
        candidates = self._workers.prefill_for(decode_id)
        fresh = [w for w in candidates if w.worker_id not in avoid]
        candidates = fresh or candidates  # a retry tries another prefill worker first
        if not candidates:
            return None
        snap = ClusterSnapshot(prefill=[self._view(w) for w in candidates], decode=[],
                               sequence=self._sequence, prefix_owner=self._prefix.view())
        choice, _ = self._policy(snap, req)
        return next((w for w in candidates if w.worker_id == choice), candidates[0])

    def _view(self, w: WorkerState) -> WorkerView:
        load = w.load
        free = (load.num_free_blocks if load else 0) - self.claims.unseen(w)
        return WorkerView(w.worker_id, w.outstanding_tokens, w.outstanding_requests,
                          max(0, free), load.num_blocks if load else 1,
                          colocated=w.role == "colocated")
