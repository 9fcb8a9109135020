"""The workloads and the scoring of ``benchmarks.pd`` (where disaggregation pays).

Workloads are trace files in Mooncake's JSONL shape (``timestamp`` ms,
``input_length``, ``output_length``, ``hash_ids``), replayed by ``pdserve bench
--dataset trace`` exactly as a user replays a trace:

* ``mix``: short chat turns (prompts of ``CHAT_PROMPT`` tokens, answers of
  ``CHAT_OUTPUT``) mixed with long prompts (``LONG_PROMPT`` tokens, short answers of
  ``LONG_OUTPUT``: summaries, RAG, agents' tool results), a ``LONG_SHARE`` of the
  requests; every prompt its own (unique hash ids);
* ``mooncake``: a window of the Mooncake conversation trace (its lengths and prefix
  sharing).

Arrivals are Poisson at a given rate (``retime``); with every timestamp 0 the whole
set arrives at once (a closed-loop run, for capacity, limits it by concurrency).

Scoring (``score``): a request meets its SLOs when it completed, its TTFT is within
the TTFT target for its prompt length, and its TPOT (time per output token after the
first) within the TPOT target. Goodput = requests meeting both per second of the run;
attainment is also given per stage (TTFT alone, TPOT alone).
"""

from __future__ import annotations

import bisect
import json
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CHAT_PROMPT = (64, 256)
CHAT_OUTPUT = (64, 192)
LONG_PROMPT = (1024, 4096)
LONG_OUTPUT = (16, 48)
LONG_SHARE = 0.2
BLOCK = 512  # tokens per Mooncake hash id


@dataclass(frozen=True)
class Record:
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def mix(n: int, seed: int = 0) -> list[Record]:
    """``n`` requests of the chat + long-prompt mix, each prompt its own."""
    rng = random.Random(seed)
    out, next_id = [], 0
    for _ in range(n):
        long = rng.random() < LONG_SHARE
        prompt = rng.randint(*(LONG_PROMPT if long else CHAT_PROMPT))
        blocks = -(-prompt // BLOCK)
        out.append(Record(prompt, rng.randint(*(LONG_OUTPUT if long else CHAT_OUTPUT)),
                          tuple(range(next_id, next_id + blocks))))
        next_id += blocks
    return out


def mooncake(path: Path, n: int, start: int = 1000) -> list[Record]:
    """``n`` records of a Mooncake trace from line ``start`` (their own times dropped)."""
    with path.open() as f:
        rows = [json.loads(line) for i, line in enumerate(f) if start <= i < start + n]
    return [Record(r["input_length"], r["output_length"], tuple(r["hash_ids"])) for r in rows]


def write_trace(records: Sequence[Record], rate: float | None, path: Path,
                seed: int = 0) -> Path:
    """The records as a trace file: Poisson arrivals at ``rate`` req/s (None: all at
    once)."""
    rng, t = random.Random(seed), 0.0
    with path.open("w") as f:
        for r in records:
            f.write(json.dumps({"timestamp": round(t * 1000), "input_length": r.input_length,
                                "output_length": r.output_length,
                                "hash_ids": list(r.hash_ids)}) + "\n")
            if rate is not None:
                t += rng.expovariate(rate)
    return path


@dataclass(frozen=True)
class Slo:
    """TTFT target by prompt length (``ttft_points``: (tokens, seconds), linear
    between them and beyond the last two) and one TPOT target."""

    ttft_points: tuple[tuple[int, float], ...]
    tpot_s: float

    def ttft_s(self, prompt_tokens: int) -> float:
        pts = self.ttft_points
        if len(pts) == 1 or prompt_tokens <= pts[0][0]:
            return pts[0][1]
        i = min(bisect.bisect_left([n for n, _ in pts], prompt_tokens), len(pts) - 1)
        (n0, t0), (n1, t1) = pts[i - 1], pts[i]
        return t0 + (t1 - t0) * (prompt_tokens - n0) / (n1 - n0)

    def describe(self) -> str:
        ttft = ", ".join(f"{n}: {1e3 * t:.0f}" for n, t in self.ttft_points)
        return f"TTFT (prompt tokens: ms) {ttft}; TPOT {1e3 * self.tpot_s:.1f} ms"


def score(result: dict[str, Any], slo: Slo) -> dict[str, float]:
    """Goodput and attainment of one ``pdserve bench`` result (its per-request lists)."""
    n = len(result["ttfts"])
    ttft_ok = tpot_ok = both = 0
    tpots = []
    for prompt, out, ttft, lat, err in zip(result["input_lens"], result["output_lens"],
                                           result["ttfts"], result["latencies"],
                                           result["errors"], strict=True):
        if err:
            continue
        tpot = (lat - ttft) / (out - 1) if out > 1 else 0.0
        tpots.append(tpot)
        a, b = ttft <= slo.ttft_s(prompt), tpot <= slo.tpot_s
        ttft_ok, tpot_ok, both = ttft_ok + a, tpot_ok + b, both + (a and b)
    tpots.sort()
    p99 = tpots[min(len(tpots) - 1, math.ceil(0.99 * len(tpots)) - 1)] if tpots else math.nan
    return {"goodput": both / result["duration"], "attainment": both / max(1, n),
            "ttft_attainment": ttft_ok / max(1, n), "tpot_attainment": tpot_ok / max(1, n),
            "tpot_p99_ms": 1e3 * p99, "ttft_p50_ms": result["median_ttft_ms"],
            "throughput": result["request_throughput"], "failed": result["failed"]}
