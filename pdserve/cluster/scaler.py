"""``Scaler``: each pool's target size, and the task that moves the cluster to it at
runtime (``pdserve scale``, ``POST /admin/scale``, the ``--autoscale`` loop).

Reconciling, per round: the pools below target get workers (started on Ray, their
model loaded, then joined by the router: probed, token stream and P x D channels
opened on demand), all at once; then the pools above target drain workers (fewest
requests first, the newest on a tie): a draining worker takes no new requests,
finishes the ones it has (at most ``drain_timeout_s``; what is left then fails
over and is retried elsewhere), leaves routing and its actor is stopped -- its
channels close with nothing in flight, so no request fails. Adds come before
drains so capacity never dips below the smaller of the two sizes.

A failed add (the cluster has no room, the model did not load) stops reconciling
until the next ``set_targets``: ``status()`` carries the error, the targets stay.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

from pdserve.cluster.cluster import Cluster, StartupError
from pdserve.owned_task import OwnedTask
from pdserve.router.router import Router

log = logging.getLogger("pdserve.cluster")
ROLES = ("prefill", "decode", "colocated")


@dataclass
class _Round:
    """The last reconcile round's outcome (for ``status``)."""

    error: str | None = None
    cut_off: int = 0  # requests still on drained workers at their timeout (failed over)


class Scaler:
    def __init__(self, cluster: Cluster, router: Router, drain_timeout_s: float = 120.0,
                 max_workers: int = 64) -> None:
        self.cluster = cluster
        self.router = router
        self.drain_timeout_s = drain_timeout_s
        self.max_workers = max_workers  # per pool: a typo must not start 10,000 actors
        self.targets = self.current()
        self._last = _Round()
        self._wake = asyncio.Event()
        self._busy = False
        self._task = OwnedTask("scaler", self._run)
        self._remove: set[str] = set()  # workers named to leave first

    # --------------------------------------------------------------- the API
    def current(self) -> dict[str, int]:
        """Workers per pool that are in the cluster and not draining."""
        counts = dict.fromkeys(ROLES, 0)
        states = self.router.workers.workers
        for wid, role in self.cluster.roles.items():
            w = states.get(wid)
            if w is None or not w.draining:
                counts[role] += 1
        return counts

    def set_targets(self, changes: dict[str, Any]) -> dict[str, Any]:
        """Set some pools' target sizes (others keep theirs); ``ValueError`` naming
        the problem for a bad pool name or size, or sizes that leave nothing serving.
        ``"remove": [worker ids]`` names the workers that leave (a rolling restart
        drains one at a time; a decode worker's requests move with their KV to the
        others): each one's pool shrinks by one unless its size is given."""
        if not isinstance(changes, dict) or not changes:
            raise ValueError(f"give target sizes for one or more of {list(ROLES)}")
        changes = dict(changes)
        remove = self._named(changes.pop("remove", []))
        unknown = sorted(set(changes) - set(ROLES))
        if unknown:
            raise ValueError(f"unknown pool(s) {unknown}; pools are {list(ROLES)} "
                             f"(and 'remove')")
        current = self.current()
        for role in ROLES:
            named = sum(self.cluster.roles[wid] == role for wid in remove)
            if named and role not in changes:
                changes[role] = current[role] - named
        for role, n in changes.items():
            if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= self.max_workers:
                raise ValueError(f"{role} must be a whole number of workers in "
                                 f"[0, {self.max_workers}], got {n!r}")
        targets = {**self.targets, **changes}
        if (targets["prefill"] == 0) != (targets["decode"] == 0):
            raise ValueError("prefill and decode workers come in pairs: both 0 or both >= 1 "
                             f"(asked for {targets['prefill']} prefill, "
                             f"{targets['decode']} decode)")
        if targets["prefill"] == 0 and targets["colocated"] == 0:
            raise ValueError("these sizes leave no worker serving")
        self.targets = targets
        self._remove |= remove
        self._last = _Round()
        self._wake.set()
        return self.status()

    def _named(self, ids: Any) -> set[str]:
        """The worker ids of a ``remove`` list, checked."""
        if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
            raise ValueError(f"remove must be a list of worker ids, got {ids!r}")
        states = self.router.workers.workers
        for wid in ids:
            if wid not in self.cluster.roles:
                raise ValueError(f"no worker {wid!r}; workers are {sorted(self.cluster.roles)}")
            if wid in states and states[wid].draining:
                raise ValueError(f"worker {wid!r} is leaving already")
        return set(ids)

    def workers(self) -> list[dict[str, Any]]:
        """Every worker the router knows (``/admin/workers``)."""
        return self.router.worker_info()

    def status(self) -> dict[str, Any]:
        current = self.current()
        return {"targets": dict(self.targets), "current": current,
                "reached": current == self.targets and not self._busy,
                "busy": self._busy, "error": self._last.error,
                "failed_over": self._last.cut_off}

    # ------------------------------------------------------------- lifecycle
    def start(self) -> None:
        self._task.start()

    async def stop(self) -> None:
        await self._task.stop()

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            self._busy = True
            try:
                await self.reconcile()
            except Exception as exc:  # keep the task alive; the status says why
                log.exception("scaling failed")
                self._last.error = f"{type(exc).__name__}: {exc}"
            finally:
                self._busy = False

    async def reconcile(self) -> None:
        """Move every pool to its target (one round; see the module docstring)."""
        current = self.current()
        adds = [role for role in ROLES for _ in range(self.targets[role] - current[role])]
        if adds:  # all of them fit now, or none is started (no half-placed actors waiting)
            try:
                await asyncio.to_thread(self.cluster.check_room,
                                        {r: adds.count(r) for r in ROLES if r in adds})
            except StartupError as exc:
                self._last.error = str(exc)
                return
        results = await asyncio.gather(*(self._add(role) for role in adds),
                                       return_exceptions=True)
        errors = [str(r) for r in results if isinstance(r, BaseException)]
        if errors:
            self._last.error = "; ".join(sorted(set(errors)))
            return
        drains = []
        for role in ROLES:
            extra = self.current()[role] - self.targets[role]
            if extra > 0:
                drains += self._victims(role, extra)
        cut = await asyncio.gather(*(self._drain(wid) for wid in drains))
        self._last.cut_off += sum(cut)

    async def _add(self, role: str) -> None:
        log.info("adding a %s worker", role)
        try:
            handle = await asyncio.to_thread(self.cluster.add_worker, role)
        except StartupError as exc:
            log.warning("could not add a %s worker: %s", role, exc)
            raise
        await self.router.add_worker(handle)
        log.info("worker %s (%s) added", handle.worker_id, role)

    def _victims(self, role: str, n: int) -> list[str]:
        """The ``n`` workers of ``role`` to drain: those named (``remove``) first,
        then those out of routing (down, restarting), then the fewest requests, then
        the newest."""
        states = self.router.workers.workers
        ids = [wid for wid, r in self.cluster.roles.items()
               if r == role and not (wid in states and states[wid].draining)]

        def key(wid: str) -> tuple[bool, bool, int, int]:
            w = states.get(wid)
            return (wid not in self._remove, w is not None and w.alive,
                    w.outstanding_requests if w else 0, -int(wid.rsplit("-", 1)[1]))

        return sorted(ids, key=key)[:n]

    async def _drain(self, worker_id: str) -> int:
        log.info("draining %s", worker_id)
        cut = 0
        if worker_id in self.router.workers.workers:
            cut = await self.router.drain_worker(worker_id, self.drain_timeout_s)
        await asyncio.to_thread(self.cluster.remove_worker, worker_id)
        self._remove.discard(worker_id)
        log.info("worker %s removed%s", worker_id,
                 f" ({cut} request(s) failed over at the drain timeout)" if cut else "")
        return cut
