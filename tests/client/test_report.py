"""Result JSON field names (vLLM's), the printed block and the sweep table."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from pdserve.client.metrics import calculate_metrics
from pdserve.client.openai_stream import RequestOutput
from pdserve.client.report import (
    build_result,
    format_result,
    format_sweep,
    rate_field,
    save_json,
    sweep_row,
)

# Fields that vLLM's `bench serve` writes and tools read.
VLLM_FIELDS = {
    "duration", "completed", "failed", "total_input_tokens", "total_output_tokens",
    "request_throughput", "request_goodput", "output_throughput", "total_token_throughput",
    "max_output_tokens_per_s", "max_concurrent_requests",
    "input_lens", "output_lens", "ttfts", "itls", "errors", "start_times",
    "request_rate", "burstiness", "max_concurrency", "model_id", "num_prompts", "date",
    "mean_ttft_ms", "median_ttft_ms", "std_ttft_ms", "p99_ttft_ms",
    "mean_tpot_ms", "median_tpot_ms", "std_tpot_ms", "p99_tpot_ms",
    "mean_itl_ms", "median_itl_ms", "std_itl_ms", "p99_itl_ms",
    "mean_e2el_ms", "median_e2el_ms", "std_e2el_ms", "p99_e2el_ms",
}


def _result() -> dict[str, object]:
    outputs = [
        RequestOutput(success=True, prompt_len=12, output_tokens=3, ttft=0.1, itl=[0.01, 0.02],
                      latency=0.13, start_time=100.0),
        RequestOutput(success=False, prompt_len=12, error="HTTP 503: down", start_time=100.2),
    ]
    metrics = calculate_metrics(outputs, 1.0, [50.0, 99.0, 99.9], {"ttft": 500.0})
    setup = {"date": "20250101-000000", "model_id": "m", "num_prompts": 2,
             "request_rate": rate_field(math.inf), "burstiness": 1.0, "max_concurrency": 4}
    return build_result(metrics, outputs, 1.0, setup)


def test_result_fields(tmp_path: Path) -> None:
    result = _result()
    assert result.keys() >= VLLM_FIELDS
    assert result.keys() >= {"p50_ttft_ms", "p99.9_itl_ms", "error_counts", "slo_attainment"}
    assert result["request_rate"] == "inf"
    assert result["ttfts"] == [0.1, 0.0]
    assert result["itls"] == [[0.01, 0.02], []]
    assert result["output_lens"] == [3, 0]
    assert result["errors"] == ["", "HTTP 503: down"]
    assert result["error_counts"] == {"HTTP 503: down": 1}
    assert result["start_times"] == pytest.approx([0.0, 0.2])
    saved = json.loads(save_json(tmp_path / "r" / "out.json", result).read_text())
    assert saved["completed"] == 1 and saved["failed"] == 1


def test_printed_block() -> None:
    text = format_result(_result(), ["ttft", "tpot", "itl", "e2el"], [50.0, 99.9])
    lines = text.splitlines()
    assert lines[0] == "============ Serving Benchmark Result ============"
    assert lines[-1] == "=" * 50
    for needle in ("Successful requests:", "Failed requests:", "Maximum request concurrency:",
                   "Request goodput (req/s):", "Mean TTFT (ms):", "P99.9 ITL (ms):",
                   "Median E2EL (ms):", "Time per Output Token (excl. 1st token)",
                   "HTTP 503: down"):
        assert needle in text
    assert "Request rate configured" not in text  # inf is not printed


def test_sweep_table() -> None:
    rows = [sweep_row({**_result(), "request_rate": r}) for r in (1.0, 2.0)]
    assert "ttfts" not in rows[0] and rows[0]["slo_attainment_pct"] == 50.0
    table = format_sweep(rows).splitlines()
    assert "Request Rate Sweep" in table[0]
    assert table[1].split()[:3] == ["rate", "ok", "fail"]
    assert table[2].split()[0] == "1.0" and table[3].split()[0] == "2.0"
