"""``WorkerLoop``: what every worker kind (prefill, decode, colocated) shares -- the
engine in its role on the loop thread, its KV layout, the async methods the router
calls (the same object in-process and inside a Ray actor, which holds it:
``pdserve/cluster/actors.py``), the load answer of health probes, the per-step metrics (batch shape, step
time, FLOPs and bytes for MFU/MBU) and their snapshot, the integrity check.

Threads: the engine belongs to the worker's loop thread (``self.loop``, a
``ThreadLoop`` whose body is the worker: ``iterate`` is one engine step). Async
methods run on the caller's event loop (Ray's actor loop, or the router's
in-process) and hand their work to the loop thread with ``_on_loop``. The loop
thread publishes the load after every iteration and the metrics snapshot
(``self.publisher``, ``metrics_publisher.py``) at most every 0.5 s (and whenever it
idles), so ``load()`` (the health probe) and ``/metrics`` answer
from the last ones at once, even while a long prefill step runs: a busy worker is
not an unhealthy one. Both are made once before the thread starts too, so a new
worker's first answers show its engine's real free blocks. A worker whose loop has
stopped answers ``WorkerGone``.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from pdserve.engine.config import EngineConfig
from pdserve.engine.cost import attended_tokens, cost_model
from pdserve.engine.results import RequestOutput, StepInfo
from pdserve.failures import WorkerGone
from pdserve.kv_transfer import KVReceiver, KVSender
from pdserve.kv_transfer.sharded import open_channel
from pdserve.kv_transfer.with_draft import with_draft
from pdserve.messages import (
    Compute,
    JoinInfo,
    RequestDelta,
    ServingLimits,
    Stages,
    TokenLogprob,
    WorkerLoad,
    WorkerMetrics,
)
from pdserve.thread_loop import LoopStopped, ThreadLoop
from pdserve.tracing import Carrier, Marks, Tracing
from pdserve.worker.core_share import CoreShare
from pdserve.worker.metrics_publisher import MetricsPublisher
from pdserve.worker.step_fit import StepFit, calibrate
from pdserve.worker.tensor_parallel import create_engine

T = TypeVar("T")
IDLE_WAIT_S = 1.0  # nothing to do: the loop sleeps until a call wakes it (or this long)


class WorkerLoop:
    def __init__(self, role: str, worker_id: str, model_dir: str | Path,
                 config: EngineConfig, cores: CoreShare | None = None,
                 tracing: Tracing | None = None) -> None:
        if config.role != role:
            raise ValueError(f"a {role} worker needs role={role!r}, got {config.role!r}")
        self.loop = ThreadLoop(f"{role}-{worker_id}", self, IDLE_WAIT_S)
        self.worker_id = worker_id
        self.role = role
        self.model_dir = str(model_dir)  # what it serves (a re-attaching router checks it)
        self.incarnation = uuid.uuid4().hex  # new for every process that builds a worker
        # Built on the loop's thread, which steps it (thread_loop.py says why).
        self.engine = self._on_loop_now(lambda: create_engine(model_dir, config))
        threading.Thread(target=self.engine.grammars.warm, name="pdserve-grammar-warm",
                         daemon=True).start()
        # This rank's KV cache; ``layout`` is the whole model's (what a request's KV is).
        self._rank_layout = self.engine.kv_layout()
        self.layout = self._rank_layout.model_wide()
        self.publisher = MetricsPublisher(
            worker_id, role, self.engine.num_blocks,
            cost_model(self.engine.model_config, config.dtype, config.quantization))
        # the node's cores, lent and borrowed at step boundaries (core_share.py)
        self.cores = cores
        self._lending = False
        self._threads = config.num_threads or 1  # the last step's
        self.step_fit = StepFit()  # its step times, for the router's placement
        self.tracing = tracing  # its spans (tracing.py); None: off
        self.marks: dict[str, Marks] = {}  # request id -> its traced events here
        self.blocks_granted = 0  # by reserve/admit (WorkerLoad.blocks_granted)
        self.metrics_at: tuple[str, int] | None = None  # its /metrics, set by who serves it
        for threads in sorted({self._threads, cores.own if cores else self._threads},
                              reverse=True):  # with shared cores: lent, then its own
            self._on_loop_now(lambda t=threads: calibrate(  # type: ignore[misc]
                self.engine, lambda: self._calibration_step(t),
                lambda info: self._fit(info, True), role))
        self._lend()
        self._load = self._make_load()

    def _open_channel(self, role: str, transfer: str,
                      options: dict[str, Any] | None) -> KVSender | KVReceiver:
        """This worker's KV channel: every tensor-parallel rank moves its own heads;
        with a draft model, its cache's channel beside the target's."""
        main = open_channel(role, transfer, self.engine.kv_cache, self._rank_layout,
                            self.engine.kv_heads, self.engine.rank_links, options)
        draft = self.engine.draft
        if draft is None:
            return main
        return with_draft(role, main, transfer, draft.kv_cache,
                          draft.kv_layout(), options)

    def _on_loop_now(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the loop thread and wait for it (while the worker is built:
        whatever does torch work goes there); a failure stops the loop."""
        try:
            return self.loop.run(fn)
        except BaseException:
            self.loop.stop()
            raise

    # ------------------------------------------------------------ async API
    async def load(self) -> WorkerLoad:
        """Routing load and identity (the last published): the router's health probe."""
        self._check_running()
        return self._load

    async def join_info(self) -> JoinInfo:
        return JoinInfo(self.incarnation, None, None, self.metrics_at, self.limits())

    def limits(self) -> ServingLimits:
        """What the router must agree with (its engine's)."""
        return ServingLimits(self.engine.block_size, self.engine.max_model_len,
                             Path(self.model_dir).name)

    async def abort(self, request_id: str) -> None:
        """Drop a request wherever it is and free its blocks (idempotent). Queued on
        the loop; never waits for it (a stalled worker must not stall the caller)."""
        self.loop.post(lambda: self._drop(request_id))

    async def check_integrity(self) -> None:
        await self._on_loop(self.engine.check_integrity)

    def metrics(self) -> WorkerMetrics:
        """The last published snapshot (any thread; never waits for the engine)."""
        return self.publisher.snapshot()

    def metrics_address(self) -> tuple[str, int] | None:
        """Where this worker's ``/metrics`` is served (deploy/ starts one per actor)."""
        return self.metrics_at

    async def _on_loop(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the loop thread; ``WorkerGone`` once the loop has stopped."""
        self._check_running()
        try:
            return await asyncio.wrap_future(self.loop.call(fn))
        except LoopStopped:
            self._check_running()  # stopped meanwhile: WorkerGone, else fn's own error
            raise

    def _check_running(self) -> None:
        if self.loop.error is not None or not self.loop.alive():
            raise WorkerGone(f"{self.role} worker {self.worker_id} is not running "
                             f"({self.loop.error!r})")

    def start(self) -> None:
        """Publish the first metrics snapshot, then start the loop thread (whose first
        pass may come only after an idle wait)."""
        self._publish_metrics(force=True)
        self.loop.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the loop, then the engine's other tensor-parallel ranks (if any)."""
        self.loop.stop(timeout)
        self.engine.close()
        if self.cores is not None:
            self.cores.close()
        if self.tracing is not None:
            self.tracing.shutdown()

    # ------------------------------------------------------------- loop side
    def _drop(self, request_id: str) -> None:
        """A request aborted: its trace marks go (it makes no spans), then the role's
        own ``_abort``."""
        self.marks.pop(request_id, None)
        self._abort(request_id)

    def _abort(self, request_id: str) -> None:
        raise NotImplementedError

    def _abort_orphans(self, request_ids: list[str]) -> None:
        """Their router's output stream ended (it stopped or died): nobody will read
        them, so they are aborted on the loop and their blocks freed now."""
        def abort_all() -> None:
            for rid in request_ids:
                self._drop(rid)

        self.loop.post(abort_all)

    def busy(self) -> bool:
        return self.engine.has_unfinished()

    def iterate(self) -> None:
        self.engine.check_ranks()  # a lost tensor-parallel rank ends the worker, idle or not
        if self.engine.has_unfinished():
            self._take_cores()
            self._run_step()
        if not self.engine.has_unfinished():  # lent at once, not after the idle wait
            self._lend()
        self._load = self._make_load()
        self._publish_metrics(force=not self.busy())

    def _run_step(self) -> None:
        """One engine step and what the worker does with its outputs."""
        raise NotImplementedError

    def _traced(self, request_id: str, carrier: Carrier | None) -> None:
        """Note a request's events here, for its spans (when traced)."""
        if self.tracing is not None and carrier is not None:
            self.marks[request_id] = Marks(self.tracing, carrier, self.worker_id)

    def _trace_outputs(self, outputs: list[RequestOutput]) -> None:
        """Token workers: the spans of traced requests whose first token or end this
        step made (``prefill`` for a prompt computed here, ``decode`` at the end)."""
        if not self.marks:
            return
        for out in outputs:
            marks = self.marks.get(out.request_id)
            if marks is None:
                continue
            if "first_token" not in marks.at:  # its prompt was computed here
                marks.mark("first_token")
                marks.span("prefill", "start", prompt_tokens=out.num_prompt_tokens,
                           cached_tokens=out.num_cached_tokens)
            if out.finished:
                marks.span("decode", "first_token", output_tokens=out.num_output_tokens,
                           finish_reason=out.finish_reason)
                del self.marks[out.request_id]

    def _lend(self) -> None:
        """Nothing to compute: the node's other workers may use this one's cores."""
        if self.cores is not None and not self._lending:
            self._lending = True
            self.cores.release()

    def _take_cores(self) -> None:
        if self.cores is not None:
            self._lending = False
            self._threads = self.cores.acquire()
            self.engine.set_num_threads(self._threads)

    def _calibration_step(self, threads: int) -> StepInfo | None:
        """A step on exactly ``threads`` threads (None: the node's cores do not allow
        that many now)."""
        if self.cores is not None:
            self._lending = False
            if self.cores.acquire() < threads:
                return None
        self._threads = threads
        self.engine.set_num_threads(threads)
        return self.engine.step().info

    def _fit(self, info: StepInfo, calibration: bool = False) -> None:
        self.step_fit.observe(self._threads, info.num_decode, info.num_tokens - info.num_decode,
                              attended_tokens(info), info.seconds, calibration)

    def _step(self) -> list[RequestOutput]:
        """One engine step, recorded in the worker's step metrics when it ran."""
        result = self.engine.step()
        info = result.info
        if info is not None:
            # logits rows: one per output, one per draft token verified
            rows = len(result.outputs) + info.num_draft_tokens
            self.publisher.observe_step(info, rows)
            self._fit(info)
        return result.outputs

    def _make_load(self) -> WorkerLoad:
        e = self.engine.stats()
        own = self.cores.own if self.cores is not None else self._threads
        compute = Compute(own, self.engine.config.num_threads or own,
                          self.cores.group if self.cores is not None else None,
                          self.step_fit.costs())
        return WorkerLoad(self.worker_id, self.role, self.incarnation, e.num_running,
                          e.num_waiting, e.num_waiting_for_kv, e.num_free_blocks,
                          e.num_blocks, e.queued_prefill_tokens, self.blocks_granted,
                          compute, self.publisher.snapshot())

    def _publish_metrics(self, force: bool = False) -> None:
        c = self.publisher.counters
        c.threads = self._threads
        if self.cores is not None:
            c.borrowed_steps, c.core_wait_seconds = self.cores.borrowed_steps, self.cores.waited_s
        self.publisher.publish(self.engine.stats(), self._before_publish, force)

    def _before_publish(self, m: WorkerMetrics) -> None:
        """Fill role-specific metrics (loop thread)."""


def prefill_stages(out: RequestOutput, received: float | None, now: float) -> Stages | None:
    """The prefill stages of a request this worker prefilled itself (colocated, or a
    decode worker's local prefill), on its first output: queue time from ``received``
    (monotonic, when it was queued here) to its first step, then that prefill."""
    if received is None or out.first_scheduled_time is None:
        return None
    return Stages(prefill_queue_s=max(0.0, out.first_scheduled_time - received),
                  prefill_s=now - out.first_scheduled_time,
                  num_cached_tokens=out.num_cached_tokens)


def delta_of(out: RequestOutput, stages: Stages | None = None,
             logprobs: list[TokenLogprob] | None = None) -> RequestDelta:
    """The router's view of one engine output (decode and colocated workers)."""
    if logprobs is None and out.logprobs:
        logprobs = list(out.logprobs)
    return RequestDelta(out.request_id, out.new_token_ids, logprobs,
                        out.finish_reason if out.finished else None, out.stop_reason,
                        stages=stages, prompt_logprobs=prompt_logprobs_of(out),
                        spec=out.spec if out.finished else None)


def prompt_logprobs_of(out: RequestOutput) -> list[TokenLogprob | None] | None:
    """An output's prompt logprobs in the boundary's shape (None when not asked)."""
    if out.prompt_logprobs is None:
        return None
    return list(out.prompt_logprobs)
