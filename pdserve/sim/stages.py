"""Each simulated request's stage timings, as the served router records them
(``StageTimings``: router queue, prefill queue and compute, KV transfer, decode queue,
TTFT, TPOT, end to end), observed into the router's own ``RouterMetrics``: the
result's ``server_metrics`` is what ``pdserve bench --scrape-metrics`` reads from a
served run (``stage_breakdown``: the same histograms, buckets and quantile rule), so
the two compare stage by stage."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, generate_latest

from pdserve.client.server_metrics import stage_breakdown
from pdserve.router.metrics import RouterMetrics
from pdserve.router.types import FinalChunk, StageTimings, Usage
from pdserve.sim.flight import Flight


def timings_of(f: Flight) -> StageTimings:
    """The request's stages (call before its requests are dropped)."""
    t = StageTimings(router_queue=f.queue_s, placement=f.placement or None)
    arrived = f.admit_start
    if f.first_s is not None:
        t.ttft = f.first_s - arrived
        t.tokens_after_first = f.num_tokens - 1
        t.inter_token = list(f.itl) if f.keep_itl else [f.last_s - f.first_s]
    if f.end is not None:
        t.e2e = f.end - arrived
    computed_by = f.prefill_req if f.placement == "remote" else f.token_req
    # (as the workers measure it: a prefill worker from the call's arrival, a token
    # worker from when its loop took the request, between two steps)
    since = f.sent_to_prefill if f.placement == "remote" else f.received
    if computed_by is not None and computed_by.first_scheduled_time is not None:
        t.prefill_queue = max(0.0, computed_by.first_scheduled_time - since)
        if computed_by.first_token_time is not None:
            t.prefill = computed_by.first_token_time - computed_by.first_scheduled_time
    if f.landed is not None and f.prefill_done is not None:
        t.kv_transfer = f.landed - f.prefill_done
        if f.token_req is not None and f.token_req.first_scheduled_time is not None:
            t.decode_queue = max(0.0, f.token_req.first_scheduled_time - f.landed)
    return t


class Stages:
    """The run's router metrics, fed one finished request at a time."""

    def __init__(self, model: str) -> None:
        self.registry = CollectorRegistry()
        self.metrics = RouterMetrics(self.registry, model)

    def observe(self, f: Flight, timings: StageTimings) -> None:
        self.metrics.observe_finished(FinalChunk(
            "length", Usage(f.prompt_len, f.num_tokens), timings=timings))

    def breakdown(self) -> dict[str, dict[str, Any]]:
        return stage_breakdown(None, generate_latest(self.registry).decode())
