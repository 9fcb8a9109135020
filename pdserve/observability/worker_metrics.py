"""Each worker's own ``/metrics``: a Prometheus collector that reads the worker's
``WorkerMetrics`` snapshot at scrape time, served on the worker's own port.

This module owns the worker metric names, their types and help, and the MFU/MBU
gauges. Labels: ``model``, ``role`` (prefill/decode), ``worker``; never a request id.
Counters and histograms are cumulative since the worker started. The workers keep
plain numbers (``WorkerMetrics``, filled on their loop thread); nothing here runs on
the engine's thread, and the engine never imports Prometheus.

Efficiency (formulas in ``pdserve/observability/efficiency.py`` and ``docs/observability.md``):

* counters ``pdserve_model_flops_total`` and ``pdserve_memory_bytes_read_total`` plus
  gauges ``pdserve_device_peak_flops`` and ``pdserve_device_peak_bytes_per_second``,
  so PromQL computes MFU/MBU over any window (the recording rules do);
* gauges ``pdserve_mfu_ratio`` / ``pdserve_mbu_ratio``: the same ratios over the
  engine steps of the last ``window_s`` seconds between scrapes (for ``pdserve top``
  and scrapers without rules). Both divide by *busy* time (the steps' seconds), so an
  idle worker does not dilute them; ``pdserve_engine_step_seconds_sum``'s rate is the
  busy fraction.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from pdserve.messages import (
    BATCH_SIZE_BUCKETS,
    BATCH_TOKENS_BUCKETS,
    STEP_SECONDS_BUCKETS,
    WorkerMetrics,
    bucket_samples,
)
from pdserve.observability.efficiency import DevicePeaks, detect_peaks

Getter = Callable[[WorkerMetrics], float]
LABELS = ("model", "role", "worker")

# (name, help, value) of the gauges and counters (counters get "_total" on export).
GAUGES: list[tuple[str, str, Getter]] = [
    ("pdserve_num_requests_running", "Requests in the engine's running batch.",
     lambda s: s.num_running),
    ("pdserve_num_requests_waiting", "Requests queued for computation.", lambda s: s.num_waiting),
    ("pdserve_num_requests_waiting_for_kv", "Decode: requests with reserved blocks awaiting KV.",
     lambda s: s.num_waiting_for_kv),
    ("pdserve_kv_cache_usage_ratio", "Fraction of KV blocks in use (1 = full).",
     lambda s: 1 - s.num_free_blocks / max(1, s.num_blocks)),
    ("pdserve_kv_blocks_free", "Allocatable KV blocks (free + evictable cached).",
     lambda s: s.num_free_blocks),
    ("pdserve_kv_blocks_capacity", "KV blocks of this worker.", lambda s: s.num_blocks),
    ("pdserve_queued_prefill_tokens", "Prompt tokens not yet computed.",
     lambda s: s.queued_prefill_tokens),
    ("pdserve_kv_blocks_in_flight", "Blocks held for KV transfers not yet acknowledged.",
     lambda s: s.blocks_in_flight),
    ("pdserve_engine_threads", "CPU threads of the last engine step (core sharing lends "
     "a node's idle cores: docs/disaggregation.md).", lambda s: s.threads),
]
COUNTERS: list[tuple[str, str, Getter]] = [
    ("pdserve_prefix_cache_queries", "Prompt blocks looked up in the prefix cache.",
     lambda s: s.prefix_queries),
    ("pdserve_prefix_cache_hits", "Prompt blocks found in the prefix cache.",
     lambda s: s.prefix_hits),
    ("pdserve_num_preemptions", "Requests preempted for recomputation.",
     lambda s: s.num_preemptions),
    ("pdserve_local_prefills", "Decode: requests whose prompt this worker computed itself "
     "(placed here by the router, or all but a short suffix cached; no KV was sent).",
     lambda s: s.local_prefills),
    ("pdserve_spec_decode_num_drafts", "Speculative drafts verified (engine steps in which "
     "a request checked a draft).", lambda s: s.spec_drafts),
    ("pdserve_spec_decode_num_draft_tokens", "Draft tokens proposed and verified.",
     lambda s: s.spec_draft_tokens),
    ("pdserve_spec_decode_num_accepted_tokens", "Draft tokens the model accepted (each one "
     "a decode step saved).", lambda s: s.spec_accepted_tokens),
    ("pdserve_kv_transfers", "KV transfers completed (sender side).", lambda s: s.kv_transfers),
    ("pdserve_kv_sends", "KV send calls (sender side): one per engine step that completed "
     "blocks of a prompt, plus the last (overlap with prefill).", lambda s: s.kv_sends),
    ("pdserve_kv_transfer_bytes", "KV bytes transferred (sender side).",
     lambda s: s.kv_transfer_bytes),
    # Not "pdserve_kv_transfer_seconds": that is the router's per-request histogram.
    ("pdserve_kv_transfer_busy_seconds", "Seconds summed over completed KV transfers "
     "(overlapping transfers add up).", lambda s: s.kv_transfer_seconds),
    ("pdserve_kv_transfer_failures", "KV transfers that failed.", lambda s: s.kv_transfer_failures),
    ("pdserve_kv_empty_blocks", "KV blocks found empty where computed KV must be: sent so "
     "(prefill worker) or arrived so (decode worker: the request fails and is retried). "
     "Never expected: each one is a bug, logged with its request.",
     lambda s: s.kv_empty_blocks),
    ("pdserve_core_borrowed_steps", "Engine steps run on another worker's idle cores too.",
     lambda s: s.borrowed_steps),
    ("pdserve_core_wait_seconds", "Seconds spent waiting for this worker's own cores back "
     "from a borrower (at most one of its steps each time).", lambda s: s.core_wait_seconds),
    ("pdserve_engine_tokens", "Tokens computed by engine steps (prompt chunks + decodes).",
     lambda s: s.tokens_computed),
    ("pdserve_model_flops", "Model FLOPs of the engine steps (efficiency.py cost model).",
     lambda s: s.model_flops),
    ("pdserve_memory_bytes_read", "Weight + KV bytes read by the engine steps.",
     lambda s: s.memory_bytes_read),
]
# (name, help, bounds, per-bucket counts, sum) of the per-step histograms.
HISTOGRAMS: list[tuple[str, str, tuple[float, ...], Callable[[WorkerMetrics], tuple[int, ...]],
                       Getter]] = [
    ("pdserve_engine_step_seconds", "Engine step time (forward + sampling).",
     STEP_SECONDS_BUCKETS, lambda s: s.step_seconds_buckets, lambda s: s.step_seconds),
    ("pdserve_batch_size", "Sequences per engine step.",
     BATCH_SIZE_BUCKETS, lambda s: s.batch_size_buckets, lambda s: s.seqs_computed),
    ("pdserve_batch_tokens", "Tokens computed per engine step.",
     BATCH_TOKENS_BUCKETS, lambda s: s.batch_tokens_buckets, lambda s: s.tokens_computed),
]
PEAK_GAUGES = (
    ("pdserve_device_peak_flops",
     "Peak dense FLOP/s of this worker's devices (all its tensor-parallel ranks)."),
    ("pdserve_device_peak_bytes_per_second",
     "Peak memory bandwidth of this worker's devices (all its tensor-parallel ranks)."),
)
RATIO_GAUGES = (
    ("pdserve_mfu_ratio", "Model FLOPs utilisation over the recent window's engine steps."),
    ("pdserve_mbu_ratio", "Memory bandwidth utilisation over the recent window's engine steps."),
)
INFO_GAUGE = ("pdserve_device_info", "The device whose peaks MFU/MBU use, and how many "
               "(tensor_parallel_size: one per rank) (value 1).")


class _Window:
    """(time, flops, bytes, busy seconds) samples taken at scrapes, for the ratio gauges."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._samples: deque[tuple[float, float, float, float]] = deque()
        self._lock = threading.Lock()  # scrapes run on the HTTP server's threads

    def ratios(self, s: WorkerMetrics, peaks: DevicePeaks) -> tuple[float, float]:
        now = time.monotonic()
        with self._lock:
            self._samples.append((now, s.model_flops, s.memory_bytes_read, s.step_seconds))
            # Keep one sample at least window_s old as the baseline.
            while len(self._samples) > 2 and now - self._samples[1][0] >= self.window_s:
                self._samples.popleft()
            base = self._samples[0] if len(self._samples) > 1 else (now, 0.0, 0.0, 0.0)
        busy = s.step_seconds - base[3]
        if busy <= 0:
            return 0.0, 0.0  # no step in the window
        return ((s.model_flops - base[1]) / busy / peaks.flops_per_s,
                (s.memory_bytes_read - base[2]) / busy / peaks.bytes_per_s)


class WorkerCollector(Collector):
    def __init__(self, model: str, snapshot: Callable[[], WorkerMetrics],
                 peaks: DevicePeaks, window_s: float = 60.0) -> None:
        self.model = model
        self.snapshot = snapshot
        self.peaks = peaks
        self._window = _Window(window_s)

    def collect(self) -> Iterator[Metric]:
        s = self.snapshot()
        values = [self.model, s.role, s.worker_id]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=LABELS)
            g.add_metric(values, float(value))
            return g

        for name, doc, get in GAUGES:
            yield gauge(name, doc, get(s))
        for name, doc, get in COUNTERS:
            c = CounterMetricFamily(name, doc, labels=LABELS)
            c.add_metric(values, float(get(s)))
            yield c
        for name, doc, bounds, counts, total in HISTOGRAMS:
            h = HistogramMetricFamily(name, doc, labels=LABELS)
            h.add_metric(values, bucket_samples(bounds, counts(s)), float(total(s)))
            yield h
        p = self.peaks
        for (name, doc), value in zip(PEAK_GAUGES, (p.flops_per_s, p.bytes_per_s), strict=True):
            yield gauge(name, doc, value)
        for (name, doc), value in zip(RATIO_GAUGES, self._window.ratios(s, p), strict=True):
            yield gauge(name, doc, value)
        info = GaugeMetricFamily(*INFO_GAUGE,
                                 labels=(*LABELS, "device", "source", "tensor_parallel_size"))
        info.add_metric([*values, p.device, p.source, str(p.ranks)], 1.0)
        yield info


def serve_worker_metrics(model: str, snapshot: Callable[[], WorkerMetrics],
                         host: str = "127.0.0.1", port: int = 0,
                         peaks: DevicePeaks | None = None,
                         tensor_parallel_size: int = 1) -> int:
    """Start the worker's ``/metrics`` server; returns the bound port. ``peaks`` (the
    whole worker's) defaults to this process's device (datasheet GPU, else a ~0.6 s
    measurement with this process's threads) times ``tensor_parallel_size``: this
    process is rank 0, each rank has a device (or threads) like it."""
    registry = CollectorRegistry()
    registry.register(WorkerCollector(model, snapshot,
                                      peaks or detect_peaks(ranks=tensor_parallel_size)))
    server, _ = start_http_server(port, addr=host, registry=registry)
    return int(server.server_port)
