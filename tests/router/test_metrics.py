"""RouterMetrics: stage histograms, token counters, SLO attainment, exposition."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from pdserve.router.metrics import RouterMetrics, metrics_text
from pdserve.router.types import ErrorKind, FinalChunk, StageTimings, Usage

MODEL = "tiny"
LABELS = {"model": MODEL, "role": "router"}

STAGE_METRICS = {
    "router_queue": "pdserve_request_queue_seconds",
    "prefill_queue": "pdserve_prefill_queue_seconds",
    "prefill": "pdserve_prefill_seconds",
    "kv_transfer": "pdserve_kv_transfer_seconds",
    "decode_queue": "pdserve_decode_queue_seconds",
    "ttft": "pdserve_time_to_first_token_seconds",
    "e2e": "pdserve_e2e_request_latency_seconds",
}


def final(
    reason: str = "stop",
    ttft: float | None = 0.2,
    gaps: tuple[float, ...] = (0.01, 0.03),
    prompt: int = 7,
    retries: int = 0,
) -> FinalChunk:
    timings = StageTimings(
        router_queue=0.001,
        prefill_queue=0.002,
        prefill=0.05,
        kv_transfer=0.004,
        decode_queue=0.0005,
        ttft=ttft,
        e2e=1.5,
        inter_token=list(gaps),
        tokens_after_first=len(gaps),
    )
    usage = Usage(prompt_tokens=prompt, completion_tokens=len(gaps) + 1, cached_tokens=3)
    return FinalChunk(reason, usage, timings=timings, num_retries=retries)


def value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    got = registry.get_sample_value(name, {**LABELS, **labels})
    return 0.0 if got is None else got


def test_stages_land_in_their_histograms() -> None:
    registry = CollectorRegistry()
    metrics = RouterMetrics(registry, MODEL)
    for _ in range(3):
        metrics.observe_finished(final())
    for field, name in STAGE_METRICS.items():
        assert value(registry, f"{name}_count") == 3, name
        expected = getattr(final().timings, field) * 3
        assert value(registry, f"{name}_sum") == pytest.approx(expected), name
    # ITL: one observation per gap; TPOT: one per request (the mean gap).
    assert value(registry, "pdserve_inter_token_latency_seconds_count") == 6
    assert value(registry, "pdserve_inter_token_latency_seconds_sum") == pytest.approx(0.12)
    assert value(registry, "pdserve_time_per_output_token_seconds_count") == 3
    assert value(registry, "pdserve_time_per_output_token_seconds_sum") == pytest.approx(0.06)
    # A 0.5 ms stage falls in the smallest buckets, not in +Inf only.
    assert value(registry, "pdserve_decode_queue_seconds_bucket", le="0.0005") == 3


def test_missing_stages_are_not_observed() -> None:
    registry = CollectorRegistry()
    metrics = RouterMetrics(registry, MODEL)
    metrics.observe_finished(FinalChunk("abort", Usage(5, 0), timings=StageTimings(e2e=0.3)))
    assert value(registry, "pdserve_e2e_request_latency_seconds_count") == 1
    assert value(registry, "pdserve_prefill_seconds_count") == 0
    assert value(registry, "pdserve_time_per_output_token_seconds_count") == 0


def test_counters() -> None:
    registry = CollectorRegistry()
    metrics = RouterMetrics(registry, MODEL)
    metrics.observe_finished(final(prompt=10, gaps=(0.1,) * 4, retries=2))
    metrics.observe_finished(final(reason="length", prompt=5, gaps=()))
    metrics.observe_rejected(ErrorKind.OVERLOADED)
    metrics.observe_rejected(ErrorKind.OVERLOADED)
    assert value(registry, "pdserve_prompt_tokens_total") == 15
    assert value(registry, "pdserve_generation_tokens_total") == 6
    assert value(registry, "pdserve_request_retries_total") == 2
    assert value(registry, "pdserve_requests_total", status="stop") == 1
    assert value(registry, "pdserve_requests_total", status="length") == 1
    assert value(registry, "pdserve_requests_total", status="overloaded") == 2


def slo(registry: CollectorRegistry, which: str, met: bool) -> float:
    return value(registry, "pdserve_slo_requests_total", slo=which, met=str(met).lower())


def test_slo_attainment() -> None:
    registry = CollectorRegistry()
    metrics = RouterMetrics(registry, MODEL, ttft_slo_s=0.5, tpot_slo_s=0.05)
    metrics.observe_finished(final(ttft=0.2, gaps=(0.01, 0.03)))  # both met
    metrics.observe_finished(final(ttft=0.9, gaps=(0.01,)))  # ttft missed
    metrics.observe_finished(final(ttft=0.1, gaps=(0.2, 0.2)))  # tpot missed
    metrics.observe_finished(final(ttft=0.1, gaps=()))  # one token: no TPOT -> met
    metrics.observe_finished(final(reason="error", ttft=0.1, gaps=(0.01,)))  # missed
    metrics.observe_finished(final(reason="abort", ttft=0.1))  # not counted
    metrics.observe_finished(final(ttft=None, gaps=()))  # no first token: ttft missed
    metrics.observe_rejected(ErrorKind.OVERLOADED)  # not counted
    assert (slo(registry, "ttft", True), slo(registry, "ttft", False)) == (3, 3)
    assert (slo(registry, "tpot", True), slo(registry, "tpot", False)) == (4, 2)
    assert (slo(registry, "both", True), slo(registry, "both", False)) == (2, 4)


def test_slo_only_for_configured_targets() -> None:
    registry = CollectorRegistry()
    metrics = RouterMetrics(registry, MODEL, ttft_slo_s=0.5)
    metrics.observe_finished(final())
    assert slo(registry, "ttft", True) == 1
    assert slo(registry, "tpot", True) + slo(registry, "tpot", False) == 0
    assert slo(registry, "both", True) + slo(registry, "both", False) == 0
    with pytest.raises(ValueError, match="tpot_slo_s"):
        RouterMetrics(CollectorRegistry(), MODEL, tpot_slo_s=0)


def test_exposition_parses_and_has_no_request_ids() -> None:
    registry = CollectorRegistry()
    metrics = RouterMetrics(registry, MODEL, ttft_slo_s=1.0, tpot_slo_s=0.1)
    metrics.observe_finished(final())
    metrics.observe_rejected(ErrorKind.INVALID)
    text = metrics_text(registry).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    expected = {
        *STAGE_METRICS.values(),
        "pdserve_time_per_output_token_seconds",
        "pdserve_inter_token_latency_seconds",
        "pdserve_requests",
        "pdserve_prompt_tokens",
        "pdserve_generation_tokens",
        "pdserve_request_retries",
        "pdserve_slo_requests",
        "pdserve_prompt_placements",
    }
    assert expected <= set(families)
    assert families["pdserve_requests"].type == "counter"
    assert families["pdserve_prefill_seconds"].type == "histogram"
    allowed = {"model", "role", "status", "slo", "met", "le", "reason", "pool", "worker",
               "where"}
    for family in families.values():
        if not family.name.startswith("pdserve_"):
            continue
        for sample in family.samples:
            assert set(sample.labels) <= allowed, sample
            assert sample.labels["model"] == MODEL
            assert sample.labels["role"] == "router"
    assert "request_id" not in text


def test_registries_are_independent() -> None:
    # Never the global default registry: two fresh registries never collide.
    first, second = CollectorRegistry(), CollectorRegistry()
    RouterMetrics(first, MODEL).observe_finished(final())
    RouterMetrics(second, MODEL)
    assert value(first, "pdserve_e2e_request_latency_seconds_count") == 1
    assert value(second, "pdserve_e2e_request_latency_seconds_count") == 0
