"""vLLM's own metric names, served natively on the router's ``/metrics`` beside
pdserve's, so vLLM's Grafana dashboards (Overview with its SLO tiles, Instances) and
tools keyed on vLLM's series (AIPerf's server-metrics scrape, autoscalers on
``vllm:num_requests_waiting``) work against a pdserve deployment unchanged, with no
recording rule.

A deployment answers as one vLLM instance whose engines are its workers: every series
has vLLM's labels ``model_name`` and ``engine`` (a worker id), and all of them come
from the router's one endpoint -- vLLM's dashboards pick their ``instance`` and
``engine`` variables from ``vllm:num_requests_running``, so series from another
endpoint would fall outside every selection.

Names, labels, meanings and bucket bounds are vLLM 0.32's (``vllm/v1/metrics/
loggers.py`` and ``buckets.py``), with one addition: the deployment's TTFT and TPOT
targets are bucket bounds of the TTFT, inter-token and per-request TPOT histograms,
so the Overview dashboard's SLO tiles (the bucket at ``le=<target>`` over the count)
are exact at them.

Per finished request (``engine``: the worker that streamed its tokens, the last
attempt's):

* ``vllm:time_to_first_token_seconds``, ``vllm:e2e_request_latency_seconds``,
  ``vllm:inter_token_latency_seconds`` (each gap), ``vllm:request_time_per_output_
  token_seconds`` (the request's mean gap) -- the router's clock, as the client sees;
* ``vllm:request_queue_time_seconds``: waiting before its prompt was first computed
  (the router's queue plus the prefill worker's); ``vllm:request_prefill_time_
  seconds``: first computed to first token; ``vllm:request_decode_time_seconds``:
  first token to the end; ``vllm:request_inference_time_seconds``: the two together;
* ``vllm:request_prompt_tokens``, ``vllm:request_generation_tokens``;
  ``vllm:prompt_tokens_total``, ``vllm:generation_tokens_total``,
  ``vllm:prompt_tokens_cached_total``, ``vllm:prompt_tokens_by_source_total{source}``
  (``local_cache_hit``: the prefix cache; ``external_kv_transfer``: computed by a
  prefill worker and moved; ``local_compute``: computed where it decodes);
* ``vllm:request_success_total{finished_reason}`` (stop, length, abort, error);
* ``vllm:prompt_tokens_cached_by_source_total{source="device"}`` (the prefix cache),
  ``vllm:external_prefix_cache_queries_total`` / ``_hits_total`` (the KV connector's:
  the tokens its engine did not hold / those moved from a prefill worker),
  ``vllm:request_prefill_kv_computed_tokens`` (a request's prompt tokens not cached).

Per engine: ``vllm_engines.py``.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from pdserve.router.types import FinalChunk
from pdserve.router.vllm_engines import LABELS, EngineLoads, Engines

# vLLM 0.32's bounds (v1/metrics/buckets.py)
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
FINISHED_REASONS = ("stop", "length", "abort", "error")
SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")


def token_buckets(max_model_len: int) -> tuple[float, ...]:
    """vLLM's request-token bounds: 1, 2, 5, 10, 20, 50, ... up to ``max_model_len``."""
    out: list[float] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_model_len:
                return tuple(out)
            out.append(float(m * scale))
        scale *= 10


def with_targets(bounds: tuple[float, ...], *targets: float | None) -> tuple[float, ...]:
    """``bounds`` with the SLO targets among them (sorted, once each)."""
    return tuple(sorted({*bounds, *(t for t in targets if t is not None)}))


class VllmMetrics:
    """vLLM's series for one served model (the module docstring)."""

    def __init__(self, registry: CollectorRegistry, model: str, max_model_len: int,
                 ttft_slo_s: float | None = None, tpot_slo_s: float | None = None) -> None:
        self.model = model

        def histogram(name: str, doc: str, bounds: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, LABELS, registry=registry, buckets=bounds)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, (*LABELS, *extra), registry=registry)

        tokens = token_buckets(max_model_len)
        self.ttft = histogram("vllm:time_to_first_token_seconds",
                              "Histogram of time to first token in seconds.",
                              with_targets(TTFT_BUCKETS, ttft_slo_s))
        self.itl = histogram("vllm:inter_token_latency_seconds",
                             "Histogram of inter-token latency in seconds.",
                             with_targets(ITL_BUCKETS, tpot_slo_s))
        self.tpot = histogram("vllm:request_time_per_output_token_seconds",
                              "Histogram of time_per_output_token_seconds per request.",
                              with_targets(ITL_BUCKETS, tpot_slo_s))
        self.e2e = histogram("vllm:e2e_request_latency_seconds",
                             "Histogram of e2e request latency in seconds.",
                             REQUEST_LATENCY_BUCKETS)
        self.phases = {phase: histogram(f"vllm:request_{phase}_time_seconds",
                                        f"Histogram of time spent in {vllm_name} phase for "
                                        "request.", REQUEST_LATENCY_BUCKETS)
                       for phase, vllm_name in (("queue", "WAITING"), ("prefill", "PREFILL"),
                                                ("decode", "DECODE"), ("inference", "RUNNING"))}
        self.prompt_hist = histogram("vllm:request_prompt_tokens",
                                     "Number of prefill tokens processed.", tokens)
        self.generation_hist = histogram("vllm:request_generation_tokens",
                                         "Number of generation tokens processed.", tokens)
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.by_source = counter("vllm:prompt_tokens_by_source",
                                 "Number of prompt tokens by source.", ("source",))
        self.cached = counter("vllm:prompt_tokens_cached",
                              "Number of cached prompt tokens (local + external).")
        self.cached_by_source = counter(
            "vllm:prompt_tokens_cached_by_source", "Prefix-cache hit tokens by the cache "
            "tier that supplied them (device: the engine's own).", ("source",))
        self.external_queries = counter(
            "vllm:external_prefix_cache_queries", "External prefix cache queries from the "
            "KV connector, in tokens (a request's tokens its engine did not hold).")
        self.external_hits = counter(
            "vllm:external_prefix_cache_hits", "External prefix cache hits from the KV "
            "connector, in tokens (moved from a prefill worker).")
        self.kv_computed = histogram(
            "vllm:request_prefill_kv_computed_tokens", "Histogram of new KV tokens computed "
            "during prefill (excluding cached tokens).", tokens)
        self.generation_tokens = counter("vllm:generation_tokens",
                                         "Number of generation tokens processed.")
        self.success = counter("vllm:request_success", "Count of successfully processed "
                               "requests.", ("finished_reason",))
        self._engines = Engines(model)
        registry.register(self._engines)

    def watch(self, loads: EngineLoads, block_size: int) -> None:
        """Where the per-engine series come from: each worker's last answered load."""
        self._engines.loads, self._engines.block_size = loads, block_size

    def observe_finished(self, final: FinalChunk) -> None:
        t, u = final.timings, final.usage
        labels = {"model_name": self.model, "engine": t.worker or ""}
        if final.finish_reason in FINISHED_REASONS:
            self.success.labels(**labels, finished_reason=final.finish_reason).inc()
        self.prompt_tokens.labels(**labels).inc(u.prompt_tokens)
        self.generation_tokens.labels(**labels).inc(u.completion_tokens)
        self.prompt_hist.labels(**labels).observe(u.prompt_tokens)
        self.generation_hist.labels(**labels).observe(u.completion_tokens)
        computed = max(0, u.prompt_tokens - u.cached_tokens)
        self.cached.labels(**labels).inc(u.cached_tokens)
        self.cached_by_source.labels(**labels, source="device").inc(u.cached_tokens)
        self.kv_computed.labels(**labels).observe(computed)
        self.by_source.labels(**labels, source="local_cache_hit").inc(u.cached_tokens)
        moved = t.placement == "remote"
        self.by_source.labels(**labels, source="external_kv_transfer").inc(computed * moved)
        self.external_queries.labels(**labels).inc(computed)
        self.external_hits.labels(**labels).inc(computed * moved)
        self.by_source.labels(**labels, source="local_compute").inc(computed * (not moved))
        for hist, value in ((self.ttft, t.ttft), (self.e2e, t.e2e), (self.tpot, t.tpot)):
            if value is not None:
                hist.labels(**labels).observe(value)
        itl = self.itl.labels(**labels)
        for gap in t.inter_token:
            itl.observe(gap)
        if t.ttft is None or t.e2e is None:
            return
        waited = (t.router_queue or 0.0) + (t.prefill_queue or 0.0)
        prefill = max(0.0, t.ttft - waited)
        decode = max(0.0, t.e2e - t.ttft)
        for phase, value in (("queue", waited), ("prefill", prefill), ("decode", decode),
                             ("inference", prefill + decode)):
            self.phases[phase].labels(**labels).observe(value)
