"""Trace replay: Mooncake prefix sharing, Azure CSV parsing, scaling, clipping, window."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdserve.client.tokens import PromptTokenizer
from pdserve.client.trace import (
    TraceOptions,
    TraceRecord,
    load_azure_csv,
    load_mooncake_jsonl,
    load_trace,
    trace_requests,
)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _write_mooncake(path: Path, rows: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_mooncake_prefix_sharing(prompt_tok: PromptTokenizer, tmp_path: Path) -> None:
    path = _write_mooncake(tmp_path / "t.jsonl", [
        {"timestamp": 0, "input_length": 1300, "output_length": 20, "hash_ids": [0, 1, 2]},
        {"timestamp": 500, "input_length": 1200, "output_length": 10, "hash_ids": [0, 1, 7]},
        {"timestamp": 1500, "input_length": 600, "output_length": 5, "hash_ids": [0, 9]},
        {"timestamp": 2000, "input_length": 700, "output_length": 5, "hash_ids": [4, 5]},
    ])
    records = load_mooncake_jsonl(path)
    assert records[1] == TraceRecord(0.5, 1200, 10, (0, 1, 7))
    # Length scale 0.125: blocks of 64 tokens; time scale 0.1: 10x faster.
    opts = TraceOptions(time_scale=0.1, length_scale=0.125, max_model_len=4096)
    assert opts.scaled_block == 64
    reqs = trace_requests(prompt_tok, records, opts)
    ids = [prompt_tok.encode(r.prompt) for r in reqs]
    assert [len(i) for i in ids] == [r.prompt_len for r in reqs] == [162, 150, 75, 88]
    assert [r.expected_output_len for r in reqs] == [2, 1, 1, 1]
    assert [r.timestamp for r in reqs] == pytest.approx([0.0, 0.05, 0.15, 0.2])
    assert _common_prefix(ids[0], ids[1]) == 2 * 64  # hash ids 0, 1 shared
    assert _common_prefix(ids[0], ids[2]) == 64  # only hash id 0
    assert _common_prefix(ids[0], ids[3]) < 64  # nothing shared (chance agreement only)
    assert reqs[0].prompt[:len(reqs[1].prompt) // 2] == reqs[1].prompt[:len(reqs[1].prompt) // 2]
    # Same seed -> same prompts; another seed -> other blocks.
    again = trace_requests(prompt_tok, records, opts)
    assert [r.prompt for r in again] == [r.prompt for r in reqs]
    other = trace_requests(prompt_tok, records, TraceOptions(length_scale=0.125, seed=5))
    assert other[0].prompt != reqs[0].prompt


def test_clipping_and_window(prompt_tok: PromptTokenizer, tmp_path: Path) -> None:
    path = _write_mooncake(tmp_path / "t.jsonl", [
        {"timestamp": 1000 * i, "input_length": 3000, "output_length": 900,
         "hash_ids": list(range(6))} for i in range(5)])
    opts = TraceOptions(max_model_len=512, start=2, num_prompts=2)
    reqs = trace_requests(prompt_tok, load_trace(path), opts)
    assert len(reqs) == 2
    assert [r.timestamp for r in reqs] == [0.0, 1.0]
    # Output cut to 512 // 2, input to what is left.
    assert all(r.expected_output_len == 256 and r.prompt_len == 256 for r in reqs)
    assert reqs[0].prompt == reqs[1].prompt  # same hash ids, clipped from the end


def test_azure_csv(prompt_tok: PromptTokenizer, tmp_path: Path) -> None:
    path = tmp_path / "azure.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                    "2023-11-16 18:15:46.6805900,374,44\n"
                    "2023-11-16 18:15:50.9951690,396,109\n"
                    "2023-11-16 18:15:47.1000000,879,9\n")
    records = load_azure_csv(path)
    assert [r.input_len for r in records] == [374, 396, 879]
    assert records[1].timestamp_s - records[0].timestamp_s == pytest.approx(4.314579, abs=1e-6)
    reqs = trace_requests(prompt_tok, load_trace(path), TraceOptions(time_scale=0.5))
    # Sorted by arrival; times relative to the first, halved.
    assert [r.prompt_len for r in reqs] == [374, 879, 396]
    assert [r.timestamp for r in reqs] == pytest.approx([0.0, 0.20971, 2.157290], abs=1e-5)
    assert all(prompt_tok.count(r.prompt) == r.prompt_len for r in reqs)


def test_bad_inputs(tmp_path: Path) -> None:
    bad = tmp_path / "bad.csv"
    bad.write_text("time,in,out\n1,2,3\n")
    with pytest.raises(ValueError, match="ContextTokens"):
        load_azure_csv(bad)
    junk = tmp_path / "junk.jsonl"
    junk.write_text('{"timestamp": 0}\n')
    with pytest.raises(ValueError, match=r"junk\.jsonl:1"):
        load_mooncake_jsonl(junk)
    with pytest.raises(ValueError, match="length-scale"):
        TraceOptions(length_scale=0)


def test_real_mooncake_sample_loads(prompt_tok: PromptTokenizer) -> None:
    path = Path(__file__).resolve().parents[3] / "shared/data/mooncake/conversation_trace.jsonl"
    if not path.is_file():
        pytest.skip("shared Mooncake traces not present")
    records = load_trace(path)
    assert len(records) > 10_000
    reqs = trace_requests(prompt_tok, records, TraceOptions(
        time_scale=0.1, length_scale=0.05, max_model_len=2048, num_prompts=20))
    assert len(reqs) == 20 and all(prompt_tok.count(r.prompt) == r.prompt_len for r in reqs)
