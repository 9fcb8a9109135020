"""Moving a running request from its decode worker A to another, B, with its KV: no
prefill again, no token lost or sent twice. The router's half (the workers' is
``worker/moves.py``); ``orchestrator.RequestRun`` runs one ``Move`` per request at a time.

1. ``start`` (while the client's stream goes on from A): B is the decode worker the
   routing policy ranks first, A excluded. A task connects A's move channel to B,
   stages on B the request's full blocks so far and has A send them -- full blocks
   never change, so A keeps decoding meanwhile -- then pushes ``PrecopyDone`` into the
   attempt's inbox.
2. ``finish`` (the attempt stops reading A's tokens): the request's tokens so far, as
   the client got them, are a retry's prompt (``RequestRun._params_left``). B reserves
   them -- the staged blocks are its prefix hits -- A takes the request out of its
   engine and sends the rest (the last, partial blocks), and the next attempt reads
   B's tokens (``Handover``). Tokens A made after the stop are dropped: B makes the
   same ones (greedy, or seeded: the draws are skipped as for a retry).

Where the move cannot go on, the request stays on A (``None``): no other decode worker,
no room on B, B refusing moves (a draft model, tensor-parallel ranks, no prefix
cache), the first phase failing, or the request ending on A first -- its end is in the
inbox, which was not read meanwhile. Once A has let the request go, a failed send
fails the attempt (``AttemptFailed``): it retries as any other, from the same tokens.
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
from pdserve.router.attempt import PrecopyDone
from pdserve.router.fanout import Fanout, Inbox
from pdserve.router.policies import RouteInput
from pdserve.router.ranking import Ranking
from pdserve.router.workers import WorkerSet, WorkerState
from pdserve.tracing import Carrier

log = logging.getLogger("pdserve.router")


class Moved(Exception):
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
    reservation: Reservation
    reason: str
    stopped_at: float  # monotonic: when the router stopped reading A
    kv_bytes: int


class Move:
    def __init__(self, workers: WorkerSet, fanout: Fanout, ranking: Ranking,
                 source: WorkerState, attempt_id: str, reason: str, block_size: int) -> None:
        self.workers, self.fanout, self.ranking = workers, fanout, ranking
        self.source = source
        self.attempt_id = attempt_id
        self.reason = reason
        self.block_size = block_size
        self.target: WorkerState | None = None
        self.error: BaseException | None = None
        self.kv_bytes = 0
        self._stage_id = f"{attempt_id}/stage"
        self._staged = False
        self._task: asyncio.Task[None] | None = None
        self._cleanup: asyncio.Future[None] | None = None

    def start(self, token_ids: list[int], params: SamplingParams, inbox: Inbox) -> bool:
        """Phase 1 in the background; False when no decode worker can take it."""
        route = RouteInput(len(token_ids), [], False, self.block_size)
        targets = [w for w in self.ranking.rank(route, frozenset({self.source.worker_id}))
                   if w.role == "decode" and w is not self.source and w.kv_endpoint]
        if not targets:
            return False
        self.target = targets[0]
        self._task = asyncio.ensure_future(self._precopy(list(token_ids), params, inbox))
        return True

    async def _precopy(self, token_ids: list[int], params: SamplingParams,
                       inbox: Inbox) -> None:
        a, b = self.source, self.target
        assert b is not None and b.kv_endpoint is not None
        try:
            await self.workers.call(a, a.decode.move_connect(b.worker_id, b.kv_endpoint))
            full = (len(token_ids) - 1) // self.block_size  # blocks of computed tokens
            if full:
                got = await self.workers.call(b, b.decode.stage(
                    self._stage_id, token_ids[:full * self.block_size], params.cache_salt))
                if got is None:
                    raise AttemptFailed(FailReason.NOT_CONNECTED,
                                        f"{b.worker_id} takes no moved request now")
                self._staged = True
                self.kv_bytes += await self.workers.call(a, a.decode.move_out(
                    self.attempt_id, self._stage_id, b.worker_id, got.reused,
                    got.blocks[got.reused:], False))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.error = exc
        finally:
            inbox.push(PrecopyDone())

    async def finish(self, attempt_id: str, token_ids: list[int], params: SamplingParams,
                     carrier: Carrier | None) -> Handover | None:
        """Phase 2 (module doc): the attempt ``attempt_id`` on B, or None (stay on A)."""
        a, b = self.source, self.target
        assert b is not None
        if self.error is not None:
            log.warning("move of %s to %s given up: %r", self.attempt_id, b.worker_id,
                        self.error)
            await self._unstage()
            return None
        stopped = time.monotonic()
        # (the prompt's logprobs went out with the first token: none to compute there)
        params = dataclasses.replace(params, prompt_logprobs=None)
        inbox = self.fanout.open(attempt_id, (b.worker_id,))
        b.outstanding_requests += 1
        kept = False
        try:
            r = await self._reserve(attempt_id, token_ids, params, carrier)
            await self._unstage()  # the reservation holds the staged blocks now
            if r is None:
                return None
            try:
                self.kv_bytes += await self.workers.call(a, a.decode.move_out(
                    self.attempt_id, attempt_id, b.worker_id, r.reused,
                    r.blocks[r.reused:], True))
            except WorkerGone as exc:
                self.workers.gone(a.worker_id, str(exc))
                raise AttemptFailed(FailReason.WORKER_DIED, f"{a.worker_id}: {exc}") from exc
            except AttemptFailed as exc:
                if exc.reason is FailReason.ABORTED:  # it ended on A: its end is in the inbox
                    return None
                raise
            kept = True
            return Handover(b, attempt_id, inbox, r, self.reason, stopped, self.kv_bytes)
        finally:
            if not kept:
                self.fanout.close(attempt_id)
                b.outstanding_requests -= 1
                with contextlib.suppress(Exception):
                    await b.handle.abort(attempt_id)
                self.workers.attempt_ended()

    async def _reserve(self, attempt_id: str, token_ids: list[int], params: SamplingParams,
                       carrier: Carrier | None) -> Reservation | None:
        b = self.target
        assert b is not None
        try:
            return await self.workers.call(b, b.decode.reserve_moved(
                attempt_id, token_ids, params, self.workers.router_id, carrier))
        except WorkerGone as exc:
            self.workers.gone(b.worker_id, str(exc))
        except (AttemptFailed, ValueError) as exc:
            log.warning("move of %s: %s refused it: %r", self.attempt_id, b.worker_id, exc)
        return None

    async def _unstage(self) -> None:
        b = self.target
        if self._staged and b is not None:
            self._staged = False
            with contextlib.suppress(Exception):
                await self.workers.call(b, b.decode.unstage(self._stage_id))

    def cancel(self) -> None:
        """The attempt ended first: stop phase 1 and drop B's stage (never waited for)."""
        if self._task is not None and not self._task.done():
            self._task.cancel()
        if self._staged:
            self._cleanup = asyncio.ensure_future(self._unstage())
