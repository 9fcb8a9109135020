"""``PrefillWorker``: a prefill pool member.

It batches prompts from many requests under the engine's token budget (chunked
prefill, prefix reuse), samples each request's first token, and pushes the
request's KV into the blocks a decode worker reserved -- overlapped with compute:
after every engine step, the blocks that step completed go out at once (prefix-cache
hits with the first chunk), and the last send, once the first token is sampled,
carries the rest (the partial last block) and the first token. So only the last
chunk's share of the transfer is added to TTFT. The channel runs on its own thread
(``kv_transfer.driver``), so sends progress and are acknowledged while the engine
steps.

Block ownership: every block handed to a send is pinned (one extra reference in the
engine's pool) until the request's transfer has ended, so a preemption cannot reuse
it while a backend may still read it. A request's life here::

    prefill() -> engine WAITING -> (chunk: send its full blocks) ... -> PREFILLED
              -> final send (rest + first token) -> SendEvent ok  -> PrefillResult
                                                 -> SendEvent err -> AttemptFailed
    (blocks released and pins dropped on the event)

A plain class with async methods: a sync constructor builds it in a test, the router
calls it in-process, ``deploy/`` wraps the class itself as a Ray actor.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import RequestOutput
from pdserve.failures import AttemptFailed, FailReason
from pdserve.kv_transfer import KVSender, SendEvent
from pdserve.kv_transfer.driver import ChannelThread
from pdserve.messages import PrefillResult, PrefillTask, TokenLogprob, WorkerMetrics
from pdserve.worker_loop import WorkerLoop, prompt_logprobs_of


@dataclass
class _InFlight:
    task: PrefillTask
    future: Future[PrefillResult]
    received: float
    peer: str
    sent_blocks: int = 0  # leading blocks already handed to a send
    pinned: list[int] = field(default_factory=list)  # source blocks referenced for sends
    num_cached_tokens: int = 0
    scheduled: float | None = None
    sampled: float | None = None
    final_sent: float | None = None  # when the last send started
    prompt_logprobs: list[TokenLogprob | None] | None = None  # with the first token


class PrefillWorker(WorkerLoop):
    def __init__(self, worker_id: str, model_dir: str | Path, config: EngineConfig,
                 transfer: str = "local", transfer_options: dict[str, Any] | None = None) -> None:
        super().__init__("prefill", worker_id, model_dir, config)
        self.sender = cast(KVSender, self._open_channel("send", transfer, transfer_options))
        self.transfer = ChannelThread(self.sender, self._on_send_events,
                                      f"kv-send-{worker_id}")
        self._peers: dict[str, tuple[str, dict[str, Any]]] = {}  # decode id -> (peer, endpoint)
        self._broken: set[str] = set()  # decode ids whose channel died: reconnect on connect()
        self._inflight: dict[str, _InFlight] = {}
        self.start()

    # ------------------------------------------------------------ async API
    async def connect(self, decode_worker: str, endpoint: dict[str, Any]) -> None:
        """Open the channel to a decode worker (checks the KV layout); a decode worker
        that restarted (new endpoint), or whose channel died, gets a new channel."""
        known = self._peers.get(decode_worker)
        if known is not None and known[1] == endpoint and decode_worker not in self._broken:
            return
        peer = await asyncio.wrap_future(self.transfer.call(lambda: self.sender.connect(endpoint)))
        self._peers[decode_worker] = (peer, endpoint)  # one dict store: the loop reads it
        self._broken.discard(decode_worker)

    async def prefill(self, task: PrefillTask) -> PrefillResult:
        """Compute the prompt and push its KV; resolves once the decode worker has
        it all. ``AttemptFailed`` when the transfer fails (the router retries)."""
        fut: Future[PrefillResult] = Future()
        now = time.monotonic()

        def add() -> None:
            known = self._peers.get(task.decode_worker)
            if known is None or task.decode_worker in self._broken:
                raise AttemptFailed(FailReason.NOT_CONNECTED,
                                    f"no channel to decode worker {task.decode_worker!r}")
            self.engine.add_request(task.request_id, task.prompt_token_ids, task.params)
            # Only the loop resolves it from now on: a caller that gives up (cancelling
            # its wrapper) cannot cancel it between a done() check here and the set.
            fut.set_running_or_notify_cancel()
            # blocks the decode worker holds already are never sent
            self._inflight[task.request_id] = _InFlight(task, fut, now, known[0],
                                                        sent_blocks=task.dst_reused)

        await self._on_loop(add)
        return await asyncio.wrap_future(fut)

    def close(self) -> None:
        self.stop()
        self.transfer.close()


    # ------------------------------------------------------------- loop side
    def _run_step(self) -> None:
        outputs = {out.request_id: out for out in self._step()}
        now = time.monotonic()
        scored: list[tuple[_InFlight, RequestOutput]] = []
        for rid, f in self._inflight.items():
            if f.final_sent is not None:
                continue
            out = outputs.get(rid)
            if out is not None and not out.prefilled:
                scored.append((f, out))  # max_tokens=0: scored, nothing to hand off
            elif out is not None:
                self._send_last(f, out, now)
            else:
                self._send_computed(f)
        for f, out in scored:
            self._scored(f, out, now)

    def _send_computed(self, f: _InFlight) -> None:
        """Send the full blocks computed so far that were not sent yet."""
        req = self.engine.requests.get(f.task.request_id)
        if req is None:
            return
        if f.scheduled is None and req.first_scheduled_time is not None:
            f.scheduled = req.first_scheduled_time
            f.num_cached_tokens = req.num_cached_tokens
        full = min(req.num_computed_tokens // self.engine.block_size, len(f.task.dst_block_ids))
        if full > f.sent_blocks:
            self._send(f, req.block_ids[f.sent_blocks:full], f.sent_blocks, None)

    def _scored(self, f: _InFlight, out: RequestOutput, now: float) -> None:
        """A request with max_tokens=0 ended in the engine: its prompt logprobs are
        the whole answer; no KV goes anywhere."""
        self._inflight.pop(f.task.request_id, None)
        scheduled = out.first_scheduled_time if out.first_scheduled_time is not None else now
        if not f.future.done():
            f.future.set_result(PrefillResult(
                request_id=f.task.request_id, num_cached_tokens=out.num_cached_tokens,
                prefill_queue_s=max(0.0, scheduled - f.received), prefill_s=now - scheduled,
                kv_transfer_s=0.0, kv_bytes=0, prompt_logprobs=prompt_logprobs_of(out)))

    def _send_last(self, f: _InFlight, out: RequestOutput, now: float) -> None:
        f.prompt_logprobs = prompt_logprobs_of(out)
        if f.scheduled is None:
            f.scheduled = out.first_scheduled_time
        f.num_cached_tokens, f.sampled, f.final_sent = out.num_cached_tokens, now, now
        src = self.engine.block_ids(out.request_id)[f.sent_blocks:]
        lp = out.logprobs[0] if out.logprobs else None
        notify = {"first_token": out.new_token_ids[0], "logprobs": None if lp is None else
                  TokenLogprob(lp.token_id, lp.logprob, lp.top, lp.rank).to_json()}
        self._send(f, src, f.sent_blocks, notify)

    def _send(self, f: _InFlight, src: list[int], start: int, notify: dict[str, Any] | None,
              ) -> None:
        rid, dst = f.task.request_id, f.task.dst_block_ids[start:start + len(src)]
        self.engine.pin(src)
        f.pinned.extend(src)
        f.sent_blocks = start + len(src)
        self._metrics.kv_sends += 1
        layers = None if notify is not None else (0, self.layout.num_layers)
        peer = f.peer
        self.transfer.post(lambda: self.sender.send(peer, rid, src, dst, layers=layers,
                                                    notify=notify))

    def _on_send_events(self, events: list[SendEvent], when: float) -> None:
        self.post(lambda: self._sent(events, when))  # channel thread -> loop thread

    def _sent(self, events: list[SendEvent], when: float) -> None:
        for ev in events:
            f = self._inflight.pop(ev.request_id, None)
            # Hand-off done, or the transfer failed -- perhaps while the prompt is still
            # being prefilled (a dead peer fails every request sent to it): free it
            # wherever it is.
            self.engine.abort(ev.request_id)
            if f is None:
                continue
            self.engine.unpin(f.pinned)
            if not ev.ok:
                self._metrics.kv_transfer_failures += 1
                if ev.reason is FailReason.PEER_DIED:  # the channel is gone, not just this request
                    self._broken.add(f.task.decode_worker)
                if not f.future.done():
                    f.future.set_exception(AttemptFailed(
                        ev.reason or FailReason.TRANSPORT,
                        f"KV transfer to {f.task.decode_worker} failed: {ev.error}"))
                continue
            if f.future.done():  # aborted while its last send was in flight
                continue
            assert f.sampled is not None and f.final_sent is not None
            nbytes = len(f.pinned) * self.layout.block_bytes
            self._metrics.kv_transfers += 1
            self._metrics.kv_transfer_bytes += nbytes
            self._metrics.kv_transfer_seconds += when - f.final_sent
            scheduled = f.scheduled if f.scheduled is not None else f.sampled
            f.future.set_result(PrefillResult(
                request_id=ev.request_id, num_cached_tokens=f.num_cached_tokens,
                prefill_queue_s=max(0.0, scheduled - f.received),
                prefill_s=f.sampled - scheduled,
                kv_transfer_s=max(0.0, when - f.final_sent), kv_bytes=nbytes,
                prompt_logprobs=f.prompt_logprobs,
            ))

    def _abort(self, request_id: str) -> None:
        f = self._inflight.get(request_id)
        if f is not None and f.pinned:  # sends started: the event ends it (pins, release)
            self.transfer.post(lambda: self.sender.abort(request_id))
        else:
            self._inflight.pop(request_id, None)
        self.engine.abort(request_id)  # frees its blocks whether queued, running or prefilled
        if f is not None and not f.future.done():
            f.future.set_exception(AttemptFailed(FailReason.ABORTED,
                                                 f"request {request_id} aborted"))

    def _before_publish(self, m: WorkerMetrics) -> None:
        m.blocks_in_flight = sum(len(f.pinned) for f in self._inflight.values())
