"""``DecodeWorker``: a decode pool member.

The router reserves blocks here for a request's prompt (admission control: no
room -> ``None``), a prefill worker writes the KV into them over the transfer
channel, and the channel's completion notice (carrying the first token) moves
the request from WAITING_FOR_KV to running. When the reservation shared all but a
short suffix of the prompt from this worker's own prefix cache (a conversation's
next turn), or whenever the router chose so (``router/placement.py``), the worker
computes the rest itself instead: no prefill worker, no KV moved, the first token
from its own next step. With a draft model (speculative decoding) it reserves the
draft's blocks for the prompt too, and the request starts once both KVs landed: it
speculates from its first step. Every engine step's new tokens, for
every request, go out as one batch on the worker's output stream
(``output_stream``) -- one frame per step, never one call per token.

Block ownership: a reservation's blocks go back to the engine only once the
receiver has reported the request (its KV landed, or it failed and no late write
can land any more). An abort while KV may still land (nixl's abort is a handshake
with the sender) keeps the blocks until that report; a reservation whose blocks
the receiver still expects KV in is refused, never handed out twice.

A plain class with async methods: a sync constructor builds it in a test, the
router calls it in-process, ``cluster/actors.py`` wraps the class itself as a Ray actor.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

from pdserve.engine.config import EngineConfig
from pdserve.engine.sampling.sampling_params import SamplingParams
from pdserve.failures import FailReason
from pdserve.kv_transfer import KVReceiver, RecvEvent
from pdserve.kv_transfer.driver import ChannelThread
from pdserve.kv_transfer.with_draft import DraftReceiver
from pdserve.messages import (
    NO_LOCAL_PREFILL,
    JoinInfo,
    LocalPrefill,
    RequestDelta,
    Reservation,
    Stages,
    TokenLogprob,
)
from pdserve.output_stream import OutputServer
from pdserve.tracing import Carrier, Tracing
from pdserve.worker.core_share import CoreShare
from pdserve.worker.loop import WorkerLoop, delta_of, prefill_stages
from pdserve.worker.moves import Moving

log = logging.getLogger("pdserve.decode_worker")


class DecodeWorker(Moving, WorkerLoop):
    def __init__(self, worker_id: str, model_dir: str | Path, config: EngineConfig,
                 transfer: str = "local", transfer_options: dict[str, Any] | None = None,
                 kv_timeout_s: float = 30.0, host: str = "127.0.0.1",
                 cores: CoreShare | None = None, tracing: Tracing | None = None,
                 send_options: dict[str, Any] | None = None) -> None:
        """``send_options``: the transfer's sender options, for the requests this worker
        moves to another (moves.py; default: ``kv_timeout_s`` as the send timeout)."""
        super().__init__("decode", worker_id, model_dir, config, cores, tracing)
        self.kv_timeout_s = kv_timeout_s
        self.receiver = cast(KVReceiver, self._on_loop_now(
            lambda: self._open_channel("recv", transfer, transfer_options)))
        self.transfer = ChannelThread(self.receiver, self._on_recv_events,
                                      f"kv-recv-{worker_id}")
        self.outputs = OutputServer(host, f"outputs-{worker_id}", self._abort_orphans)
        self._kv_arrived: dict[str, float] = {}  # request id -> when its KV landed
        self._expecting: set[str] = set()  # reserved; the receiver has not reported it
        self._aborted: set[str] = set()  # ... of those, aborted: free on the report
        self._received: dict[str, float] = {}  # prefilled here: reserved at (until its first token)
        self._init_moves(transfer, send_options if send_options is not None
                         else {"timeout_s": kv_timeout_s})
        self.start()

    # ------------------------------------------------------------ async API
    async def join_info(self) -> JoinInfo:
        endpoint = await asyncio.wrap_future(self.transfer.call(self.receiver.endpoint))
        return JoinInfo(self.incarnation, self.outputs.address, endpoint,
                        self.metrics_at, self.limits())

    async def reserve(self, request_id: str, prompt_token_ids: Sequence[int],
                      params: SamplingParams, local: LocalPrefill = NO_LOCAL_PREFILL,
                      router_id: str = "", trace: Carrier | None = None,
                      ) -> Reservation | None:
        """Blocks for the prompt's KV (the leading ones from this worker's own prefix
        cache where it holds the prompt's first blocks: only the rest is sent), or
        ``None`` when there is no room now. Where ``local`` applies to what those
        shared blocks leave of the prompt, this worker computes it itself
        (``Reservation.local``). Fails with ``ValueError`` for a request this worker
        can never serve. Its tokens go to ``router_id``'s output stream; ``trace``:
        its attempt's trace context (tracing.py)."""
        return await self._on_loop(lambda: self._reserve(
            request_id, prompt_token_ids, params, local, router_id, trace))

    def close(self) -> None:
        self.stop()
        self.transfer.close()
        self._close_moves()
        self.outputs.close()

    # ------------------------------------------------------------- loop side
    def _reserve(self, rid: str, prompt: Sequence[int], params: SamplingParams,
                 local: LocalPrefill, router_id: str,
                 trace: Carrier | None = None) -> Reservation | None:
        blocks = self.engine.reserve(rid, prompt, params)
        if blocks is None:
            return None
        self.outputs.assign(rid, router_id)
        self._traced(rid, trace)
        reused = self.engine.cached_tokens(rid) // self.engine.block_size
        # (prompt logprobs need every position computed, which only a prefill worker does)
        if (params.prompt_logprobs is None
                and local.applies(len(prompt) - reused * self.engine.block_size, reused)):
            self.engine.prefill_reserved(rid)
            self._received[rid] = time.monotonic()
            self.publisher.counters.local_prefills += 1
            self.blocks_granted += len(blocks)
            return Reservation(blocks, reused, local=True)
        draft = self.engine.reserve_draft(rid)  # []: no draft KV comes (none, or no room)
        try:
            # only the blocks the KV is written into (reused ones are shared, read-only)
            if draft:  # any thread may
                cast(DraftReceiver, self.receiver).expect(rid, blocks[reused:],
                                                          self.kv_timeout_s, draft)
            else:
                self.receiver.expect(rid, blocks[reused:], self.kv_timeout_s)
        except ValueError as exc:
            # The engine handed out blocks the receiver still expects KV in: ownership
            # is checked, not trusted. Never give them to this request; no room now.
            self.engine.abort(rid)
            self.outputs.forget(rid)
            self.marks.pop(rid, None)
            log.error("decode worker %s: reservation %s refused: %s", self.worker_id, rid, exc)
            return None
        self.transfer.wake()  # poll soon: it may be asleep with nothing pending
        self._expecting.add(rid)
        self.blocks_granted += len(blocks)
        return Reservation(blocks, reused, draft_blocks=draft)

    def _abort(self, rid: str) -> None:
        self.outputs.forget(rid)
        self._kv_arrived.pop(rid, None)
        self._received.pop(rid, None)
        if self._abort_move(rid):  # moving here: its blocks wait for both transfers' reports
            return
        if rid in self._expecting:  # KV may still land: keep the blocks until reported
            if rid not in self._aborted:
                self._aborted.add(rid)
                self.transfer.post(lambda: self.receiver.abort(rid))
        else:
            self.engine.abort(rid)

    def _on_recv_events(self, events: list[RecvEvent], when: float) -> None:
        self.loop.post(lambda: self._arrived(events, when))  # channel thread -> loop thread

    def _arrived(self, events: list[RecvEvent], when: float) -> None:
        batch: list[RequestDelta] = []
        for ev in events:
            rid = ev.request_id
            self._expecting.discard(rid)
            if self._moved_arrived(ev, batch):
                continue
            if rid in self._aborted:  # nobody waits for it; its blocks can be reused now
                self._aborted.discard(rid)
                self.engine.abort(rid)
                continue
            if not self.engine.has_request(rid):
                continue
            if not ev.ok:
                self.marks.pop(rid, None)
                self.engine.abort(rid)
                self.publisher.counters.kv_transfer_failures += 1
                batch.append(RequestDelta(rid, [], finish_reason="error",
                                          failure=ev.reason or FailReason.TRANSPORT,
                                          error=f"KV transfer failed: {ev.error}"))
                continue
            if empty := self.engine.empty_blocks(self.engine.block_ids(rid)):
                self._arrived_empty(rid, empty, batch)
                continue
            if (marks := self.marks.get(rid)) is not None:  # the first token came with it
                marks.mark("first_token")
                marks.span("kv_receive", "start", blocks=len(self.engine.block_ids(rid)))
            notify = ev.notify or {}
            lp = notify.get("logprobs")
            out = self.engine.start_decode(rid, int(notify["first_token"]))
            if out.finished:
                self._trace_outputs([out])
            else:
                self._kv_arrived[rid] = when
            batch.append(delta_of(out, logprobs=None if lp is None
                                  else [TokenLogprob.from_json(lp)]))
        # Arrivals carry each request's first token: publish them now, not after the
        # next decode step (that would add a whole step to every TTFT).
        self.outputs.publish(batch)

    def _arrived_empty(self, rid: str, empty: list[int], batch: list[RequestDelta]) -> None:
        """A request whose KV "landed" with blocks still empty: decoding it would read
        whatever those blocks hold, and its prompt's blocks would enter the prefix cache
        for later requests. Fail it instead (the router retries elsewhere)."""
        self.publisher.counters.kv_empty_blocks += len(empty)
        log.error("decode worker %s: request %s: KV arrived with %d of its blocks empty "
                  "(%s)", self.worker_id, rid, len(empty), empty[:8])
        self.marks.pop(rid, None)
        self.engine.abort(rid)
        batch.append(RequestDelta(rid, [], finish_reason="error", failure=FailReason.TRANSPORT,
                                  error=f"KV arrived with {len(empty)} blocks empty"))

    def _run_step(self) -> None:
        t0 = time.monotonic()
        batch = []
        outputs = self._step()
        now = time.monotonic()
        for out in outputs:
            arrived = self._kv_arrived.pop(out.request_id, None)
            stages = (Stages(decode_queue_s=max(0.0, t0 - arrived)) if arrived is not None
                      else prefill_stages(out, self._received.pop(out.request_id, None), now))
            batch.append(delta_of(out, stages))
        self.outputs.publish(batch)
        self._trace_outputs(outputs)
