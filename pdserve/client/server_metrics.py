"""The server-side stage breakdown of a run, from two scrapes of ``/metrics``.

This module owns reading Prometheus histograms from exposition text (parsed with
``prometheus_client.parser``), subtracting the scrape taken before the run from
the one taken after, and summarising each stage over the run:

* mean = Δsum / Δcount;
* p50 / p90 / p99 from the Δ cumulative buckets, interpolating linearly inside
  the bucket that holds the rank (Prometheus' ``histogram_quantile`` rule; a rank
  in the ``+Inf`` bucket reports the largest finite bound).

Series of one histogram with different labels (model, role, worker) are summed:
the breakdown is for the whole deployment. Times are reported in milliseconds.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

# Request stages in the order a request passes them (see ARCHITECTURE.md, Metrics).
STAGE_HISTOGRAMS = (
    "pdserve_request_queue_seconds",
    "pdserve_prefill_queue_seconds",
    "pdserve_prefill_seconds",
    "pdserve_kv_transfer_seconds",
    "pdserve_decode_queue_seconds",
    "pdserve_time_to_first_token_seconds",
    "pdserve_time_per_output_token_seconds",
    "pdserve_e2e_request_latency_seconds",
)
# Server histograms with a client-side counterpart, for side-by-side printing.
CLIENT_COUNTERPART = {
    "pdserve_time_to_first_token_seconds": "ttft",
    "pdserve_time_per_output_token_seconds": "tpot",
    "pdserve_e2e_request_latency_seconds": "e2el",
}
QUANTILES = (0.5, 0.9, 0.99)
# The router's counter of where each attempt's prompt was computed (its ``where`` label:
# remote, local, colocated).
PLACEMENTS = "pdserve_prompt_placements"


@dataclass
class Histogram:
    """One histogram, all label sets summed: cumulative counts per upper bound."""

    sum: float = 0.0
    count: float = 0.0
    buckets: dict[float, float] = field(default_factory=dict)  # le -> cumulative count

    def minus(self, before: Histogram) -> Histogram:
        return Histogram(self.sum - before.sum, self.count - before.count,
                         {le: c - before.buckets.get(le, 0.0) for le, c in self.buckets.items()})

    def quantile(self, q: float) -> float | None:
        """Seconds below which a fraction `q` of observations fall (None if empty)."""
        bounds = sorted(self.buckets)
        if not bounds:
            return None
        total = self.buckets[bounds[-1]]
        if total <= 0:
            return None
        rank = q * total
        prev_le, prev_cum = 0.0, 0.0
        for le in bounds:
            cum = self.buckets[le]
            if cum >= rank:
                if math.isinf(le):
                    return prev_le
                if cum == prev_cum:
                    return le
                return prev_le + (le - prev_le) * (rank - prev_cum) / (cum - prev_cum)
            prev_le, prev_cum = le, cum
        return prev_le


def parse_histograms(text: str, names: Iterable[str] = STAGE_HISTOGRAMS) -> dict[str, Histogram]:
    """The histograms `names` found in exposition `text` (label sets summed)."""
    wanted = set(names)
    out: dict[str, Histogram] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            base, _, suffix = sample.name.rpartition("_")
            if base not in wanted or suffix not in ("bucket", "sum", "count"):
                continue
            hist = out.setdefault(base, Histogram())
            if suffix == "sum":
                hist.sum += sample.value
            elif suffix == "count":
                hist.count += sample.value
            else:
                le = float(sample.labels["le"])
                hist.buckets[le] = hist.buckets.get(le, 0.0) + sample.value
    return out


def stage_breakdown(before_text: str | None, after_text: str | None,
                    names: Iterable[str] = STAGE_HISTOGRAMS) -> dict[str, dict[str, Any]]:
    """Per histogram present after the run: count, mean and quantiles (ms) over the run.

    A histogram missing from `before_text` (first request ever, or no scrape) counts
    from zero.
    """
    if after_text is None:
        return {}
    names = tuple(names)
    before = parse_histograms(before_text, names) if before_text else {}
    after = parse_histograms(after_text, names)
    result: dict[str, dict[str, Any]] = {}
    for name in names:
        if name not in after:
            continue
        delta = after[name].minus(before.get(name, Histogram()))
        row: dict[str, Any] = {"count": round(delta.count),
                               "mean_ms": delta.sum / delta.count * 1000.0
                               if delta.count > 0 else None}
        for q in QUANTILES:
            value = delta.quantile(q)
            row[f"p{round(q * 100)}_ms"] = None if value is None else value * 1000.0
        result[name] = row
    return result


def placements(before_text: str | None, after_text: str | None) -> dict[str, int]:
    """Attempts admitted over the run by where their prompt was computed (the router's
    ``pdserve_prompt_placements`` counter, reasons summed); places with none left out."""
    def counts(text: str | None) -> dict[str, float]:
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(text or ""):
            for sample in family.samples:
                if sample.name == f"{PLACEMENTS}_total":
                    where = sample.labels["where"]
                    out[where] = out.get(where, 0.0) + sample.value
        return out

    if after_text is None:
        return {}
    before, after = counts(before_text), counts(after_text)
    delta = {where: round(n - before.get(where, 0.0)) for where, n in after.items()}
    return {where: n for where, n in sorted(delta.items()) if n}


def format_breakdown(breakdown: Mapping[str, Mapping[str, Any]],
                     client: Mapping[str, float] | None = None) -> list[str]:
    """Lines of the printed "Server Stage Breakdown" section.

    `client` maps "ttft"/"tpot"/"e2el" to the client-side mean (ms), shown beside
    the matching server histogram.
    """
    def ms(v: Any) -> str:
        return "-" if v is None else f"{v:.2f}"

    lines = [f"{'stage (ms)':<28}{'count':>7}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}"
             f"{'client':>10}"]
    for name, row in breakdown.items():
        short = name.removeprefix("pdserve_").removesuffix("_seconds")
        side = (client or {}).get(CLIENT_COUNTERPART.get(name, ""))
        lines.append(f"{short:<28}{row['count']:>7}{ms(row['mean_ms']):>10}"
                     f"{ms(row['p50_ms']):>10}{ms(row['p90_ms']):>10}{ms(row['p99_ms']):>10}"
                     f"{ms(side):>10}")
    return lines
