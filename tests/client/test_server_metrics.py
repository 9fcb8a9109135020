"""Server stage breakdown: deltas of two /metrics scrapes, means and bucket quantiles."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from pdserve.client.server_metrics import (
    Histogram as Hist,
)
from pdserve.client.server_metrics import (
    format_breakdown,
    parse_histograms,
    placements,
    stage_breakdown,
)

BEFORE = """\
# HELP pdserve_prefill_seconds Prefill.
# TYPE pdserve_prefill_seconds histogram
pdserve_prefill_seconds_bucket{le="0.1",model="m",role="router"} 2.0
pdserve_prefill_seconds_bucket{le="0.2",model="m",role="router"} 3.0
pdserve_prefill_seconds_bucket{le="0.4",model="m",role="router"} 4.0
pdserve_prefill_seconds_bucket{le="+Inf",model="m",role="router"} 4.0
pdserve_prefill_seconds_count{model="m",role="router"} 4.0
pdserve_prefill_seconds_sum{model="m",role="router"} 0.5
"""

AFTER = """\
# HELP pdserve_prefill_seconds Prefill.
# TYPE pdserve_prefill_seconds histogram
pdserve_prefill_seconds_bucket{le="0.1",model="m",role="router"} 4.0
pdserve_prefill_seconds_bucket{le="0.2",model="m",role="router"} 9.0
pdserve_prefill_seconds_bucket{le="0.4",model="m",role="router"} 13.0
pdserve_prefill_seconds_bucket{le="+Inf",model="m",role="router"} 14.0
pdserve_prefill_seconds_count{model="m",role="router"} 14.0
pdserve_prefill_seconds_sum{model="m",role="router"} 2.5
# HELP pdserve_kv_transfer_seconds KV.
# TYPE pdserve_kv_transfer_seconds histogram
pdserve_kv_transfer_seconds_bucket{le="0.01",model="m",role="router"} 1.0
pdserve_kv_transfer_seconds_bucket{le="+Inf",model="m",role="router"} 1.0
pdserve_kv_transfer_seconds_count{model="m",role="router"} 1.0
pdserve_kv_transfer_seconds_sum{model="m",role="router"} 0.004
"""


def test_delta_by_hand() -> None:
    out = stage_breakdown(BEFORE, AFTER)
    assert list(out) == ["pdserve_prefill_seconds", "pdserve_kv_transfer_seconds"]
    pre = out["pdserve_prefill_seconds"]
    # Δ: count 10, sum 2.0 -> mean 200 ms; Δ cumulative buckets 2, 6, 9, 10.
    assert pre["count"] == 10
    assert pre["mean_ms"] == pytest.approx(200.0)
    # p50: rank 5 in (0.1, 0.2] holding ranks 2..6 -> 0.1 + 0.1 * 3/4 = 0.175 s.
    assert pre["p50_ms"] == pytest.approx(175.0)
    # p90: rank 9 in (0.2, 0.4] holding 6..9 -> 0.4 s.
    assert pre["p90_ms"] == pytest.approx(400.0)
    # p99: rank 9.9 falls in +Inf -> largest finite bound.
    assert pre["p99_ms"] == pytest.approx(400.0)
    # Missing before: counted from zero.
    kv = out["pdserve_kv_transfer_seconds"]
    assert kv["count"] == 1 and kv["mean_ms"] == pytest.approx(4.0)
    assert kv["p50_ms"] == pytest.approx(5.0)


def test_label_sets_are_summed_and_empty_runs() -> None:
    reg = CollectorRegistry()
    h = Histogram("pdserve_prefill_seconds", "p", ["worker"], registry=reg, buckets=(1.0,))
    h.labels(worker="a").observe(0.5)
    h.labels(worker="b").observe(2.0)
    text = generate_latest(reg).decode()
    hist = parse_histograms(text)["pdserve_prefill_seconds"]
    assert (hist.count, hist.sum) == (2.0, 2.5)
    assert hist.buckets == {1.0: 1.0, float("inf"): 2.0}
    same = stage_breakdown(text, text)["pdserve_prefill_seconds"]
    assert same == {"count": 0, "mean_ms": None, "p50_ms": None, "p90_ms": None,
                    "p99_ms": None}
    assert stage_breakdown(text, None) == {}
    assert Hist().quantile(0.5) is None


def test_format_breakdown() -> None:
    lines = format_breakdown(stage_breakdown(BEFORE, AFTER), {"ttft": 1.0})
    assert lines[0].split() == ["stage", "(ms)", "count", "mean", "p50", "p90", "p99", "client"]
    assert lines[1].split()[:3] == ["prefill", "10", "200.00"]


def test_placements_are_the_router_counter_s_delta_by_where() -> None:
    reg = CollectorRegistry()
    c = Counter("pdserve_prompt_placements", "p", ["where", "reason"], registry=reg)
    c.labels(where="remote", reason="protects_tpot").inc(3)
    c.labels(where="local", reason="faster_here").inc(1)
    c.labels(where="colocated", reason="colocated")  # a series at zero
    before = generate_latest(reg).decode()
    c.labels(where="remote", reason="protects_tpot").inc(2)
    c.labels(where="remote", reason="unmeasured").inc(1)
    c.labels(where="local", reason="within_ttft_slo").inc(4)
    after = generate_latest(reg).decode()
    assert placements(before, after) == {"local": 4, "remote": 3}
    assert placements(None, after) == {"local": 5, "remote": 6}
    assert placements(before, None) == {}
