"""``DecodeWorker``: a decode pool member.

The router reserves blocks here for a request's prompt (admission control: no
room -> ``None``), a prefill worker writes the KV into them over the transfer
channel, and the channel's completion notice (carrying the first token) moves
the request from WAITING_FOR_KV to running. Every engine step's new tokens, for
every request, go into one output batch that the router collects with
``poll_outputs`` -- one call per step, never one per token.

A plain class: a sync constructor builds it in a unit test; ``deploy/`` wraps it
as a Ray actor.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import RequestOutput
from pdserve.engine.sampler import TokenLogprobs
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kv_transfer import make_receiver
from pdserve.messages import DecodeOutput
from pdserve.worker_loop import WorkerLoop

log = logging.getLogger("pdserve.decode_worker")


class DecodeWorker(WorkerLoop):
    def __init__(self, worker_id: str, model_dir: str | Path, config: EngineConfig,
                 transfer: str = "local", transfer_options: dict[str, Any] | None = None,
                 kv_timeout_s: float = 30.0) -> None:
        super().__init__("decode", worker_id, model_dir, config)
        self.kv_timeout_s = kv_timeout_s
        self.receiver = make_receiver(transfer, self.engine.kv_cache, self.layout,
                                      **(transfer_options or {}))
        self._outbox: list[DecodeOutput] = []
        self._out_cv = threading.Condition()
        self._kv_arrived: dict[str, float] = {}  # request id -> when its KV landed
        # Block ownership: a request's blocks go back to the engine only once the
        # receiver has reported it (no late write can land in them any more).
        self._expecting: set[str] = set()  # reserved; the receiver has not reported it
        self._aborted: set[str] = set()  # ... of those, aborted: free on the report
        self.start()

    # ----------------------------------------------------- called from any thread
    def endpoint(self) -> Future[dict[str, Any]]:
        """Connection info a prefill worker needs to write into this worker's KV."""
        return self.call(self.receiver.endpoint)

    def reserve(self, request_id: str, prompt_token_ids: Sequence[int],
                params: SamplingParams) -> Future[list[int] | None]:
        """Blocks for the prompt's KV, or ``None`` when there is no room now.
        Fails with ``ValueError`` for a request this worker can never serve."""
        return self.call(lambda: self._reserve(request_id, prompt_token_ids, params))

    def abort(self, request_id: str) -> None:
        """Drop a request wherever it is; its blocks are freed (idempotent)."""
        self.call(lambda: self._abort(request_id))

    def poll_outputs(self, timeout_s: float = 0.05) -> list[DecodeOutput]:
        """Everything produced since the last call; waits up to ``timeout_s`` for
        something to arrive."""
        with self._out_cv:
            if not self._outbox:
                self._out_cv.wait(timeout_s)
            out, self._outbox = self._outbox, []
        if self.error is not None and not out:
            raise RuntimeError(f"decode worker {self.worker_id} loop died: {self.error!r}")
        return out

    def close(self) -> None:
        self.stop()
        self.receiver.close()

    # ---------------------------------------------------------------- loop side
    def _reserve(self, rid: str, prompt: Sequence[int], params: SamplingParams) -> list[int] | None:
        blocks = self.engine.reserve(rid, prompt, params)
        if blocks is None:
            return None
        try:
            self.receiver.expect(rid, blocks, self.kv_timeout_s)
        except ValueError as exc:
            # The engine handed out blocks the receiver still expects KV in: ownership
            # is checked, not trusted. Never give them to this request; no room now.
            self.engine.abort(rid)
            log.error("decode worker %s: reservation %s refused: %s", self.worker_id, rid, exc)
            return None
        self._expecting.add(rid)
        return blocks

    def _abort(self, rid: str) -> None:
        self._kv_arrived.pop(rid, None)
        if rid in self._expecting:  # KV may still land: keep the blocks until reported
            self._aborted.add(rid)
            self.receiver.abort(rid)
        else:
            self.engine.abort(rid)

    def iterate(self) -> None:
        batch: list[DecodeOutput] = []
        for ev in self.receiver.poll():
            self._expecting.discard(ev.request_id)
            if ev.request_id in self._aborted:  # its blocks can be reused now
                self._aborted.discard(ev.request_id)
                self.engine.abort(ev.request_id)
                continue
            if ev.request_id not in self.engine.requests:
                continue
            if ev.ok:
                now = time.monotonic()
                self._kv_arrived[ev.request_id] = now
                notify = ev.notify or {}
                lp = notify.get("logprobs")
                first_lp = None if lp is None else TokenLogprobs(
                    lp["token_id"], lp["logprob"], lp["rank"], [tuple(t) for t in lp["top"]])
                batch.append(self._convert(self.engine.start_decode(
                    ev.request_id, int(notify["first_token"]), first_lp)))
            else:
                self.engine.abort(ev.request_id)
                self._stats.kv_transfer_failures += 1
                batch.append(DecodeOutput(ev.request_id, [], "", True, "error",
                                          error=f"KV transfer failed: {ev.error}"))
        # Arrivals carry each request's first token: publish them now, not after the
        # next decode step (that would add a whole step to every TTFT).
        self._publish(batch)
        batch = []
        if self.engine.has_unfinished():
            t0 = time.monotonic()
            outputs = self._step()
            for out in outputs:
                item = self._convert(out)
                arrived = self._kv_arrived.pop(out.request_id, None)
                if arrived is not None and out.first_scheduled_time is not None:
                    item.decode_queue_s = max(0.0, t0 - arrived)
                batch.append(item)
        self._publish(batch)

    def _publish(self, batch: list[DecodeOutput]) -> None:
        if batch:
            with self._out_cv:
                self._outbox.extend(batch)
                self._out_cv.notify_all()

    def _convert(self, out: RequestOutput) -> DecodeOutput:
        if out.finished:
            self._kv_arrived.pop(out.request_id, None)
        return DecodeOutput(
            request_id=out.request_id, token_ids=out.new_token_ids, text=out.text,
            finished=out.finished, finish_reason=out.finish_reason,
            stop_reason=out.stop_reason,
            logprobs=[(lp.token_id, lp.logprob, lp.top) for lp in out.logprobs],
        )
