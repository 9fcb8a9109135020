"""The ``/v1/responses`` body (``ResponsesRequest``), the fields it refuses, and its
mapping to the chat completions body it is served as (``to_chat_body``); a chat
error about that body names the Responses field instead (``renamed``)."""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag

from pdserve.router.openai.request_models import (
    EMPTY,
    VLLM_UNIMPLEMENTED,
    Body,
    GenerationFields,
    InvalidRequest,
    JsonSchema,
    NonEmpty,
    TopN,
    only,
)

LOGPROBS = "message.output_text.logprobs"


class TextPart(Body):
    type: Literal["input_text", "output_text"]  # images, files, audio: not supported
    text: str


class MessageItem(Body):
    type: Literal["message"] = "message"  # the short form omits it
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[TextPart]


class FunctionCallItem(Body):
    type: Literal["function_call"]
    call_id: NonEmpty
    name: NonEmpty
    arguments: str  # JSON text


class FunctionCallOutputItem(Body):
    type: Literal["function_call_output"]
    call_id: NonEmpty
    output: str | list[TextPart]


def _item_type(value: Any) -> str | None:
    return value.get("type", "message") if isinstance(value, dict) else None


InputItem = Annotated[Annotated[MessageItem, Tag("message")]
                      | Annotated[FunctionCallItem, Tag("function_call")]
                      | Annotated[FunctionCallOutputItem, Tag("function_call_output")],
                      Discriminator(_item_type)]


class FunctionTool(Body):
    type: Literal["function"]  # built-in tools (web search, files, ...): not supported
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: str | None = None
    parameters: JsonSchema | None = None
    strict: bool | None = None


class FunctionChoice(Body):
    type: Literal["function"]
    name: NonEmpty


class PlainText(Body):
    type: Literal["text"]


class JsonObject(Body):
    type: Literal["json_object"]


class JsonSchemaText(Body):
    type: Literal["json_schema"]
    name: NonEmpty
    description: str | None = None
    schema_: JsonSchema = Field(alias="schema")
    strict: bool | None = None


class TextConfig(Body):
    format: Annotated[PlainText | JsonObject | JsonSchemaText,
                      Field(discriminator="type")] | None = None


class ResponsesRequest(GenerationFields):
    input: str | Annotated[list[InputItem], Field(min_length=1)]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool = True
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    text: TextConfig | None = None
    include: list[Literal["message.output_text.logprobs"]] | None = None
    top_logprobs: TopN | None = None  # with include's logprobs
    # calls of built-in tools, which are refused: any limit holds
    max_tool_calls: Annotated[int, Field(ge=1)] | None = None
    store: bool = True  # kept for previous_response_id and GET (ResponseStore)
    previous_response_id: NonEmpty | None = None
    metadata: dict[str, str] | None = None  # echoed
    user: str | None = None

    def wants_logprobs(self) -> bool:
        return LOGPROBS in (self.include or [])

    def own_items(self) -> list[Any]:
        """This request's input as items (a text is one user message)."""
        return ([MessageItem(role="user", content=self.input)] if isinstance(self.input, str)
                else self.input)

    def to_chat_body(self) -> dict[str, Any]:
        """The chat completions body that asks for what this one does."""
        body = self.model_dump(include=set(SHARED), exclude_unset=True, by_alias=True)
        body["messages"] = self._chat_messages()
        if self.max_output_tokens is not None:
            body["max_completion_tokens"] = self.max_output_tokens
        if self.tools:
            body["tools"] = [{"type": "function", "function": t.model_dump(
                exclude={"type"}, exclude_none=True)} for t in self.tools]
        if isinstance(self.tool_choice, FunctionChoice):
            body["tool_choice"] = {"type": "function",
                                   "function": {"name": self.tool_choice.name}}
        elif self.tool_choice is not None:
            body["tool_choice"] = self.tool_choice
        body["parallel_tool_calls"] = self.parallel_tool_calls
        fmt = self.text.format if self.text else None
        if isinstance(fmt, JsonObject):
            body["response_format"] = {"type": "json_object"}
        elif isinstance(fmt, JsonSchemaText):
            body["response_format"] = {"type": "json_schema", "json_schema": fmt.model_dump(
                exclude={"type"}, exclude_none=True, by_alias=True)}
        if self.wants_logprobs():
            body["logprobs"] = True
            body["top_logprobs"] = self.top_logprobs or 0
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        return body

    def _chat_messages(self) -> list[dict[str, Any]]:
        """The conversation as chat messages: the instructions, then the input items."""
        out: list[dict[str, Any]] = []
        if self.instructions:
            out.append({"role": "system", "content": self.instructions})
        for item in self.own_items():
            if isinstance(item, MessageItem):
                out.append({"role": "system" if item.role == "developer" else item.role,
                            "content": _text(item.content)})
            elif isinstance(item, FunctionCallItem):
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}
                if out and out[-1]["role"] == "assistant":  # the same turn's text, or calls
                    out[-1].setdefault("tool_calls", []).append(call)
                else:
                    out.append({"role": "assistant", "content": None, "tool_calls": [call]})
            else:
                out.append({"role": "tool", "tool_call_id": item.call_id,
                            "content": _text(item.output)})
        return out


REFUSED_RESPONSES = {
    **VLLM_UNIMPLEMENTED,
    "prompt_logprobs": only(None),
    "use_beam_search": only(None, False),
    "length_penalty": only(None, 1.0, 1),
    "conversation": dataclasses.replace(
        EMPTY, why="use previous_response_id, or send the whole conversation as input"),
    "background": only(None, False),
    "prompt": EMPTY,  # stored prompt templates
    "truncation": only(None, "disabled"),
}
# The chat body's fields that are the Responses body's too, same names and rules.
SHARED = frozenset(GenerationFields.model_fields)
# Chat names in errors -> the Responses field they came from.
_RENAMED = (("messages", "input"), ("max_completion_tokens", "max_output_tokens"),
            ("response_format", "text.format"), ("logprobs", "include"))


def responses_field(chat: str) -> str:
    """The Responses field a chat body's field came from."""
    return next((ours.split(".")[0] for name, ours in _RENAMED if name == chat), chat)


def renamed(exc: InvalidRequest) -> InvalidRequest:
    """A chat error about the mapped body, naming the Responses field instead."""
    message = exc.message
    for chat, ours in _RENAMED:
        if message.startswith(chat):
            message = ours + message[len(chat):]
    message = message.replace(".function.parameters", ".parameters")
    return InvalidRequest(message, None if exc.param is None else responses_field(exc.param))


def _text(content: str | list[TextPart]) -> str:
    return content if isinstance(content, str) else "".join(p.text for p in content)
