"""What a benchmark hands back: the result JSON, the printed block, the sweep table.

This module owns the result's field names (vLLM's ``bench serve`` names, so tools
that read vLLM results read ours: ``completed``, ``total_input_tokens``,
``request_throughput``, ``mean_ttft_ms``, ``p99_ttft_ms``, ``ttfts``, ``itls``, ...),
the familiar "Serving Benchmark Result" block, and the one-row-per-rate sweep
summary. Fields beyond vLLM's: ``std_*_ms`` for every metric, ``latencies``,
``start_times`` (seconds after the run started), ``queue_times``,
``error_counts``, ``slo_attainment``, ``goodput_config`` and ``server_metrics``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pdserve.client.metrics import PERCENTILE_METRICS, BenchmarkMetrics, percentile_label
from pdserve.client.openai_stream import RequestOutput
from pdserve.client.server_metrics import format_breakdown

WIDTH = 50
_HEADERS = {
    "ttft": ("TTFT", "Time to First Token"),
    "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
    "itl": ("ITL", "Inter-token Latency"),
    "e2el": ("E2EL", "End-to-end Latency"),
}
# Sweep table: (column title, result field, format).
SWEEP_COLUMNS = (
    ("rate", "request_rate", "{}"),
    ("ok", "completed", "{}"),
    ("fail", "failed", "{}"),
    ("req/s", "request_throughput", "{:.2f}"),
    ("good/s", "request_goodput", "{:.2f}"),
    ("SLO %", "slo_attainment_pct", "{:.1f}"),
    ("out tok/s", "output_throughput", "{:.1f}"),
    ("TTFT mean", "mean_ttft_ms", "{:.1f}"),
    ("TTFT p99", "p99_ttft_ms", "{:.1f}"),
    ("TPOT mean", "mean_tpot_ms", "{:.1f}"),
    ("TPOT p99", "p99_tpot_ms", "{:.1f}"),
)


def rate_field(rate: float) -> float | str:
    """vLLM writes an unbounded rate as the string "inf"."""
    return "inf" if math.isinf(rate) else rate


def build_result(metrics: BenchmarkMetrics, outputs: Sequence[RequestOutput], duration: float,
                 setup: Mapping[str, Any]) -> dict[str, Any]:
    """The result JSON object: `setup` fields first, then figures, then per-request lists."""
    t0 = min((o.start_time for o in outputs), default=0.0)
    result: dict[str, Any] = dict(setup)
    result.update({
        "duration": duration,
        "completed": metrics.completed,
        "failed": metrics.failed,
        "total_input_tokens": metrics.total_input,
        "total_output_tokens": metrics.total_output,
        "request_throughput": metrics.request_throughput,
        "request_goodput": metrics.request_goodput,
        "slo_attainment": metrics.slo_attainment,
        "slo_attainment_by_metric": metrics.slo_attainment_by_metric,
        "output_throughput": metrics.output_throughput,
        "total_token_throughput": metrics.total_token_throughput,
        "max_output_tokens_per_s": metrics.max_output_tokens_per_s,
        "max_concurrent_requests": metrics.max_concurrent_requests,
    })
    for name in PERCENTILE_METRICS:
        stats = metrics.stats(name)
        result[f"mean_{name}_ms"] = stats.mean
        result[f"median_{name}_ms"] = stats.median
        result[f"std_{name}_ms"] = stats.std
        for p, value in stats.percentiles:
            result[f"p{percentile_label(p)}_{name}_ms"] = value
    result.update({
        "input_lens": [o.prompt_len for o in outputs],
        "output_lens": [o.output_tokens if o.success else 0 for o in outputs],
        "ttfts": [o.ttft if o.success else 0.0 for o in outputs],
        "itls": [o.itl if o.success else [] for o in outputs],
        "latencies": [o.latency if o.success else 0.0 for o in outputs],
        "start_times": [o.start_time - t0 for o in outputs],
        "queue_times": [o.queue_time for o in outputs],
        "errors": [o.error for o in outputs],
        "error_counts": metrics.error_counts,
    })
    return result


def _line(label: str, value: Any, fmt: str = "{}") -> str:
    return f"{label:<40} {fmt.format(value):<10}"


def _section(title: str, fill: str = "-") -> str:
    return f" {title} ".center(WIDTH, fill) if title else fill * WIDTH


def format_result(result: Mapping[str, Any], metric_names: Sequence[str],
                  percentiles: Sequence[float]) -> str:
    """The printed block for one run."""
    lines = [_section("Serving Benchmark Result", "="),
             _line("Successful requests:", result["completed"]),
             _line("Failed requests:", result["failed"])]
    if result.get("max_concurrency") is not None:
        lines.append(_line("Maximum request concurrency:", result["max_concurrency"]))
    if result.get("request_rate") not in (None, "inf"):
        lines.append(_line("Request rate configured (RPS):", result["request_rate"], "{:.2f}"))
    lines += [_line("Benchmark duration (s):", result["duration"], "{:.2f}"),
              _line("Total input tokens:", result["total_input_tokens"]),
              _line("Total generated tokens:", result["total_output_tokens"]),
              _line("Request throughput (req/s):", result["request_throughput"], "{:.2f}")]
    if result.get("request_goodput") is not None:
        lines.append(_line("Request goodput (req/s):", result["request_goodput"], "{:.2f}"))
        lines.append(_line("SLO attainment (%):", 100.0 * result["slo_attainment"], "{:.2f}"))
    lines += [
        _line("Output token throughput (tok/s):", result["output_throughput"], "{:.2f}"),
        _line("Peak output token throughput (tok/s):", result["max_output_tokens_per_s"],
              "{:.2f}"),
        _line("Peak concurrent requests:", result["max_concurrent_requests"]),
        _line("Total token throughput (tok/s):", result["total_token_throughput"], "{:.2f}"),
    ]
    for name in metric_names:
        short, header = _HEADERS[name]
        lines.append(_section(header))
        lines.append(_line(f"Mean {short} (ms):", result[f"mean_{name}_ms"], "{:.2f}"))
        lines.append(_line(f"Median {short} (ms):", result[f"median_{name}_ms"], "{:.2f}"))
        lines.append(_line(f"Std {short} (ms):", result[f"std_{name}_ms"], "{:.2f}"))
        for p in percentiles:
            label = percentile_label(p)
            lines.append(_line(f"P{label} {short} (ms):", result[f"p{label}_{name}_ms"],
                               "{:.2f}"))
    if result.get("error_counts"):
        lines.append(_section("Errors"))
        for message, count in result["error_counts"].items():
            lines.append(f"{count:>6}  {message}")
    if result.get("server_metrics"):
        lines.append(_section("Server Stage Breakdown"))
        client = {name: result[f"mean_{name}_ms"] for name in ("ttft", "tpot", "e2el")}
        lines += format_breakdown(result["server_metrics"], client)
    if result.get("server_placements"):
        lines.append(_line("Prompts computed (where: attempts):", ", ".join(
            f"{where} {n}" for where, n in result["server_placements"].items())))
    lines.append(_section("", "="))
    return "\n".join(lines)


def sweep_row(result: Mapping[str, Any]) -> dict[str, Any]:
    """A sweep row: the run's scalar fields (per-request lists dropped)."""
    row = {k: v for k, v in result.items() if not isinstance(v, list)}
    attained = result.get("slo_attainment")
    row["slo_attainment_pct"] = None if attained is None else 100.0 * attained
    return row


def format_sweep(rows: Sequence[Mapping[str, Any]]) -> str:
    """The sweep summary table, one line per request rate."""
    def cell(row: Mapping[str, Any], key: str, fmt: str) -> str:
        value = row.get(key)
        return "-" if value is None else fmt.format(value)

    widths = [max(len(title), *(len(cell(r, key, fmt)) for r in rows)) + 2
              for title, key, fmt in SWEEP_COLUMNS]
    header = "".join(t.rjust(w) for (t, _, _), w in zip(SWEEP_COLUMNS, widths, strict=True))
    body = ["".join(cell(r, key, fmt).rjust(w)
                    for (_, key, fmt), w in zip(SWEEP_COLUMNS, widths, strict=True))
            for r in rows]
    title = " Request Rate Sweep (latencies in ms) ".center(len(header), "=")
    return "\n".join([title, header, *body, "=" * len(header)])


def save_json(path: str | Path, obj: Mapping[str, Any]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")
    return path
