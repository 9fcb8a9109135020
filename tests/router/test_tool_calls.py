"""Tool calling: the family syntaxes (``router/openai/tool_parsers/``) -- parsing whole and
streamed outputs, the forcing grammar, prompt rendering -- the request mapping of
``tools`` / ``tool_choice`` (``openai.chat_request``), and the response shapes, whole and
streamed, through the HTTP API over a scripted router."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import llguidance
import pytest

from pdserve.engine.model.tiny import CHAT_TEMPLATE
from pdserve.engine.sampling.structured import StructuredOutput, grammar_of
from pdserve.engine.tokenizer import Tokenizer
from pdserve.router.openai.chat_request import ChatCompletionRequest
from pdserve.router.openai.chat_response import ChatBuilder
from pdserve.router.openai.request_models import InvalidRequest
from pdserve.router.openai.response_objects import TokenText
from pdserve.router.openai.tool_parsers import syntax_for
from pdserve.router.openai.tool_parsers.base import ToolCall, ToolSyntax, call_deltas
from pdserve.router.openai.tool_parsers.hermes import HERMES
from pdserve.router.openai.tool_parsers.llama3 import LLAMA3
from pdserve.router.types import FinalChunk, StreamChunk, Usage
from tests.router.http_helpers import HERMES_CALL, Client, ScriptedRouter, serve, sse

WEATHER: dict[str, Any] = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
TIME: dict[str, Any] = {"type": "function", "function": {"name": "get_time"}}  # no parameters
USER = [{"role": "user", "content": "Weather in Paris?"}]


def calls_of(events: list[Any]) -> list[tuple[str, str]]:
    return [(e.name, e.arguments) for e in events if isinstance(e, ToolCall)]


# ---------------------------------------------------------------- parsing

@pytest.mark.parametrize(("text", "content", "calls"), [
    (HERMES_CALL, None, [("get_weather", '{"city": "Paris"}')]),
    # text before, two calls, compact or spaced JSON, arguments as a JSON string
    ('Let me check.\n' + HERMES_CALL + '\n<tool_call>\n{"name":"get_time","arguments":{}}'
     '\n</tool_call>', "Let me check.", [("get_weather", '{"city": "Paris"}'),
                                         ("get_time", "{}")]),
    ('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>', None,
     [("f", '{"a": 1}')]),
    ("no call here", "no call here", []),
    ("  spaced  ", "  spaced  ", []),  # without calls the text is kept as it is
    # malformed: not JSON, no name, arguments not an object -> content
    ('<tool_call>\n{"name": "f", "arguments": {\n</tool_call>',
     '<tool_call>\n{"name": "f", "arguments": {\n</tool_call>', []),
    ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
    ('<tool_call>{"name": "f", "arguments": 3}</tool_call>',
     '<tool_call>{"name": "f", "arguments": 3}</tool_call>', []),
    # the output ended before </tool_call>: a whole JSON still counts
    ('<tool_call>\n{"name": "f", "arguments": {}}\n', None, [("f", "{}")]),
    # ... or inside it (max_tokens cut the tag, a few tokens long): still a call
    ('<tool_call>\n{"name": "f", "arguments": {}}\n</tool_', None, [("f", "{}")]),
    (HERMES_CALL + '\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}</', None,
     [("get_weather", '{"city": "Paris"}'), ("f", '{"a": 1}')]),
    ('<tool_call>\n{"name": "f", "arguments": {}}\n</tool_x',
     '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_x', []),
    ('<tool_call>\n{"name": "f", "argu', '<tool_call>\n{"name": "f", "argu', []),
    ("a <tool_c", "a <tool_c", []),  # a held-back prefix of the marker comes out
])
def test_hermes_parse(text: str, content: str | None, calls: list[tuple[str, str]]) -> None:
    got_content, got = HERMES.parse(text)
    assert got_content == content
    assert [(c.name, c.arguments) for c in got] == calls
    assert all(c.id.startswith("call_") and len(c.id) > 20 for c in got)
    assert len({c.id for c in got}) == len(got)


@pytest.mark.parametrize(("text", "content", "calls"), [
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', None,
     [("get_weather", '{"city": "Paris"}')]),
    ('<|python_tag|>{"name": "f", "arguments": {"a": [1, 2]}}', None, [("f", '{"a": [1, 2]}')]),
    (' {"name": "f", "parameters": {}}; {"name": "g", "parameters": {"x": 1}}', None,
     [("f", "{}"), ("g", '{"x": 1}')]),
    ("It is sunny.", "It is sunny.", []),
    ('{"answer": 42}', '{"answer": 42}', []),  # JSON that is not a call: content
    ('{"name": "f", "parameters": {}} and more', '{"name": "f", "parameters": {}} and more', []),
    ('{"name": "f", "parameters": {', '{"name": "f", "parameters": {', []),
])
def test_llama3_parse(text: str, content: str | None, calls: list[tuple[str, str]]) -> None:
    got_content, got = LLAMA3.parse(text)
    assert got_content == content
    assert [(c.name, c.arguments) for c in got] == calls


@pytest.mark.parametrize("syntax", [HERMES, LLAMA3])
@pytest.mark.parametrize("text", [
    "Plain answer with <b>tags</b> and < signs.",
    "Checking.\n" + HERMES_CALL + "\n" + HERMES_CALL.replace("Paris", "Oslo") + "\nDone.",
    '{"name": "get_weather", "parameters": {"city": "Paris"}}',
    '<tool_call>\n{"name": "f", "arguments": {\n</tool_call> tail',
    HERMES_CALL + '\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_',
])
def test_streamed_parse_matches_whole(syntax: ToolSyntax, text: str) -> None:
    # Fed one character at a time: nothing shown early, the same calls and content.
    stream = syntax.stream()
    events = [e for ch in text for e in stream.feed(ch)] + stream.finish()
    content, calls = syntax.parse(text)
    assert calls_of(events) == [(c.name, c.arguments) for c in calls]
    shown = "".join(e for e in events if isinstance(e, str))
    assert (shown.strip() or None) == (content.strip() or None if content else None)
    if not calls:
        assert shown == text


def test_hermes_stream_holds_back_a_possible_call() -> None:
    s = HERMES.stream()
    assert s.feed("Hi <tool") == ["Hi"]  # "<tool" could open a call; the space waits too
    assert s.feed("_call>\n{\"name\": \"f\", ") == []
    events = s.feed('"arguments": {}}\n</tool_call>')
    assert calls_of(events) == [("f", "{}")]
    assert s.feed("\n") == [] and s.finish() == []  # whitespace after calls is dropped
    s = HERMES.stream()
    assert s.feed("x <tool") == ["x"] and s.feed("box") == [" <toolbox"]


def test_syntax_for_picks_the_family() -> None:
    assert syntax_for(CHAT_TEMPLATE) is HERMES  # ChatML, as the default model's
    assert syntax_for(None) is HERMES
    llama = ('{%- if tools %}Respond in the format {"name": function name, "parameters": '
             'dictionary}{% endif %}<|python_tag|>')
    assert syntax_for(llama) is LLAMA3
    qwen = '{{- "<tool_call>\\n{\\"name\\": <function-name>, \\"parameters\\": ..." }}'
    assert syntax_for(qwen) is HERMES


# ---------------------------------------------------------------- grammar

def _matches(tok: Tokenizer, grammar: str, text: str) -> bool:
    ll = llguidance.LLTokenizer(tok.backend.to_str(), n_vocab=tok.vocab_size,
                                eos_token=sorted(tok.eos_token_ids))
    m = llguidance.LLMatcher(ll, grammar, log_level=0)
    return m.consume_tokens(tok.encode(text, add_special_tokens=False)) and m.is_accepting()


def test_forcing_grammar_compiles_and_takes_compact_calls(
        tiny_model: Callable[[str], Path]) -> None:
    tok = Tokenizer.from_dir(tiny_model("llama-gqa"))
    functions = [WEATHER["function"], TIME["function"]]
    one = grammar_of(StructuredOutput.grammar(HERMES.grammar(functions, parallel=False)))
    many = grammar_of(StructuredOutput.grammar(HERMES.grammar(functions, parallel=True)))
    time_call = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    assert _matches(tok, one, HERMES_CALL) and _matches(tok, one, time_call)
    assert not _matches(tok, one, HERMES_CALL + "\n" + time_call)
    assert _matches(tok, many, HERMES_CALL + "\n" + time_call)
    assert not _matches(tok, one, HERMES_CALL.replace(": ", ":"))  # compact JSON only
    assert not _matches(tok, one, HERMES_CALL.replace("get_weather", "get_wether"))
    assert not _matches(tok, one, HERMES_CALL.replace('"city"', '"town"'))
    assert not _matches(tok, one, time_call.replace("{}", '{"x": 1}'))  # no parameters
    llama = grammar_of(StructuredOutput.grammar(LLAMA3.grammar(functions, parallel=True)))
    call = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    assert _matches(tok, llama, call) and _matches(tok, llama, f"{call}; {call}")
    assert LLAMA3.parse(f"{call}; {call}")[1][1].name == "get_weather"


# ---------------------------------------------------------------- requests

def chat(syntax: ToolSyntax = HERMES, native: bool = False, **body: Any) -> Any:
    """(The body, its router request, its plan)."""
    r = ChatCompletionRequest.parse({"messages": USER, **body})
    return r, *r.to_router("r", lambda m, t, kw: 10, 100, syntax, native)


def test_auto_renders_tools_and_parses_without_constraint() -> None:
    _, req, plan = chat(tools=[WEATHER, TIME])  # tool_choice defaults to auto
    assert req.params.structured is None and plan.tools is HERMES
    system, user = req.messages
    assert system["role"] == "system" and user == USER[0]
    assert "<tools>\n" + json.dumps(WEATHER) in system["content"]
    assert '{"type": "function", "function": {"name": "get_time"}}' in system["content"]
    assert "<tool_call>" in system["content"]
    # the parameters schemas are checked (compiled) before the request runs
    assert [name for name, _ in plan.grammars] == ["tools[0].function.parameters"]


def test_none_renders_no_tools() -> None:
    _, req, plan = chat(tools=[WEATHER], tool_choice="none")
    assert req.messages == USER and plan.tools is None and req.params.structured is None
    _, req, plan = chat(tool_choice="none")  # harmless without tools
    assert plan.tools is None


def test_required_and_named_constrain_the_output() -> None:
    _, req, plan = chat(tools=[WEATHER, TIME], tool_choice="required")
    assert req.params.structured == StructuredOutput.grammar(
        HERMES.grammar([WEATHER["function"], TIME["function"]], parallel=True))
    assert plan.grammars[-1] == ("tool_choice", req.params.structured)
    _, req, _ = chat(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False)
    assert req.params.structured == StructuredOutput.grammar(
        HERMES.grammar([WEATHER["function"], TIME["function"]], parallel=False))
    _, req, plan = chat(LLAMA3, tools=[WEATHER, TIME],
                        tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert req.params.structured == StructuredOutput.grammar(
        LLAMA3.grammar([TIME["function"]], parallel=False))
    assert plan.tools is LLAMA3 and "Respond in the format" in req.messages[0]["content"]


def test_history_with_calls_and_results_is_rendered(tiny_model: Callable[[str], Path]) -> None:
    messages = [
        {"role": "system", "content": "Be brief."}, *USER,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    _, req, _ = chat(messages=messages, tools=[WEATHER])
    assert [m["role"] for m in req.messages] == ["system", "user", "assistant", "tool"]
    assert req.messages[0]["content"].startswith("Be brief.\n\n# Tools")
    assert req.messages[2]["content"] == HERMES_CALL
    assert req.messages[3]["content"] == "<tool_response>\nsunny\n</tool_response>"
    # A ChatML template (as the default model's) renders all of it.
    text = Tokenizer.from_dir(tiny_model("llama-gqa")).render_chat(req.messages)
    assert "<|im_start|>tool\n<tool_response>" in text and HERMES_CALL in text
    _, req, _ = chat(LLAMA3, messages=messages)  # no tools declared: history only
    assert req.messages[2]["content"] == (
        '{"name": "get_weather", "parameters": {"city": "Paris"}}')
    assert req.messages[3]["content"] == "sunny" and req.messages[0]["content"] == "Be brief."


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"tools": [{"type": "function"}]}, "tools", "function"),
    ({"tools": [{"type": "function", "function": {"description": "x"}}]}, "tools", "name"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools", "pattern"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}, "tools",
     "dict"),
    ({"tools": [WEATHER, WEATHER]}, "tools", "twice"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tool_choice": "auto"}, "tool_choice", "needs tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "'nope'"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice", "response_format and tool_choice"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [{
        "id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]},
     "messages", "only allowed in assistant"),
    ({"messages": [{"role": "tool", "content": None}]}, "messages", "content is required"),
])
def test_invalid_tools_are_a_400_naming_the_field(body: dict[str, Any], param: str,
                                                  words: str) -> None:
    with pytest.raises(InvalidRequest) as e:
        chat(**body)
    assert e.value.param == param and words in e.value.message, e.value.message


# ---------------------------------------------------------------- responses

def builder(tiny_model: Callable[[str], Path], **kw: Any) -> ChatBuilder:
    return ChatBuilder(request_id="r", model="tiny", created=1,
                       text=TokenText(Tokenizer.from_dir(tiny_model("llama-gqa"))),
                       logprobs=False, tools=HERMES, **kw)


def test_stream_deltas_are_openai_shaped(tiny_model: Callable[[str], Path]) -> None:
    out = builder(tiny_model)
    text = "Sure.\n" + HERMES_CALL + "\n" + HERMES_CALL.replace("Paris", "Oslo")
    chunks = [c for i in range(0, len(text), 7) for c in out.chunk(StreamChunk([1], text[i:i + 7]))]
    chunks += out.final_chunks(FinalChunk("stop", Usage(3, 40)))
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert "".join(d.get("content", "") for d in deltas) == "Sure."
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert [c["index"] for c in calls] == [0, 0, 1, 1]
    assert calls[0]["id"].startswith("call_") and calls[0]["type"] == "function"
    assert calls[0]["function"] == {"name": "get_weather", "arguments": ""}
    assert calls[1] == {"index": 0, "function": {"arguments": '{"city": "Paris"}'}}
    assert calls[3]["function"]["arguments"] == '{"city": "Oslo"}'
    assert calls[2]["id"] != calls[0]["id"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert call_deltas(0, ToolCall("f", "{}", "call_x"))[0]["id"] == "call_x"


def test_stream_without_calls_is_content(tiny_model: Callable[[str], Path]) -> None:
    out = builder(tiny_model)
    chunks = [c for piece in ("It is ", "<", "b>sunny</b>\n") for c in out.chunk(
        StreamChunk([1], piece))] + out.final_chunks(FinalChunk("length", Usage(3, 3)))
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == (
        "It is <b>sunny</b>\n")
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_whole_response_has_tool_calls(tiny_model: Callable[[str], Path]) -> None:
    out = builder(tiny_model)
    out.add(StreamChunk([1], "Checking.\n" + HERMES_CALL))
    choice = out.response([FinalChunk("stop", Usage(3, 20))])["choices"][0]
    message = choice["message"]
    assert message["content"] == "Checking." and choice["finish_reason"] == "tool_calls"
    (call,) = message["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    out = builder(tiny_model)
    out.add(StreamChunk([1], "Just text."))
    message = out.response([FinalChunk("stop", Usage(3, 2))])["choices"][0]["message"]
    assert message["content"] == "Just text." and "tool_calls" not in message


def test_tool_calls_over_http(tiny_model: Callable[[str], Path]) -> None:
    router = ScriptedRouter(Tokenizer.from_dir(tiny_model("llama-gqa")))
    router.script = [StreamChunk([5], HERMES_CALL[:15]), StreamChunk([6], HERMES_CALL[15:]),
                     FinalChunk("stop", Usage(9, 2))]
    body = {"messages": USER, "tools": [WEATHER]}

    async def run(c: Client) -> None:
        r = await c.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
        assert choice["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
        events = await sse(c, "/v1/chat/completions", {**body, "stream": True})
        calls = [e["choices"][0]["delta"]["tool_calls"][0] for e in events[:-1]
                 if "tool_calls" in e["choices"][0]["delta"]]
        assert calls[0]["function"]["name"] == "get_weather"
        assert json.loads(calls[1]["function"]["arguments"]) == {"city": "Paris"}
        assert events[-2]["choices"][0]["finish_reason"] == "tool_calls"
        r = await c.post("/v1/chat/completions", json={**body, "tools": [
            {"type": "function", "function": {"name": "f", "parameters": {"type": "bogus"}}}]})
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "tools", err
        assert "tools[0].function.parameters" in err["message"] and "bogus" in err["message"]

    serve(router, run)


def test_forced_call_grammar_keeps_nested_definitions() -> None:
    """pydantic puts nested models in ``$defs`` and refers to them from the root: inside
    the call grammar they must still resolve (instructor's and LangChain's tools)."""
    item = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    nested = {"$defs": {"Item": item},
              "type": "object",
              "properties": {"item": {"$ref": "#/$defs/Item"},
                             "next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},
              "required": ["item", "next"]}
    old_style = {"definitions": {"Item": item}, "type": "object",
                 "properties": {"item": {"$ref": "#/definitions/Item"}}, "required": ["item"]}
    lark = HERMES.grammar([{"name": "a", "parameters": nested},
                           {"name": "b", "parameters": old_style}], parallel=True)
    grammar_of(StructuredOutput.grammar(lark))  # compiles: every $ref resolves
    assert '"$ref": "#/$defs/f0.Item"' in lark and '"$ref": "#/$defs/f1.Item"' in lark
    assert '"$ref": "#/$defs/f0.root"' in lark


def test_a_closing_tag_inside_a_json_string_does_not_end_the_call() -> None:
    text = ('<tool_call>\n{"name": "f", "arguments": {"city": "Rome}}</tool_call></", '
            '"n": 1}}\n</tool_call>')
    content, calls = HERMES.parse(text)
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("f", {"city": "Rome}}</tool_call></", "n": 1})]
    # Streamed a character at a time: the same call, nothing leaks as content.
    s = HERMES.stream()
    events = [e for ch in text for e in s.feed(ch)] + s.finish()
    assert [e.name for e in events if not isinstance(e, str)] == ["f"]
    assert not [e for e in events if isinstance(e, str)]


# A Qwen2.5-style template: it renders the tools and earlier calls itself.
NATIVE_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}"
    "{{ t.function.name }};{% endfor %}</tools><|im_end|>\n{%- endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{%- for c in m.tool_calls or [] %}<tool_call>{{ c.function.name }}"
    "({{ c.function.arguments.city }})</tool_call>{%- endfor %}"
    "{%- if m.tool_call_id %}[{{ m.tool_call_id }}]{%- endif %}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}")


def test_a_template_that_renders_tools_gets_them_structured(
        tiny_model: Callable[[str], Path]) -> None:
    base = Tokenizer.from_dir(tiny_model("llama-gqa"))
    tok = Tokenizer(base.backend, eos_token_ids=base.eos_token_ids,
                    bos_token_id=base.bos_token_id, chat_template=NATIVE_TEMPLATE)
    assert tok.renders_tools and not base.renders_tools
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = [*USER, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    _, req, plan = chat(native=True, messages=messages, tools=[WEATHER, TIME])
    assert plan.tools is HERMES and req.tools is not None
    assert [t["function"]["name"] for t in req.tools] == ["get_weather", "get_time"]
    assert req.messages is not None and req.messages[1]["tool_calls"][0]["function"] == {
        "name": "get_weather", "arguments": {"city": "Paris"}}  # an object, as templates want
    text = tok.render_chat(req.messages, tools=req.tools)
    assert "<tools>get_weather;get_time;</tools>" in text  # the template's own rendering
    assert "<tool_call>get_weather(Paris)</tool_call>" in text and "[call_1]" in text
    assert "# Tools\n\nYou may call" not in text  # pdserve's prompt is not added
    # The same request for a template without tools support: pdserve writes them in.
    _, req, _ = chat(messages=messages, tools=[WEATHER])
    assert req.tools is None and req.messages is not None
    assert "<tools>" in req.messages[0]["content"]
