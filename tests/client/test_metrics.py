"""Aggregation math against hand-computed values: percentiles, TPOT, goodput, errors."""

from __future__ import annotations

import pytest

from pdserve.client.metrics import (
    calculate_metrics,
    parse_goodput,
    parse_metric_names,
    parse_percentiles,
    percentile_label,
    stats_ms,
)
from pdserve.client.openai_stream import RequestOutput


def _ok(start: float, ttft: float, itl: list[float], n_in: int = 10) -> RequestOutput:
    return RequestOutput(success=True, prompt_len=n_in, output_tokens=len(itl) + 1, ttft=ttft,
                         itl=itl, latency=ttft + sum(itl), start_time=start)


def _failed(msg: str) -> RequestOutput:
    return RequestOutput(success=False, error=msg, prompt_len=10)


def test_stats_by_hand() -> None:
    s = stats_ms([0.001, 0.002, 0.003, 0.004], [50, 90, 99])
    assert s.mean == pytest.approx(2.5)
    assert s.median == pytest.approx(2.5)
    assert s.std == pytest.approx(1.118034, rel=1e-6)  # population std
    # Linear interpolation: rank p/100 * (n - 1) = 2.7 for p90 -> 3 + 0.7 * 1.
    assert dict(s.percentiles) == pytest.approx({50: 2.5, 90: 3.7, 99: 3.97})
    assert stats_ms([], [99]).mean == 0.0


def test_calculate_metrics_by_hand() -> None:
    outputs = [
        # ttft 100 ms, 3 gaps of 20 ms -> e2el 160 ms, TPOT 20 ms, 4 tokens
        _ok(0.0, 0.100, [0.02, 0.02, 0.02]),
        # ttft 300 ms, 1 gap of 100 ms -> e2el 400 ms, TPOT 100 ms, 2 tokens
        _ok(0.05, 0.300, [0.1]),
        # ttft 50 ms, one token: no TPOT; e2el 50 ms
        _ok(0.5, 0.050, []),
        _failed("HTTP 429: server overloaded"),
        _failed("HTTP 429: server overloaded"),
        _failed("TimeoutError: no answer within the request timeout"),
    ]
    m = calculate_metrics(outputs, 2.0, [50, 99], {"ttft": 200.0, "tpot": 50.0})
    assert (m.completed, m.failed) == (3, 3)
    assert (m.total_input, m.total_output) == (30, 7)
    assert m.request_throughput == pytest.approx(1.5)
    assert m.output_throughput == pytest.approx(3.5)
    assert m.total_token_throughput == pytest.approx(18.5)
    assert m.ttft.mean == pytest.approx(150.0)
    assert m.ttft.median == pytest.approx(100.0)
    assert m.tpot.mean == pytest.approx(60.0)  # (20 + 100) / 2; the 1-token request is out
    assert m.itl.mean == pytest.approx(40.0)  # (20 * 3 + 100) / 4
    assert m.e2el.mean == pytest.approx((160 + 400 + 50) / 3)
    # Good: request 1 (ttft 100, tpot 20) and request 3 (ttft 50, tpot counts as 0).
    assert m.request_goodput == pytest.approx(1.0)
    assert m.slo_attainment == pytest.approx(2 / 6)
    assert m.slo_attainment_by_metric == pytest.approx({"ttft": 2 / 6, "tpot": 2 / 6})
    assert m.error_counts == {"HTTP 429: server overloaded": 2,
                              "TimeoutError: no answer within the request timeout": 1}
    assert m.max_concurrent_requests == 2  # requests 1 and 2 overlap; 3 starts at 0.5
    assert m.max_output_tokens_per_s == 7.0  # every token within the first second
    no_slo = calculate_metrics(outputs, 2.0, [99])
    assert no_slo.request_goodput is None and no_slo.slo_attainment is None


def test_e2el_slo_is_inclusive() -> None:
    m = calculate_metrics([_ok(0.0, 0.1, [0.1])], 1.0, [99], {"e2el": 200.0})
    assert m.slo_attainment == 1.0


def test_parsers() -> None:
    assert parse_goodput(["ttft:500", "tpot:50", "e2el:1e4"]) == {
        "ttft": 500.0, "tpot": 50.0, "e2el": 10000.0}
    assert parse_goodput(None) == {}
    for bad in (["ttft"], ["itl:5"], ["ttft:-1"], ["ttft:abc"]):
        with pytest.raises(ValueError, match="goodput"):
            parse_goodput(bad)
    assert parse_percentiles("50, 90,99.9") == [50.0, 90.0, 99.9]
    with pytest.raises(ValueError):
        parse_percentiles("101")
    assert parse_metric_names("ttft,e2el") == ["ttft", "e2el"]
    with pytest.raises(ValueError):
        parse_metric_names("ttft,latency")
    assert percentile_label(99.0) == "99" and percentile_label(99.9) == "99.9"
