"""The router's request-level Prometheus metrics.

This module owns the metric names, labels, buckets and the rules for what one
finished or rejected request adds to them. Names and meanings follow vLLM (see
ARCHITECTURE.md "Metrics"); every series has the labels ``model`` and
``role="router"``, ``pdserve_requests_total`` adds ``status``, the SLO counters add
``slo`` and ``met``. Never a request id: a label per request would grow the
series count without bound.

Metrics live in the registry passed in (never prometheus_client's global default
one), so tests and several routers in one process stay apart. One registry holds
one ``RouterMetrics``: the families are registered by name and a second instance
would collide.

SLO attainment (``pdserve_slo_requests_total{slo, met}``), counted per finished
request when a target is configured (``slo="both"`` only when both are):

* ``finish_reason`` "stop" / "length": ``ttft`` met iff TTFT <= target; ``tpot`` met
  iff TPOT <= target, and met when there is no TPOT (fewer than 2 output tokens);
  ``both`` met iff both are.
* "error": missed, whatever the timings (the client got no complete answer).
* "abort" (the client went away): not counted — the outcome was not the server's.
* Rejected requests (``observe_rejected``) are counted only in ``requests_total``.

Attainment = ``met="true"`` / (``met="true"`` + ``met="false"``) over a window.

Failures (the fault model, ARCHITECTURE.md): ``pdserve_failed_attempts_total{reason}``
counts attempts that failed and were retried or gave up, by ``FailReason`` (every
reason is exported from 0); ``pdserve_worker_restarts_total{pool, worker}`` counts
workers that rejoined with a new incarnation (Ray restarted them);
``pdserve_workers_in_routing{pool}`` is how many of each pool serve now.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from pdserve.failures import FailReason
from pdserve.router.placement import REASONS
from pdserve.router.types import ErrorKind, FinalChunk
from pdserve.router.vllm_metrics import EngineLoads, VllmMetrics

ROLE = "router"

# Stage latencies: sub-millisecond (a queue hop on an idle cluster) to ten minutes
# (a long prompt prefilled on CPU threads behind a queue).
STAGE_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5,
    0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0,
)  # fmt: skip
# Per-token gaps: ~1 ms on a GPU decode step to seconds for a CPU engine or a stall.
TOKEN_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075,
    0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
# Whole requests: tens of ms (one token, warm GPU) to an hour (long CPU generation).
E2E_BUCKETS = (
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
    50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 3600.0,
)  # fmt: skip

_LABELS = ("model", "role")

# StageTimings field -> (metric name, help, buckets); the queue/prefill/transfer stages
# are measured by the workers, each on its own clock, and reported back.
_STAGES = {
    "router_queue": (
        "pdserve_request_queue_seconds",
        "Router: arrival until dispatched to a prefill/decode pair.",
        STAGE_BUCKETS,
    ),
    "prefill_queue": (
        "pdserve_prefill_queue_seconds",
        "Prefill worker: received until first scheduled.",
        STAGE_BUCKETS,
    ),
    "prefill": (
        "pdserve_prefill_seconds",
        "Prefill worker: first scheduled until first token sampled.",
        STAGE_BUCKETS,
    ),
    "kv_transfer": (
        "pdserve_kv_transfer_seconds",
        "Prefill worker: KV send started until acknowledged by the decode worker.",
        STAGE_BUCKETS,
    ),
    "decode_queue": (
        "pdserve_decode_queue_seconds",
        "Decode worker: KV arrived until first decode step.",
        STAGE_BUCKETS,
    ),
    "ttft": (
        "pdserve_time_to_first_token_seconds",
        "Router: arrival until first token received.",
        STAGE_BUCKETS,
    ),
    "e2e": (
        "pdserve_e2e_request_latency_seconds",
        "Router: arrival until finished.",
        E2E_BUCKETS,
    ),
}

# 16 KiB .. 16 GiB, x4 per bucket
KV_BYTES_BUCKETS = tuple(float(16 * 1024 * 4**i) for i in range(11))
_SLO_COUNTED = ("stop", "length", "error")  # "abort" is not counted, see docstring


class RouterMetrics:
    """Request-level metrics for one model served by this router."""

    def __init__(
        self,
        registry: CollectorRegistry,
        model: str,
        ttft_slo_s: float | None = None,
        tpot_slo_s: float | None = None,
    ):
        for name, target in (("ttft_slo_s", ttft_slo_s), ("tpot_slo_s", tpot_slo_s)):
            if target is not None and not target > 0:
                raise ValueError(f"{name} must be > 0 or None, got {target}")
        self.model = model
        self.ttft_slo_s = ttft_slo_s
        self.tpot_slo_s = tpot_slo_s
        labels = {"model": model, "role": ROLE}

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, _LABELS, registry=registry, buckets=buckets).labels(
                **labels
            )

        # Children with the fixed labels bound, one per StageTimings field.
        self._stages = {
            field: histogram(name, doc, buckets) for field, (name, doc, buckets) in _STAGES.items()
        }
        self._tpot = histogram(
            "pdserve_time_per_output_token_seconds",
            "Router: mean gap between output tokens after the first, per request.",
            TOKEN_BUCKETS,
        )
        self._itl = histogram(
            "pdserve_inter_token_latency_seconds",
            "Router: each gap between consecutive output tokens (a delivery of several "
            "tokens, a speculative step's, is one gap).",
            TOKEN_BUCKETS,
        )
        self._kv_bytes = histogram(
            "pdserve_kv_transfer_request_bytes",
            "Prefill worker: KV bytes sent for one request (only the blocks the decode "
            "worker did not hold already).",
            KV_BYTES_BUCKETS,
        )
        self._requests = Counter(
            "pdserve_requests",
            "Requests ended, by status: a finish reason (stop/length/abort/error) "
            "or the error kind a request was rejected with.",
            (*_LABELS, "status"),
            registry=registry,
        )
        self._prompt_tokens = Counter(
            "pdserve_prompt_tokens",
            "Prompt tokens of finished requests.",
            _LABELS,
            registry=registry,
        ).labels(**labels)
        self._generation_tokens = Counter(
            "pdserve_generation_tokens",
            "Output tokens of finished requests.",
            _LABELS,
            registry=registry,
        ).labels(**labels)
        self._retries = Counter(
            "pdserve_request_retries",
            "Times a request moved to another prefill/decode pair after a failure.",
            _LABELS,
            registry=registry,
        ).labels(**labels)
        self._slo = Counter(
            "pdserve_slo_requests",
            "Finished requests by SLO (ttft/tpot/both) and whether it was met.",
            (*_LABELS, "slo", "met"),
            registry=registry,
        )
        self._failed = Counter(
            "pdserve_failed_attempts",
            "Request attempts that failed on a worker (then retried or given up), by reason.",
            (*_LABELS, "reason"),
            registry=registry,
        )
        for reason in FailReason:
            self._failed.labels(**labels, reason=reason.value)
        self._placements = Counter(
            "pdserve_prompt_placements",
            "Attempts by where their prompt was computed (remote: a prefill worker; local: "
            "the decode worker; colocated) and why (docs/operations.md, placement).",
            (*_LABELS, "where", "reason"),
            registry=registry,
        )
        for where, reasons in REASONS.items():
            for why in reasons:
                self._placements.labels(**labels, where=where, reason=why)
        self._restarts = Counter(
            "pdserve_worker_restarts",
            "Workers that rejoined routing with a new incarnation (restarted).",
            (*_LABELS, "pool", "worker"),
            registry=registry,
        )
        self._in_routing = Gauge(
            "pdserve_workers_in_routing",
            "Workers of each pool in routing now.",
            (*_LABELS, "pool"),
            registry=registry,
        )
        self._moves = Counter(
            "pdserve_request_moves",
            "Running requests moved to another decode worker with their KV, by reason "
            "(drain, rebalance) and outcome (moved; abandoned: it stayed where it was; "
            "failed: its attempt on the new worker failed before a token, and retried).",
            (*_LABELS, "reason", "outcome"),
            registry=registry,
        )
        self._move_bytes = Counter(
            "pdserve_request_move_kv_bytes",
            "KV bytes sent between decode workers for moved requests.",
            _LABELS,
            registry=registry,
        ).labels(**labels)
        self._move_pause = histogram(
            "pdserve_request_move_pause_seconds",
            "Router: a moved request's pause, from its last token read from the old decode "
            "worker's stream to its first from the new one.",
            TOKEN_BUCKETS,
        )
        self._labels = labels
        self._registry = registry
        self.vllm: VllmMetrics | None = None  # vLLM's names, once a router serves these

    def watch(self, max_model_len: int, loads: EngineLoads, block_size: int) -> None:
        """The router these metrics serve: its model length (vLLM's token buckets), its
        workers' loads (vLLM's per-engine series) and block size; vLLM's series start
        here."""
        if self.vllm is None:
            self.vllm = VllmMetrics(self._registry, self.model, max_model_len,
                                    self.ttft_slo_s, self.tpot_slo_s)
        self.vllm.watch(loads, block_size)

    def observe_attempt_failed(self, reason: FailReason) -> None:
        self._failed.labels(**self._labels, reason=reason.value).inc()

    def observe_placement(self, where: str, reason: str) -> None:
        """One attempt admitted: where its prompt is computed, and why."""
        self._placements.labels(**self._labels, where=where, reason=reason).inc()

    def observe_move(self, reason: str, outcome: str, kv_bytes: int = 0,
                     pause_s: float | None = None) -> None:
        """A move of a running request ended: ``outcome`` moved | abandoned | failed."""
        self._moves.labels(**self._labels, reason=reason, outcome=outcome).inc()
        self._move_bytes.inc(kv_bytes)
        if pause_s is not None:
            self._move_pause.observe(pause_s)

    def observe_worker(self, worker: str, pool: str, what: str, in_routing: int) -> None:
        """A worker joined, rejoined after a restart ("restarted") or left routing."""
        restarts = self._restarts.labels(**self._labels, pool=pool, worker=worker)
        if what == "restarted":
            restarts.inc()
        self._in_routing.labels(**self._labels, pool=pool).set(in_routing)

    def observe_finished(self, final: FinalChunk) -> None:
        """Record one request that reached its FinalChunk (any finish reason)."""
        timings = final.timings
        for field, hist in self._stages.items():
            value = getattr(timings, field)
            if value is not None:
                hist.observe(value)
        for gap in timings.inter_token:
            self._itl.observe(gap)
        tpot = timings.tpot
        if tpot is not None:
            self._tpot.observe(tpot)
        if timings.kv_bytes is not None:
            self._kv_bytes.observe(timings.kv_bytes)
        self._requests.labels(**self._labels, status=final.finish_reason).inc()
        self._prompt_tokens.inc(final.usage.prompt_tokens)
        self._generation_tokens.inc(final.usage.completion_tokens)
        if final.num_retries:
            self._retries.inc(final.num_retries)
        self._observe_slo(final)
        if self.vllm is not None:
            self.vllm.observe_finished(final)

    def observe_rejected(self, kind: ErrorKind) -> None:
        """Record one request that ended with a RouterError instead of a FinalChunk."""
        self._requests.labels(**self._labels, status=kind.value).inc()

    def _observe_slo(self, final: FinalChunk) -> None:
        if final.finish_reason not in _SLO_COUNTED:
            return
        served = final.finish_reason != "error"
        ttft, tpot = final.timings.ttft, final.timings.tpot
        ttft_met = served and ttft is not None and self._meets(ttft, self.ttft_slo_s)
        tpot_met = served and (tpot is None or self._meets(tpot, self.tpot_slo_s))
        if self.ttft_slo_s is not None:
            self._count_slo("ttft", ttft_met)
        if self.tpot_slo_s is not None:
            self._count_slo("tpot", tpot_met)
        if self.ttft_slo_s is not None and self.tpot_slo_s is not None:
            self._count_slo("both", ttft_met and tpot_met)

    @staticmethod
    def _meets(value: float, target: float | None) -> bool:
        return target is None or value <= target

    def _count_slo(self, slo: str, met: bool) -> None:
        self._slo.labels(**self._labels, slo=slo, met="true" if met else "false").inc()


def metrics_text(registry: CollectorRegistry) -> bytes:
    """The registry in Prometheus text exposition format (for ``GET /metrics``).
    Always the text format, never negotiated OpenMetrics: prometheus_client 0.26's
    OpenMetrics encoder escapes the colons of vLLM's names (``vllm:x`` would reach
    Prometheus as ``vllm_x``; prometheus/client_python#1177)."""
    return generate_latest(registry)
