"""vLLM's per-engine series on the router's ``/metrics`` (``vllm_metrics.py`` has the
request-level ones and why all come from the router): each engine (a worker) as its
load last answered the router's health probe, with the metrics snapshot it carries (at
most ~0.5 s older), read at scrape time.

Gauges: ``vllm:num_requests_running``, ``vllm:num_requests_waiting`` (queued, and reserved
waiting for KV), ``vllm:kv_cache_usage_perc``; the counters ``vllm:prefix_cache_
queries_total`` and ``_hits_total`` (tokens: the engine's blocks x block size),
``vllm:num_preemptions_total``, ``vllm:spec_decode_num_drafts_total``,
``_num_draft_tokens_total``, ``_num_accepted_tokens_total``,
``vllm:nixl_num_failed_transfers_total``; the histograms ``vllm:iteration_tokens_total``
(tokens per engine step; pdserve's bounds, 1 to 32,768 in powers of two, where vLLM's
are 1, 8, 16, ... 16,384), ``vllm:nixl_xfer_time_seconds`` and
``vllm:nixl_bytes_transferred`` (per request sent, on the prefill worker, whatever the
channel: vLLM's bounds; the time is from the request's last send to the decode
worker's acknowledgement, the part of the transfer prefill did not overlap);
``vllm:num_requests_waiting_by_reason{reason}`` (capacity: queued for compute;
deferred: reserved, waiting for KV), ``vllm:engine_sleep_state{sleep_state}`` (always
awake), ``vllm:cache_config_info`` (block size, blocks), and the counters
``vllm:estimated_flops_per_gpu_total`` and ``_read_bytes_per_gpu_total`` (per engine,
pdserve's cost model, ``engine/cost.py``). A worker's counters start again from 0 when
it restarts (a counter reset, as Prometheus expects).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from pdserve.messages import (
    BATCH_TOKENS_BUCKETS,
    KV_XFER_BYTES_BUCKETS,
    KV_XFER_SECONDS_BUCKETS,
    WorkerLoad,
    WorkerMetrics,
    bucket_samples,
)

LABELS = ("model_name", "engine")
EngineLoads = Callable[[], Mapping[str, WorkerLoad]]


# vLLM counter (its name without _total) <- (help, WorkerMetrics field, x block size)
_COUNTERS = {
    "vllm:prefix_cache_queries": ("Prefix cache queries, in terms of number of queried "
                                  "tokens.", "prefix_queries", True),
    "vllm:prefix_cache_hits": ("Prefix cache hits, in terms of number of cached tokens.",
                               "prefix_hits", True),
    "vllm:num_preemptions": ("Cumulative number of preemption from the engine.",
                             "num_preemptions", False),
    "vllm:spec_decode_num_drafts": ("Number of spec decoding drafts.", "spec_drafts", False),
    "vllm:spec_decode_num_draft_tokens": ("Number of draft tokens.", "spec_draft_tokens",
                                          False),
    "vllm:spec_decode_num_accepted_tokens": ("Number of accepted tokens.",
                                             "spec_accepted_tokens", False),
    "vllm:nixl_num_failed_transfers": ("Number of failed KV cache transfers.",
                                       "kv_transfer_failures", False),
    "vllm:estimated_flops_per_gpu": ("Estimated model FLOPs of the engine's steps.",
                                     "model_flops", False),
    "vllm:estimated_read_bytes_per_gpu": ("Estimated bytes read (weights and KV) by the "
                                          "engine's steps.", "memory_bytes_read", False),
}
SLEEP_STATES = ("awake", "weights_offloaded", "discard_all")  # pdserve's engines never sleep
# vLLM histogram <- (help, bounds, WorkerMetrics bucket counts, its sum)
_HISTOGRAMS = {
    "vllm:iteration_tokens_total": (
        "Histogram of number of tokens per engine_step.", BATCH_TOKENS_BUCKETS,
        "batch_tokens_buckets", "tokens_computed"),
    "vllm:nixl_xfer_time_seconds": (
        "Histogram of transfer duration for KV cache transfers (a request's, from its "
        "last send to the acknowledgement).", KV_XFER_SECONDS_BUCKETS,
        "kv_xfer_seconds_buckets", "kv_transfer_seconds"),
    "vllm:nixl_bytes_transferred": (
        "Histogram of bytes transferred per KV cache transfer (a request's).",
        KV_XFER_BYTES_BUCKETS, "kv_xfer_bytes_buckets", "kv_transfer_bytes"),
}


class Engines(Collector):
    """The per-engine series, read from the workers' loads at scrape time."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.loads: EngineLoads = dict
        self.block_size = 1

    def collect(self) -> Iterator[Metric]:
        running = GaugeMetricFamily("vllm:num_requests_running",
                                    "Number of requests in model execution batches.",
                                    labels=LABELS)
        waiting = GaugeMetricFamily("vllm:num_requests_waiting",
                                    "Number of requests waiting to be processed.",
                                    labels=LABELS)
        usage = GaugeMetricFamily("vllm:kv_cache_usage_perc",
                                  "KV-cache usage. 1 means 100 percent usage.", labels=LABELS)
        by_reason = GaugeMetricFamily(
            "vllm:num_requests_waiting_by_reason", "Number of waiting requests by reason: "
            "capacity (for compute), deferred (reserved, waiting for their KV).",
            labels=(*LABELS, "reason"))
        sleep = GaugeMetricFamily("vllm:engine_sleep_state", "Engine sleep state (1: the "
                                  "state it is in).", labels=(*LABELS, "sleep_state"))
        config = GaugeMetricFamily("vllm:cache_config_info", "Information of the KV cache "
                                   "configuration.", labels=(*LABELS, "block_size",
                                                             "num_gpu_blocks"))
        counters = {name: CounterMetricFamily(name, doc, labels=LABELS)
                    for name, (doc, _, _) in _COUNTERS.items()}
        histograms = {name: HistogramMetricFamily(name, doc, labels=LABELS)
                      for name, (doc, _, _, _) in _HISTOGRAMS.items()}
        for engine, load in sorted(self.loads().items()):
            values = [self.model, engine]
            running.add_metric(values, load.num_running)
            waiting.add_metric(values, load.num_waiting + load.num_waiting_for_kv)
            usage.add_metric(values, 1 - load.num_free_blocks / max(1, load.num_blocks))
            by_reason.add_metric([*values, "capacity"], load.num_waiting)
            by_reason.add_metric([*values, "deferred"], load.num_waiting_for_kv)
            for state in SLEEP_STATES:
                sleep.add_metric([*values, state], float(state == "awake"))
            config.add_metric([*values, str(self.block_size), str(load.num_blocks)], 1.0)
            m: WorkerMetrics | None = load.metrics
            if m is None:
                continue
            for name, (_, field, in_blocks) in _COUNTERS.items():
                scale = self.block_size if in_blocks else 1
                counters[name].add_metric(values, getattr(m, field) * scale)
            for name, (_, bounds, counts, total) in _HISTOGRAMS.items():
                histograms[name].add_metric(values, bucket_samples(bounds, getattr(m, counts)),
                                            float(getattr(m, total)))
        yield from (running, waiting, usage, by_reason, sleep, config, *counters.values(),
                    *histograms.values())
