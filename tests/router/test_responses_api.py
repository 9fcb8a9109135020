"""OpenAI's Responses API (``POST /v1/responses``, ``router/openai/responses/``): a
body maps to the chat body that asks for the same (messages, tools, format, limits),
the chat result maps back to output items, whole and as the typed stream events, and
bad input is a 400 naming the Responses field. Over HTTP with a scripted router (exact
texts, tool calls, failures) and with a real in-process pair (the same answer as the
chat endpoint, token for token)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pdserve.engine.sampling.structured import StructuredOutput
from pdserve.engine.tokenizer import Tokenizer
from pdserve.router.openai.request_models import validate_body
from pdserve.router.openai.responses.request import REFUSED_RESPONSES, ResponsesRequest
from pdserve.router.openai.responses.store import ResponseStore
from pdserve.router.types import ErrorKind, FinalChunk, RouterError, StreamChunk, Usage
from tests.inprocess import Pair
from tests.router.http_helpers import GREEDY, HERMES_CALL, LEAKY, ChoicesRouter, Client, serve

WEATHER: dict[str, Any] = {"type": "function", "name": "get_weather", "description": "Weather",
                           "parameters": {"type": "object", "properties": {
                               "city": {"type": "string"}}, "required": ["city"]}}
SCHEMA: dict[str, Any] = {"type": "object", "properties": {"a": {"type": "integer"}},
                          "required": ["a"]}


async def events(client: Client, body: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """The (event, data) pairs of one streamed response."""
    async with client.stream("POST", "/v1/responses", json={**body, "stream": True}) as r:
        assert r.status_code == 200, await r.aread()
        text = (await r.aread()).decode()
    out = []
    for block in text.strip().split("\n\n"):
        event, data = block.split("\n")
        assert event.startswith("event: ") and data.startswith("data: "), block
        out.append((event[7:], json.loads(data[6:])))
        assert out[-1][1]["type"] == out[-1][0]
    assert [d["sequence_number"] for _, d in out] == list(range(len(out)))
    return out


def parsed(body: dict[str, Any]) -> dict[str, Any]:
    r: ResponsesRequest = validate_body(ResponsesRequest, body, REFUSED_RESPONSES)
    return r.to_chat_body()


def test_a_conversation_maps_to_chat_messages() -> None:
    body = parsed({"instructions": "Be brief.", "input": [
        {"role": "developer", "content": "Use tools."},
        {"role": "user", "content": [{"type": "input_text", "text": "Weather in "},
                                     {"type": "input_text", "text": "Paris?"}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Checking.", "annotations": []}]},
        {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"city": "Paris"}', "status": "completed"},
        {"type": "function_call", "call_id": "call_2", "name": "get_weather",
         "arguments": '{"city": "Lyon"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "call_2",
         "output": [{"type": "input_text", "text": "rain"}]}],
        "tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_weather"},
        "parallel_tool_calls": False, "max_output_tokens": 7, "temperature": 0.5, "seed": 3,
        "text": {"format": {"type": "json_schema", "name": "t", "schema": SCHEMA}},
        "include": ["message.output_text.logprobs"], "top_logprobs": 2, "stream": True,
        "store": True, "metadata": {"k": "v"}, "user": "u", "reasoning": {"effort": None},
        "truncation": "disabled", "max_tool_calls": 3})
    calls = [{"id": f"call_{i}", "type": "function", "function": {
        "name": "get_weather", "arguments": json.dumps({"city": city})}}
        for i, city in ((1, "Paris"), (2, "Lyon"))]
    assert body == {
        "messages": [{"role": "system", "content": "Be brief."},
                     {"role": "system", "content": "Use tools."},
                     {"role": "user", "content": "Weather in Paris?"},
                     {"role": "assistant", "content": "Checking.", "tool_calls": calls},
                     {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
                     {"role": "tool", "tool_call_id": "call_2", "content": "rain"}],
        "tools": [{"type": "function", "function": {k: v for k, v in WEATHER.items()
                                                    if k != "type"}}],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "parallel_tool_calls": False, "max_completion_tokens": 7, "temperature": 0.5,
        "seed": 3, "response_format": {"type": "json_schema", "json_schema": {
            "name": "t", "schema": SCHEMA}},
        "logprobs": True, "top_logprobs": 2, "stream": True,
        "stream_options": {"include_usage": True}}
    # calls with no text before them are an assistant message of their own
    body = parsed({"input": [{"type": "function_call", "call_id": "c", "name": "f",
                              "arguments": "{}"}]})
    assert body["messages"] == [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]
    assert parsed({"input": "hi"}) == {"messages": [{"role": "user", "content": "hi"}],
                                       "parallel_tool_calls": True}


def test_text_answers_whole_and_streamed(tiny_model: Callable[[str], Path]) -> None:
    router = ChoicesRouter(Tokenizer.from_dir(tiny_model("llama-gqa")))
    router.script = [StreamChunk([5], "Hello"), StreamChunk([6], " there"),
                     FinalChunk("stop", Usage(4, 2, cached_tokens=2))]
    body = {"input": "hi", "max_output_tokens": 9, "metadata": {"k": "v"}, "store": True,
            "temperature": 0.3}

    async def run(c: Client) -> None:
        r = await c.post("/v1/responses", json=body, headers={"X-Request-Id": "q"})
        assert r.status_code == 200, r.text
        whole = r.json()
        assert whole["id"].startswith("resp_") and whole["object"] == "response"
        assert whole["id"] != "resp_q" and len(whole["id"]) == 37  # random: resp_ + 32 hex
        assert whole["status"] == "completed" and whole["incomplete_details"] is None
        assert whole["store"] is True and whole["metadata"] == {"k": "v"}
        assert whole["max_output_tokens"] == 9 and whole["temperature"] == 0.3
        assert whole["text"] == {"format": {"type": "text"}} and whole["tool_choice"] == "none"
        assert whole["output"] == [{
            "type": "message", "id": "msg_" + whole["id"][5:], "status": "completed",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "Hello there", "annotations": [],
                         "logprobs": []}]}]
        assert whole["usage"] == {"input_tokens": 4, "input_tokens_details": {"cached_tokens": 2},
                                  "output_tokens": 2,
                                  "output_tokens_details": {"reasoning_tokens": 0},
                                  "total_tokens": 6}
        req = router.seen[-1]
        assert req.params.max_tokens == 9 and req.params.temperature == 0.3
        assert req.messages == [{"role": "user", "content": "hi"}]

        got = await events(c, {**body, "stream": True})
        assert [e for e, _ in got] == [
            "response.created", "response.in_progress", "response.output_item.added",
            "response.content_part.added", "response.output_text.delta",
            "response.output_text.delta", "response.output_text.done",
            "response.content_part.done", "response.output_item.done", "response.completed"]
        assert got[0][1]["response"]["status"] == "in_progress"
        assert [d["delta"] for e, d in got if e == "response.output_text.delta"] == [
            "Hello", " there"]
        assert got[6][1]["text"] == "Hello there"
        assert got[6][1]["item_id"] == got[-1][1]["response"]["output"][0]["id"]
        assert got[-1][1]["response"] == {**whole, "created_at": got[-1][1]["response"][
            "created_at"], "id": got[-1][1]["response"]["id"],
            "output": [{**whole["output"][0], "id": got[-1][1]["response"]["output"][0]["id"]}]}

        # cut by max_output_tokens: incomplete, whole and streamed
        router.script = [StreamChunk([5], "Hel"), FinalChunk("length", Usage(4, 1))]
        whole = (await c.post("/v1/responses", json=body)).json()
        assert whole["status"] == "incomplete" and whole["output"][0]["status"] == "incomplete"
        assert whole["incomplete_details"] == {"reason": "max_output_tokens"}
        got = await events(c, body)  # completed, as vLLM sends it (AIPerf reads only that)
        assert got[-1][0] == "response.completed"
        assert got[-1][1]["response"]["status"] == "incomplete"
        assert got[-1][1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
        # nothing came out: still one (empty) message
        router.script = [FinalChunk("stop", Usage(4, 1))]
        got = await events(c, body)
        assert got[-1][1]["response"]["output"][0]["content"][0]["text"] == ""
        assert (await c.post("/v1/responses", json=body)).json()["output"][0]["content"][0][
            "text"] == ""

    serve(router, run)


def test_function_calls_whole_and_streamed(tiny_model: Callable[[str], Path]) -> None:
    router = ChoicesRouter(Tokenizer.from_dir(tiny_model("llama-gqa")))
    router.script = [StreamChunk([4], "Let me check. "), StreamChunk([5], HERMES_CALL[:15]),
                     StreamChunk([6], HERMES_CALL[15:]), FinalChunk("stop", Usage(9, 3))]
    body = {"input": "Weather in Paris?", "tools": [WEATHER], "tool_choice": "required"}

    async def run(c: Client) -> None:
        whole = (await c.post("/v1/responses", json=body)).json()
        assert whole["status"] == "completed" and whole["tool_choice"] == "required"
        assert whole["tools"] == [WEATHER]
        message, call = whole["output"]
        assert message["content"][0]["text"] == "Let me check."
        assert call["type"] == "function_call" and call["name"] == "get_weather"
        assert call["call_id"].startswith("call_") and call["id"].startswith("fc_")
        assert json.loads(call["arguments"]) == {"city": "Paris"}
        assert call["status"] == "completed"
        (req,) = router.seen
        assert req.params.structured is not None  # required: the call grammar
        assert isinstance(req.params.structured, StructuredOutput)

        got = await events(c, body)
        kinds = [e for e, _ in got]
        assert kinds[kinds.index("response.output_item.done") + 1:] == [
            "response.output_item.added", "response.function_call_arguments.delta",
            "response.function_call_arguments.done", "response.output_item.done",
            "response.completed"]
        added = got[kinds.index("response.output_item.added", 3)][1]
        assert added["output_index"] == 1 and added["item"]["arguments"] == ""
        done = got[kinds.index("response.function_call_arguments.done")][1]
        assert json.loads(done["arguments"]) == {"city": "Paris"} and done["output_index"] == 1
        final = got[-1][1]["response"]["output"]
        assert [i["type"] for i in final] == ["message", "function_call"]
        assert final[1]["arguments"] == done["arguments"]

        # the calls' results, sent back as input items, reach the model as tool messages
        r = await c.post("/v1/responses", json={**body, "tool_choice": "auto", "input": [
            {"role": "user", "content": "Weather in Paris?"}, *whole["output"],
            {"type": "function_call_output", "call_id": call["call_id"], "output": "sunny"}]})
        assert r.status_code == 200, r.text
        assert "sunny" in json.dumps(router.seen[-1].messages)

    serve(router, run)


def test_previous_response_id_continues_a_kept_conversation(
        tiny_model: Callable[[str], Path]) -> None:
    router = ChoicesRouter(Tokenizer.from_dir(tiny_model("llama-gqa")))
    router.script = [StreamChunk([5], "Paris."), FinalChunk("stop", Usage(4, 1))]

    async def run(c: Client) -> None:
        first = (await c.post("/v1/responses", json={"instructions": "Be brief.",
                                                     "input": "Capital of France?"},
                              headers={"X-Request-Id": "a"})).json()
        assert first["id"] != "resp_a" and first["store"] is True  # random, not the request id
        assert (await c.get(f"/v1/responses/{first['id']}")).json() == first
        metrics = (await c.get("/metrics")).text
        assert 'pdserve_responses_kept{model="tiny"} 1.0' in metrics
        assert re.search(r'pdserve_responses_kept_bytes\{model="tiny"\} [1-9]', metrics)
        assert (await c.get("/v1/responses/resp_a")).status_code == 404
        # continued, streamed: the first turn (not its instructions), its answer, then this
        router.script = [StreamChunk([6], HERMES_CALL), FinalChunk("stop", Usage(9, 2))]
        got = await events(c, {"input": "And its weather?", "previous_response_id": first["id"],
                               "tools": [WEATHER], "stream": True})
        assert [m for m in router.seen[-1].messages if m["role"] != "system"] == [
            {"role": "user", "content": "Capital of France?"},
            {"role": "assistant", "content": "Paris."},
            {"role": "user", "content": "And its weather?"}]
        second = got[-1][1]["response"]
        assert second["previous_response_id"] == first["id"]
        seen = json.dumps(router.seen[-1].messages)
        assert "Capital of France?" in seen and "Paris." in seen and "And its weather?" in seen
        assert "Be brief." not in seen  # instructions are not carried over
        call = second["output"][0]
        assert call["type"] == "function_call"
        # a third turn answers the call by its call_id alone
        router.script = [StreamChunk([5], "Sunny."), FinalChunk("stop", Usage(9, 1))]
        third = (await c.post("/v1/responses", json={
            "previous_response_id": second["id"], "input": [
                {"type": "function_call_output", "call_id": call["call_id"],
                 "output": "sunny"}]})).json()
        assert third["output"][0]["content"][0]["text"] == "Sunny."
        roles = [m["role"] for m in router.seen[-1].messages]
        assert roles == ["user", "assistant", "user", "assistant", "tool"], roles
        assert "get_weather" in router.seen[-1].messages[3]["content"]
        assert "sunny" in router.seen[-1].messages[4]["content"]
        # store false: answered, not kept; an unknown or forgotten id is a 404 / 400
        r = (await c.post("/v1/responses", json={"input": "x", "store": False})).json()
        assert r["store"] is False
        assert (await c.get(f"/v1/responses/{r['id']}")).status_code == 404
        r = await c.delete(f"/v1/responses/{third['id']}")
        assert r.json() == {"id": third["id"], "object": "response", "deleted": True}
        assert (await c.delete(f"/v1/responses/{third['id']}")).status_code == 404
        r = await c.post("/v1/responses", json={"input": "x",
                                                "previous_response_id": third["id"]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "previous_response_id"

    serve(router, run)


def test_the_store_keeps_the_last_ones() -> None:
    store = ResponseStore(limit=2)
    for i in range(3):
        r = validate_body(ResponsesRequest, {"input": f"q{i}"})
        store.keep(r, {"id": f"resp_{i}", "output": []})
    assert store.get("resp_0") is None and store.get("resp_2") is not None
    continued = store.continued(validate_body(ResponsesRequest, {
        "input": "next", "previous_response_id": "resp_1"}))
    assert continued.to_chat_body()["messages"] == [{"role": "user", "content": "q1"},
                                                {"role": "user", "content": "next"}]
    # using one keeps it longest: resp_1 was used, so resp_2 goes first
    store.keep(continued, {"id": "resp_3", "output": []})
    assert store.get("resp_1") is not None and store.get("resp_2") is None
    r = validate_body(ResponsesRequest, {"input": "x", "store": False})
    store.keep(r, {"id": "resp_4", "output": []})
    assert store.get("resp_4") is None
    # a bound on bytes too: a long conversation pushes older ones out
    store = ResponseStore(limit=10, max_bytes=3000)
    for i in range(3):
        store.keep(validate_body(ResponsesRequest, {"input": "x" * 1000}),
                   {"id": f"resp_{i}", "output": []})
    assert store.get("resp_0") is None and store.get("resp_1") and store.get("resp_2")
    store.keep(validate_body(ResponsesRequest, {"input": "x" * 5000}),
               {"id": "resp_big", "output": []})  # alone over the bound: not even itself
    assert all(store.get(f"resp_{i}") is None for i in (1, 2, "big"))


def test_logprobs_and_structured_output(tiny_model: Callable[[str], Path]) -> None:
    router = ChoicesRouter(Tokenizer.from_dir(tiny_model("llama-gqa")))
    router.script = [StreamChunk([5], '{"a": 1}'), FinalChunk("stop", Usage(4, 1))]
    body: dict[str, Any] = {"input": "x", "text": {"format": {"type": "json_schema", "name": "t",
                                              "schema": SCHEMA, "strict": True}}}

    async def run(c: Client) -> None:
        whole = (await c.post("/v1/responses", json=body)).json()
        assert whole["output"][0]["content"][0]["text"] == '{"a": 1}'
        assert whole["text"]["format"] == body["text"]["format"]
        assert router.seen[-1].params.structured == StructuredOutput.json_schema(SCHEMA)
        assert router.seen[-1].params.logprobs is None
        lp = {"include": ["message.output_text.logprobs"], "top_logprobs": 3}
        await c.post("/v1/responses", json={"input": "x", **lp})
        assert router.seen[-1].params.logprobs == 3

    serve(router, run)


def test_a_failure_mid_stream_is_response_failed(tiny_model: Callable[[str], Path]) -> None:
    router = ChoicesRouter(Tokenizer.from_dir(tiny_model("llama-gqa")))
    router.script = [StreamChunk([5], "a"), RouterError(ErrorKind.INTERNAL, LEAKY)]

    async def run(c: Client) -> None:
        got = await events(c, {"input": "x"})
        assert got[-1][0] == "response.failed"
        failed = got[-1][1]["response"]
        assert failed["status"] == "failed" and failed["error"]["code"] == "server_error"
        assert failed["error"]["message"].startswith("internal error (request id ")
        assert "4242" not in json.dumps(got)
        assert failed["output"][0]["content"][0]["text"] == "a"
        # before the first token: the error's status, as for chat
        router.script = [RouterError(ErrorKind.OVERLOADED, "busy", retry_after_s=2.0)]
        r = await c.post("/v1/responses", json={"input": "x", "stream": True})
        assert r.status_code == 429 and r.headers["retry-after"] == "2"

    serve(router, run)


BAD = [
    ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id",
     "not a response this server keeps"),
    ({"input": "x", "conversation": "conv_1"}, "conversation", "previous_response_id"),
    ({"input": "x", "background": True}, "background", "background"),
    ({"input": "x", "foo_bar": 1, "reasoning": {"effort": "high"}}, "foo_bar",
     "unknown field 'foo_bar'"),  # (reasoning: ignored, test_http_api.py)
    ({"input": "x", "truncation": "auto"}, "truncation", "truncation"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
     "input", "input"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input", "item_reference"),
    ({"input": []}, "input", "input"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools", "tools"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens", "max_output_tokens"),
    ({"input": "x", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}},
     "tool_choice", "nope"),
    ({"input": "x", "tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"input": "x", "tools": [{**WEATHER, "parameters": {"type": "bogus"}}]}, "tools",
     "tools[0].parameters"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "t",
                                        "schema": {"type": "bogus"}}}}, "text", "text.format"),
    ({"input": "x", "include": ["file_search_call.results"]}, "include", "include"),
    ({"input": "x", "top_logprobs": 30}, "top_logprobs", "top_logprobs"),
    ({"input": "x", "model": "other"}, None, "other"),
    (["x"], None, "JSON object"),
]


@pytest.mark.parametrize(("body", "param", "said"), BAD, ids=[str(p) for _, p, _ in BAD])
def test_bad_input_is_a_400_naming_the_field(tiny_model: Callable[[str], Path], body: Any,
                                             param: str | None, said: str) -> None:
    router = ChoicesRouter(Tokenizer.from_dir(tiny_model("llama-gqa")))
    router.script = [FinalChunk("stop", Usage(1, 0))]

    async def run(c: Client) -> None:
        r = await c.post("/v1/responses", json=body)
        assert r.status_code in (400, 404), r.text
        err = r.json()["error"]
        assert err["param"] == param and said in err["message"], err
        assert router.seen == []  # refused before reaching the router

    serve(router, run)


def test_the_same_answer_as_chat(pair_factory: Callable[..., Pair]) -> None:
    """A real pair: greedy, the response's text is the chat completion's, token for
    token, whole and streamed, and the usage counts the same prompt."""
    pair = pair_factory()
    messages = [{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"}]

    async def run(c: Client) -> None:
        chat = (await c.post("/v1/chat/completions", json={
            **GREEDY, "messages": messages, "max_tokens": 12})).json()
        body = {**GREEDY, "instructions": "sys", "input": "hi", "max_output_tokens": 12}
        whole = (await c.post("/v1/responses", json=body)).json()
        text = chat["choices"][0]["message"]["content"]
        assert whole["output"][0]["content"][0]["text"] == text
        assert whole["usage"]["input_tokens"] == chat["usage"]["prompt_tokens"]
        assert whole["usage"]["output_tokens"] == 12 and whole["status"] == "incomplete"
        got = await events(c, body)
        assert "".join(d["delta"] for e, d in got if e == "response.output_text.delta") == text
        assert got[-1][1]["response"]["usage"]["output_tokens"] == 12

    serve(pair, run)


def test_the_openai_sdk_reads_it(pair_factory: Callable[..., Pair]) -> None:
    """The ``openai`` client's own Responses types and stream helper accept the
    answers (run in a thread: the SDK's sync client against the served app)."""
    import asyncio

    import openai

    pair = pair_factory()

    async def run(c: Client) -> None:
        def use() -> None:
            client = openai.OpenAI(base_url=str(c.base_url).rstrip("/") + "/v1", api_key="x")
            r = client.responses.create(model="tiny", input="hi", max_output_tokens=5,
                                        temperature=0, extra_body={"ignore_eos": True})
            assert r.status == "incomplete" and r.usage is not None
            assert r.usage.output_tokens == 5 and isinstance(r.output_text, str)
            with client.responses.stream(model="tiny", input="hi", max_output_tokens=5,
                                         temperature=0, extra_body={"ignore_eos": True}
                                         ) as stream:
                kinds = {event.type for event in stream}
                final = stream.get_final_response()  # also when the limit cut it
            assert {"response.created", "response.output_text.delta"} <= kinds
            assert final.status == "incomplete" and final.output_text == r.output_text
            again = client.responses.create(model="tiny", input="more", max_output_tokens=3,
                                            previous_response_id=r.id)
            assert again.previous_response_id == r.id and again.store
            assert client.responses.retrieve(again.id).output_text == again.output_text
            client.responses.delete(again.id)
            with pytest.raises(openai.NotFoundError):
                client.responses.retrieve(again.id)

        await asyncio.to_thread(use)

    serve(pair, run)


def test_pdserve_bench_client_reads_the_stream(tiny_model: Callable[[str], Path]) -> None:
    """``pdserve bench --endpoint /v1/responses``: its client takes the text from the
    delta events, usage and finish from response.completed, an error from
    response.failed."""
    from pdserve.client.openai_stream import OpenAIStreamClient, request_body

    router = ChoicesRouter(Tokenizer.from_dir(tiny_model("llama-gqa")))
    router.script = [StreamChunk([5], "Hel"), StreamChunk([6], "lo"),
                     FinalChunk("length", Usage(4, 2))]

    async def run(c: Client) -> None:
        body = request_body("/v1/responses", "tiny", "hi", 2, True)
        assert body["input"] == "hi" and body["max_output_tokens"] == 2
        async with OpenAIStreamClient(str(c.base_url)) as client:
            out = await client.stream("/v1/responses", body)
            assert out.success and out.generated_text == "Hello", out.error
            assert out.usage_reported and out.output_tokens == 2 and out.prompt_len == 4
            assert out.finish_reason == "length" and len(out.itl) == 1
            router.script = [StreamChunk([5], "a"), RouterError(ErrorKind.INTERNAL, "boom")]
            out = await client.stream("/v1/responses", body)
            assert not out.success and out.error.startswith("stream error: internal error")
        assert router.seen[0].params.max_tokens == 2 and router.seen[0].params.ignore_eos

    serve(router, run)
