"""``promtool``: exposition text of a router and a worker passes ``check metrics``;
the scrape config and the recording rules pass ``check config`` / ``check rules``;
and ``test rules`` evaluates the efficiency and vLLM-name rules on known series."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import yaml
from prometheus_client import generate_latest

from pdserve.engine.results import StepInfo
from tests.observability.conftest import (
    DEPLOY,
    RULES,
    router_registry,
    router_with_traffic,
    sample_stats,
    worker_registry,
)


def promtool(bins: tuple[str, str], *args: str, stdin: bytes | None = None,
             ) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run([bins[0], *args], input=stdin, capture_output=True, timeout=60)


def test_router_exposition_passes_lint(prometheus_bins: tuple[str, str]) -> None:
    # Fresh (labelled families empty) and after traffic (every family has series).
    for registry in (router_registry(), router_with_traffic()):
        done = promtool(prometheus_bins, "check", "metrics", stdin=generate_latest(registry))
        assert done.returncode == 0 and not done.stdout.strip(), done.stdout + done.stderr


def test_worker_exposition_passes_lint(prometheus_bins: tuple[str, str]) -> None:
    stats = sample_stats()
    stats.observe_step(StepInfo(num_seqs=2, num_tokens=2, num_decode=2, context_tokens=40,
                                seconds=0.01), 1e9, 1e8)
    done = promtool(prometheus_bins, "check", "metrics",
                    stdin=generate_latest(worker_registry(stats)))
    assert done.returncode == 0 and not done.stdout.strip(), done.stdout + done.stderr


def test_scrape_config_and_rules_are_valid(prometheus_bins: tuple[str, str],
                                           tmp_path: Path) -> None:
    shutil.copytree(DEPLOY / "prometheus", tmp_path / "prometheus")
    (tmp_path / "prometheus" / "targets" / "pdserve.json").write_text("[]\n")
    done = promtool(prometheus_bins, "check", "config",
                    str(tmp_path / "prometheus" / "prometheus.yml"))
    assert done.returncode == 0 and b"WARNING" not in done.stdout + done.stderr, done.stdout
    assert b"1 rule files found" in done.stdout
    done = promtool(prometheus_bins, "check", "rules", str(RULES))
    assert done.returncode == 0, done.stdout + done.stderr


def test_rules_evaluate_to_the_documented_values(prometheus_bins: tuple[str, str],
                                                 tmp_path: Path) -> None:
    w = 'model="m",role="prefill",worker="prefill-0"'
    d = 'model="m",role="decode",worker="decode-0"'
    # Per 15 s: 6e11 FLOPs and 7.5 busy seconds -> 4e10 FLOP/s over 0.5 busy = 8e10
    # FLOP/s while busy, 80% of a 1e11 peak. Bytes: 1.5e11 / 7.5 s = 2e10 B/s = 20%.
    tests = {"rule_files": [str(RULES)], "evaluation_interval": "15s", "tests": [{
        "interval": "15s",
        "input_series": [
            {"series": f"pdserve_model_flops_total{{{w}}}", "values": "0+6e11x10"},
            {"series": f"pdserve_memory_bytes_read_total{{{w}}}", "values": "0+1.5e11x10"},
            {"series": f"pdserve_engine_step_seconds_sum{{{w}}}", "values": "0+7.5x10"},
            {"series": f"pdserve_device_peak_flops{{{w}}}", "values": "1e11x10"},
            {"series": f"pdserve_device_peak_bytes_per_second{{{w}}}", "values": "1e11x10"},
            {"series": f"pdserve_prefix_cache_hits_total{{{d}}}", "values": "3x10"},
            {"series": f"pdserve_kv_cache_usage_ratio{{{d}}}", "values": "0.25x10"},
            {"series": f'pdserve_time_per_output_token_seconds_bucket{{{d},le="+Inf"}}',
             "values": "0+2x10"},
        ],
        "promql_expr_test": [
            _expect("worker:pdserve_mfu_ratio:rate1m", w, 0.8),
            _expect("worker:pdserve_mbu_ratio:rate1m", w, 0.2),
            _expect("worker:pdserve_engine_busy_ratio:rate1m", w, 0.5),
            _expect("pool:pdserve_mfu_ratio:rate1m", 'model="m",role="prefill"', 0.8),
            _expect("vllm:gpu_prefix_cache_hits_total", d + ',model_name="m"', 3),
            _expect("vllm:gpu_cache_usage_perc", d + ',model_name="m"', 0.25),
            _expect("vllm:time_per_output_token_seconds_bucket",
                    d + ',le="+Inf",model_name="m"', 16),
        ],
    }]}
    path = tmp_path / "rules_test.yml"
    path.write_text(yaml.safe_dump(tests))
    done = promtool(prometheus_bins, "test", "rules", str(path))
    assert done.returncode == 0, (done.stdout + done.stderr).decode()


def _expect(name: str, labels: str, value: float) -> dict[str, object]:
    return {"expr": name, "eval_time": "2m",
            "exp_samples": [{"labels": f"{name}{{{labels}}}", "value": value}]}
