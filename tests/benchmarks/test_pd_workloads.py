"""benchmarks.pd's workloads and scoring (benchmarks/pd_workloads.py): the mix, Poisson
trace files pdserve bench replays, TTFT targets by prompt length, goodput."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.pd_workloads import (
    CHAT_PROMPT,
    LONG_PROMPT,
    Record,
    Slo,
    mix,
    score,
    write_trace,
)


def test_the_mix_is_chat_turns_and_long_prompts_each_its_own() -> None:
    recs = mix(400, seed=3)
    longs = [r for r in recs if r.input_length >= LONG_PROMPT[0]]
    assert 0.12 < len(longs) / len(recs) < 0.28
    assert all(CHAT_PROMPT[0] <= r.input_length <= CHAT_PROMPT[1]
               for r in recs if r not in longs)
    ids = [h for r in recs for h in r.hash_ids]
    assert len(ids) == len(set(ids))  # no two prompts share a block
    assert all(len(r.hash_ids) == -(-r.input_length // 512) for r in recs)
    assert mix(400, seed=3) == recs


def test_trace_files_are_poisson_or_all_at_once(tmp_path: Path) -> None:
    recs = [Record(100, 10, (i,)) for i in range(2000)]
    rows = [json.loads(line) for line in
            write_trace(recs, 4.0, tmp_path / "t.jsonl").read_text().splitlines()]
    assert rows[0] == {"timestamp": 0, "input_length": 100, "output_length": 10, "hash_ids": [0]}
    span_s = rows[-1]["timestamp"] / 1000
    assert 2000 / span_s == pytest.approx(4.0, rel=0.1)
    burst = write_trace(recs[:5], None, tmp_path / "b.jsonl").read_text().splitlines()
    assert {json.loads(line)["timestamp"] for line in burst} == {0}


def test_ttft_targets_by_prompt_length() -> None:
    slo = Slo(((128, 0.1), (1024, 1.0), (4096, 4.0)), 0.03)
    assert slo.ttft_s(10) == 0.1  # below the first point: its target
    assert slo.ttft_s(576) == pytest.approx(0.55)
    assert slo.ttft_s(2560) == pytest.approx(2.5)
    assert slo.ttft_s(8192) == pytest.approx(8.0)  # beyond: along the last two


def test_score_counts_each_stage_and_both() -> None:
    slo = Slo(((100, 0.5),), 0.05)
    result = {  # four requests: all good; TTFT late; TPOT slow; failed
        "input_lens": [100, 100, 100, 100], "output_lens": [11, 11, 11, 0],
        "ttfts": [0.2, 0.9, 0.2, 0.0], "latencies": [0.6, 1.3, 1.8, 0.0],
        "errors": ["", "", "", "boom"], "duration": 2.0, "median_ttft_ms": 200.0,
        "request_throughput": 1.5, "failed": 1,
    }
    got = score(result, slo)
    assert got["goodput"] == 0.5 and got["attainment"] == 0.25
    assert got["ttft_attainment"] == 0.5 and got["tpot_attainment"] == 0.5
    assert got["tpot_p99_ms"] == pytest.approx(160.0)
