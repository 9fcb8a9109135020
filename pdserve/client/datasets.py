"""The requests a benchmark sends: synthetic random prompts and ShareGPT conversations.

This module owns `SampleRequest` (one prompt with its token length, the number of
tokens to ask for, and, for trace replay, its arrival time) and the two
non-trace datasets. Trace replay (Azure, Mooncake) lives in `trace.py`.

* ``random`` — as in vLLM: input and output lengths drawn uniformly from
  ``[floor(L * (1 - r)), ceil(L * (1 + r))]`` (``r`` = ``--random-range-ratio``),
  an optional shared prefix of ``--random-prefix-len`` tokens, token ids sampled
  then decoded; the prompt's token count is exact for the served tokenizer.
* ``sharegpt`` — a ShareGPT JSON file (a list of ``{"conversations": [{"from":
  "human", "value": ...}, {"from": "gpt", "value": ...}, ...]}``): the first turn is
  the prompt, the second's token count the output length (or a fixed
  ``--sharegpt-output-len``). Pairs shorter than 4 tokens, or longer than the
  model's context, are skipped, as vLLM does.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pdserve.client.tokens import PromptTokenizer

_MIN_LEN = 4  # ShareGPT pairs shorter than this (prompt or answer) are skipped


@dataclass(frozen=True)
class SampleRequest:
    """One request of a benchmark; made by a dataset, read by the runner."""

    prompt: str  # sent as text
    prompt_len: int  # tokens the server counts for `prompt` (client tokenizer)
    expected_output_len: int  # max_tokens asked for
    timestamp: float | None = None  # trace replay: seconds after the first request


def length_range(mean: int, range_ratio: float) -> tuple[int, int]:
    """Inclusive [low, high] that lengths are drawn from around `mean` (low >= 1)."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    low = max(1, math.floor(mean * (1.0 - range_ratio)))
    high = max(low, math.ceil(mean * (1.0 + range_ratio)))
    return low, high


def random_lengths(rng: np.random.Generator, num_prompts: int, input_len: int,
                   output_len: int, range_ratio: float) -> tuple[np.ndarray, np.ndarray]:
    """The random dataset's (input lengths after the prefix, output lengths): the first
    draws of its generator (``pdserve simulate`` makes the same workload from them)."""
    in_lo, in_hi = length_range(input_len, range_ratio)
    out_lo, out_hi = length_range(output_len, range_ratio)
    return (rng.integers(in_lo, in_hi + 1, size=num_prompts),
            rng.integers(out_lo, out_hi + 1, size=num_prompts))


def random_requests(tok: PromptTokenizer, num_prompts: int, input_len: int, output_len: int,
                    range_ratio: float = 0.0, prefix_len: int = 0,
                    seed: int = 0) -> list[SampleRequest]:
    """`num_prompts` random prompts of exact token lengths (prefix included).

    Every prompt starts with the same `prefix_len` tokens; `input_len` is the length
    of the part after it, special tokens counted (as vLLM's --random-input-len).
    """
    if input_len < 1 or output_len < 1 or prefix_len < 0 or num_prompts < 1:
        raise ValueError("--random-input-len, --random-output-len and --num-prompts must "
                         "be >= 1 and --random-prefix-len >= 0")
    if input_len + prefix_len <= tok.num_special:
        raise ValueError(f"--random-input-len {input_len} leaves no room after the "
                         f"tokenizer's {tok.num_special} special tokens")
    rng = np.random.default_rng(seed)
    in_lens, out_lens = random_lengths(rng, num_prompts, input_len, output_len, range_ratio)
    prefix = tok.random_ids(rng, prefix_len)
    out: list[SampleRequest] = []
    for n_in, n_out in zip(in_lens, out_lens, strict=True):
        target = prefix_len + int(n_in)
        ids = prefix + tok.random_ids(rng, target - tok.num_special - prefix_len)
        text, count = tok.fit_to_length(ids, target, rng)
        out.append(SampleRequest(text, count, int(n_out)))
    return out


def _conversation_pairs(data: Any) -> list[tuple[str, str]]:
    if not isinstance(data, list):
        raise ValueError("ShareGPT file: expected a JSON list of conversations")
    pairs = []
    for entry in data:
        if not isinstance(entry, dict):
            continue
        turns = entry.get("conversations") or entry.get("conversation")
        if not isinstance(turns, list) or len(turns) < 2:
            continue
        first, second = turns[0], turns[1]
        if not (isinstance(first, dict) and isinstance(second, dict)):
            continue
        prompt, answer = first.get("value"), second.get("value")
        if isinstance(prompt, str) and isinstance(answer, str):
            pairs.append((prompt, answer))
    return pairs


def sharegpt_requests(tok: PromptTokenizer, path: str | Path, num_prompts: int,
                      max_model_len: int, output_len: int | None = None,
                      seed: int = 0) -> list[SampleRequest]:
    """Up to `num_prompts` (prompt, answer-length) pairs from a ShareGPT JSON file,
    shuffled with `seed`; fewer only if the file has fewer usable pairs."""
    text = Path(path).read_text(encoding="utf-8")
    pairs = _conversation_pairs(json.loads(text))
    order = np.random.default_rng(seed).permutation(len(pairs))
    out: list[SampleRequest] = []
    for idx in order:
        if len(out) >= num_prompts:
            break
        prompt, answer = pairs[int(idx)]
        n_in = tok.count(prompt)
        n_out = output_len if output_len is not None else len(tok.encode(answer))
        if n_in < _MIN_LEN or (output_len is None and n_out < _MIN_LEN):
            continue
        if n_in + n_out > max_model_len:
            continue
        out.append(SampleRequest(prompt, n_in, n_out))
    if not out:
        raise ValueError(f"{path}: no usable ShareGPT conversation (need a first turn and "
                         f"an answer of >= {_MIN_LEN} tokens within {max_model_len} tokens)")
    return out
