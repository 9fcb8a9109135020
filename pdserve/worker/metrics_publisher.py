"""``MetricsPublisher``: a worker's metrics, counted on its loop thread and published
as a snapshot any thread reads without waiting for the engine (the worker's
``/metrics`` and the router's probes read the last one, even while a long step runs).

The loop thread adds to ``counters`` (steps through ``observe_step``: batch shape,
time, FLOPs and bytes for MFU/MBU; the worker's own counts directly) and calls
``publish`` after every iteration: a new snapshot at most every ``period_s``, or at
once when forced (the worker idles, or starts)."""

from __future__ import annotations

import time
from collections.abc import Callable

from pdserve.engine.cost import CostModel
from pdserve.engine.results import EngineStats, StepInfo
from pdserve.messages import WorkerMetrics

METRICS_PERIOD_S = 0.5


class MetricsPublisher:
    def __init__(self, worker_id: str, role: str, num_blocks: int, cost: CostModel,
                 period_s: float = METRICS_PERIOD_S) -> None:
        self.counters = WorkerMetrics(worker_id, role, num_blocks=num_blocks)
        self._published = WorkerMetrics(**vars(self.counters))
        self._published_at = 0.0
        self._cost = cost
        self._period_s = period_s

    def snapshot(self) -> WorkerMetrics:
        """The last published snapshot (any thread)."""
        return self._published

    def observe_step(self, info: StepInfo, rows: int) -> None:
        """One engine step that ran a batch computing ``rows`` logits rows."""
        self.counters.observe_step(info, *self._cost.step(info, rows))

    def publish(self, e: EngineStats, fill: Callable[[WorkerMetrics], None],
                force: bool = False) -> None:
        """A new snapshot from the engine's stats, ``fill`` adding the role's own."""
        now = time.monotonic()
        if not force and now - self._published_at < self._period_s:
            return
        self._published_at = now
        m = self.counters
        m.num_running, m.num_waiting = e.num_running, e.num_waiting
        m.num_waiting_for_kv, m.num_free_blocks = e.num_waiting_for_kv, e.num_free_blocks
        m.queued_prefill_tokens = e.queued_prefill_tokens
        m.prefix_queries, m.prefix_hits = e.prefix_queries, e.prefix_hits
        m.num_preemptions = e.num_preemptions
        if e.spec is not None:
            m.spec_drafts, m.spec_draft_tokens = e.spec.num_drafts, e.spec.num_draft_tokens
            m.spec_accepted_tokens = e.spec.num_accepted_tokens
        fill(m)
        self._published = WorkerMetrics(**vars(m))  # one reference swap: readers see all or none
