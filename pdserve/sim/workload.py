"""The simulated client's workload: ``pdserve bench``'s datasets and arrival process
(``BenchConfig``), as lengths, send times and prompt block hashes -- no text.

* random: the lengths ``random_requests`` draws for the same seed (its first draws,
  ``random_lengths``); every prompt shares its first ``--random-prefix-len`` tokens;
* trace (Mooncake, Azure): the same window, scaling and clipping
  (``trace.window``, ``TraceOptions``); prompts share blocks as their ``hash_ids``
  do (a block of the trace's size per id: two prompts share a prefix as far as
  their ids agree);
* sharegpt: the same pairs as the bench, counted by the model's tokenizer (no
  sharing).

A prompt's blocks are identified by integers standing for their chained hashes:
equal prefixes give equal leading hashes, the rest are unique per request.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from pdserve.client.bench import BenchConfig
from pdserve.client.datasets import random_lengths
from pdserve.client.request_runner import arrival_offsets
from pdserve.client.trace import TraceOptions, TraceRecord, load_trace, window

SHARED, OWN, TRACE = 1, 2, 3  # tags of the three kinds of block identity
# (own blocks: the tag, the request's index and the block's, in one number)
MASK = (1 << 64) - 1  # identities are unsigned, as the engine's block hashes


@dataclass(frozen=True)
class Planned:
    """One request of the workload."""

    index: int
    offset: float  # seconds after the run starts
    prompt_len: int
    output_len: int
    shared_tokens: int = 0  # random: the common prefix
    hash_ids: tuple[int, ...] = ()  # trace
    trace_block: int = 0  # tokens per trace hash id

    def block_hashes(self, block_size: int) -> list[int]:
        """The prompt's full blocks' identities."""
        n = self.prompt_len // block_size
        shared = min(n, self.shared_tokens // block_size)  # (blocks ending inside it)
        out = [hash((SHARED, b)) & MASK for b in range(shared)]
        if self.trace_block:
            for b in range(shared, n):
                i = ((b + 1) * block_size - 1) // self.trace_block  # its last token's id
                if i >= len(self.hash_ids):
                    break
                out.append(hash((TRACE, self.hash_ids[i], b)) & MASK)
        own = (OWN << 56) | (self.index << 24)  # this request's own blocks, numbered
        out.extend(range(own + len(out), own + n))
        return out


def shares_blocks(planned: Sequence[Planned], block_size: int) -> bool:
    """Whether any full prompt block of one request is a block of another: without
    that, a prefix cache never hits and the engines can run without one (the same
    schedule, without hashing or registering every block)."""
    if len(planned) < 2:
        return False
    if any(p.shared_tokens >= block_size for p in planned):
        return True
    seen: set[int] = set()  # (only a trace's blocks can repeat: the rest are unique)
    for p in planned:
        if p.hash_ids:
            ids = p.block_hashes(block_size)
            if not seen.isdisjoint(ids):
                return True
            seen.update(ids)
    return False


def plan(cfg: BenchConfig, rate: float, max_model_len: int,
         sharegpt_lengths: list[tuple[int, int]] | None = None) -> list[Planned]:
    """The requests of one run at ``rate`` (trace: its own times)."""
    if cfg.dataset == "trace":
        return list(_trace(cfg, max_model_len))
    if cfg.dataset == "sharegpt":
        if sharegpt_lengths is None:
            raise ValueError("--dataset sharegpt needs the model's tokenizer to count its "
                             "prompts (a model directory with tokenizer.json)")
        lengths = sharegpt_lengths
    else:
        rng = np.random.default_rng(cfg.seed)
        ins, outs = random_lengths(rng, cfg.num_prompts, cfg.random_input_len,
                                   cfg.random_output_len, cfg.random_range_ratio)
        lengths = [(cfg.random_prefix_len + int(i), int(o)) for i, o in zip(ins, outs, strict=True)]
    for i, (n_in, n_out) in enumerate(lengths):
        if n_in + n_out > max_model_len:
            raise ValueError(f"request {i}: {n_in} prompt + {n_out} output tokens exceed "
                             f"--max-model-len {max_model_len}")
    offsets = arrival_offsets(len(lengths), rate, cfg.burstiness, cfg.seed)
    return [Planned(i, t, n_in, n_out, shared_tokens=cfg.random_prefix_len)
            for i, (t, (n_in, n_out)) in enumerate(zip(offsets, lengths, strict=True))]


def _trace(cfg: BenchConfig, max_model_len: int) -> Iterator[Planned]:
    assert cfg.dataset_path is not None
    opts = TraceOptions(time_scale=cfg.trace_time_scale, length_scale=cfg.trace_length_scale,
                        max_model_len=max_model_len, start=cfg.trace_start,
                        num_prompts=cfg.num_prompts, seed=cfg.seed)
    picked: list[TraceRecord] = window(load_trace(cfg.dataset_path, cfg.trace_format), opts)
    t0 = picked[0].timestamp_s
    for i, rec in enumerate(picked):
        n_in, n_out = opts.scaled_lengths(rec)
        yield Planned(i, (rec.timestamp_s - t0) * opts.time_scale, max(2, n_in), n_out,
                      hash_ids=rec.hash_ids, trace_block=opts.scaled_block)


def offered_rate(planned: list[Planned]) -> float:
    span = planned[-1].offset - planned[0].offset if planned else 0.0
    return (len(planned) - 1) / span if span > 0 else math.inf
