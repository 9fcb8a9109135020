"""Moving a running request from its decode worker A to another, B, with its KV: no
prefill again, no token lost or sent twice. The router's half (the workers' is
``worker/moves.py``); ``orchestrator.RequestRun`` runs one ``Move`` per request at a
time, while the client's stream goes on from A:

1. ``start``: B is the decode worker the routing policy ranks first (A excluded). A
   task connects A's move channel to B, reserves the request on B -- its tokens so
   far as the client has them, as a retry's prompt (``RequestRun._params_left``),
   plus ``SPARE_BLOCKS`` for the tokens A makes meanwhile -- and has A send the full
   blocks (they never change: A decodes on), then pushes ``PrecopyDone``.
2. ``stop``: a task asks A to let the request go at its next step boundary and send
   the rest, with the tokens B does not have; A answers the length L it stopped at
   (``MoveStopped``). A's tokens up to L are on their way on A's stream.
3. ``handover``: once the attempt has read A's tokens up to L, the next attempt reads
   B's (``Handover``): B's first token is the one after L.

Where the move cannot go on, the request stays on A: no other decode worker, no room on
B, B refusing moves (a draft model, tensor-parallel ranks), a failed first phase, the
request ending on A first (its end is on A's stream), or A's tokens outgrowing B's
spare blocks (then the move starts over). Once A has let the request go, a failure is
the attempt's: A dying fails the old attempt, the tail's transfer failing fails the new
one -- either retries as any other, from the tokens the client has.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from dataclasses import dataclass

from pdserve.engine.sampling.sampling_params import SamplingParams
from pdserve.failures import AttemptFailed, FailReason, WorkerGone
from pdserve.messages import Reservation
from pdserve.router.attempt import MoveStopped, PrecopyDone
from pdserve.router.fanout import Fanout, Inbox
from pdserve.router.policies import RouteInput
from pdserve.router.ranking import Ranking
from pdserve.router.workers import WorkerSet, WorkerState

log = logging.getLogger("pdserve.router")
SPARE_BLOCKS = 4  # on B, for the tokens A makes while the full blocks move


class Moved(Exception):  # not an error: the attempt's way out to the next
    """Raised by an attempt whose request moved: the next attempt takes ``handover``."""

    def __init__(self, handover: Handover) -> None:
        super().__init__(handover.attempt_id)
        self.handover = handover


@dataclass
class Handover:
    """A move done: the next attempt reads ``worker``'s tokens of ``attempt_id``."""

    worker: WorkerState
    attempt_id: str
    inbox: Inbox
    source: WorkerState  # counted until the moved request's first token on ``worker``
    reservation: Reservation
    reason: str
    stopped_at: float  # monotonic: when the router read A's last token
    kv_bytes: int


class Move:
    def __init__(self, workers: WorkerSet, fanout: Fanout, ranking: Ranking,
                 source: WorkerState, attempt_id: str, new_attempt_id: str, reason: str,
                 block_size: int) -> None:
        self.workers, self.fanout, self.ranking = workers, fanout, ranking
        self.source = source
        self.attempt_id, self.new_attempt_id = attempt_id, new_attempt_id
        self.reason = reason
        self.block_size = block_size
        self.target: WorkerState | None = None
        self.error: BaseException | None = None  # of the last phase
        self.stop_at: int | None = None  # A's length when it let the request go
        self.kv_bytes = 0
        self._known = 0  # tokens B was given
        self._reservation: Reservation | None = None
        self._head = 0  # blocks sent in the first phase (from B's reused ones)
        self._inbox: Inbox | None = None
        self._task: asyncio.Task[None] | None = None
        self._cleanup: asyncio.Future[None] | None = None

    def start(self, token_ids: list[int], params: SamplingParams, inbox: Inbox) -> bool:
        """Phase 1 in the background; False when no decode worker can take it."""
        route = RouteInput(len(token_ids), [], False, self.block_size)
        targets = [w for w in self.ranking.rank(route, frozenset({self.source.worker_id}))
                   if w.role == "decode" and w is not self.source and w.kv_endpoint]
        if not targets:
            return False
        b = self.target = targets[0]
        self._inbox = self.fanout.open(self.new_attempt_id, (b.worker_id,))
        b.outstanding_requests += 1
        self._task = asyncio.ensure_future(self._precopy(list(token_ids), params, inbox))
        return True

    async def _precopy(self, token_ids: list[int], params: SamplingParams,
                       inbox: Inbox) -> None:
        a, b = self.source, self.target
        assert b is not None and b.kv_endpoint is not None
        try:
            await self.workers.call(a, a.decode.move_connect(b.worker_id, b.kv_endpoint))
            head = (len(token_ids) - 1) // self.block_size  # full blocks of computed tokens
            # (the prompt's logprobs went out with the first token: none to compute there)
            params = dataclasses.replace(params, prompt_logprobs=None)
            r = await self.workers.call(b, b.decode.reserve_moved(
                self.new_attempt_id, token_ids, params, head, SPARE_BLOCKS,
                self.workers.router_id, None))
            if r is None:
                raise AttemptFailed(FailReason.NOT_CONNECTED,
                                    f"{b.worker_id} takes no moved request now")
            self._reservation, self._known = r, len(token_ids)
            self._head = max(head, r.reused)
            if head > r.reused:
                self.kv_bytes += await self.workers.call(a, a.decode.move_blocks(
                    self.attempt_id, f"{self.new_attempt_id}/head", b.worker_id, r.reused,
                    r.blocks[r.reused:head]))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the move is given up, the request stays
            self.error = exc
        finally:
            inbox.push(PrecopyDone())

    def stop(self, inbox: Inbox) -> None:
        """Phase 2 in the background: A lets the request go (module doc)."""
        self._task = asyncio.ensure_future(self._stop(inbox))

    async def _stop(self, inbox: Inbox) -> None:
        a, b, r = self.source, self.target, self._reservation
        assert b is not None and r is not None
        try:
            self.stop_at, nbytes = await self.workers.call(a, a.decode.move_stop(
                self.attempt_id, self.new_attempt_id, b.worker_id, self._head,
                r.blocks[self._head:], self._known))
            self.kv_bytes += nbytes
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the orchestrator maps it (``stopped``)
            self.error = exc
        finally:
            inbox.push(MoveStopped())

    def stopped(self) -> bool:
        """After ``MoveStopped``: True when A let the request go; False when it is still
        on A (the move is over). Raises the old attempt's failure when A died."""
        exc = self.error
        if exc is None:
            return True
        if isinstance(exc, WorkerGone):
            self.workers.gone(self.source.worker_id, str(exc))
            raise AttemptFailed(FailReason.WORKER_DIED, f"{self.source.worker_id}: {exc}")
        log.warning("move of %s: it stays on %s: %r", self.attempt_id, self.source.worker_id,
                    exc)
        return False

    def handover(self) -> Handover:
        b, r, inbox = self.target, self._reservation, self._inbox
        assert b is not None and r is not None and inbox is not None
        self._inbox = None  # the next attempt's now
        return Handover(b, self.new_attempt_id, inbox, self.source, r, self.reason,
                        time.monotonic(), self.kv_bytes)

    def cancel(self) -> None:
        """The move is over without a hand-over: its tasks stop, B's reservation goes
        (never waited for)."""
        if self._task is not None and not self._task.done():
            self._task.cancel()
        b = self.target
        if self._inbox is None or b is None:
            return
        self.fanout.close(self.new_attempt_id)
        self._inbox = None
        b.outstanding_requests -= 1
        self._cleanup = asyncio.ensure_future(self._abort(b))

    async def _abort(self, b: WorkerState) -> None:
        with contextlib.suppress(Exception):
            await b.handle.abort(self.new_attempt_id)
        self.workers.attempt_ended()
