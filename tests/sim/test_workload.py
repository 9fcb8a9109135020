"""The simulated client sends what ``pdserve bench`` sends: the same lengths and
arrival times for the same flags, and prompts that share blocks as the dataset's do."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from pdserve.client.bench import BenchConfig
from pdserve.client.datasets import random_requests
from pdserve.client.request_runner import arrival_offsets
from pdserve.client.tokens import PromptTokenizer
from pdserve.sim.link import LINKS, Pipe
from pdserve.sim.workload import plan, shares_blocks


def test_random_lengths_and_times_are_the_benchs(tiny_model: Callable[[str], Path]) -> None:
    tok = PromptTokenizer.from_dir(tiny_model("llama-gqa"))
    cfg = BenchConfig("http://simulated", num_prompts=25, random_input_len=100,
                      random_output_len=30, random_range_ratio=0.4, random_prefix_len=20,
                      burstiness=0.5, seed=7)
    sent = random_requests(tok, 25, 100, 30, 0.4, 20, seed=7)
    planned = plan(cfg, 3.0, 2048)
    assert [p.prompt_len for p in planned] == [r.prompt_len for r in sent]
    assert [p.output_len for p in planned] == [r.expected_output_len for r in sent]
    assert [p.offset for p in planned] == arrival_offsets(25, 3.0, 0.5, 7)
    a, b = planned[0].block_hashes(16), planned[1].block_hashes(16)
    assert a[0] == b[0] and a[1] != b[1]  # the 20-token prefix fills one block of 16


def test_trace_prompts_share_what_their_hash_ids_share(tmp_path: Path) -> None:
    rows = [{"timestamp": 0, "input_length": 1200, "output_length": 10, "hash_ids": [0, 1, 2]},
            {"timestamp": 500, "input_length": 1100, "output_length": 5, "hash_ids": [0, 1, 9]},
            {"timestamp": 1500, "input_length": 700, "output_length": 8, "hash_ids": [4, 5]}]
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = BenchConfig("http://simulated", dataset="trace", dataset_path=str(path),
                      trace_time_scale=2.0)
    p = plan(cfg, float("inf"), 4096)
    assert [x.offset for x in p] == [0.0, 1.0, 3.0]  # ms on the trace's clock, scaled
    h0, h1, h2 = (x.block_hashes(16) for x in p)
    shared = 2 * 512 // 16  # two hash ids of 512 tokens
    assert h0[:shared] == h1[:shared] and h0[shared] != h1[shared]
    assert not set(h2) & set(h0)
    assert shares_blocks(p, 16) and not shares_blocks([p[0], p[2]], 16)
    assert not shares_blocks(p, 2048)  # no whole engine block within one hash id


def test_own_blocks_are_unique_and_shared_ones_common() -> None:
    cfg = BenchConfig("http://simulated", num_prompts=50, random_input_len=300)
    p = plan(cfg, 10.0, 4096)
    ids = [h for x in p for h in x.block_hashes(16)]
    assert len(ids) == len(set(ids)) and not shares_blocks(p, 16)
    cfg = BenchConfig("http://simulated", num_prompts=50, random_input_len=300,
                      random_prefix_len=40)
    p = plan(cfg, 10.0, 4096)
    assert len({x.block_hashes(16)[1] for x in p}) == 1  # blocks 0, 1 inside the prefix
    assert len({x.block_hashes(16)[2] for x in p}) == 50
    assert shares_blocks(p, 16) and not shares_blocks(p, 64)


def test_a_pipe_queues_its_sends() -> None:
    link = LINKS["tcp"]
    pipe = Pipe(link, block_bytes=1_000_000, ranks=2)
    first = pipe.send(0.0, 10)
    assert first == link.latency_s + 10e6 / (2 * link.bandwidth) + 10 * link.per_block_s
    assert pipe.send(0.0, 1) > first  # behind the first
    assert pipe.send(first + 1.0, 0) == first + 1.0 + link.latency_s  # idle again
