"""Ranking: the routing policy and the placement rule over the router's view of its
workers -- which token worker a request should try first, which prefill worker would
compute its prompt, and where each decision is counted. Pure bookkeeping, no calls
to a worker: ``Admission`` (``admission.py``) makes the calls, and the simulator
(``pdserve/sim/``) runs the same ranking on its virtual clock.

The policy sees a snapshot in which each worker's free blocks are its last reported
ones minus what this router has reserved there since (``Claims``): a burst of
concurrent admissions sees its own reservations and spreads, instead of piling onto
the worker that looked emptiest 0.25 s ago.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Protocol

from pdserve.engine.sampling.sampling_params import SamplingParams
from pdserve.router.placement import Slo
from pdserve.router.placing import Placer
from pdserve.router.policies import (
    ClusterSnapshot,
    Policy,
    PrefixIndex,
    RouteInput,
    WorkerView,
    prefix_affinity,
)
from pdserve.router.workers import WorkerState


class WorkerSource(Protocol):
    """What the ranking reads of the router's workers (``WorkerSet``'s)."""

    def live(self, *roles: str) -> Sequence[WorkerState]: ...

    def prefill_for(self, decode_id: str) -> Sequence[WorkerState]: ...


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


class Ranking:
    def __init__(self, workers: WorkerSource, policy: Policy, prefix: PrefixIndex,
                 block_size: int, local_prefill_max_tokens: int = 0,
                 placement: str = "measured", slo: Slo | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``prefix``: which prefill worker last computed each prompt block;
        ``clock``: the placement rule's (the simulator's is virtual)."""
        self._workers = workers
        self._policy = policy
        self._prefix = prefix
        # block hash -> the token worker (decode, colocated) that last held it: the
        # prompt and output of a request it finished (the orchestrator records them)
        self.token_prefix = PrefixIndex()
        self.tracks_token_prefix = policy is prefix_affinity  # the only policy that reads it
        self.placer = Placer(prefix, self.token_prefix, block_size, local_prefill_max_tokens,
                             placement, slo or Slo(), clock)
        self.claims = Claims()
        self._sequence = 0

    def order(self, route: RouteInput, params: SamplingParams,
              avoid: frozenset[str] = frozenset()) -> tuple[list[WorkerState], WorkerState | None]:
        """The token workers to try, in order, and the colocated one put first for its
        predicted TTFT, if one was (``Placer.order``)."""
        return self.placer.order(self.rank(route, avoid), route, params,
                                 lambda d: self.pick_prefill(d.worker_id, route, avoid))

    def rank(self, req: RouteInput, avoid: frozenset[str] = frozenset()) -> list[WorkerState]:
        """Live token workers in the policy's order of preference (``avoid`` last)."""
        tokens = self._workers.live("decode", "colocated")
        self._sequence += 1
        snap = ClusterSnapshot(prefill=[], decode=[self._view(w) for w in tokens],
                               sequence=self._sequence,
                               token_prefix_owner=self.token_prefix.view())
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
        choice, _ = (prefix_affinity if req.share_prefix else self._policy)(snap, req)
        return next((w for w in candidates if w.worker_id == choice), candidates[0])

    def _view(self, w: WorkerState) -> WorkerView:
        load = w.load
        free = (load.num_free_blocks if load else 0) - self.claims.unseen(w)
        return WorkerView(w.worker_id, w.outstanding_tokens, w.outstanding_requests,
                          max(0, free), load.num_blocks if load else 1,
                          colocated=w.role == "colocated")
