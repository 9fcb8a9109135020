"""gRPC sampling parameters added with issue 18 (``logit_bias``, ``priority``, the
``structured`` oneof) and vLLM's token controls, mapped to ``SamplingParams`` and the
router request; a bad constraint is INVALID_ARGUMENT naming its field before anything
reaches the router. Uses the scripted router of ``test_grpc_server.py``."""

from __future__ import annotations

import json
import time
from typing import Any

import grpc
import pytest

from pdserve.engine.sampling.sampling_params import SamplingParams
from pdserve.engine.sampling.structured import StructuredOutput
from pdserve.protos import pb
from pdserve.router.api import common as api_common
from pdserve.router.grpc.messages import request_from_proto, sampling_params_from_proto
from tests.router.grpc_helpers import ScriptedRouter, collect, expect_status, serve

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
TAG = {"structures": [{"begin": "<f=n>", "schema": SCHEMA, "end": "</f>"}], "triggers": ["<f="]}


def test_new_fields_map_to_sampling_params() -> None:
    p = sampling_params_from_proto(pb.SamplingParameters(
        logit_bias={7: -100.0, 3: 2.5}, priority=-4, json_schema=json.dumps(SCHEMA)))
    assert p.logit_bias == ((3, 2.5), (7, -100.0))
    assert p.priority == -4
    assert p.structured == StructuredOutput.json_schema(SCHEMA)

    cases: dict[str, tuple[dict[str, Any], StructuredOutput | None]] = {
        "json_object": ({"json_object": True}, StructuredOutput.json_object()),
        "json_object false": ({"json_object": False}, None),
        "regex": ({"regex": "[a-z]+"}, StructuredOutput.regex("[a-z]+")),
        "choice": ({"choice": pb.Choices(choices=["yes", "no"])},
                   StructuredOutput.choice(["yes", "no"])),
        "grammar": ({"grammar": 'start: "a"+'}, StructuredOutput.grammar('start: "a"+')),
        "structural_tag": ({"structural_tag": json.dumps(TAG)},
                           StructuredOutput.structural_tag(TAG)),
        "unset": ({}, None),
    }
    for name, (fields, want) in cases.items():
        assert sampling_params_from_proto(pb.SamplingParameters(**fields)).structured == want, name


def test_token_controls_map_to_the_request() -> None:
    req = request_from_proto(pb.GenerateRequest(
        text="x", truncate_prompt_tokens=-1, bad_words=["no", " never"],
        params=pb.SamplingParameters(allowed_token_ids=[9, 4], skip_special_tokens=False,
                                     cache_salt="t")), None)
    assert req.params.allowed_token_ids == (4, 9) and not req.params.skip_special_tokens
    assert req.params.cache_salt == "t"
    assert req.bad_words == ("no", " never") and req.truncate_prompt_tokens == -1
    plain = request_from_proto(pb.GenerateRequest(text="x"), None)
    assert plain.params.skip_special_tokens and plain.params.allowed_token_ids == ()
    assert plain.bad_words == () and plain.truncate_prompt_tokens is None
    with pytest.raises(ValueError, match="cache_salt"):
        sampling_params_from_proto(pb.SamplingParameters(cache_salt=""))
    for bad, named in (({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
                       ({"bad_words": ["a", ""]}, "bad_words"),
                       ({"bad_words": ["a"] * 65}, "bad_words")):
        with pytest.raises(ValueError, match=named):
            request_from_proto(pb.GenerateRequest(text="x", **bad), None)


def test_chat_template_extras_map_to_the_request() -> None:
    chat = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="x")])
    req = request_from_proto(pb.GenerateRequest(
        chat=chat, add_generation_prompt=False, continue_final_message=True,
        chat_template_kwargs='{"persona": "a pirate"}'), None)
    assert req.chat_template_args == {"add_generation_prompt": False,
                                      "continue_final_message": True,
                                      "template_kwargs": {"persona": "a pirate"}}
    assert request_from_proto(pb.GenerateRequest(chat=chat), None).chat_template_args == {}
    for bad, named in (({"text": "x", "continue_final_message": True}, "continue_final_message"),
                       ({"chat": chat, "continue_final_message": True}, "continue_final_message"),
                       ({"chat": chat, "chat_template_kwargs": "[1]"}, "chat_template_kwargs"),
                       ({"chat": chat, "chat_template_kwargs": "{x"}, "chat_template_kwargs"),
                       ({"chat": chat, "chat_template_kwargs": '{"tools": []}'},
                        "chat_template_kwargs")):
        with pytest.raises(ValueError) as info:
            request_from_proto(pb.GenerateRequest(**bad), None)
        assert str(info.value).startswith(named), (bad, info.value)


def test_defaults_unchanged_and_old_messages_still_parse() -> None:
    assert sampling_params_from_proto(pb.SamplingParameters()) == SamplingParams()
    # A message from a client built before these fields: the same bytes, same meaning.
    old = pb.SamplingParameters(max_tokens=3, temperature=0.5).SerializeToString()
    p = sampling_params_from_proto(pb.SamplingParameters.FromString(old))
    assert (p.max_tokens, p.temperature, p.priority, p.logit_bias, p.structured) == (
        3, 0.5, 0, (), None)


@pytest.mark.parametrize(("fields", "named"), [
    ({"json_schema": "{not json"}, "json_schema: not valid JSON"),
    ({"json_schema": "[1, 2]"}, "json_schema: a JSON schema must be an object"),
    ({"json_schema": "{\"maximum\": NaN}"}, "json_schema: not valid JSON: NaN is not JSON"),
    ({"json_schema": "[" * 100_000}, "json_schema: "),  # nested too deep for Python
    ({"choice": pb.Choices()}, "choice:"),
    ({"choice": pb.Choices(choices=["a", ""])}, "choice:"),
    ({"regex": ""}, "regex:"),
    ({"structural_tag": "{x"}, "structural_tag: not valid JSON"),
    ({"structural_tag": "[]"}, "structural_tag: a structural tag must be an object"),
    ({"grammar": "  "}, "grammar:"),
    ({"logit_bias": {5: 101.0}}, "logit_bias[5] must be in [-100, 100]"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias token ids must be non-negative"),
])
def test_bad_values_name_the_field(fields: dict[str, Any], named: str) -> None:
    with pytest.raises(ValueError) as info:
        sampling_params_from_proto(pb.SamplingParameters(**fields))
    assert named in str(info.value)


def test_over_grpc_valid_constraints_reach_the_router() -> None:
    router = ScriptedRouter()

    async def scenario(channel: grpc.aio.Channel) -> None:
        params = pb.SamplingParameters(priority=3, logit_bias={1: 1.0},
                                       json_schema=json.dumps(SCHEMA))
        out = await collect(channel, pb.GenerateRequest(text="ab", params=params))
        assert out[-1].WhichOneof("kind") == "final"
        await collect(channel, pb.GenerateRequest(
            text="c", params=pb.SamplingParameters(choice=pb.Choices(choices=["x", "y"]))))

    serve(router, scenario)
    first, second = router.requests
    assert first.params.priority == 3 and first.params.logit_bias == ((1, 1.0),)
    assert first.params.structured == StructuredOutput.json_schema(SCHEMA)
    assert second.params.structured == StructuredOutput.choice(["x", "y"])


def test_over_grpc_a_bad_constraint_is_invalid_argument_and_never_queued() -> None:
    router = ScriptedRouter()
    bad = {
        "json_schema": pb.SamplingParameters(json_schema='{"type": "objekt"}'),
        "regex": pb.SamplingParameters(regex="a(b"),  # the compiler's error spans lines
        "grammar": pb.SamplingParameters(grammar="start: undefined_rule"),
        "logit_bias": pb.SamplingParameters(logit_bias={3: -250.0}),
    }

    async def scenario(channel: grpc.aio.Channel) -> None:
        for field, params in bad.items():
            err = await expect_status(channel, pb.GenerateRequest(text="x", params=params))
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, field
            assert err.details().startswith(field), (field, err.details())

    serve(router, scenario)
    assert router.requests == []


def test_a_constraint_that_compiles_too_long_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    def slow(s: StructuredOutput) -> str:
        time.sleep(1.0)
        return ""

    monkeypatch.setattr(api_common, "grammar_of", slow)
    monkeypatch.setattr(api_common, "STRUCTURED_COMPILE_TIMEOUT_S", 0.05)
    router = ScriptedRouter()

    async def scenario(channel: grpc.aio.Channel) -> None:
        err = await expect_status(channel, pb.GenerateRequest(
            text="x", params=pb.SamplingParameters(regex="a+")))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.details().startswith("regex: the constraint took longer than 0.05 s")

    serve(router, scenario)
    assert router.requests == []
