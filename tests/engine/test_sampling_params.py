"""SamplingParams: defaults, normalisation, and every validation error."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from pdserve.engine.sampling.sampling_params import SamplingParams


def test_defaults_are_valid_and_greedy() -> None:
    p = SamplingParams()
    assert p.greedy
    assert not p.has_penalties
    assert p.max_tokens == 16 and p.stop == () and p.stop_token_ids == ()


def test_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        SamplingParams().temperature = 1.0  # type: ignore[misc]


def test_lists_become_tuples_and_ints_become_floats() -> None:
    p = SamplingParams(stop=["a", "bc"], stop_token_ids=[1, 2], temperature=1, top_p=1)
    assert p.stop == ("a", "bc")
    assert p.stop_token_ids == (1, 2)
    assert isinstance(p.temperature, float) and p.temperature == 1.0
    assert not p.greedy
    assert SamplingParams(stop="x").stop == ("x",)
    bans = SamplingParams(allowed_token_ids=[9, 2, 9], bad_words=[[3, 4], [5], [3, 4]])
    assert bans.allowed_token_ids == (2, 9) and bans.bad_words == ((3, 4), (5,))
    assert bans.needs_processing
    hash(p)  # usable as a dict key once lists are tuples


def test_boundaries_accepted() -> None:
    SamplingParams(max_tokens=1, min_tokens=1)
    SamplingParams(temperature=100.0, top_p=1e-9, top_k=-1, min_p=1.0)
    SamplingParams(frequency_penalty=-2.0, presence_penalty=2.0, repetition_penalty=1e-3)
    SamplingParams(seed=2**63 - 1, logprobs=0)
    SamplingParams(seed=-(2**63), logprobs=20, stop=tuple("abcdefghijklmnop"))


def test_has_penalties() -> None:
    assert SamplingParams(repetition_penalty=1.1).has_penalties
    assert SamplingParams(frequency_penalty=0.5).has_penalties
    assert SamplingParams(presence_penalty=-0.5).has_penalties


INVALID: list[tuple[dict[str, Any], str]] = [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -3}, "max_tokens"),
    ({"max_tokens": 1.5}, "max_tokens"),
    ({"max_tokens": True}, "max_tokens"),
    ({"max_tokens": "16"}, "max_tokens"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 17}, "min_tokens"),
    ({"max_tokens": 4, "min_tokens": 5}, "min_tokens"),
    ({"min_tokens": False}, "min_tokens"),
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": 100.5}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"temperature": float("inf")}, "temperature"),
    ({"temperature": "0.7"}, "temperature"),
    ({"temperature": None}, "temperature"),
    ({"temperature": True}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.01}, "top_p"),
    ({"top_p": -0.5}, "top_p"),
    ({"top_p": float("nan")}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"top_k": 2.0}, "top_k"),
    ({"top_k": True}, "top_k"),
    ({"min_p": -0.01}, "min_p"),
    ({"min_p": 1.5}, "min_p"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"repetition_penalty": -1.0}, "repetition_penalty"),
    ({"repetition_penalty": float("inf")}, "repetition_penalty"),
    ({"frequency_penalty": 2.1}, "frequency_penalty"),
    ({"frequency_penalty": -2.1}, "frequency_penalty"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"presence_penalty": -3.0}, "presence_penalty"),
    ({"presence_penalty": "0"}, "presence_penalty"),
    ({"seed": 2**63}, "seed"),
    ({"seed": -(2**63) - 1}, "seed"),
    ({"seed": 1.0}, "seed"),
    ({"seed": True}, "seed"),
    ({"seed": "42"}, "seed"),
    ({"stop": [""]}, "stop"),
    ({"stop": ""}, "stop"),
    ({"stop": ["ok", 3]}, "stop"),
    ({"stop": tuple(f"s{i}" for i in range(17))}, "stop"),
    ({"stop": 5}, "stop"),
    ({"stop": {"a"}}, "stop"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"stop_token_ids": [1, "2"]}, "stop_token_ids"),
    ({"stop_token_ids": [True]}, "stop_token_ids"),
    ({"stop_token_ids": 3}, "stop_token_ids"),
    ({"ignore_eos": 1}, "ignore_eos"),
    ({"ignore_eos": "yes"}, "ignore_eos"),
    ({"include_stop_str_in_output": None}, "include_stop_str_in_output"),
    ({"logprobs": -1}, "logprobs"),
    ({"logprobs": 21}, "logprobs"),
    ({"logprobs": 2.0}, "logprobs"),
    ({"logprobs": True}, "logprobs"),
    ({"allowed_token_ids": [-1]}, "allowed_token_ids"),
    ({"allowed_token_ids": 5}, "allowed_token_ids"),
    ({"allowed_token_ids": ["5"]}, "allowed_token_ids"),
    ({"bad_words": [[]]}, "bad_words"),
    ({"bad_words": [[1, -2]]}, "bad_words"),
    ({"bad_words": ["word"]}, "bad_words"),
    ({"bad_words": [[1]] * 2 + [[i, 1] for i in range(128)]}, "bad_words"),
    ({"bad_words": [list(range(65))]}, "bad_words"),
    ({"skip_special_tokens": 0}, "skip_special_tokens"),
]


@pytest.mark.parametrize(("kwargs", "field"), INVALID, ids=[repr(k) for k, _ in INVALID])
def test_invalid_values_raise_naming_the_field(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_range_is_in_message() -> None:
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\]"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match=r"\[-2, 2\]"):
        SamplingParams(frequency_penalty=5)


def test_from_dict_roundtrip() -> None:
    p = SamplingParams.from_dict({"temperature": 0.7, "stop": ["\n"], "seed": 3, "logprobs": 2})
    assert p == SamplingParams(temperature=0.7, stop=("\n",), seed=3, logprobs=2)
    assert SamplingParams.from_dict({}) == SamplingParams()
    full = dataclasses.asdict(p)
    assert SamplingParams.from_dict(full) == p


def test_from_dict_rejects_unknown_keys_by_name() -> None:
    with pytest.raises(ValueError, match=r"'best_of'.*'n'|'n'.*'best_of'") as err:
        SamplingParams.from_dict({"temperature": 1.0, "best_of": 2, "n": 3})
    assert "temperature" not in str(err.value).split("allowed")[0]


def test_from_dict_validates_values_and_type() -> None:
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams.from_dict({"top_k": -5})
    with pytest.raises(ValueError, match="mapping"):
        SamplingParams.from_dict([("top_k", 1)])  # type: ignore[arg-type]
