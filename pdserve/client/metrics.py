"""Turning per-request outputs into benchmark figures.

This module owns the definitions (the same as vLLM's ``bench serve`` so numbers
compare):

* TTFT: send -> first text chunk. E2EL: send -> stream end.
* TPOT of a request: ``(e2el - ttft) / (output_tokens - 1)``, the first token
  excluded; requests with one output token have no TPOT (left out of the TPOT
  statistics, counted as 0 for goodput).
* ITL: every gap between consecutive text chunks, all requests pooled.
* Percentiles: linear interpolation between closest ranks (``numpy.percentile``);
  std is the population std. Empty lists give 0, as in vLLM.
* Throughputs divide by the run's duration; only completed requests count tokens.
* Goodput: completed requests meeting *every* given SLO (``ttft``, ``tpot``,
  ``e2el`` in ms, value >= measured), per second. SLO attainment: that count over
  all requests sent (a failed request missed its SLO).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from pdserve.client.openai_stream import RequestOutput

PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el")
GOODPUT_METRICS = ("ttft", "tpot", "e2el")


def parse_goodput(pairs: Sequence[str] | None) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` -> ``{"ttft": 500.0, "tpot": 50.0}`` (ms)."""
    slo: dict[str, float] = {}
    for pair in pairs or ():
        name, sep, value = pair.partition(":")
        try:
            ms = float(value)
        except ValueError:
            ms = math.nan
        if not sep or math.isnan(ms):
            raise ValueError(f"--goodput takes KEY:MS pairs (e.g. ttft:500), got {pair!r}")
        if name not in GOODPUT_METRICS:
            raise ValueError(f"--goodput metric must be one of {GOODPUT_METRICS}, got {name!r}")
        if ms < 0:
            raise ValueError(f"--goodput {name}: the target must be >= 0 ms, got {ms}")
        slo[name] = ms
    return slo


def parse_percentiles(text: str) -> list[float]:
    """``"50,90,99"`` -> ``[50.0, 90.0, 99.0]`` (each in [0, 100])."""
    try:
        values = [float(p) for p in text.split(",") if p.strip()]
    except ValueError as exc:
        raise ValueError(f"--metric-percentiles: numbers separated by commas, got {text!r}") from exc
    if not values or any(not 0 <= p <= 100 for p in values):
        raise ValueError(f"--metric-percentiles must be in [0, 100], got {text!r}")
    return values


def parse_metric_names(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in PERCENTILE_METRICS]
    if bad or not names:
        raise ValueError(f"--percentile-metrics must name some of {PERCENTILE_METRICS}, "
                         f"got {text!r}")
    return names


def percentile_label(p: float) -> str:
    """99.0 -> "99", 99.9 -> "99.9" (the ``p{label}_ttft_ms`` field names)."""
    return str(int(p)) if int(p) == p else str(p)


@dataclass(frozen=True)
class Stats:
    """Summary of one latency metric, in milliseconds."""

    mean: float
    median: float
    std: float
    percentiles: tuple[tuple[float, float], ...]  # (p, value)


def stats_ms(values_s: Sequence[float], percentiles: Sequence[float]) -> Stats:
    arr = np.asarray(values_s if len(values_s) else [0.0], dtype=np.float64) * 1000.0
    return Stats(float(arr.mean()), float(np.median(arr)), float(arr.std()),
                 tuple((p, float(np.percentile(arr, p))) for p in percentiles))


def request_tpot(out: RequestOutput) -> float | None:
    """Seconds per output token after the first; None with fewer than 2 tokens."""
    if out.output_tokens < 2:
        return None
    return (out.latency - out.ttft) / (out.output_tokens - 1)


def meets_slo(out: RequestOutput, slo_ms: Mapping[str, float]) -> dict[str, bool]:
    """Per SLO metric: did this completed request meet it."""
    measured = {"ttft": out.ttft, "tpot": request_tpot(out) or 0.0, "e2el": out.latency}
    return {name: measured[name] * 1000.0 <= target for name, target in slo_ms.items()}


@dataclass(frozen=True)
class BenchmarkMetrics:
    """Aggregate figures of one run; field names follow vLLM's result JSON."""

    completed: int
    failed: int
    total_input: int
    total_output: int
    request_throughput: float
    request_goodput: float | None  # None when no --goodput was given
    slo_attainment: float | None  # good / all requests sent
    slo_attainment_by_metric: dict[str, float]
    output_throughput: float
    total_token_throughput: float
    ttft: Stats
    tpot: Stats
    itl: Stats
    e2el: Stats
    max_output_tokens_per_s: float
    max_concurrent_requests: int
    error_counts: dict[str, int] = field(default_factory=dict)

    def stats(self, name: str) -> Stats:
        return {"ttft": self.ttft, "tpot": self.tpot, "itl": self.itl, "e2el": self.e2el}[name]


def _peaks(done: Sequence[RequestOutput]) -> tuple[float, int]:
    """(most output tokens in any 1 s bucket, most requests in flight at once)."""
    if not done:
        return 0.0, 0
    t0 = min(o.start_time for o in done)
    buckets: Counter[int] = Counter()
    for o in done:
        t = o.start_time + o.ttft
        buckets[int(t - t0)] += 1
        for gap in o.itl:
            t += gap
            buckets[int(t - t0)] += 1
    # Sweep over [start, end) intervals: an end at the same instant as a start comes first.
    events = sorted([(o.start_time, 1) for o in done] +
                    [(o.start_time + o.latency, -1) for o in done])
    level = peak = 0
    for _, step in events:
        level += step
        peak = max(peak, level)
    return float(max(buckets.values())), peak


def calculate_metrics(outputs: Sequence[RequestOutput], duration_s: float,
                      percentiles: Sequence[float],
                      slo_ms: Mapping[str, float] | None = None) -> BenchmarkMetrics:
    """Figures for one run of `outputs` that took `duration_s` seconds."""
    done = [o for o in outputs if o.success]
    failed = [o for o in outputs if not o.success]
    dur = max(duration_s, 1e-9)
    total_in = sum(o.prompt_len for o in done)
    total_out = sum(o.output_tokens for o in done)
    tpots = [t for t in (request_tpot(o) for o in done) if t is not None]
    itls = [gap for o in done for gap in o.itl]
    good = 0
    per_metric: Counter[str] = Counter()
    if slo_ms:
        for o in done:
            met = meets_slo(o, slo_ms)
            per_metric.update(name for name, ok in met.items() if ok)
            good += all(met.values())
    n_all = max(len(outputs), 1)
    peak_tok, peak_conc = _peaks(done)
    return BenchmarkMetrics(
        completed=len(done), failed=len(failed), total_input=total_in, total_output=total_out,
        request_throughput=len(done) / dur,
        request_goodput=good / dur if slo_ms else None,
        slo_attainment=good / n_all if slo_ms else None,
        slo_attainment_by_metric={name: per_metric[name] / n_all for name in slo_ms or {}},
        output_throughput=total_out / dur,
        total_token_throughput=(total_in + total_out) / dur,
        ttft=stats_ms([o.ttft for o in done], percentiles),
        tpot=stats_ms(tpots, percentiles),
        itl=stats_ms(itls, percentiles),
        e2el=stats_ms([o.latency for o in done], percentiles),
        max_output_tokens_per_s=peak_tok, max_concurrent_requests=peak_conc,
        error_counts=dict(Counter(o.error for o in failed).most_common()),
    )
