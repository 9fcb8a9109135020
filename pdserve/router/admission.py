"""Admission: where a request's tokens will be made, and whether there is room now.

A token worker (decode, or colocated) must take the request: ``reserve`` allocates
the prompt's KV blocks on a decode worker, ``admit`` queues the prompt on a colocated
one; ``None``/``False`` means no room now. Candidates are ranked by the routing policy
and the placement rule (``ranking.py``), tried in that order. With no room anywhere the request waits (at most
``max_waiting`` of them, each up to ``queue_timeout_s``), woken whenever a request
ends or a worker joins; then OVERLOADED (HTTP 429 / RESOURCE_EXHAUSTED).

Order of the waiting requests (``params.priority``, vLLM's field: lower first). A
request that found no room joins the queue; the queue is served strictly in order:
only its head tries again (when woken, and every 0.5 s), and when the head leaves
(admitted, timed out, failed) the next head is woken at once. The order is by
effective priority ``priority - floor(waited / AGING_S)`` (waited: since this
admission began), then arrival: FIFO within a priority, and a low priority is not
starved, since every ``AGING_S`` seconds of waiting is worth one level. A new
request tries at once only if it ranks ahead of every queued one (so, with no
queue, requests admit concurrently as they always did); otherwise it queues behind
them. A head that fits nowhere holds back those behind it (as the engine's waiting
queue does), for at most ``queue_timeout_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from dataclasses import dataclass, field

from pdserve.engine.sampling.sampling_params import SamplingParams, effective_priority
from pdserve.failures import AttemptFailed, FailReason, WorkerGone
from pdserve.router.placement import Slo
from pdserve.router.placing import Target
from pdserve.router.policies import Policy, PrefixIndex, RouteInput
from pdserve.router.ranking import Ranking
from pdserve.router.types import ErrorKind, RouterError
from pdserve.router.workers import WorkerSet, WorkerState
from pdserve.tracing import Carrier

# Seconds of waiting worth one priority level (see the module doc); the engine's
# waiting queue (engine/scheduler.py, which the router may not import) uses the same.
POLL_S = 0.5  # the queue's head retries at least this often, woken or not



@dataclass(eq=False)
class _Ticket:
    """One admission's place in the waiting queue."""

    priority: int
    since: float  # monotonic: when the admission began
    seq: int  # arrival order: FIFO among equal effective priorities
    turn: asyncio.Event = field(default_factory=asyncio.Event)  # set: try again now

    def key(self, now: float) -> tuple[int, int]:
        return effective_priority(self.priority, now - self.since), self.seq


class Admission:
    def __init__(self, workers: WorkerSet, policy: Policy, prefix: PrefixIndex,
                 max_waiting: int, queue_timeout_s: float, block_size: int,
                 local_prefill_max_tokens: int = 0, placement: str = "measured",
                 slo: Slo | None = None) -> None:
        self._workers = workers
        self.ranking = Ranking(workers, policy, prefix, block_size, local_prefill_max_tokens,
                               placement, slo)
        self.max_waiting = max_waiting
        self.queue_timeout_s = queue_timeout_s
        self._block_size = block_size
        self.num_waiting = 0
        self._capacity = asyncio.Event()  # set whenever room may have appeared
        self._queue: list[_Ticket] = []  # requests that found no room, waiting
        self._tickets = itertools.count()

    def wake(self) -> None:
        """Room may have appeared (a request ended, a worker joined): the waiting
        queue's head tries again, and ``wait_for_change`` returns."""
        self._capacity.set()
        head = self._head()
        if head is not None:
            head.turn.set()

    def watch(self) -> None:
        """Start watching for ``wake``: call before checking what ``wait_for_change``
        waits for, so that no wake in between is missed."""
        self._capacity.clear()

    async def wait_for_change(self, timeout_s: float) -> None:
        """Until ``wake`` since the last ``watch``, at most ``timeout_s`` (and 0.5 s)."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(min(timeout_s, POLL_S)):
                await self._capacity.wait()

    def full(self) -> bool:
        return self.num_waiting >= self.max_waiting

    async def admit(self, attempt_id: str, ids: list[int], params: SamplingParams,
                    route: RouteInput, deadline: float, avoid: frozenset[str] = frozenset(),
                    trace: Carrier | None = None) -> Target:
        """``avoid``: workers this request already failed on (tried last); ``trace``:
        the attempt's trace context, for the worker's spans. Waits its turn in the
        queue (module doc) while there is no room."""
        now = time.monotonic()
        give_up = min(deadline, now + self.queue_timeout_s)
        need = -(-len(ids) // self._block_size)
        ticket = _Ticket(params.priority, now, next(self._tickets))
        queued = my_turn = False
        self.num_waiting += 1
        try:
            while True:
                had_turn = my_turn or ticket.turn.is_set()  # it was (told it is) the head
                ticket.turn.clear()  # a wake from here on is seen by the wait below
                head, now = self._head(), time.monotonic()
                my_turn = head is None or head is ticket or ticket.key(now) < head.key(now)
                if my_turn:
                    ranked, faster = self.ranking.order(route, params, avoid)
                    for w in ranked:
                        target = await self._try(w, attempt_id, ids, params, need, route,
                                                 avoid, trace)
                        if target is not None:
                            if w is faster:
                                target.reason = "faster_colocated"
                            return target
                elif had_turn and head is not None:
                    head.turn.set()  # aging made another the head: hand it the turn
                if not queued:  # no room, or others wait ahead of it
                    self._queue.append(ticket)
                    queued = True
                remaining = give_up - time.monotonic()
                if remaining <= 0:
                    if not self._workers.ready():
                        raise RouterError(ErrorKind.NOT_READY, "no worker is serving right now",
                                          retry_after_s=1.0)
                    raise RouterError(ErrorKind.OVERLOADED,
                                      "no decode worker has room for this request",
                                      retry_after_s=1.0)
                # The head polls; the rest sleep until their turn (or their timeout).
                wait_s = min(remaining, POLL_S) if my_turn else remaining
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(wait_s):
                        await ticket.turn.wait()
        finally:
            self.num_waiting -= 1
            if queued:
                self._queue.remove(ticket)
                self.wake()  # the next in line may have room now, or the head changed

    def _head(self) -> _Ticket | None:
        """The waiting request whose turn it is (lowest key), if any wait."""
        if not self._queue:
            return None
        now = time.monotonic()
        return min(self._queue, key=lambda t: t.key(now))

    async def _try(self, w: WorkerState, attempt_id: str, ids: list[int],
                   params: SamplingParams, need: int, route: RouteInput,
                   avoid: frozenset[str], trace: Carrier | None) -> Target | None:
        rk = self.ranking
        rk.claims.ask(w, need)
        w.outstanding_requests += 1
        granted = False
        try:
            if w.role == "decode":
                p = rk.pick_prefill(w.worker_id, route, avoid)
                placing = rk.placer.prepare(w, p, route, params)
                try:  # counted before the call: the admissions meanwhile see this one
                    got = await self._workers.call(w, w.decode.reserve(
                        attempt_id, ids, params, placing.local, self._workers.router_id,
                        trace))
                finally:
                    placing.claim.undo()
                granted = got is not None
                return rk.placer.placed(placing, got) if got is not None else None
            granted = bool(await self._workers.call(w, w.colocated.admit(
                attempt_id, ids, params, self._workers.router_id, trace)))
            return Target(w, None, uncached=len(ids)) if granted else None
        except ValueError as exc:  # the worker can never serve it: the request's fault
            raise RouterError(ErrorKind.INVALID, str(exc)) from exc
        except WorkerGone as exc:
            self._workers.gone(w.worker_id, str(exc))
            return None
        except (AttemptFailed, asyncio.CancelledError):
            # The call went out and may still reserve (or admit): free that (never
            # waits). Cancelled: the client left, or another choice of its request failed.
            await w.handle.abort(attempt_id)
            raise
        except Exception as exc:  # a transport error: this attempt fails, probes judge w
            raise AttemptFailed(FailReason.TRANSPORT,
                                f"admission on {w.worker_id}: {exc!r}") from exc
        finally:
            rk.claims.answered(w, need, granted)
            if not granted:
                w.outstanding_requests -= 1
                self._workers.attempt_ended()
