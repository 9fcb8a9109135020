"""``PrefillWorker``: a prefill pool member.

It batches prompts from many requests under the engine's token budget (chunked
prefill, prefix reuse), samples each request's first token, and pushes the
request's KV blocks into the blocks a decode worker reserved, over its transfer
channel. The request's blocks stay referenced here until the decode side
acknowledges the KV (or the transfer fails); then they are released.

A request's life here (all on the loop thread)::

    submit -> engine WAITING -> (chunks) -> PREFILLED -> sender.send -> SENDING
           -> SendEvent ok  -> release blocks, resolve the future with PrefillResult
           -> SendEvent err -> release blocks, fail the future

A plain class: a sync constructor builds it in a unit test; ``deploy/`` wraps it
as a Ray actor.
"""

from __future__ import annotations

import dataclasses
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve.engine.config import EngineConfig
from pdserve.engine.sampler import TokenLogprobs
from pdserve.kv_transfer import make_sender
from pdserve.messages import PrefillResult, PrefillTask, WorkerStats
from pdserve.worker_loop import WorkerLoop


class PrefillError(RuntimeError):
    """The prefill or its KV transfer failed; the router retries elsewhere."""


@dataclass
class _InFlight:
    task: PrefillTask
    future: Future[PrefillResult]
    received: float
    first_token: int | None = None
    scheduled: float | None = None
    sampled: float | None = None
    send_started: float | None = None
    num_cached_tokens: int = 0
    num_blocks: int = 0


class PrefillWorker(WorkerLoop):
    def __init__(self, worker_id: str, model_dir: str | Path, config: EngineConfig,
                 transfer: str = "local", transfer_options: dict[str, Any] | None = None) -> None:
        super().__init__("prefill", worker_id, model_dir, config)
        self.sender = make_sender(transfer, self.engine.kv_cache, self.layout,
                                  **(transfer_options or {}))
        self._peers: dict[str, Any] = {}  # decode worker id -> sender peer id
        self._inflight: dict[str, _InFlight] = {}
        self.start()

    # ----------------------------------------------------- called from any thread
    def connect(self, decode_worker: str, endpoint: dict[str, Any]) -> Future[None]:
        """Open the channel to a decode worker (checks the KV layout)."""
        return self.call(lambda: self._connect(decode_worker, endpoint))

    def submit(self, task: PrefillTask) -> Future[PrefillResult]:
        fut: Future[PrefillResult] = Future()
        now = time.monotonic()

        def add() -> None:
            if task.decode_worker not in self._peers:
                raise PrefillError(f"not connected to decode worker {task.decode_worker!r}")
            self.engine.add_request(task.request_id, task.prompt_token_ids, task.params)
            self._inflight[task.request_id] = _InFlight(task, fut, now)

        self.call(add).add_done_callback(lambda added: _forward_failure(added, fut))
        return fut

    def abort(self, request_id: str) -> None:
        self.call(lambda: self._abort(request_id, "aborted"))

    def close(self) -> None:
        self.stop()
        self.sender.close()

    # ---------------------------------------------------------------- loop side
    def _connect(self, decode_worker: str, endpoint: dict[str, Any]) -> None:
        if decode_worker not in self._peers:
            self._peers[decode_worker] = self.sender.connect(endpoint)

    def iterate(self) -> None:
        if self.engine.has_unfinished():
            outputs = self._step()
            now = time.monotonic()
            for out in outputs:
                f = self._inflight[out.request_id]
                f.scheduled = out.first_scheduled_time
                self._send(f, out.new_token_ids[0], out.num_cached_tokens, now,
                           out.logprobs[0] if out.logprobs else None)
        for ev in self.sender.poll():
            self._on_send_event(ev)

    def _send(self, f: _InFlight, first_token: int, cached: int, now: float,
              logprobs: TokenLogprobs | None) -> None:
        rid = f.task.request_id
        f.first_token, f.sampled, f.num_cached_tokens = first_token, now, cached
        src = self.engine.block_ids(rid)
        f.num_blocks = len(src)
        f.send_started = time.monotonic()
        self.sender.send(self._peers[f.task.decode_worker], rid, src, f.task.dst_block_ids,
                         notify={"first_token": first_token,
                                 "logprobs": None if logprobs is None else dataclasses.asdict(logprobs)})

    def _on_send_event(self, ev: Any) -> None:
        f = self._inflight.pop(ev.request_id, None)
        self.engine.release(ev.request_id)
        if f is None:
            return
        if not ev.ok:
            self._stats.kv_transfer_failures += 1
            if not f.future.done():
                f.future.set_exception(PrefillError(f"KV transfer failed: {ev.error}"))
            return
        now = time.monotonic()
        assert f.first_token is not None and f.sampled is not None
        assert f.send_started is not None
        nbytes = f.num_blocks * self.layout.block_bytes
        self._stats.kv_transfers += 1
        self._stats.kv_transfer_bytes += nbytes
        self._stats.kv_transfer_seconds += now - f.send_started
        scheduled = f.scheduled if f.scheduled is not None else f.sampled
        f.future.set_result(PrefillResult(
            request_id=ev.request_id, first_token=f.first_token,
            num_cached_tokens=f.num_cached_tokens,
            prefill_queue_s=max(0.0, scheduled - f.received),
            prefill_s=f.sampled - scheduled,
            kv_transfer_s=now - f.send_started, kv_bytes=nbytes,
        ))

    def _abort(self, request_id: str, why: str) -> None:
        f = self._inflight.pop(request_id, None)
        if f is not None and f.send_started is not None:
            self.sender.abort(request_id)
        self.engine.abort(request_id)  # frees blocks whether queued or prefilled
        if f is not None and not f.future.done():
            f.future.set_exception(PrefillError(f"request {request_id} {why}"))

    def _snapshot(self) -> WorkerStats:
        self._stats.blocks_in_flight = sum(f.num_blocks for f in self._inflight.values()
                                           if f.send_started is not None)
        return super()._snapshot()


def _forward_failure(src: Future[Any], dst: Future[Any]) -> None:
    exc = src.exception()
    if exc is not None and not dst.done():
        dst.set_exception(exc)
