"""Trace replay: Azure LLM inference CSV and Mooncake JSONL, scaled to the machine.

This module owns reading the two trace formats into `TraceRecord`s, taking a
window of them, scaling their times and lengths, clipping to the model's context
and building prompts whose prefix sharing matches the trace.

Formats:

* Azure (``.csv``): columns ``TIMESTAMP`` (``2023-11-16 18:15:46.6805900`` or
  seconds), ``ContextTokens``, ``GeneratedTokens``. No prefix information: every
  prompt is its own random text.
* Mooncake (``.jsonl``): ``timestamp`` (ms from start), ``input_length``,
  ``output_length``, ``hash_ids`` (one id per 512-token prompt block; requests
  whose leading hash ids agree share that prompt prefix).

Scaling (`TraceOptions`):

* times: request i arrives at ``(t_i - t_first) * time_scale`` seconds after the
  run starts — ``time_scale=0.1`` replays ten times faster, ``2`` at half speed;
* lengths: input and output lengths and the hash block size (512) are multiplied
  by ``length_scale`` (rounded, at least 1), so a shared hash id still means a
  shared block, only a shorter one;
* clipping: the output is cut to ``max_model_len // 2``, then the input to
  ``max_model_len - output``, cutting from the end so shared prefixes stay shared.

Prompt layout for a Mooncake request with hash ids [h0, h1, h2] (B = scaled block)::

    | block(h0): B tokens | block(h1): B tokens | block(h2)[:rest] | own tail? |

``block(h)`` is a deterministic run of stable word tokens seeded by (seed, h), so
equal hash ids give equal token runs and equal text; the tail (only when the
scaled input is longer than the blocks) is unique to the request.
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import numpy as np

from pdserve.client.datasets import SampleRequest
from pdserve.client.tokens import PromptTokenizer

MOONCAKE_BLOCK_TOKENS = 512
FORMATS = ("auto", "mooncake", "azure")


@dataclass(frozen=True)
class TraceRecord:
    """One request of a trace, as read (unscaled)."""

    timestamp_s: float  # arrival, seconds on the trace's own clock
    input_len: int
    output_len: int
    hash_ids: tuple[int, ...] = ()  # Mooncake prefix blocks; () for Azure


@dataclass(frozen=True)
class TraceOptions:
    """How a trace window is replayed; validated on construction."""

    time_scale: float = 1.0  # arrival gaps are multiplied by this (0.1 = 10x faster)
    length_scale: float = 1.0  # input/output lengths and block size multiplied by this
    max_model_len: int = 2048  # input + output clipped to this
    start: int = 0  # index of the first trace request replayed
    num_prompts: int | None = None  # how many (None: to the end)
    block_tokens: int = MOONCAKE_BLOCK_TOKENS  # the trace's tokens per hash id
    seed: int = 0

    def __post_init__(self) -> None:
        if self.time_scale < 0:
            raise ValueError(f"--trace-time-scale must be >= 0, got {self.time_scale}")
        if self.length_scale <= 0:
            raise ValueError(f"--trace-length-scale must be > 0, got {self.length_scale}")
        if self.max_model_len < 2:
            raise ValueError(f"--max-model-len must be >= 2, got {self.max_model_len}")
        if self.start < 0 or (self.num_prompts is not None and self.num_prompts < 1):
            raise ValueError("--trace-start must be >= 0 and --num-prompts >= 1")

    @property
    def scaled_block(self) -> int:
        return max(1, round(self.block_tokens * self.length_scale))

    def scaled_lengths(self, record: TraceRecord) -> tuple[int, int]:
        """(input, output) after scaling and clipping to the context."""
        n_in = max(1, round(record.input_len * self.length_scale))
        n_out = max(1, round(record.output_len * self.length_scale))
        n_out = min(n_out, self.max_model_len // 2)
        return min(n_in, self.max_model_len - n_out), n_out


def _parse_time(value: str) -> float:
    """Seconds from a number or an ISO-like date (fractions past microseconds cut)."""
    value = value.strip()
    try:
        return float(value)
    except ValueError:
        pass
    main, _, frac = value.partition(".")
    stamp = datetime.fromisoformat(main.replace("T", " "))
    return stamp.timestamp() + (float(f"0.{frac[:6]}") if frac else 0.0)


def load_azure_csv(path: str | Path) -> list[TraceRecord]:
    """Records of an Azure LLM inference trace CSV, in file order."""
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        need = {"TIMESTAMP", "ContextTokens", "GeneratedTokens"}
        if not need.issubset(reader.fieldnames or ()):
            raise ValueError(f"{path}: Azure trace needs columns {sorted(need)}, "
                             f"found {reader.fieldnames}")
        return [TraceRecord(_parse_time(row["TIMESTAMP"]), int(row["ContextTokens"]),
                            int(row["GeneratedTokens"])) for row in reader]


def load_mooncake_jsonl(path: str | Path) -> list[TraceRecord]:
    """Records of a Mooncake trace (timestamp in ms), in file order."""
    out = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                out.append(TraceRecord(float(obj["timestamp"]) / 1000.0,
                                       int(obj["input_length"]), int(obj["output_length"]),
                                       tuple(int(h) for h in obj.get("hash_ids") or ())))
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{lineno}: not a Mooncake trace line ({exc})") from exc
    return out


def load_trace(path: str | Path, fmt: str = "auto") -> list[TraceRecord]:
    """Read a trace; ``auto`` picks Azure for ``.csv`` and Mooncake otherwise."""
    if fmt not in FORMATS:
        raise ValueError(f"--trace-format must be one of {FORMATS}, got {fmt!r}")
    if fmt == "auto":
        fmt = "azure" if str(path).lower().endswith(".csv") else "mooncake"
    return load_azure_csv(path) if fmt == "azure" else load_mooncake_jsonl(path)


def window(records: list[TraceRecord], opts: TraceOptions) -> list[TraceRecord]:
    """The replayed slice, sorted by arrival (a trace file is not always sorted)."""
    end = None if opts.num_prompts is None else opts.start + opts.num_prompts
    picked = sorted(records[opts.start:end], key=lambda r: r.timestamp_s)
    if not picked:
        raise ValueError(f"trace window is empty (--trace-start {opts.start} of "
                         f"{len(records)} requests)")
    return picked


class _Blocks:
    """Deterministic token runs per hash id, made on first use."""

    def __init__(self, tok: PromptTokenizer, size: int, seed: int) -> None:
        self.tok, self.size, self.seed = tok, size, seed
        self._made: dict[int, list[int]] = {}

    def get(self, hash_id: int) -> list[int]:
        if hash_id not in self._made:
            rng = np.random.default_rng([self.seed, 1, hash_id])
            self._made[hash_id] = self.tok.random_ids(rng, self.size)
        return self._made[hash_id]


def trace_requests(tok: PromptTokenizer, records: list[TraceRecord],
                   opts: TraceOptions) -> list[SampleRequest]:
    """The window of `records` as requests with scaled arrival times and prompts."""
    picked = window(records, opts)
    blocks = _Blocks(tok, opts.scaled_block, opts.seed)
    t0 = picked[0].timestamp_s
    out = []
    for i, rec in enumerate(picked):
        n_in, n_out = opts.scaled_lengths(rec)
        n_in = max(n_in, tok.num_special + 1)
        content = n_in - tok.num_special
        ids: list[int] = []
        for h in rec.hash_ids:
            if len(ids) >= content:
                break
            ids += blocks.get(h)
        ids = ids[:content]
        rng = np.random.default_rng([opts.seed, 2, opts.start + i])
        ids += tok.random_ids(rng, content - len(ids))  # the request's own tail
        text, count = tok.fit_to_length(ids, n_in, rng)
        out.append(SampleRequest(text, count, n_out,
                                 timestamp=(rec.timestamp_s - t0) * opts.time_scale))
    return out
