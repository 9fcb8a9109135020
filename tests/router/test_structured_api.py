"""The OpenAI fields that shape an output (``router/openai/sampling_fields.py``): structured
outputs (``response_format``, vLLM's ``guided_*`` and ``structured_outputs``) mapped
to ``SamplingParams.structured`` and checked before a request runs, ``logit_bias``,
``priority``, and ``n`` choices -- their requests, and their merged responses
(``openai.response_builder.ResponseBuilder``, and over HTTP with a scripted router)."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pdserve.engine.sampling.structured import StructuredOutput
from pdserve.engine.tokenizer import Tokenizer
from pdserve.router.api import common as api_common
from pdserve.router.openai.chat_request import ChatCompletionRequest
from pdserve.router.openai.chat_response import ChatBuilder
from pdserve.router.openai.completion_request import CompletionRequest
from pdserve.router.openai.completion_response import CompletionBuilder
from pdserve.router.openai.request_models import InvalidRequest
from pdserve.router.openai.response_builder import ResponseBuilder
from pdserve.router.openai.response_objects import TokenText
from pdserve.router.openai.sampling_fields import check_grammars, choice_requests
from pdserve.router.openai.tool_parsers.hermes import HERMES
from pdserve.router.types import (
    ErrorKind,
    FinalChunk,
    RouterError,
    StreamChunk,
    Usage,
)
from tests.router.http_helpers import ChoicesRouter, Client, serve, sse
from tests.waiting import until_async

SCHEMA: dict[str, Any] = {"type": "object", "properties": {"a": {"type": "integer"}},
                          "required": ["a"]}
USER = [{"role": "user", "content": "hi"}]
TAG = {"structures": [{"begin": "<function=get_weather>", "schema": SCHEMA, "end": "</function>"}],
       "triggers": ["<function="]}


def chat(**body: Any) -> Any:
    """(The body, its router request, its plan)."""
    r = ChatCompletionRequest.parse({"messages": USER, **body})
    return r, *r.to_router("r", lambda m, t, kw: 10, 100, HERMES)


def completion(**body: Any) -> Any:
    """(The body, its router requests, its plan)."""
    r = CompletionRequest.parse({"prompt": "x", **body})
    return r, *r.to_router("r")


def one_completion(**body: Any) -> Any:
    """``completion`` of one prompt, shaped as ``chat``: (body, its request, plan)."""
    r, (req,), plan = completion(**body)
    return r, req, plan


def invalid(make: Callable[..., Any], **body: Any) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as e:
        make(**body)
    return e.value


# ---------------------------------------------------------------- structured outputs

@pytest.mark.parametrize(("body", "expected"), [
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, StructuredOutput.json_object()),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "thing", "schema": SCHEMA, "strict": True, "description": "d"}}},
     StructuredOutput.json_schema(SCHEMA)),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "any"}}},
     StructuredOutput.json_object()),
    ({"guided_json": SCHEMA}, StructuredOutput.json_schema(SCHEMA)),
    ({"guided_json": '{"type": "object", "properties": {"a": {"type": "integer"}}, '
                     '"required": ["a"]}'}, StructuredOutput.json_schema(SCHEMA)),
    ({"guided_regex": "[a-z]+"}, StructuredOutput.regex("[a-z]+")),
    ({"guided_choice": ["yes", "no"]}, StructuredOutput.choice(["yes", "no"])),
    ({"guided_grammar": 'start: "a"+'}, StructuredOutput.grammar('start: "a"+')),
    ({"structured_outputs": {"json": SCHEMA}}, StructuredOutput.json_schema(SCHEMA)),
    ({"structured_outputs": {"regex": "\\d+"}}, StructuredOutput.regex("\\d+")),
    ({"structured_outputs": {"choice": ["a", "b"]}}, StructuredOutput.choice(["a", "b"])),
    ({"structured_outputs": {"grammar": 'start: "x"'}}, StructuredOutput.grammar('start: "x"')),
    ({"structured_outputs": {"json_object": True}}, StructuredOutput.json_object()),
    ({"structured_outputs": {"json_object": False}}, None),
    ({"response_format": {"type": "structural_tag", **TAG}}, StructuredOutput.structural_tag(TAG)),
    ({"structured_outputs": {"structural_tag": json.dumps(TAG)}},
     StructuredOutput.structural_tag(TAG)),
    ({"structural_tag": json.dumps(TAG)}, StructuredOutput.structural_tag(TAG)),
])
def test_each_field_maps_to_its_constraint(body: dict[str, Any],
                                           expected: StructuredOutput | None) -> None:
    for make in (chat, one_completion):
        _, req, plan = make(**body)
        assert req.params.structured == expected, (make, body)
        assert [c for _, c in plan.grammars] == ([] if expected is None else [expected])
        asyncio.run(check_grammars(plan.grammars))  # each compiles


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"response_format": {"type": "json_object"}, "guided_json": SCHEMA}, "guided_json",
     "response_format and guided_json"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice",
     "guided_regex and guided_choice"),
    ({"guided_grammar": "start: a", "structured_outputs": {"json": SCHEMA}},
     "structured_outputs", "guided_grammar and structured_outputs.json"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs",
     "structured_outputs.regex and structured_outputs.choice"),
])
def test_two_constraints_are_a_400_naming_both(body: dict[str, Any], param: str,
                                               words: str) -> None:
    for make in (chat, completion):
        e = invalid(make, **body)
        assert e.param == param and words in e.message, e.message


@pytest.mark.parametrize(("body", "param"), [
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_json": "[1, 2]"}, "guided_json"),
    ({"guided_json": 5}, "guided_json"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_choice": ["a", ""]}, "guided_choice"),
    ({"guided_regex": ""}, "guided_regex"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": 1}}},
     "response_format"),
    ({"structured_outputs": {"json": "{"}}, "structured_outputs"),
    ({"structured_outputs": {"choice": "a"}}, "structured_outputs"),
    ({"structural_tag": "{"}, "structural_tag"),
    ({"structural_tag": '{"format": {"type": "triggered_tags"}}'}, "structural_tag"),
    ({"response_format": {"type": "structural_tag", "structures": [], "triggers": ["<f"]}},
     "response_format"),
    ({"response_format": {"type": "structural_tag", "triggers": ["<f"], "structures": [
        {"begin": "<g>", "schema": {}, "end": ""}]}}, "response_format"),
    ({"structured_outputs": {"structural_tag": json.dumps(
        {**TAG, "structures": [{"begin": "<function=f>", "end": ""}]})}}, "structured_outputs"),
])
def test_malformed_constraints_are_a_400(body: dict[str, Any], param: str) -> None:
    assert invalid(chat, **body).param == param


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"guided_json": {"type": "bogus"}}, "guided_json", "Invalid type: bogus"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"$ref": "#/nope"}}}}}},
     "response_format", "invalid JSON schema"),
    ({"guided_regex": "a("}, "guided_regex", "unclosed group"),
    ({"guided_grammar": "start: missing_rule"}, "guided_grammar", "missing_rule"),
    ({"structured_outputs": {"grammar": "start: x"}}, "structured_outputs",
     "structured_outputs.grammar"),
    ({"structural_tag": json.dumps({**TAG, "structures": [
        {"begin": "<function=f>", "schema": {"type": "bogus"}, "end": ""}]})},
     "structural_tag", "Invalid type: bogus"),
])
def test_constraints_that_do_not_compile_are_a_400(body: dict[str, Any], param: str,
                                                   words: str) -> None:
    _, _, plan = chat(**body)  # parsing passes; compiling names the field
    with pytest.raises(InvalidRequest) as e:
        asyncio.run(check_grammars(plan.grammars))
    assert e.value.param == param and words in e.value.message, e.value.message
    assert "\n" not in e.value.message  # clients are shown one-line messages only


def test_compiling_is_bounded_in_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """A compile past the limit refuses the request while the compiling thread is still
    at work: the request does not wait for it."""
    compiling = threading.Event()  # set once the refusal is in: the compile may end
    monkeypatch.setattr(api_common, "STRUCTURED_COMPILE_TIMEOUT_S", 0.05)
    monkeypatch.setattr(api_common, "grammar_of", lambda s: compiling.wait(30))
    _, _, plan = chat(guided_regex="a+")

    async def refused() -> InvalidRequest:
        try:
            with pytest.raises(InvalidRequest) as e:  # (waiting, it would compile in 30 s)
                await check_grammars(plan.grammars)
        finally:
            compiling.set()  # (asyncio.run waits for the compiling thread)
        return e.value

    error = asyncio.run(refused())
    assert error.param == "guided_regex"
    assert "too complex to compile within 0.05 s" in error.message


# ---------------------------------------------------------------- logit_bias, priority, n

def test_logit_bias_and_priority() -> None:
    for make in (chat, one_completion):
        _, req, _ = make(logit_bias={"5": -100, "17": 2.5}, priority=-3)
        assert req.params.logit_bias == ((5, -100.0), (17, 2.5))
        assert req.params.priority == -3
        _, req, _ = make()
        assert req.params.logit_bias == () and req.params.priority == 0
    for body in ({"logit_bias": {"x": 1}}, {"logit_bias": {"5": 101}}, {"logit_bias": [1]},
                 {"logit_bias": {str(i): 1 for i in range(1025)}}):
        assert invalid(completion, **body).param == "logit_bias"
    assert invalid(chat, priority=1.5).param == "priority"
    assert invalid(chat, priority=2**63).param == "priority"


def test_n_choices_are_requests_with_their_own_seeds() -> None:
    _, req, _ = one_completion(n=3, seed=7, best_of=3)
    reqs = choice_requests(req, 3)
    assert [(r.request_id, r.params.seed, r.prompt) for r in reqs] == [
        ("r-0", 7, "x"), ("r-1", 8, "x"), ("r-2", 9, "x")]
    assert all(r.params.max_tokens == req.params.max_tokens for r in reqs)
    assert choice_requests(req, 1) == [req]  # one choice: the request as it is
    _, req, _ = chat(n=2)
    assert [(r.request_id, r.params.seed) for r in choice_requests(req, 2)] == [
        ("r-0", None), ("r-1", None)]
    _, req, _ = chat(n=2, seed=2**63 - 1)  # wraps within int64
    assert [r.params.seed for r in choice_requests(req, 2)] == [2**63 - 1, -(2**63)]
    for body, param in (({"n": 0}, "n"), ({"n": 17}, "n"), ({"n": 2, "best_of": 3}, "best_of"),
                        ({"best_of": 2}, "best_of")):
        e = invalid(completion, **body)
        assert e.param == param, e.message
    assert "must equal n" in invalid(completion, best_of=2).message


def test_a_batch_of_prompts_is_a_request_per_prompt() -> None:
    """Prompt-major, as vLLM: prompt p's choices are p * n + i; each prompt's choices
    are seeded as if it came alone, so batching changes no answer."""
    _, reqs, _ = completion(prompt=["a", "b"], n=2, seed=5)
    assert [(q.request_id, q.prompt) for q in reqs] == [("r-0", "a"), ("r-1", "b")]
    assert [(c.request_id, c.prompt, c.params.seed) for q in reqs
            for c in choice_requests(q, 2)] == [
        ("r-0-0", "a", 5), ("r-0-1", "a", 6), ("r-1-0", "b", 5), ("r-1-1", "b", 6)]
    _, reqs, _ = completion(prompt=[[1, 2], [3]])
    assert [(q.request_id, q.prompt_token_ids) for q in reqs] == [("r-0", [1, 2]), ("r-1", [3])]
    _, (one,), _ = completion(prompt=["a"])  # a batch of one: the request as it is
    assert (one.request_id, one.prompt) == ("r", "a")
    assert invalid(completion, prompt=["a"] * 65).param == "prompt"


# ---------------------------------------------------------------- merged responses

def builder(tiny_model: Callable[[str], Path], chat: bool, **kw: Any) -> ResponseBuilder:
    """A chat or a completions response builder."""
    return (ChatBuilder if chat else CompletionBuilder)(
        request_id="r", model="tiny", created=1,
        text=TokenText(Tokenizer.from_dir(tiny_model("llama-gqa"))), logprobs=False, **kw)


def test_whole_response_merges_the_choices(tiny_model: Callable[[str], Path]) -> None:
    for chat_shape in (True, False):
        out = builder(tiny_model, chat_shape, n=2)
        out.add(StreamChunk([1], "b-"), 1)
        out.add(StreamChunk([1], "a"), 0)
        out.add(StreamChunk([1], "b"), 1)
        whole = out.response([FinalChunk("stop", Usage(5, 1, cached_tokens=4)),
                              FinalChunk("length", Usage(5, 2, cached_tokens=0))])
        texts = [c["message"]["content"] if chat_shape else c["text"] for c in whole["choices"]]
        assert texts == ["a", "b-b"]
        assert [c["index"] for c in whole["choices"]] == [0, 1]
        assert [c["finish_reason"] for c in whole["choices"]] == ["stop", "length"]
        assert whole["usage"] == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8,
                                  "prompt_tokens_details": {"cached_tokens": 4}}


def test_usage_counts_each_prompt_once(tiny_model: Callable[[str], Path]) -> None:
    out = builder(tiny_model, False, n=2, prompts=2)
    for i in range(4):
        out.add(StreamChunk([1], str(i)), i)
    whole = out.response([FinalChunk("stop", Usage(5, 1, cached_tokens=4)),
                          FinalChunk("stop", Usage(5, 2, cached_tokens=4)),
                          FinalChunk("stop", Usage(7, 3, cached_tokens=0)),
                          FinalChunk("stop", Usage(7, 4, cached_tokens=0))])
    assert [(c["index"], c["text"]) for c in whole["choices"]] == [
        (0, "0"), (1, "1"), (2, "2"), (3, "3")]
    assert whole["usage"] == {"prompt_tokens": 12, "completion_tokens": 10, "total_tokens": 22,
                              "prompt_tokens_details": {"cached_tokens": 4}}


def test_stream_tags_chunks_and_counts_usage_once(tiny_model: Callable[[str], Path]) -> None:
    out = builder(tiny_model, True, n=2, include_usage=True)
    chunks = [*out.chunk(StreamChunk([1], "x"), 1), *out.chunk(StreamChunk([1], "y"), 0),
              *out.final_chunks(FinalChunk("stop", Usage(5, 1)), 1)]
    assert all(c["usage"] is None for c in chunks)  # no usage before every choice finished
    chunks += out.final_chunks(FinalChunk("length", Usage(5, 4)), 0)
    by_index: dict[int, list[dict[str, Any]]] = {0: [], 1: []}
    for c in chunks[:-1]:
        (choice,) = c["choices"]
        by_index[choice["index"]].append(choice)
    for index, text, reason in ((0, "y", "length"), (1, "x", "stop")):
        deltas = [c["delta"] for c in by_index[index]]
        assert deltas[0] == {"role": "assistant", "content": ""}  # each choice its own role
        assert "".join(d.get("content", "") for d in deltas) == text
        assert [c["finish_reason"] for c in by_index[index]][-1] == reason
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5
    assert chunks[-1]["usage"]["prompt_tokens"] == 5


# ---------------------------------------------------------------- over HTTP

def test_n_choices_over_http(tiny_model: Callable[[str], Path]) -> None:
    router = ChoicesRouter(Tokenizer.from_dir(tiny_model("llama-gqa")))
    router.script = [StreamChunk([5], "a"), StreamChunk([6], "b"), FinalChunk("stop", Usage(4, 2))]

    async def run(c: Client) -> None:
        r = await c.post("/v1/completions", json={"prompt": "x", "n": 3, "seed": 1},
                         headers={"X-Request-Id": "q"})
        whole = r.json()
        assert r.status_code == 200 and whole["id"] == "cmpl-q"
        assert [ch["text"] for ch in whole["choices"]] == ["ab"] * 3
        assert [ch["index"] for ch in whole["choices"]] == [0, 1, 2]
        assert whole["usage"]["prompt_tokens"] == 4 and whole["usage"]["completion_tokens"] == 6
        assert sorted((q.request_id, q.params.seed) for q in router.seen) == [
            ("q-0", 1), ("q-1", 2), ("q-2", 3)]
        events = await sse(c, "/v1/chat/completions", {
            "messages": USER, "n": 2, "stream": True, "stream_options": {"include_usage": True}})
        assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == 4
        finish = [e["choices"][0] for e in events[:-2] if e["choices"][0]["finish_reason"]]
        assert sorted(ch["index"] for ch in finish) == [0, 1]
        for i in (0, 1):
            assert "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-2]
                           if e["choices"][0]["index"] == i) == "ab"

        # One choice fails before its first token: the request's status, the others end.
        router.closed.clear()
        router.scripts = {"f-0": [StreamChunk([5], "a"), 30.0],
                          "f-1": [RouterError(ErrorKind.OVERLOADED, "busy", retry_after_s=1)]}
        r = await c.post("/v1/completions", json={"prompt": "x", "n": 2},
                         headers={"X-Request-Id": "f"})
        assert r.status_code == 429 and r.json()["error"]["message"] == "busy"
        # ... or later: an error event, then [DONE]; the waiting choice is cancelled.
        router.scripts = {"g-0": [StreamChunk([5], "a"), 30.0],
                          "g-1": [StreamChunk([5], "b"), 0.05,
                                  RouterError(ErrorKind.DEADLINE, "too slow")]}
        async with c.stream("POST", "/v1/completions", json={
                "prompt": "x", "n": 2, "stream": True}, headers={"X-Request-Id": "g"}) as s:
            lines = [line async for line in s.aiter_lines() if line.startswith("data: ")]
        assert '"too slow"' in lines[-2] and lines[-1] == "data: [DONE]"
        await until_async("every choice's stream closed",
                          lambda: {"f-0", "f-1", "g-0", "g-1"} <= set(router.closed))

    serve(router, run)


def test_a_batch_of_prompts_over_http(tiny_model: Callable[[str], Path]) -> None:
    """Each prompt's choices start together once its first choice has its first
    token; the response lists every choice prompt-major, whole and streamed."""
    router = ChoicesRouter(Tokenizer.from_dir(tiny_model("llama-gqa")))
    router.script = [StreamChunk([5], "a"), FinalChunk("stop", Usage(4, 1))]
    router.scripts = {"b-1-0": [StreamChunk([6], "b"), FinalChunk("stop", Usage(6, 1))],
                      "b-1-1": [StreamChunk([6], "c"), FinalChunk("stop", Usage(6, 1))]}

    async def run(c: Client) -> None:
        r = await c.post("/v1/completions", json={"prompt": ["x", "y"], "n": 2, "seed": 3},
                         headers={"X-Request-Id": "b"})
        whole = r.json()
        assert r.status_code == 200, whole
        assert [(ch["index"], ch["text"]) for ch in whole["choices"]] == [
            (0, "a"), (1, "a"), (2, "b"), (3, "c")]
        assert whole["usage"]["prompt_tokens"] == 10 and whole["usage"]["completion_tokens"] == 4
        seen = [(q.request_id, q.prompt, q.params.seed) for q in router.seen]
        assert sorted(seen) == [("b-0-0", "x", 3), ("b-0-1", "x", 4), ("b-1-0", "y", 3),
                                ("b-1-1", "y", 4)]
        assert {s[0] for s in seen[:2]} == {"b-0-0", "b-1-0"}  # first choices first
        events = await sse(c, "/v1/completions", {
            "prompt": [[5, 6], [7]], "stream": True, "stream_options": {"include_usage": True}},
            )
        assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == 2
        assert sorted((e["choices"][0]["index"], e["choices"][0]["text"]) for e in events[:-2]
                      if e["choices"][0]["text"]) == [(0, "a"), (1, "a")]

    serve(router, run)


def test_structured_request_over_http(tiny_model: Callable[[str], Path]) -> None:
    router = ChoicesRouter(Tokenizer.from_dir(tiny_model("llama-gqa")))
    router.script = [StreamChunk([5], '{"a": 1}'), FinalChunk("stop", Usage(4, 1))]

    async def run(c: Client) -> None:
        r = await c.post("/v1/chat/completions", json={
            "messages": USER, "response_format": {"type": "json_schema", "json_schema": {
                "name": "t", "schema": SCHEMA}}, "logit_bias": {"5": 3}, "priority": 2})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == '{"a": 1}'
        (req,) = router.seen
        assert req.params.structured == StructuredOutput.json_schema(SCHEMA)
        assert req.params.logit_bias == ((5, 3.0),) and req.params.priority == 2
        for body, param in (({"guided_regex": "a("}, "guided_regex"),
                            ({"guided_json": SCHEMA, "guided_regex": "a"}, "guided_regex")):
            r = await c.post("/v1/completions", json={"prompt": "x", **body})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        assert len(router.seen) == 1  # refused before reaching the router

    serve(router, run)
