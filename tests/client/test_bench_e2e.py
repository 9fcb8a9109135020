"""``pdserve bench`` end to end against the fake streaming server (loopback, port 0)."""

from __future__ import annotations

import json
import socket
from collections.abc import Callable
from pathlib import Path

import pytest

from pdserve.cli.main import main
from pdserve.client.sweep import describe_goodput, distserve_goodput
from tests.client.fake_server import FakeServer

Make = Callable[..., FakeServer]
PNG_MAGIC = b"\x89PNG"


def _bench(url: str, tiny_dir: Path, *flags: str) -> int:
    return main(["bench", "--base-url", url, "--tokenizer", str(tiny_dir), "--disable-tqdm",
                 *flags])


def test_single_run(fake_server: Make, tiny_dir: Path, tmp_path: Path,
                    capsys: pytest.CaptureFixture[str]) -> None:
    srv = fake_server(fail_every=5)
    result_file = tmp_path / "out.json"
    rc = _bench(srv.url, tiny_dir, "--num-prompts", "12", "--random-input-len", "40",
                "--random-output-len", "6", "--request-rate", "200", "--max-concurrency", "4",
                # SLOs no run misses (10 min): the attainment counts failures, not speed
                "--goodput", "ttft:600000", "tpot:600000", "--metric-percentiles", "50,99",
                "--scrape-metrics", "--result-filename", str(result_file),
                "--plot", str(tmp_path / "plots"))
    assert rc == 0
    printed = capsys.readouterr().out
    assert "============ Serving Benchmark Result ============" in printed
    assert "Server Stage Breakdown" in printed and "HTTP 429: server overloaded" in printed
    r = json.loads(result_file.read_text())
    assert (r["completed"], r["failed"]) == (10, 2)
    assert r["error_counts"] == {"HTTP 429: server overloaded": 2}
    assert r["model_id"] == "tiny-model" and r["max_model_len"] == 1024
    assert r["request_rate"] == 200.0 and r["max_concurrency"] == 4
    ok = [i for i, e in enumerate(r["errors"]) if not e]
    assert [r["input_lens"][i] for i in ok] == [40] * 10  # the server counted 40 tokens
    assert [r["output_lens"][i] for i in ok] == [6] * 10
    assert r["total_output_tokens"] == 60 and r["total_input_tokens"] == 400
    assert all(len(r["itls"][i]) == 5 for i in ok)
    assert r["request_goodput"] > 0 and r["slo_attainment"] == pytest.approx(10 / 12)
    assert {"p50_ttft_ms", "p99_tpot_ms", "mean_itl_ms", "std_e2el_ms"} <= r.keys()
    assert r["max_concurrent_requests"] <= 4
    # Every body asked for exact lengths (random dataset: ignore_eos on by default).
    assert all(b["ignore_eos"] and b["max_tokens"] == 6 for b in srv.bodies)
    stages = r["server_metrics"]
    assert stages["pdserve_prefill_seconds"]["count"] == 10
    assert stages["pdserve_prefill_seconds"]["mean_ms"] == pytest.approx(3.0)
    assert stages["pdserve_time_to_first_token_seconds"]["count"] == 10
    for name in ("latency_cdf.png", "timeline.png"):
        assert (tmp_path / "plots" / name).read_bytes()[:4] == PNG_MAGIC


def test_sweep_chat(fake_server: Make, tiny_dir: Path, tmp_path: Path,
                    capsys: pytest.CaptureFixture[str]) -> None:
    srv = fake_server()
    rc = _bench(srv.url, tiny_dir, "--endpoint", "/v1/chat/completions", "--num-prompts", "6",
                "--random-input-len", "16", "--random-output-len", "4",
                "--sweep-rates", "100,400", "--goodput", "e2el:10000", "--save-result",
                "--result-dir", str(tmp_path), "--plot", str(tmp_path / "plots"))
    assert rc == 0
    printed = capsys.readouterr().out
    assert "Request Rate Sweep" in printed
    (saved,) = tmp_path.glob("pdserve-sweep-tiny-model-*.json")
    obj = json.loads(saved.read_text())
    assert obj["backend"] == "openai-chat"
    assert [row["request_rate"] for row in obj["rows"]] == [100.0, 400.0]
    assert all(row["completed"] == 6 and row["slo_attainment_pct"] == 100.0
               for row in obj["rows"])
    assert all("messages" in b for b in srv.bodies) and len(srv.bodies) == 12
    for name in ("sweep.png", "latency_cdf.png", "timeline_100.0.png", "timeline_400.0.png"):
        assert (tmp_path / "plots" / name).read_bytes()[:4] == PNG_MAGIC


def test_sweep_reports_the_distserve_goodput_of_its_rows(
        fake_server: Make, tiny_dir: Path, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    # One request at a time, at least 20 ms to its first token: at 1000 req/s (10
    # requests within ~9 ms) the sixth and later wait at least 100 ms more than that,
    # past the 100 ms TTFT SLO, however fast the machine. What the lower rate attains
    # depends on the machine, so the test checks the sweep's report against its own
    # rows; tests/client/test_sweep.py checks the goodput's arithmetic.
    srv = fake_server(serial=True, ttft_s=0.02, token_gap_s=0.001)
    out = tmp_path / "sweep.json"
    rc = _bench(srv.url, tiny_dir, "--num-prompts", "10", "--random-input-len", "8",
                "--random-output-len", "4", "--sweep-rates", "10,1000",
                "--goodput", "ttft:100", "--result-filename", str(out),
                "--plot", str(tmp_path / "plots"))
    assert rc == 0
    saved = json.loads(out.read_text())
    assert [row["request_rate"] for row in saved["rows"]] == [10.0, 1000.0]
    assert saved["rows"][1]["slo_attainment"] <= 0.5
    g = saved["distserve_goodput"]
    assert g == distserve_goodput(saved["rows"], 0.9) and g["bound"] in ("below",
                                                                        "interpolated")
    assert describe_goodput(g) in capsys.readouterr().out
    assert (tmp_path / "plots" / "sweep.png").read_bytes()[:4] == PNG_MAGIC


def test_trace_replay(fake_server: Make, tiny_dir: Path, tmp_path: Path) -> None:
    srv = fake_server(max_model_len=256)
    trace = tmp_path / "mooncake.jsonl"
    rows = [{"timestamp": 100 * i, "input_length": 1024 + 512 * (i % 3),
             "output_length": 40 + i, "hash_ids": [0, 1, i + 2, i + 3]} for i in range(8)]
    trace.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = tmp_path / "trace.json"
    rc = _bench(srv.url, tiny_dir, "--dataset", "trace", "--dataset-path", str(trace),
                "--trace-start", "2", "--num-prompts", "5", "--trace-time-scale", "0.1",
                "--trace-length-scale", "0.125", "--result-filename", str(out))
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["completed"] == 5 and r["num_prompts"] == 5
    assert r["request_rate"] == pytest.approx(4 / 0.04)  # 5 arrivals over 40 ms
    assert r["output_lens"] == [round((40 + i) * 0.125) for i in range(2, 7)]
    assert r["input_lens"] == [min(round((1024 + 512 * (i % 3)) * 0.125), 256 - r["output_lens"][k])
                               for k, i in enumerate(range(2, 7))]
    prompts = [b["prompt"] for b in srv.bodies]
    shared = len(" ".join(prompts[0].split()[:128]))  # hash ids 0, 1: 2 blocks of 64 words
    assert len({p[:shared] for p in prompts}) == 1
    starts = r["start_times"]
    assert starts == sorted(starts) and starts[-1] >= 0.035


def test_failures_and_bad_input(fake_server: Make, tiny_dir: Path,
                                capsys: pytest.CaptureFixture[str]) -> None:
    srv = fake_server(fail_every=1)
    assert _bench(srv.url, tiny_dir, "--num-prompts", "3", "--random-input-len", "8",
                  "--random-output-len", "2") == 1
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    capsys.readouterr()
    assert _bench(dead, tiny_dir, "--num-prompts", "2") == 2
    assert "cannot list models" in capsys.readouterr().err
    assert _bench(srv.url, tiny_dir, "--goodput", "ttft") == 2
    assert _bench(srv.url, tiny_dir, "--dataset", "trace") == 2
    assert _bench(srv.url, tiny_dir, "--slo-attainment-target", "0") == 2
