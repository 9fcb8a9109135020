"""Each worker's own ``/metrics``: a Prometheus collector that reads the worker's
stats snapshot at scrape time, served on the worker's own port.

Labels: ``model``, ``role`` (prefill/decode), ``worker``. Counters are cumulative
since the worker started.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pdserve.messages import WorkerStats

# (name, help, stats field or function) for gauges and counters
_GAUGES: list[tuple[str, str, Callable[[WorkerStats], float]]] = [
    ("pdserve_num_requests_running", "Requests in the engine's running batch.",
     lambda s: s.num_running),
    ("pdserve_num_requests_waiting", "Requests queued for computation.", lambda s: s.num_waiting),
    ("pdserve_num_requests_waiting_for_kv", "Decode: requests with reserved blocks awaiting KV.",
     lambda s: s.num_waiting_for_kv),
    ("pdserve_kv_cache_usage_ratio", "Fraction of KV blocks in use (1 = full).",
     lambda s: 1 - s.num_free_blocks / max(1, s.num_blocks)),
    ("pdserve_kv_blocks_free", "Allocatable KV blocks (free + evictable cached).",
     lambda s: s.num_free_blocks),
    ("pdserve_kv_blocks_total", "KV blocks of this worker.", lambda s: s.num_blocks),
    ("pdserve_queued_prefill_tokens", "Prompt tokens not yet computed.",
     lambda s: s.queued_prefill_tokens),
    ("pdserve_kv_blocks_in_flight", "Blocks held for KV transfers not yet acknowledged.",
     lambda s: s.blocks_in_flight),
]
_COUNTERS: list[tuple[str, str, Callable[[WorkerStats], float]]] = [
    ("pdserve_prefix_cache_queries", "Prompt blocks looked up in the prefix cache.",
     lambda s: s.prefix_queries),
    ("pdserve_prefix_cache_hits", "Prompt blocks found in the prefix cache.",
     lambda s: s.prefix_hits),
    ("pdserve_num_preemptions", "Requests preempted for recomputation.",
     lambda s: s.num_preemptions),
    ("pdserve_kv_transfers", "KV transfers completed.", lambda s: s.kv_transfers),
    ("pdserve_kv_transfer_bytes", "KV bytes transferred.", lambda s: s.kv_transfer_bytes),
    ("pdserve_kv_transfer_seconds", "Seconds spent in completed KV transfers.",
     lambda s: s.kv_transfer_seconds),
    ("pdserve_kv_transfer_failures", "KV transfers that failed.", lambda s: s.kv_transfer_failures),
    ("pdserve_engine_steps", "Engine steps run.", lambda s: s.steps),
    ("pdserve_engine_step_seconds", "Seconds spent in engine steps.", lambda s: s.step_seconds),
]


class WorkerCollector(Collector):
    def __init__(self, model: str, snapshot: Callable[[], WorkerStats]) -> None:
        self.model = model
        self.snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        s = self.snapshot()
        labels = ["model", "role", "worker"]
        values = [self.model, s.role, s.worker_id]
        for name, doc, get in _GAUGES:
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric(values, float(get(s)))
            yield g
        for name, doc, get in _COUNTERS:
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric(values, float(get(s)))
            yield c


def serve_worker_metrics(model: str, snapshot: Callable[[], WorkerStats],
                         host: str = "127.0.0.1", port: int = 0) -> int:
    """Start the worker's ``/metrics`` server; returns the bound port."""
    registry = CollectorRegistry()
    registry.register(WorkerCollector(model, snapshot))
    server, _ = start_http_server(port, addr=host, registry=registry)
    return int(server.server_port)
