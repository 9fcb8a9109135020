"""``PrefillWorker``: a prefill pool member.

It batches prompts from many requests under the engine's token budget (chunked
prefill, prefix reuse), samples each request's first token, and pushes the
request's KV into the blocks a decode worker reserved -- overlapped with compute:
after every engine step, the blocks that step completed go out at once (prefix-cache
hits with the first chunk), and the last send, once the first token is sampled,
carries the rest (the partial last block) and the first token. With a draft model
(speculative decoding), the draft's prompt KV is computed once the first token is
answered and goes out just before that last send, as part of the same transfer. The
first token also
goes straight back to the router (``prefill``'s answer), which streams it before the
hand-over ends; ``handoff`` then answers once the decode worker has the KV. So the
transfer adds nothing to TTFT. The channel runs on its own thread
(``kv_transfer.driver``), so sends progress and are acknowledged while the engine
steps.

Block ownership: every block handed to a send is pinned (one extra reference in the
engine's pool) until the request's transfer has ended, so a preemption cannot reuse
it while a backend may still read it. A request's life here::

    prefill() -> engine WAITING -> (chunk: send its full blocks) ... -> PREFILLED
              -> FirstToken, final send (rest + first token)
    handoff()                                    -> SendEvent ok  -> PrefillResult
                                                 -> SendEvent err -> AttemptFailed
    (blocks released and pins dropped on the event; a failure before the first token
    fails prefill() too)

A plain class with async methods: a sync constructor builds it in a test, the router
calls it in-process, ``cluster/actors.py`` wraps the class itself as a Ray actor.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from pdserve.engine.config import EngineConfig
from pdserve.engine.results import RequestOutput
from pdserve.engine.sampling.sampling_params import SamplingParams
from pdserve.engine.sampling.stop import StopChecker
from pdserve.failures import AttemptFailed, FailReason
from pdserve.kv_transfer import KVSender, SendEvent
from pdserve.kv_transfer.driver import ChannelThread
from pdserve.kv_transfer.with_draft import DraftSender
from pdserve.messages import FirstToken, PrefillResult, PrefillTask, TokenLogprob, WorkerMetrics
from pdserve.tracing import Tracing
from pdserve.worker.core_share import CoreShare
from pdserve.worker.loop import WorkerLoop, prompt_logprobs_of

log = logging.getLogger("pdserve.prefill_worker")

# A hand-off answer resolved this long ago and not taken was its router's, which died.
HANDOFF_KEEP_S = 60.0


@dataclass
class _InFlight:
    task: PrefillTask
    first: Future[FirstToken]  # prefill()'s answer
    future: Future[PrefillResult]  # handoff()'s answer
    received: float
    peer: str
    sent_blocks: int = 0  # leading blocks already handed to a send
    pinned: list[int] = field(default_factory=list)  # source blocks referenced for sends
    draft_blocks: int = 0  # of those, the last pinned for the draft's KV (its own bytes)
    final_sent: float | None = None  # when the last send started (the first token sampled)

    def fail(self, exc: BaseException) -> None:
        for fut in (self.first, self.future):
            if not fut.done():
                fut.set_exception(exc)


class PrefillWorker(WorkerLoop):
    def __init__(self, worker_id: str, model_dir: str | Path, config: EngineConfig,
                 transfer: str = "local", transfer_options: dict[str, Any] | None = None,
                 cores: CoreShare | None = None, tracing: Tracing | None = None) -> None:
        super().__init__("prefill", worker_id, model_dir, config, cores, tracing)
        self.sender = cast(KVSender, self._on_loop_now(
            lambda: self._open_channel("send", transfer, transfer_options)))
        self.transfer = ChannelThread(self.sender, self._on_send_events,
                                      f"kv-send-{worker_id}")
        self._peers: dict[str, tuple[str, dict[str, Any]]] = {}  # decode id -> (peer, endpoint)
        self._broken: set[str] = set()  # decode ids whose channel died: reconnect on connect()
        self._inflight: dict[str, _InFlight] = {}
        # handoff()'s answers, from prefill() until handoff() takes them (or an abort);
        # a router that died never takes its own: ``_sweep_handoffs`` drops them
        self._handoffs: dict[str, Future[PrefillResult]] = {}
        self._handoff_done_at: dict[str, float] = {}  # request id -> when seen resolved
        self.start()

    # ------------------------------------------------------------ async API
    async def connect(self, decode_worker: str, endpoint: dict[str, Any]) -> None:
        """Open the channel to a decode worker (checks the KV layout); a decode worker
        that restarted (new endpoint), or whose channel died, gets a new channel."""
        known = self._peers.get(decode_worker)
        if known is not None and known[1] == endpoint and decode_worker not in self._broken:
            return
        peer = await asyncio.wrap_future(self.transfer.connect(endpoint))
        self._peers[decode_worker] = (peer, endpoint)  # one dict store: the loop reads it
        self._broken.discard(decode_worker)

    async def prefill(self, task: PrefillTask) -> FirstToken:
        """Compute the prompt and start pushing its KV; answers with the first token
        as soon as it is sampled (``handoff`` answers when the decode worker has the
        KV). ``AttemptFailed`` when the transfer fails first (the router retries)."""
        first: Future[FirstToken] = Future()
        done: Future[PrefillResult] = Future()
        now = time.monotonic()

        def add() -> None:
            known = self._peers.get(task.decode_worker)
            if known is None or task.decode_worker in self._broken:
                raise AttemptFailed(FailReason.NOT_CONNECTED,
                                    f"no channel to decode worker {task.decode_worker!r}")
            self.engine.add_request(task.request_id, task.prompt_token_ids, task.params)
            self._traced(task.request_id, task.trace)
            # Only the loop resolves them from now on: a caller that gives up (cancelling
            # its wrapper) cannot cancel one between a done() check here and the set.
            first.set_running_or_notify_cancel()
            done.set_running_or_notify_cancel()
            # blocks the decode worker holds already are never sent
            self._inflight[task.request_id] = _InFlight(task, first, done, now, known[0],
                                                        sent_blocks=task.dst_reused)
            self._handoffs[task.request_id] = done
            self._sweep_handoffs(now)

        await self._on_loop(add)
        return await asyncio.wrap_future(first)

    async def handoff(self, request_id: str) -> PrefillResult:
        """After ``prefill`` answered with a token: resolves once the decode worker has
        all the KV. ``AttemptFailed`` when the transfer fails or the request is unknown
        here (aborted)."""
        # No hop onto the loop (it may be in a long step): one atomic dict pop; the
        # entry was put there before prefill() answered.
        fut = self._handoffs.pop(request_id, None)
        if fut is None:
            raise AttemptFailed(FailReason.ABORTED, f"no hand-off of {request_id} here")
        return await asyncio.wrap_future(fut)

    def close(self) -> None:
        self.stop()
        self.transfer.close()

    def _sweep_handoffs(self, now: float) -> None:
        """Drop the answers nobody took ``HANDOFF_KEEP_S`` after they resolved (their
        router died between ``prefill`` and ``handoff``); on the loop, per new request."""
        for rid, fut in list(self._handoffs.items()):
            if not fut.done():
                continue
            seen = self._handoff_done_at.setdefault(rid, now)
            if now - seen >= HANDOFF_KEEP_S:
                self._handoffs.pop(rid, None)
        for rid in [r for r in self._handoff_done_at if r not in self._handoffs]:
            del self._handoff_done_at[rid]


    # ------------------------------------------------------------- loop side
    def _run_step(self) -> None:
        outputs = {out.request_id: out for out in self._step()}
        now = time.monotonic()
        scored: list[tuple[_InFlight, RequestOutput]] = []
        drafting: list[tuple[_InFlight, dict[str, Any]]] = []
        for rid, f in self._inflight.items():
            if f.final_sent is not None:
                continue
            out = outputs.get(rid)
            if out is not None and not out.prefilled:
                scored.append((f, out))  # max_tokens=0: scored, nothing to hand off
            elif out is not None:
                token, lp, final = self._first(out, f.task.params)
                notify = {"first_token": token, "logprobs": None if lp is None else lp.to_json()}
                if f.task.draft_dst_block_ids and self.engine.draft is not None:
                    drafting.append((f, notify))  # the draft's prompt KV goes first
                else:
                    self._send_last(f, notify)  # queued before the answer is out
                self._answer(f, out, now, token, lp, final)
            else:
                self._send_computed(f)
        for f, out in scored:
            self._scored(f, out, now)
        # The first tokens are out: now the draft model's prompt KV (for the decode
        # workers that reserved blocks for it), then those requests' last sends.
        if drafting:
            self.engine.prefill_draft([f.task.request_id for f, _ in drafting])
        for f, notify in drafting:
            self._send_last(f, notify)

    def _send_computed(self, f: _InFlight) -> None:
        """Send the full blocks computed so far that were not sent yet."""
        computed = self.engine.computed_blocks(f.task.request_id)[:len(f.task.dst_block_ids)]
        if len(computed) > f.sent_blocks:
            self._send(f, computed[f.sent_blocks:], f.sent_blocks, None)

    def _scored(self, f: _InFlight, out: RequestOutput, now: float) -> None:
        """A request with max_tokens=0 ended in the engine: its prompt logprobs are
        the whole answer; no KV goes anywhere."""
        rid = f.task.request_id
        self._inflight.pop(rid, None)
        self._handoffs.pop(rid, None)
        f.future.set_result(PrefillResult(rid, kv_transfer_s=0.0, kv_bytes=0))
        self._answer(f, out, now, None, None, final=True)
        self.marks.pop(rid, None)

    def _answer(self, f: _InFlight, out: RequestOutput, now: float, token: int | None,
                lp: TokenLogprob | None, final: bool) -> None:
        scheduled = out.first_scheduled_time if out.first_scheduled_time is not None else now
        if not f.first.done() and (marks := self.marks.get(f.task.request_id)) is not None:
            marks.mark("scheduled", ago_s=max(0.0, now - scheduled))
            marks.span("prefill_queue", "start", "scheduled")
            marks.span("prefill", "scheduled", prompt_tokens=len(f.task.prompt_token_ids),
                       cached_tokens=out.num_cached_tokens)
        if not f.first.done():
            f.first.set_result(FirstToken(
                f.task.request_id, token, lp, final, num_cached_tokens=out.num_cached_tokens,
                prefill_queue_s=max(0.0, scheduled - f.received), prefill_s=now - scheduled,
                prompt_logprobs=prompt_logprobs_of(out)))

    def _first(self, out: RequestOutput, params: SamplingParams,
               ) -> tuple[int, TokenLogprob | None, bool]:
        """The first token, its logprob, and whether it ends the request."""
        token = out.new_token_ids[0]
        lp = out.logprobs[0] if out.logprobs else None
        # The engine's stop rules for this one token (the decode worker applies them
        # again in start_decode): a token that ends the request is not streamed early.
        final = StopChecker(params, self.engine.eos_token_ids).token_decision(
            token, 1) is not None
        return token, lp, final

    def _send_last(self, f: _InFlight, notify: dict[str, Any]) -> None:
        """The draft's KV (when the decode worker reserved blocks for it), then the
        rest of the target's with the first token: the final send."""
        f.final_sent = time.monotonic()
        rid = f.task.request_id
        if rid in self.marks:
            self.marks[rid].mark("kv_send")
        blocks = self.engine.block_ids(rid)
        if f.task.draft_dst_block_ids and isinstance(self.sender, DraftSender):
            dst, sender, peer = f.task.draft_dst_block_ids, self.sender, f.peer
            self.engine.pin(blocks)  # read from the draft cache at the target's blocks
            f.pinned.extend(blocks)
            f.draft_blocks = len(blocks)
            self.transfer.post(lambda: sender.send_draft(peer, rid, blocks, dst))
        self._send(f, blocks[f.sent_blocks:], f.sent_blocks, notify)

    def _send(self, f: _InFlight, src: list[int], start: int, notify: dict[str, Any] | None,
              ) -> None:
        rid, dst = f.task.request_id, f.task.dst_block_ids[start:start + len(src)]
        if empty := self.engine.empty_blocks(src):  # the decode worker fails the request
            self.publisher.counters.kv_empty_blocks += len(empty)
            log.error("prefill worker %s: request %s: sending %d empty blocks (%s; blocks "
                      "%d.. of %d, %d computed)", self.worker_id, rid, len(empty),
                      empty[:8], start, len(f.task.dst_block_ids),
                      len(self.engine.computed_blocks(rid)))
        self.engine.pin(src)
        f.pinned.extend(src)
        f.sent_blocks = start + len(src)
        self.publisher.counters.kv_sends += 1
        layers = None if notify is not None else (0, self.layout.num_layers)
        peer = f.peer
        self.transfer.post(lambda: self.sender.send(peer, rid, src, dst, layers=layers,
                                                    notify=notify))

    def _on_send_events(self, events: list[SendEvent], when: float) -> None:
        self.loop.post(lambda: self._sent(events, when))  # channel thread -> loop thread

    def _sent(self, events: list[SendEvent], when: float) -> None:
        for ev in events:
            f = self._inflight.pop(ev.request_id, None)
            # Hand-off done, or the transfer failed -- perhaps while the prompt is still
            # being prefilled (a dead peer fails every request sent to it): free it
            # wherever it is.
            self.engine.abort(ev.request_id)
            marks = self.marks.pop(ev.request_id, None)
            if f is None:
                continue
            if marks is not None:
                marks.span("kv_send", "kv_send", blocks=len(f.pinned), decode_worker=
                           f.task.decode_worker, failure=None if ev.ok else str(ev.reason))
            self.engine.unpin(f.pinned)
            if not ev.ok:
                self.publisher.counters.kv_transfer_failures += 1
                if ev.reason is FailReason.PEER_DIED:  # the channel is gone, not just this request
                    self._broken.add(f.task.decode_worker)
                if not f.first.done():  # prefill() fails: nobody will ask for handoff()
                    self._handoffs.pop(ev.request_id, None)
                f.fail(AttemptFailed(ev.reason or FailReason.TRANSPORT,
                                     f"KV transfer to {f.task.decode_worker} failed: {ev.error}"))
                continue
            if f.future.done():  # aborted while its last send was in flight
                continue
            assert f.final_sent is not None
            nbytes = (len(f.pinned) - f.draft_blocks) * self.layout.block_bytes
            if isinstance(self.sender, DraftSender):
                nbytes += f.draft_blocks * self.sender.draft_layout.block_bytes
            self.publisher.counters.observe_transfer(when - f.final_sent, nbytes)
            f.future.set_result(PrefillResult(ev.request_id, max(0.0, when - f.final_sent),
                                              nbytes))

    def _abort(self, request_id: str) -> None:
        f = self._inflight.get(request_id)
        if f is not None and f.pinned:  # sends started: the event ends it (pins, release)
            self.transfer.post(lambda: self.sender.abort(request_id))
        else:
            self._inflight.pop(request_id, None)
        self.engine.abort(request_id)  # frees its blocks whether queued, running or prefilled
        self._handoffs.pop(request_id, None)
        if f is not None:
            f.fail(AttemptFailed(FailReason.ABORTED, f"request {request_id} aborted"))

    def _before_publish(self, m: WorkerMetrics) -> None:
        m.blocks_in_flight = sum(len(f.pinned) - f.draft_blocks
                                 for f in self._inflight.values())
