"""Applications on the API, unchanged, against a real ``pdserve serve`` (subprocess,
embedded Ray cluster, the default model SmolLM2-135M-Instruct), disaggregated (1P+1D)
and colocated: the ``openai`` client's structured outputs and tool calls, LangChain's
``with_structured_output``, ``instructor`` and the Agents SDK's tool loop (over
``/v1/responses`` and chat), plus n > 1, logit_bias and vLLM's guided fields. Every
structured answer is sampled at temperature 0.8 and must parse and validate, every
forced tool call must name a declared function with valid arguments."""

from __future__ import annotations

import json
import os
import re
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import instructor
import jsonschema
import langchain_openai
import openai
import pydantic
import pytest

from tests.integration.procs import kill_marked, marked_env, start_serve

pytestmark = pytest.mark.slow
MODES = {
    "1p1d": "transfer: torch\nprefill: {num_cpus: 1}\ndecode: {num_cpus: 1}\n",
    "colocated": "prefill: {workers: 0}\ndecode: {workers: 0}\n"
                 "colocated: {workers: 1, num_cpus: 1}\n",
}
SCHEMAS: dict[str, dict[str, Any]] = {
    "person": {"type": "object",
               "properties": {"name": {"type": "string", "maxLength": 30},
                              "age": {"type": "integer", "minimum": 0, "maximum": 120},
                              "email": {"type": "string",
                                        "pattern": "^[a-z]{1,12}@[a-z]{1,12}\\.com$"}},
               "required": ["name", "age", "email"], "additionalProperties": False},
    "order": {"type": "object",
              "properties": {"items": {"type": "array", "minItems": 1, "maxItems": 3,
                                       "items": {"type": "object",
                                                 "properties": {
                                                     "sku": {"type": "string",
                                                             "pattern": "^[A-Z]{3}[0-9]{2}$"},
                                                     "qty": {"type": "integer", "minimum": 1,
                                                             "maximum": 9}},
                                                 "required": ["sku", "qty"],
                                                 "additionalProperties": False}},
                             "status": {"enum": ["new", "paid", "shipped"]},
                             "total": {"type": "number", "minimum": 0, "maximum": 1000}},
              "required": ["items", "status", "total"], "additionalProperties": False},
    "weather": {"type": "object",
                "properties": {"city": {"type": "string", "maxLength": 20},
                               "forecast": {"type": "object",
                                            "properties": {
                                                "celsius": {"type": "integer", "minimum": -40,
                                                            "maximum": 50},
                                                "sky": {"enum": ["sunny", "cloudy", "rain"]}},
                                            "required": ["celsius", "sky"],
                                            "additionalProperties": False},
                               "alerts": {"type": "array", "maxItems": 2,
                                          "items": {"type": "string", "maxLength": 20}}},
                "required": ["city", "forecast", "alerts"], "additionalProperties": False},
}
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city",
        "parameters": {"type": "object",
                       "properties": {"city": {"type": "string", "maxLength": 20},
                                      "unit": {"enum": ["celsius", "fahrenheit"]}},
                       "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "add", "description": "Add two integers",
        "parameters": {"type": "object",
                       "properties": {"a": {"type": "integer", "minimum": -99, "maximum": 99},
                                      "b": {"type": "integer", "minimum": -99, "maximum": 99}},
                       "required": ["a", "b"], "additionalProperties": False}}},
]
ARGS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@dataclass
class Served:
    client: openai.OpenAI
    base_url: str
    model: str


@pytest.fixture(scope="module", params=list(MODES))
def served(request: pytest.FixtureRequest, default_model_dir: Path,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    tmp = tmp_path_factory.mktemp(f"apps-{request.param}")
    (tmp / "cluster.yaml").write_text(MODES[request.param])
    mark, env = marked_env()
    proc, text = start_serve(["--model", str(default_model_dir), "--config",
                              str(tmp / "cluster.yaml"), "--http-port", "0", "--grpc-port", "0"],
                             tmp / "serve.log", env)
    try:
        http = re.search(r"HTTP\s+(http://127\.0\.0\.1:\d+)/v1", text)
        assert http, text
        client = openai.OpenAI(base_url=f"{http[1]}/v1", api_key="unused", max_retries=0,
                               timeout=120)
        yield Served(client, f"{http[1]}/v1", client.models.list().data[0].id)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        kill_marked(mark)


def ask(content: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": content}]


def test_json_schema_answers_always_validate(served: Served) -> None:
    s = served
    for name, schema in SCHEMAS.items():
        r = s.client.chat.completions.create(
            model=s.model, messages=ask(f"Describe a {name} as JSON."),  # type: ignore[arg-type]
            temperature=0.8, max_tokens=300, n=4, seed=7,
            response_format={"type": "json_schema",
                             "json_schema": {"name": name, "schema": schema, "strict": True}})
        assert len(r.choices) == 4 and [c.index for c in r.choices] == [0, 1, 2, 3]
        for c in r.choices:
            assert c.finish_reason == "stop", c.message.content
            jsonschema.validate(json.loads(c.message.content or ""), schema)
    # json_object, streamed (greedy: an unbounded object from a 135M model at 0.8 can
    # outrun any max_tokens); and vLLM's guided fields through extra_body.
    stream = s.client.chat.completions.create(
        model=s.model, messages=ask("Give a JSON object with your name and age."),  # type: ignore[arg-type]
        temperature=0, max_tokens=300, stream=True, response_format={"type": "json_object"})
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert isinstance(json.loads(text), dict)
    choice = s.client.completions.create(model=s.model, prompt="The sky is", max_tokens=8,
                                         temperature=0.8,
                                         extra_body={"guided_choice": ["blue", "grey"]})
    assert choice.choices[0].text in ("blue", "grey")
    regex = s.client.completions.create(model=s.model, prompt="A date:", max_tokens=20,
                                        extra_body={"guided_regex": r"20[0-9]{2}-[01][0-9]"})
    assert re.fullmatch(r"20[0-9]{2}-[01][0-9]", regex.choices[0].text)


def test_bad_schema_is_a_400_naming_it(served: Served) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        served.client.chat.completions.create(
            model=served.model, messages=ask("x"),  # type: ignore[arg-type]
            response_format={"type": "json_schema",
                             "json_schema": {"name": "x", "schema": {"type": "wat"}}})
    assert "wat" in str(exc.value.body) and exc.value.body["param"] == "response_format"  # type: ignore[index]


def test_forced_tool_calls_name_a_declared_function_with_valid_arguments(
        served: Served) -> None:
    s = served
    prompts = ["What is the weather in Paris?", "Add 2 and 40.", "Help me.",
               "Weather in Oslo in fahrenheit?"]
    for i, prompt in enumerate(prompts):
        r = s.client.chat.completions.create(
            model=s.model, messages=ask(prompt), tools=TOOLS,  # type: ignore[arg-type]
            tool_choice="required", temperature=0.8, seed=i, max_tokens=200)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls" and c.message.tool_calls, c.message
        for call in c.message.tool_calls:
            assert call.type == "function" and call.id
            jsonschema.validate(json.loads(call.function.arguments), ARGS[call.function.name])
    # A named function, streamed: the deltas add up to one valid call of it.
    stream = s.client.chat.completions.create(
        model=s.model, messages=ask("Add 3 and 4."), tools=TOOLS,  # type: ignore[arg-type]
        tool_choice={"type": "function", "function": {"name": "add"}}, temperature=0.8,
        max_tokens=100, stream=True)
    name, args, finish = "", "", None
    for chunk in stream:
        for d in chunk.choices[0].delta.tool_calls or []:
            name += d.function.name or "" if d.function else ""
            args += d.function.arguments or "" if d.function else ""
        finish = chunk.choices[0].finish_reason or finish
    assert name == "add" and finish == "tool_calls"
    jsonschema.validate(json.loads(args), ARGS["add"])
    # The tool's result goes back in, rendered by the chat template; the model answers.
    call = {"id": "call_1", "type": "function",
            "function": {"name": "add", "arguments": '{"a": 3, "b": 4}'}}
    follow = s.client.chat.completions.create(
        model=s.model, tools=TOOLS, max_tokens=20, temperature=0,  # type: ignore[arg-type]
        messages=[*ask("Add 3 and 4."),  # type: ignore[list-item]
                  {"role": "assistant", "content": None, "tool_calls": [call]},
                  {"role": "tool", "tool_call_id": "call_1", "content": "7"}])
    assert follow.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_logit_bias(served: Served, default_model_dir: Path) -> None:
    from pdserve.engine.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(default_model_dir)
    banana, kiwi = (tok.encode(w, add_special_tokens=False)[0] for w in (" banana", " kiwi"))

    def first(bias: dict[str, int]) -> str:
        return served.client.completions.create(model=served.model, prompt="Hello",
                                                max_tokens=1, temperature=0,
                                                logit_bias=bias).choices[0].text

    assert first({str(banana): 100}) == tok.decode([banana])
    assert first({str(banana): -100, str(kiwi): 100}) == tok.decode([kiwi])


class Forecast(pydantic.BaseModel):
    celsius: int = pydantic.Field(ge=-40, le=50)
    sky: Literal["sunny", "cloudy", "rain"]


class CityWeather(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=20)
    forecast: Forecast


def test_langchain_with_structured_output(served: Served) -> None:
    llm = langchain_openai.ChatOpenAI(model=served.model, base_url=served.base_url,
                                 api_key="unused", temperature=0.8, max_tokens=200,
                                 max_retries=0)
    for method in ("json_schema", "function_calling"):
        result = llm.with_structured_output(CityWeather, method=method).invoke(
            "What is the weather in Rome?")
        assert isinstance(result, CityWeather), (method, result)


def test_instructor(served: Served) -> None:
    for mode in (instructor.Mode.TOOLS, instructor.Mode.JSON_SCHEMA):
        client = instructor.from_openai(served.client, mode=mode)
        result = client.chat.completions.create(
            model=served.model, response_model=CityWeather, max_retries=0,
            messages=ask("What is the weather in Lima?"), temperature=0.8, max_tokens=200)
        assert isinstance(result, CityWeather), (mode, result)


def test_openai_agents_sdk_runs_a_tool_loop(served: Served) -> None:
    """The Agents SDK's own run loop, over the Responses API (its default model) and
    over chat completions: the model must call the tool, the SDK runs it and sends the
    result back as input, and the model answers or (a small model may) calls again,
    which again sends results back. The SDK refuses an answer that ``max_tokens`` cut
    (status incomplete: ``ModelBehaviorError``), which a rambling small model may give
    after the tool's result; that too is after the loop's round trip. Then the
    ``openai`` client's ``responses.parse`` with a pydantic model."""
    import asyncio

    import agents

    agents.set_tracing_disabled(True)
    called: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """Current weather in a city."""
        called.append(city)
        return f"Sunny and 21 C in {city}."

    async def run(model: agents.Model, extra: dict[str, int] | None = None) -> None:
        agent = agents.Agent(name="weather", instructions="Answer with the get_weather tool.",
                             tools=[get_weather], model=model, model_settings=agents.ModelSettings(
                                 temperature=0.8, max_tokens=200, tool_choice="required",
                                 parallel_tool_calls=False, extra_body=extra))
        called.clear()
        try:
            result = await agents.Runner.run(agent, "What is the weather in Paris?", max_turns=3)
        except agents.MaxTurnsExceeded:
            assert len(called) >= 2, called  # each turn called the tool, got its result
            return
        except agents.ModelBehaviorError as exc:
            assert called and "incomplete" in str(exc), (called, exc)  # the answer was cut
            return
        kinds = [type(item).__name__ for item in result.new_items]
        assert called and kinds[0] == "ToolCallItem" and "ToolCallOutputItem" in kinds, \
            (kinds, [(r.output, r.usage) for r in result.raw_responses])
        assert kinds[-1] == "MessageOutputItem" and isinstance(result.final_output, str), kinds

    async def both() -> None:
        client = openai.AsyncOpenAI(base_url=served.base_url, api_key="unused", max_retries=0)
        await run(agents.OpenAIResponsesModel(served.model, client))
        # Seeded: unseeded, 2 runs in ~8 here got a plain answer (no call) over chat completions
        await run(agents.OpenAIChatCompletionsModel(served.model, client), {"seed": 11})

    asyncio.run(both())
    parsed = served.client.responses.parse(model=served.model, input="Weather in Rome?",
                                           text_format=CityWeather, temperature=0.8,
                                           max_output_tokens=200)
    assert isinstance(parsed.output_parsed, CityWeather), parsed.output
