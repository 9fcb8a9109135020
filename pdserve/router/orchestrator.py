"""``RequestRun``: one request's life in the router -- attempts on a prefill/decode
pair or a colocated worker until it finishes, fails with a clear error, or passes
its deadline.

One attempt (``_attempt``)::

    admission: reserve on a decode worker (or admit on a colocated one)
      -> decode: pick a prefill worker connected to it, start P.prefill(task) --
         unless the decode worker computes the prompt's short uncached suffix
         itself (``Reservation.local``): then, as on a colocated worker, every token
         comes from its stream
      -> read the attempt's inbox (``attempt.Event``): token deltas from the
         worker's stream, P's first token (streamed at once, before the KV hand-over
         ends; the decode worker's copy of it is then dropped), P's hand-off ending
         (P.handoff), a worker's failure, the deadline -- each moves the attempt's
         state machine (``attempt.Attempt``), which says what the client gets
      -> the engine finished it, or a stop string did (then abort it on the worker)
    cleanup: counters, inbox, and -- unless the engine finished -- abort on both
    workers (idempotent there; never waited for)

Retries (``stream``): an ``AttemptFailed`` (a transfer failed, a worker died or left
routing, a transport error) moves the request to another attempt, at most
``max_retries`` times and never past the deadline, with the prompt plus every token
already streamed as the new prompt (and max_tokens/min_tokens reduced by them, and
``resumed_tokens`` saying how many, so a structured-output grammar resumes after them), so
no token is sent twice or skipped. Text is made here, once per request, by one
``OutputProcessor`` that lives across attempts: held-back stop-string prefixes and
half-decoded characters carry over exactly. What cannot be served ends with a
``RouterError``: INVALID (the worker says the request can never fit), OVERLOADED /
NOT_READY (no room / nobody serving within the queue timeout), DEADLINE, or INTERNAL
naming the failure reasons (details go to the log with the request id).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import assert_never

from pdserve.engine.block_pool import prefix_block_hashes, root_hash
from pdserve.engine.output import OutputProcessor
from pdserve.engine.sampling.sampling_params import SamplingParams
from pdserve.engine.sampling.stop import StopDecision
from pdserve.failures import AttemptFailed, FailReason
from pdserve.messages import PrefillTask, RequestDelta, TokenLogprob
from pdserve.router.attempt import (
    Attempt,
    DeadlinePassed,
    HandoffAnswered,
    Leg,
    MoveRequested,
    MoveStopped,
    PrecopyDone,
    PrefillAnswered,
    WorkerFailed,
)
from pdserve.router.fanout import Inbox
from pdserve.router.migration import Handover, Move, Moved
from pdserve.router.placing import Target
from pdserve.router.policies import RouteInput
from pdserve.router.prefill_leg import PrefillLeg, PrefillLegs
from pdserve.router.services import Services
from pdserve.router.trace import RequestTrace
from pdserve.router.types import (
    ErrorKind,
    FinalChunk,
    GenerateRequest,
    RouterError,
    StageTimings,
    StreamChunk,
    Usage,
)
from pdserve.router.workers import WorkerState
from pdserve.tracing import Carrier

log = logging.getLogger("pdserve.router")
MAX_MOVES = 16  # moves of one request to another decode worker (drains, rebalancing)


class RequestRun(PrefillLegs):
    def __init__(self, s: Services, req: GenerateRequest, prompt: list[int], arrival: float,
                 deadline: float) -> None:
        self.s = s
        self.req = req
        self.trace = RequestTrace(s.tracing, req.trace, req.request_id, s.model, req.params,
                                  len(prompt))
        self._attempts = 0
        self.prompt = prompt
        self.arrival = arrival
        self.deadline = deadline
        self.emitted: list[int] = []
        self.text = OutputProcessor(s.tokenizer, prompt, req.params)
        self.timings = StageTimings()
        self.cached = 0
        self._last_token_at: float | None = None
        self._failed_on: set[str] = set()  # workers an attempt of this request failed on
        self._moves = 0  # to another decode worker (router/migration.py), at most MAX_MOVES
        # prompt logprobs (asked for with params.prompt_logprobs): from the prefilling
        # worker; handed to the client once, with the first chunk
        self.prompt_logprobs: list[TokenLogprob | None] | None = None
        self._prompt_logprobs_sent = False

    async def stream(self) -> AsyncIterator[StreamChunk | FinalChunk]:
        final: FinalChunk | None = None
        try:
            async for item in self._stream():
                if isinstance(item, FinalChunk):
                    final = item
                    self.trace.finished(final)  # now: a client may stop reading at it
                yield item
        except BaseException as exc:  # a failure, the client gone (the stream closed)
            self.trace.finished(final, None if final is not None else repr(exc))
            raise

    async def _stream(self) -> AsyncIterator[StreamChunk | FinalChunk]:
        failures: list[AttemptFailed] = []
        handover: Handover | None = None  # a move's: the next attempt is on its worker
        while len(failures) <= self.s.max_retries:
            try:
                async with contextlib.aclosing(self._attempt(handover)) as deltas:
                    handover = None
                    async for delta in deltas:
                        chunk, final = self._process(delta, len(failures))
                        if chunk is not None:
                            yield chunk
                        if final is not None:
                            yield final
                            return
            except Moved as moved:  # not a failure: the stream goes on from the new worker
                handover = moved.handover
            except AttemptFailed as exc:
                failures.append(exc)
                if self.s.metrics is not None:
                    self.s.metrics.observe_attempt_failed(exc.reason)
                log.warning("request %s attempt %d failed (%s): %s", self.req.request_id,
                            len(failures) - 1, exc.reason.value, exc.message)
                if time.monotonic() >= self.deadline:
                    break
        reasons = ", ".join(f.reason.value for f in failures)
        raise RouterError(ErrorKind.INTERNAL,
                          f"request failed after {len(failures)} attempt(s): {reasons}")

    # ------------------------------------------------------------ one attempt
    async def _admit(self, ids: list[int], params: SamplingParams, hashes: list[int],
                     ) -> tuple[str, Inbox, Target, Carrier | None]:
        """A new attempt: its id, its inbox, where it runs (admission), its trace."""
        s = self.s
        # unique per attempt, and among routers serving the same workers
        aid = f"{self.req.request_id}#{next(s.attempt_ids)}@{s.workers.router_id}"
        route = RouteInput(len(ids), hashes, self.req.share_prefix, s.block_size)
        avoid = frozenset(self._failed_on)
        # Open before admitting: a colocated worker computes as soon as it admits, and
        # its first tokens can reach the router before admit() returns here.
        inbox = s.fanout.open(aid, ())
        carrier = self.trace.attempt(self._attempts)
        self._attempts += 1
        try:
            target = await s.admission.admit(aid, ids, params, route, self.deadline, avoid,
                                             carrier)
        except BaseException as exc:
            s.fanout.close(aid)
            self.trace.attempt_ended(type(exc).__name__, str(exc))
            raise
        if self.timings.router_queue is None:
            self.timings.router_queue = time.monotonic() - self.arrival
        token = target.worker
        inbox.workers = (token.worker_id,)  # its failure now ends the attempt
        self.timings.placement, self.timings.placement_reason = target.placement, target.reason
        self.timings.worker = token.worker_id
        self.trace.admitted({"pdserve.worker": token.worker_id,
                             "pdserve.prefill_worker": target.prefill.worker_id
                             if target.prefill else None,
                             "pdserve.placement": target.placement,
                             "pdserve.placement_reason": target.reason})
        if s.metrics is not None:
            s.metrics.observe_placement(target.placement, target.reason)
        return aid, inbox, target, carrier

    async def _attempt(self, handover: Handover | None = None,
                       ) -> AsyncGenerator[RequestDelta, None]:
        s = self.s
        ids, params = self.prompt + self.emitted, self._params_left()
        hashes = prefix_block_hashes(ids, s.block_size, root=root_hash(params.cache_salt))
        if handover is None:
            aid, inbox, target, carrier = await self._admit(ids, params, hashes)
        else:  # moved here: the KV is in, the tokens come from the new worker's stream
            aid, inbox, carrier = handover.attempt_id, handover.inbox, None
            target = Target(handover.worker, handover.reservation, placement="moved",
                            reason=handover.reason)
            self.timings.worker = handover.worker.worker_id
        token = target.worker
        local_pending = target.uncached if target.placement == "local" else 0
        timer = asyncio.get_running_loop().call_later(
            max(0.0, self.deadline - time.monotonic()), inbox.push, DeadlinePassed())
        r = target.reservation
        # a decode worker not computing the prompt itself: its KV comes from P
        att = Attempt(self.req.request_id, aid, token.worker_id,
                      remote=r is not None and not r.local and handover is None)
        leg: PrefillLeg | None = None
        move: Move | None = None
        handed: Handover | None = None
        wanted: str | None = None  # a move asked for, to start once the attempt can move
        try:
            if r is not None and att.leg is Leg.PREFILLING:
                p = target.prefill
                if p is None:
                    raise AttemptFailed(FailReason.NOT_CONNECTED,
                                        f"no prefill worker is connected to {token.worker_id}")
                leg = self._start_prefill(p, inbox, PrefillTask(
                    aid, ids, params, token.worker_id, r.blocks, r.reused, r.draft_blocks,
                    carrier), hashes)
            wants_prompt = params.prompt_logprobs is not None
            while True:
                if move is not None and move.stop_at is not None and (
                        len(self.prompt) + len(self.emitted) >= move.stop_at):
                    handed, move = move.handover(), None  # A's tokens are all out
                    raise Moved(handed)  # (A stays counted until B has the KV: _moved_in)
                if wanted is not None and att.movable:
                    move, wanted = self._start_move(token, aid, wanted, inbox), None
                event = await inbox.get()
                match event:
                    case RequestDelta() as delta:
                        if local_pending and (delta.token_ids or delta.finish_reason):
                            token.local_tokens -= local_pending  # its prompt is computed
                            local_pending = 0
                            target.first_token()
                        delta = att.delta(delta)
                        if handover is not None and delta.token_ids:
                            self._moved_in(handover, "moved")
                            handover = None
                        if wants_prompt and self.prompt_logprobs is None and leg is not None:
                            await self._late_first(leg)  # the prompt's part comes first
                            if self.prompt_logprobs is None:
                                raise AttemptFailed(FailReason.TRANSPORT,
                                                    f"{leg.worker.worker_id}: no prompt logprobs")
                        if delta.finish_reason is not None:
                            att.finish(delta)
                            await self._late_prefill(leg)  # P's timings belong in the final chunk's
                            self._held_by(token, delta.token_ids, hashes)
                        yield delta
                    case PrefillAnswered():
                        assert leg is not None  # only a prefill leg's call pushes it
                        first = self._first_done(leg)
                        target.first_token()
                        streamed = att.prefill_answered(first)
                        if att.leg is Leg.HANDING_OFF:
                            self._start_handoff(leg, inbox)
                        if streamed is not None:
                            yield streamed
                    case HandoffAnswered():
                        assert leg is not None  # only a prefill leg's call pushes it
                        att.handoff_answered()
                        self._handoff_done(leg)
                    case MoveRequested(reason=reason):
                        if (move is None and token.role == "decode"
                                and self._moves < MAX_MOVES):
                            wanted = reason
                    case PrecopyDone():
                        assert move is not None  # only a move's tasks push these
                        if move.error is None:
                            move.stop(inbox)
                        else:
                            self._move_over(move)
                            move = None
                    case MoveStopped():
                        assert move is not None
                        if not move.stopped():  # (raises when A died: the attempt fails)
                            if (isinstance(move.error, ValueError)  # outgrew B's blocks
                                    and self._moves < MAX_MOVES):
                                wanted = move.reason  # anew
                            self._move_over(move)
                            move = None
                    case WorkerFailed() | DeadlinePassed():
                        att.fail(event)
                    case _:
                        assert_never(event)
                if att.finished:
                    return
        except AttemptFailed as exc:
            self._failed_on.update((token.worker_id, *([leg.worker.worker_id] if leg else [])))
            self.trace.attempt_ended(exc.reason.value, exc.message)
            raise
        finally:
            if handover is not None:  # moved here, and ended before a token came
                self._moved_in(handover, "failed")
            if move is not None:
                move.cancel()
            self.trace.attempt_ended()
            timer.cancel()
            s.fanout.close(aid)
            if handed is None:
                token.outstanding_requests -= 1
            token.local_tokens -= local_pending
            if leg is not None:
                for fut in (leg.future, leg.handoff):
                    if fut is not None and not fut.done():
                        fut.cancel()
                leg.settle()
            if not att.finished:  # cancelled, failed, stopped by a stop string, past its deadline
                for w in (token, leg.worker if leg is not None else None):
                    if w is not None:
                        with contextlib.suppress(Exception):
                            await w.handle.abort(aid)
            s.admission.wake()
            s.workers.attempt_ended()

    # ---------------------------------------------------------------- moves
    def _start_move(self, token: WorkerState, aid: str, reason: str,
                    inbox: Inbox) -> Move | None:
        """Phase 1 of a move (router/migration.py); None when nowhere to go."""
        s = self.s
        self._moves += 1
        move = Move(s.workers, s.fanout, s.admission.ranking, token, aid,
                    f"{self.req.request_id}#{next(s.attempt_ids)}@{s.workers.router_id}",
                    reason, s.block_size)
        if move.start(self.prompt + self.emitted, self._params_left(), inbox):
            return move
        if s.metrics is not None:
            s.metrics.observe_move(reason, "abandoned")
        return None

    def _move_over(self, move: Move) -> None:
        """A move that ends with the request where it was."""
        move.cancel()
        if self.s.metrics is not None:
            self.s.metrics.observe_move(move.reason, "abandoned")

    def _moved_in(self, handover: Handover, outcome: str) -> None:
        """A moved request's first token on its new worker came ("moved": the pause
        since the router read the old one's last), or its attempt ended first. Either
        way the old worker's sends for it are over: it is no longer counted (a drain
        waits for that before the worker stops)."""
        handover.source.outstanding_requests -= 1
        self.s.workers.attempt_ended()
        if self.s.metrics is not None:
            self.s.metrics.observe_move(handover.reason, outcome, handover.kv_bytes,
                                        time.monotonic() - handover.stopped_at
                                        if outcome == "moved" else None)

    def _held_by(self, token: WorkerState, last: list[int], hashes: list[int]) -> None:
        """The token worker's prefix cache now holds this request's prompt and output
        (up to ``last``, the final delta's tokens) but the very last token, whose KV was
        never computed: prefix affinity sends a later turn of the conversation there.
        ``hashes``: the attempt's prompt blocks, hashed when it started."""
        if not self.s.admission.ranking.tracks_token_prefix:
            return
        held = (self.prompt + self.emitted + last)[:-1]
        bs = self.s.block_size
        self.s.admission.ranking.token_prefix.record(
            prefix_block_hashes(held, bs, hashes[: len(held) // bs],
                                root_hash(self.req.params.cache_salt)), token.worker_id)


    # --------------------------------------------------------------- tokens
    def _process(self, delta: RequestDelta, attempt: int,
                 ) -> tuple[StreamChunk | None, FinalChunk | None]:
        t = self.timings
        if delta.stages is not None:
            st = delta.stages
            t.decode_queue = st.decode_queue_s if st.decode_queue_s is not None else t.decode_queue
            if st.prefill_s is not None:
                t.prefill_queue, t.prefill = st.prefill_queue_s, st.prefill_s
                self.cached = self.cached or st.num_cached_tokens
        self._got_prompt_logprobs(delta.prompt_logprobs)
        if delta.spec is not None:
            t.spec_draft_tokens += delta.spec[0]
            t.spec_accepted_tokens += delta.spec[1]
        chunk = None
        decision = None
        if delta.token_ids:
            engine = (StopDecision(delta.finish_reason, delta.stop_reason)  # type: ignore[arg-type]
                      if delta.finish_reason in ("stop", "length") else None)
            text, decision, n = self.text.push(delta.token_ids, engine)
            tokens = delta.token_ids[:n]
            now = time.monotonic()
            if t.ttft is None:
                t.ttft = now - self.arrival
                t.tokens_after_first += max(0, len(tokens) - 1)
            elif self._last_token_at is not None:
                t.inter_token.append(now - self._last_token_at)
                t.tokens_after_first += len(tokens)
            self._last_token_at = now
            self.emitted.extend(tokens)
            chunk = StreamChunk(tokens, text, list(delta.logprobs[:n]) if delta.logprobs else [],
                                self._take_prompt_logprobs(), len(self.prompt))
        if decision is None and delta.finish_reason is None:
            return chunk, None
        if decision is None:  # the engine ended it without a token
            if delta.finish_reason not in ("stop", "length"):  # aborted under us
                raise AttemptFailed(FailReason.ABORTED,
                                    f"ended by the worker: {delta.finish_reason}")
            decision = StopDecision(delta.finish_reason, delta.stop_reason)  # type: ignore[arg-type]
            if chunk is None and (tail := self.text.flush()):
                chunk = StreamChunk([], tail, prompt_tokens=len(self.prompt))
        t.e2e = time.monotonic() - self.arrival
        final = FinalChunk(decision.finish_reason,
                           Usage(len(self.prompt), len(self.emitted), self.cached,
                                 (t.spec_accepted_tokens,
                                  t.spec_draft_tokens - t.spec_accepted_tokens)
                                 if self.req.params.prediction else None),
                           stop_reason=decision.stop_reason, timings=t, num_retries=attempt,
                           prompt_logprobs=self._take_prompt_logprobs())
        if self.s.metrics is not None:
            self.s.metrics.observe_finished(final)
        return chunk, final

    def _got_prompt_logprobs(self, lps: list[TokenLogprob | None] | None) -> None:
        # A retry prefills prompt + emitted tokens: only the prompt's part is the answer.
        if lps is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = lps[: len(self.prompt)]

    def _take_prompt_logprobs(self) -> list[TokenLogprob | None] | None:
        if self._prompt_logprobs_sent or self.prompt_logprobs is None:
            return None
        self._prompt_logprobs_sent = True
        return self.prompt_logprobs

    def _params_left(self) -> SamplingParams:
        p, n = self.req.params, len(self.emitted)
        if not n:
            return p
        return dataclasses.replace(p, max_tokens=p.max_tokens - n,
                                   min_tokens=max(0, p.min_tokens - n), resumed_tokens=n)
