"""An attempt's prefill leg: the call to a prefill worker P for the prompt's first
token, then P's hand-off of the KV to the decode worker -- the half of
``orchestrator.RequestRun`` that talks to P (a mixin: its state is the run's)."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pdserve.failures import AttemptFailed, FailReason, WorkerGone
from pdserve.messages import FirstToken, PrefillResult, PrefillTask, TokenLogprob
from pdserve.router.attempt import HandoffAnswered, PrefillAnswered
from pdserve.router.fanout import Inbox
from pdserve.router.types import ErrorKind, RouterError, StageTimings
from pdserve.router.workers import WorkerState

if TYPE_CHECKING:
    from pdserve.router.services import Services

LATE_PREFILL_WAIT_S = 5.0  # P's timings may come after a request done in a token or two


@dataclass
class PrefillLeg:
    """An attempt's prefill call (its first token, then its hand-off), counted against
    its worker (by admission, which chose it) until settled."""

    worker: WorkerState
    future: asyncio.Future[FirstToken]  # P.prefill: the first token
    request_id: str
    num_tokens: int
    decode_worker: str
    first: FirstToken | None = None  # the future's answer, once taken
    handoff: asyncio.Future[PrefillResult] | None = None  # P.handoff, once the token is in
    settled: bool = False

    def settle(self) -> None:
        if not self.settled:
            self.settled = True
            self.worker.outstanding_tokens -= self.num_tokens
            self.worker.outstanding_requests -= 1

class PrefillLegs:
    """``RequestRun``'s calls to its prefill workers."""

    if TYPE_CHECKING:  # the run's, used here
        s: Services
        timings: StageTimings
        cached: int

        def _got_prompt_logprobs(self, lps: list[TokenLogprob | None] | None) -> None: ...

    def _start_prefill(self, p: WorkerState, inbox: Inbox, task: PrefillTask,
                       hashes: list[int]) -> PrefillLeg:
        self.s.fanout.attach(task.request_id, p.worker_id)
        self.s.prefix.record(hashes, p.worker_id)
        fut = asyncio.ensure_future(p.prefill.prefill(task))
        fut.add_done_callback(lambda _: inbox.push(PrefillAnswered()))
        return PrefillLeg(p, fut, task.request_id, len(task.prompt_token_ids),
                           task.decode_worker)

    def _start_handoff(self, leg: PrefillLeg, inbox: Inbox | None) -> None:
        if leg.handoff is None:
            leg.handoff = asyncio.ensure_future(leg.worker.prefill.handoff(leg.request_id))
            if inbox is not None:
                leg.handoff.add_done_callback(lambda _: inbox.push(HandoffAnswered()))

    def _first_done(self, leg: PrefillLeg) -> FirstToken:
        """P's first token (and its timings, prompt logprobs); raises what failed."""
        if leg.first is None:
            first = leg.first = self._answer(leg, leg.future)
            t = self.timings
            t.prefill_queue, t.prefill = first.prefill_queue_s, first.prefill_s
            self.cached = self.cached or first.num_cached_tokens
            self._got_prompt_logprobs(first.prompt_logprobs)
            if first.token_id is None:  # nothing handed off
                self._settle(leg)
        return leg.first

    def _handoff_done(self, leg: PrefillLeg) -> None:
        """P's hand-off ended: the decode worker has the KV (or it failed: raises)."""
        assert leg.handoff is not None
        try:
            res = self._answer(leg, leg.handoff)
        finally:
            self._settle(leg)
        self.timings.kv_transfer, self.timings.kv_bytes = res.kv_transfer_s, res.kv_bytes

    def _settle(self, leg: PrefillLeg) -> None:
        leg.settle()
        self.s.workers.attempt_ended()  # a draining prefill worker may be done now
        self.s.fanout.detach(leg.request_id, leg.worker.worker_id)  # P may leave now

    def _answer(self, leg: PrefillLeg, fut: asyncio.Future[Any]) -> Any:
        """One of P's answers, or the failure it means for the attempt."""
        p = leg.worker
        if fut.cancelled():
            raise AttemptFailed(FailReason.ABORTED, f"{p.worker_id}: call cancelled")
        exc = fut.exception()
        if exc is None:
            return fut.result()
        if isinstance(exc, ValueError):
            raise RouterError(ErrorKind.INVALID, str(exc)) from exc
        if isinstance(exc, WorkerGone):
            self.s.workers.gone(p.worker_id, str(exc))
            raise AttemptFailed(FailReason.WORKER_DIED, f"{p.worker_id}: {exc}") from exc
        if isinstance(exc, AttemptFailed):
            if exc.reason in (FailReason.PEER_DIED, FailReason.NOT_CONNECTED):
                self.s.workers.channel_lost(p.worker_id, leg.decode_worker)
            raise exc
        raise AttemptFailed(FailReason.TRANSPORT, f"{p.worker_id}: {exc!r}") from exc

    async def _late_first(self, leg: PrefillLeg) -> None:
        """A decode worker's tokens came before P's first-token answer: wait for it
        (the prompt's logprobs and P's timings are in it)."""
        if leg.first is not None:
            return
        with contextlib.suppress(Exception):  # a failure is _first_done's to map
            async with asyncio.timeout(LATE_PREFILL_WAIT_S):
                await asyncio.shield(leg.future)
        if leg.future.done():
            self._first_done(leg)

    async def _late_prefill(self, leg: PrefillLeg | None) -> None:
        """The request ended; P's answers (its timings) may not be in yet."""
        if leg is None or leg.settled:
            return
        with contextlib.suppress(RouterError, AttemptFailed):  # a late failure is moot
            await self._late_first(leg)
            if leg.first is None:
                return
            self._start_handoff(leg, None)
            assert leg.handoff is not None
            with contextlib.suppress(Exception):
                async with asyncio.timeout(LATE_PREFILL_WAIT_S):
                    await asyncio.shield(leg.handoff)
            if leg.handoff.done():
                self._handoff_done(leg)
