"""Hypothesis against the live gRPC server: random ``GenerateRequest`` messages
(every field, values inside and far outside their ranges, odd request ids and
text), random bytes, and valid messages corrupted (bytes flipped, cut short,
garbage appended). Asserted for each: the call ends (no hang) with OK or a status
that names the client's fault (never INTERNAL or UNKNOWN), and a stream that
ends OK ends with exactly one Final message."""

from __future__ import annotations

from typing import Any

import grpc
import hypothesis.strategies as st
from hypothesis import HealthCheck, given, settings

from pdserve.protos import pb, pb_grpc
from pdserve.router.grpc.server import SERVICE_NAME
from tests.fuzz.conftest import CONTEXT, GRPC_AUTH, STATS
from tests.integration.live_server import CALL_TIMEOUT_S, LiveServer

MAX_EXAMPLES = 300
SERVER_FAULTS = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}
INT64 = st.integers(-(2**63), 2**63 - 1)
UINT32 = st.integers(0, 2**32 - 1)


def _small_or_any(small: st.SearchStrategy[Any], anything: st.SearchStrategy[Any]
                  ) -> st.SearchStrategy[Any]:
    """Mostly values that can run (bounded work), sometimes anything at all."""
    return st.one_of(small, small, anything)


FLOATS = st.floats(allow_nan=True, allow_infinity=True)
# One structured-output constraint (the oneof): small valid ones, and any text.
SMALL_SCHEMAS = ['{"type": "object"}', '{"type": "string", "maxLength": 4}',
                 '{"enum": ["a", "b"]}', '{"type": "wat"}', "[1, 2", "{}"]
STRUCTURED = st.one_of(
    st.fixed_dictionaries({"json_schema": st.sampled_from(SMALL_SCHEMAS) | st.text(max_size=30)}),
    st.fixed_dictionaries({"json_object": st.booleans()}),
    st.fixed_dictionaries({"regex": st.sampled_from(["[0-9]{2}", "a|b", "(", ""])
                           | st.text(max_size=20)}),
    st.fixed_dictionaries({"choice": st.lists(st.text(max_size=6), max_size=4).map(
        lambda c: pb.Choices(choices=c))}),
    st.fixed_dictionaries({"grammar": st.sampled_from(['root ::= "x"', 'start: "y"', "::="])
                           | st.text(max_size=30)}),
    st.fixed_dictionaries({"structural_tag": st.sampled_from([
        '{"structures": [{"begin": "<f>", "schema": {}, "end": "</f>"}], "triggers": ["<f"]}',
        '{"structures": [], "triggers": []}', "{", "[]"]) | st.text(max_size=20)}))
PARAMS = st.fixed_dictionaries({}, optional={
    "max_tokens": _small_or_any(st.integers(-2, CONTEXT), INT64),
    "min_tokens": _small_or_any(st.integers(-2, 8), INT64),
    "temperature": _small_or_any(st.floats(0, 2), FLOATS),
    "top_p": _small_or_any(st.floats(0, 1), FLOATS),
    "top_k": _small_or_any(st.integers(-2, 50), INT64),
    "min_p": _small_or_any(st.floats(0, 1), FLOATS),
    "repetition_penalty": _small_or_any(st.floats(0, 2), FLOATS),
    "frequency_penalty": _small_or_any(st.floats(-2, 2), FLOATS),
    "presence_penalty": _small_or_any(st.floats(-2, 2), FLOATS),
    "seed": INT64,
    "stop": st.lists(st.text(max_size=8), max_size=20),
    "stop_token_ids": st.lists(UINT32, max_size=20),
    "ignore_eos": st.booleans(),
    "logprobs": _small_or_any(st.integers(-1, 21), INT64),
    "include_stop_str_in_output": st.booleans(),
    "logit_bias": st.dictionaries(_small_or_any(st.integers(-2, 300), st.integers(-(2**31),
                                                                                 2**31 - 1)),
                                  _small_or_any(st.floats(-100, 100), FLOATS), max_size=4),
    "priority": _small_or_any(st.integers(-3, 3), INT64),
    "allowed_token_ids": st.lists(_small_or_any(st.integers(0, 300), UINT32), max_size=6),
    "skip_special_tokens": st.booleans(),
    "cache_salt": st.text(max_size=8),
}).flatmap(lambda params: st.one_of(st.just(params), STRUCTURED.map(
    lambda structured: {**params, **structured})))
TEXT = st.text(max_size=200)  # any code points protobuf can carry (no lone surrogates)
CHAT = st.lists(st.builds(pb.ChatMessage, role=st.sampled_from(["system", "user", "assistant",
                                                                "tool", "", "x"]) | TEXT,
                          content=TEXT), max_size=5).map(lambda m: pb.ChatMessages(messages=m))
TOKEN_IDS = st.lists(_small_or_any(st.integers(0, 300), UINT32), max_size=80).map(
    lambda ids: pb.TokenIds(ids=ids))
PROMPT = st.one_of(st.fixed_dictionaries({"text": TEXT}), st.fixed_dictionaries({"chat": CHAT}),
                   st.fixed_dictionaries({"token_ids": TOKEN_IDS}), st.just({}))
REQUESTS = st.builds(
    lambda prompt, params, extra: pb.GenerateRequest(
        **prompt, **extra, params=pb.SamplingParameters(**params)),
    PROMPT, PARAMS,
    st.fixed_dictionaries({}, optional={
        "request_id": st.text(max_size=140),
        "model": st.sampled_from(["", "tiny"]) | st.text(max_size=20),
        "timeout_s": _small_or_any(st.floats(0.001, 20), FLOATS),
        "truncate_prompt_tokens": _small_or_any(st.integers(-2, 40), INT64),
        "bad_words": st.lists(st.text(max_size=12), max_size=4),
        "add_generation_prompt": st.booleans(),
        "continue_final_message": st.booleans(),
        "chat_template_kwargs": st.sampled_from(["", "{}", '{"a": 1}', "[", '{"tools": 1}'])
        | st.text(max_size=12),
    }))


@st.composite
def corrupt(draw: st.DrawFn) -> bytes:
    """A valid message's bytes, damaged; or random bytes."""
    raw = bytearray(draw(REQUESTS).SerializeToString())
    how = draw(st.sampled_from(["flip", "cut", "append", "random"]))
    if how == "flip" and raw:
        for i in draw(st.lists(st.integers(0, len(raw) - 1), min_size=1, max_size=4)):
            raw[i] ^= draw(st.integers(1, 255))
    elif how == "cut" and raw:
        del raw[draw(st.integers(0, len(raw) - 1)):]
    elif how == "append":
        raw += draw(st.binary(min_size=1, max_size=16))
    else:
        raw = bytearray(draw(st.binary(max_size=64)))
    return bytes(raw)


def _outcome(stream: Any) -> grpc.StatusCode:
    """Read a Generate call to its end; its status."""
    finals = 0
    try:
        for response in stream:
            finals += response.WhichOneof("kind") == "final"
    except grpc.RpcError as exc:
        code: grpc.StatusCode = exc.code()
        assert code not in SERVER_FAULTS, f"{code}: {exc.details()}"
        # The client's own deadline means the server hung; the request's is a status.
        assert code != grpc.StatusCode.DEADLINE_EXCEEDED or exc.details() != "Deadline Exceeded", \
            "the call hung"
        return code
    assert finals == 1, f"a stream ended OK with {finals} final messages"
    return grpc.StatusCode.OK


def test_random_generate_requests(live: LiveServer, grpc_channel: grpc.Channel) -> None:
    stub = pb_grpc.GenerationStub(grpc_channel)

    @settings(max_examples=MAX_EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(request=REQUESTS)
    def one(request: Any) -> None:
        code = _outcome(stub.Generate(request, timeout=CALL_TIMEOUT_S, metadata=GRPC_AUTH))
        STATS.record("grpc messages", code.name)

    one()


def test_corrupt_generate_messages(live: LiveServer, grpc_channel: grpc.Channel) -> None:
    generate = grpc_channel.unary_stream(f"/{SERVICE_NAME}/Generate",
                                         response_deserializer=pb.GenerateResponse.FromString)
    list_models = grpc_channel.unary_unary(f"/{SERVICE_NAME}/ListModels",
                                           response_deserializer=pb.ListModelsResponse.FromString)

    @settings(max_examples=MAX_EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(payload=corrupt())
    def one(payload: bytes) -> None:
        code = _outcome(generate(payload, timeout=CALL_TIMEOUT_S, metadata=GRPC_AUTH))
        STATS.record("grpc corrupt", code.name)
        try:
            list_models(payload, timeout=CALL_TIMEOUT_S, metadata=GRPC_AUTH)
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT, exc

    one()
    # Still serving, and every block came back (checked again at teardown).
    out = list(pb_grpc.GenerationStub(grpc_channel).Generate(
        pb.GenerateRequest(text="hi", params=pb.SamplingParameters(max_tokens=2, ignore_eos=True)),
        timeout=CALL_TIMEOUT_S, metadata=GRPC_AUTH))
    assert out[-1].final.usage.completion_tokens == 2
