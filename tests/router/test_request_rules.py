"""The router's own request fields (``GenerateRequest.problem``): one copy of their
rules, asked by ``Router.generate`` for every front end's request and by the gRPC
mapping before it sets the deadline."""

from __future__ import annotations

import pytest

from pdserve.engine.sampling.sampling_params import MAX_BAD_WORD_TEXTS, SamplingParams
from pdserve.protos import pb
from pdserve.router.grpc.server import request_from_proto
from pdserve.router.types import GenerateRequest


def req(**fields: object) -> GenerateRequest:
    return GenerateRequest("r", SamplingParams(), prompt="x", **fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(("fields", "param"), [
    ({"timeout_s": 0.0}, "timeout_s"), ({"timeout_s": -1.0}, "timeout_s"),
    ({"timeout_s": float("inf")}, "timeout_s"), ({"timeout_s": float("nan")}, "timeout_s"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
    ({"bad_words": ("a", "")}, "bad_words"),
    ({"bad_words": ("a",) * (MAX_BAD_WORD_TEXTS + 1)}, "bad_words"),
])
def test_each_rule_names_its_field(fields: dict[str, object], param: str) -> None:
    problem = req(**fields).problem()
    assert problem is not None and problem[0] == param and problem[1].startswith(param)


def test_what_the_rules_allow() -> None:
    assert req().problem() is None
    assert req(timeout_s=0.001, truncate_prompt_tokens=-1,
               bad_words=("a",) * MAX_BAD_WORD_TEXTS).problem() is None
    assert req(truncate_prompt_tokens=1).problem() is None


def test_grpc_refuses_a_bad_timeout_before_the_deadline_hides_it() -> None:
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        request_from_proto(pb.GenerateRequest(text="x", timeout_s=-1), time_remaining=5.0)
    r = request_from_proto(pb.GenerateRequest(text="x", timeout_s=300), time_remaining=5.0)
    assert r.timeout_s == 5.0  # the earlier of the two
    r = request_from_proto(pb.GenerateRequest(text="x"), time_remaining=-1.0)
    assert r.timeout_s is not None and 0 < r.timeout_s < 1e-3  # past: ends at once
