"""Random and ShareGPT datasets: exact token lengths, ranges, shared prefix, filtering."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdserve.client.datasets import length_range, random_requests, sharegpt_requests
from pdserve.client.tokens import PromptTokenizer, resolve_tokenizer_dir


def test_stable_pool_round_trips(prompt_tok: PromptTokenizer) -> None:
    assert prompt_tok.stable and len(prompt_tok.pool) >= 32
    ids = [int(i) for i in prompt_tok.pool[:50]] * 3
    assert prompt_tok.encode(prompt_tok.decode(ids)) == ids


@pytest.mark.parametrize("n_in", [1, 7, 64, 300])
def test_random_lengths_are_exact(prompt_tok: PromptTokenizer, n_in: int) -> None:
    reqs = random_requests(prompt_tok, 5, n_in, 9, seed=3)
    assert len(reqs) == 5
    for r in reqs:
        assert r.prompt_len == n_in == prompt_tok.count(r.prompt)
        assert r.expected_output_len == 9
    if n_in > 1:  # one-token prompts may repeat
        assert len({r.prompt for r in reqs}) == 5


def test_random_range_ratio_and_seed(prompt_tok: PromptTokenizer) -> None:
    reqs = random_requests(prompt_tok, 40, 100, 20, range_ratio=0.5, seed=1)
    lo, hi = length_range(100, 0.5)
    assert (lo, hi) == (50, 150)
    assert all(lo <= r.prompt_len <= hi and prompt_tok.count(r.prompt) == r.prompt_len
               for r in reqs)
    assert all(10 <= r.expected_output_len <= 30 for r in reqs)
    assert len({r.prompt_len for r in reqs}) > 5
    again = random_requests(prompt_tok, 40, 100, 20, range_ratio=0.5, seed=1)
    assert [r.prompt for r in again] == [r.prompt for r in reqs]


def test_random_prefix_is_shared(prompt_tok: PromptTokenizer) -> None:
    reqs = random_requests(prompt_tok, 3, 20, 4, prefix_len=32, seed=0)
    ids = [prompt_tok.encode(r.prompt) for r in reqs]
    assert all(len(i) == 52 for i in ids)
    assert ids[0][:32] == ids[1][:32] == ids[2][:32]
    assert ids[0][32:] != ids[1][32:]


def test_random_rejects_bad_ratio(prompt_tok: PromptTokenizer) -> None:
    with pytest.raises(ValueError, match="range-ratio"):
        random_requests(prompt_tok, 2, 10, 10, range_ratio=1.0)


def test_sharegpt(prompt_tok: PromptTokenizer, tmp_path: Path) -> None:
    long_answer = "the answer is quite long and detailed " * 3
    data = [
        {"conversations": [{"from": "human", "value": "tell me about the lazy dog please"},
                           {"from": "gpt", "value": long_answer}]},
        {"conversations": [{"from": "human", "value": "hi"},
                           {"from": "gpt", "value": long_answer}]},  # prompt too short
        {"conversations": [{"from": "human", "value": "only one turn here at all"}]},
        {"id": "no turns"},
        {"conversations": [{"from": "human", "value": "what does a serving system do"},
                           {"from": "gpt", "value": long_answer * 40}]},  # too long
    ]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(data))
    reqs = sharegpt_requests(prompt_tok, path, 10, max_model_len=256)
    assert len(reqs) == 1
    assert reqs[0].prompt.startswith("tell me")
    assert reqs[0].prompt_len == prompt_tok.count(reqs[0].prompt)
    assert reqs[0].expected_output_len == len(prompt_tok.encode(long_answer))
    fixed = sharegpt_requests(prompt_tok, path, 10, max_model_len=100_000, output_len=7)
    assert len(fixed) == 2 and all(r.expected_output_len == 7 for r in fixed)


def test_resolve_tokenizer_dir(tiny_dir: Path) -> None:
    assert resolve_tokenizer_dir(str(tiny_dir), "ignored") == tiny_dir
    assert resolve_tokenizer_dir(None, str(tiny_dir / "tokenizer.json")) == tiny_dir
    with pytest.raises(FileNotFoundError, match="--tokenizer"):
        resolve_tokenizer_dir(None, "/nonexistent/model-xyz")
