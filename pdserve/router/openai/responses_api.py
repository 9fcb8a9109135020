"""OpenAI's Responses API (``POST /v1/responses``, what the Agents SDK and Codex speak)
over the chat machinery: a body is validated (``ResponsesRequest``), mapped to a chat
completions body (``chat_body``), served as chat, and the chat result mapped back,
whole (``response_object``) or as the Responses stream's typed events
(``ResponseEvents``).

State: a response is kept (unless ``store`` is false) in the router's memory, the
last ``STORED`` of them (``ResponseStore``), with the conversation that led to it
as input items; ``previous_response_id`` continues it (its instructions are not
carried over, as OpenAI does), ``GET`` / ``DELETE /v1/responses/{id}`` read and
forget it. A client may instead send the whole conversation as ``input`` (earlier
output items, function calls and their outputs included), as the Agents SDK does.
``conversation`` objects and ``background`` are refused. Function tools only; ``text.format``
(``json_schema``, ``json_object``) is chat's ``response_format``; logprobs come with
``include: ["message.output_text.logprobs"]``; ``developer`` messages are system
messages. A stopped output is ``completed``, one cut by ``max_output_tokens`` (or the
context) ``incomplete``. Errors name the Responses field (``renamed``).
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, TypeAdapter

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
from pdserve.router.types import RouterError

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


def _messages(r: ResponsesRequest) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if r.instructions:
        out.append({"role": "system", "content": r.instructions})
    for item in _own_items(r):
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


def wants_logprobs(r: ResponsesRequest) -> bool:
    return LOGPROBS in (r.include or [])


def chat_body(r: ResponsesRequest) -> dict[str, Any]:
    """The chat completions body that asks for what ``r`` does."""
    body = r.model_dump(include=set(SHARED), exclude_unset=True, by_alias=True)
    body["messages"] = _messages(r)
    if r.max_output_tokens is not None:
        body["max_completion_tokens"] = r.max_output_tokens
    if r.tools:
        body["tools"] = [{"type": "function", "function": t.model_dump(
            exclude={"type"}, exclude_none=True)} for t in r.tools]
    if isinstance(r.tool_choice, FunctionChoice):
        body["tool_choice"] = {"type": "function", "function": {"name": r.tool_choice.name}}
    elif r.tool_choice is not None:
        body["tool_choice"] = r.tool_choice
    body["parallel_tool_calls"] = r.parallel_tool_calls
    fmt = r.text.format if r.text else None
    if isinstance(fmt, JsonObject):
        body["response_format"] = {"type": "json_object"}
    elif isinstance(fmt, JsonSchemaText):
        body["response_format"] = {"type": "json_schema", "json_schema": fmt.model_dump(
            exclude={"type"}, exclude_none=True, by_alias=True)}
    if wants_logprobs(r):
        body["logprobs"] = True
        body["top_logprobs"] = r.top_logprobs or 0
    if r.stream:
        body["stream_options"] = {"include_usage": True}
    return body


def skeleton(r: ResponsesRequest, model: str, created: int) -> dict[str, Any]:
    """The response object before any output: the request's settings echoed. Its id
    is random, not the request id a client may choose: knowing it reads the kept
    response (``GET /v1/responses/{id}``)."""
    fmt = r.text.format if r.text and r.text.format else PlainText(type="text")
    return {
        "id": f"resp_{uuid.uuid4().hex}", "object": "response", "created_at": created,
        "status": "in_progress", "error": None, "incomplete_details": None,
        "instructions": r.instructions, "max_output_tokens": r.max_output_tokens,
        "model": model, "output": [], "parallel_tool_calls": r.parallel_tool_calls,
        "previous_response_id": r.previous_response_id, "reasoning": None, "store": r.store,
        "temperature": r.temperature, "top_p": r.top_p,
        "text": {"format": fmt.model_dump(exclude_none=True, by_alias=True)},
        "tool_choice": (r.tool_choice.model_dump() if isinstance(r.tool_choice, FunctionChoice)
                        else r.tool_choice or ("auto" if r.tools else "none")),
        "tools": [t.model_dump(exclude_none=True) for t in r.tools or []],
        "top_logprobs": r.top_logprobs, "max_tool_calls": r.max_tool_calls,
        "truncation": "disabled", "usage": None,
        "user": r.user, "metadata": r.metadata or {},
    }


def _message_item(response_id: str, text: str = "", logprobs: list[Any] | None = None,
                  ) -> dict[str, Any]:
    """The response's message item (its id: the response's, ``msg_`` for ``resp_``)."""
    return {"type": "message", "id": "msg_" + response_id.removeprefix("resp_"),
            "status": "in_progress",
            "role": "assistant", "content": [_text_part(text, logprobs or [])]}


def _text_part(text: str, logprobs: list[Any]) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}


def _call_item(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"type": "function_call", "id": "fc_" + call_id.removeprefix("call_"),
            "call_id": call_id, "name": name, "arguments": arguments, "status": "in_progress"}


def _usage(chat: dict[str, Any] | None) -> dict[str, Any] | None:
    if chat is None:
        return None
    return {"input_tokens": chat["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": chat["prompt_tokens_details"][
                "cached_tokens"]},
            "output_tokens": chat["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": chat["total_tokens"]}


def _finished(base: dict[str, Any], items: list[dict[str, Any]], finish_reason: str | None,
              usage: dict[str, Any] | None) -> dict[str, Any]:
    """The response once its output ended: cut by the token limit (``length``) it is
    ``incomplete``, else ``completed``."""
    cut = finish_reason == "length"
    status = "incomplete" if cut else "completed"
    for item in items:
        item["status"] = status
    return {**base, "status": status, "output": items,
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
            "usage": _usage(usage)}


def response_object(base: dict[str, Any], chat: dict[str, Any],
                    logprobs: bool) -> dict[str, Any]:
    """The whole response from the whole chat completion (one choice)."""
    choice = chat["choices"][0]
    message = choice["message"]
    calls = message.get("tool_calls") or []
    items = []
    if message["content"] or not calls:
        lps = (choice["logprobs"] or {}).get("content") or [] if logprobs else []
        items.append(_message_item(base["id"], message["content"] or "",
                                   lps))
    items += [_call_item(c["id"], c["function"]["name"], c["function"]["arguments"])
              for c in calls]
    return _finished(base, items, choice["finish_reason"], chat["usage"])


class ResponseEvents:
    """The chat stream's chunks as the Responses stream's events (SSE ``event:`` +
    ``data:``, numbered by ``sequence_number``): created and in_progress, per output
    item its added / delta / done events (text, then each function call), then
    completed with the whole response (whose status may be incomplete), or failed."""

    def __init__(self, base: dict[str, Any], logprobs: bool):
        self._base, self._logprobs = base, logprobs
        self._seq = 0
        self._items: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None  # the item being streamed
        self._finish: str | None = None
        self._usage: dict[str, Any] | None = None

    def _event(self, type_: str, **fields: Any) -> bytes:
        data = {"type": type_, "sequence_number": self._seq, **fields}
        self._seq += 1
        return (f"event: {type_}\ndata: ".encode()
                + json.dumps(data, ensure_ascii=False).encode() + b"\n\n")

    def _where(self) -> dict[str, Any]:
        assert self._open is not None
        return {"item_id": self._open["id"], "output_index": len(self._items) - 1}

    def _add(self, item: dict[str, Any]) -> list[bytes]:
        out = self._close()
        self._items.append(item)
        self._open = item
        out.append(self._event("response.output_item.added", output_index=len(self._items) - 1,
                               item=item))
        if item["type"] == "message":
            out.append(self._event("response.content_part.added", **self._where(),
                                   content_index=0, part=_text_part("", [])))
        return out

    def _close(self) -> list[bytes]:
        item, out = self._open, list[bytes]()
        if item is None:
            return out
        item["status"] = "incomplete" if self._finish == "length" else "completed"
        if item["type"] == "message":
            part = item["content"][0]
            out.append(self._event("response.output_text.done", **self._where(), content_index=0,
                                   text=part["text"], logprobs=part["logprobs"]))
            out.append(self._event("response.content_part.done", **self._where(),
                                   content_index=0, part=part))
        else:
            out.append(self._event("response.function_call_arguments.done", **self._where(),
                                   name=item["name"], arguments=item["arguments"]))
        out.append(self._event("response.output_item.done", output_index=len(self._items) - 1,
                               item=item))
        self._open = None
        return out

    def _chunk(self, chunk: dict[str, Any]) -> list[bytes]:
        if chunk.get("usage"):
            self._usage = chunk["usage"]
        out: list[bytes] = []
        for choice in chunk["choices"]:
            delta = choice.get("delta", {})
            lps = ((choice.get("logprobs") or {}).get("content") or []) if self._logprobs else []
            if delta.get("content"):
                if self._open is None or self._open["type"] != "message":
                    out += self._add(_message_item(self._base["id"]))
                part = self._open["content"][0]  # type: ignore[index]
                part["text"] += delta["content"]
                part["logprobs"] += lps
                out.append(self._event("response.output_text.delta", **self._where(),
                                       content_index=0, delta=delta["content"], logprobs=lps))
            for call in delta.get("tool_calls") or []:
                if call.get("id"):
                    out += self._add(_call_item(call["id"], call["function"]["name"], ""))
                if pieces := call.get("function", {}).get("arguments"):
                    self._open["arguments"] += pieces  # type: ignore[index]
                    out.append(self._event("response.function_call_arguments.delta",
                                           **self._where(), delta=pieces))
            if choice.get("finish_reason"):
                self._finish = choice["finish_reason"]
        return out

    async def events(self, chunks: AsyncIterator[dict[str, Any]],
                     describe: Callable[[RouterError], dict[str, Any]],
                     done: Callable[[dict[str, Any]], None]) -> AsyncIterator[bytes]:
        """The events of the chat ``chunks``; a RouterError raised while reading them
        ends the stream with ``response.failed`` (``describe(exc)``: its error object).
        ``done(response)`` is called with the whole response before its last event."""
        yield self._event("response.created", response=self._base)
        yield self._event("response.in_progress", response=self._base)
        try:
            async for chunk in chunks:
                for event in self._chunk(chunk):
                    yield event
        except RouterError as exc:
            error = describe(exc)
            yield self._event("response.failed", response={
                **self._base, "status": "failed", "output": self._items,
                "error": {"code": error.get("code") or error["type"],
                          "message": error["message"]}})
            return
        if not self._items:  # nothing at all came out: an empty message
            for event in self._add(_message_item(self._base["id"])):
                yield event
        for event in self._close():
            yield event
        # response.completed even when its status is incomplete, as vLLM sends it:
        # AIPerf reads usage only there and the SDK's get_final_response() needs it
        whole = _finished(self._base, self._items, self._finish, self._usage)
        done(whole)
        yield self._event("response.completed", response=whole)


STORED = 1024  # responses kept for previous_response_id (each with its conversation)
STORED_BYTES = 256 << 20  # and their JSON at most (a long context's chain is large)
_ITEMS: TypeAdapter[list[Any]] = TypeAdapter(list[InputItem])


class ResponseStore:
    """The last ``limit`` responses that asked to be stored, with the conversation
    that led to each (input items, its own output last), at most ``max_bytes`` of
    JSON in all, the least recently used forgotten first. One router's memory: a
    restart forgets them."""

    def __init__(self, limit: int = STORED, max_bytes: int = STORED_BYTES):
        self._limit, self._max_bytes = limit, max_bytes
        self._bytes = 0
        # id -> (response, conversation, their JSON size)
        self._kept: OrderedDict[str, tuple[dict[str, Any], list[dict[str, Any]], int]] = (
            OrderedDict())

    def __len__(self) -> int:
        return len(self._kept)

    @property
    def bytes(self) -> int:
        return self._bytes

    def get(self, response_id: str) -> dict[str, Any] | None:
        kept = self._kept.get(response_id)
        return None if kept is None else kept[0]

    def delete(self, response_id: str) -> bool:
        kept = self._kept.pop(response_id, None)
        self._bytes -= 0 if kept is None else kept[2]
        return kept is not None

    def continued(self, r: ResponsesRequest) -> ResponsesRequest:
        """``r`` with the conversation of its ``previous_response_id`` before its own
        input; InvalidRequest when that response is not kept."""
        if r.previous_response_id is None:
            return r
        kept = self._kept.get(r.previous_response_id)
        if kept is None:
            raise InvalidRequest(
                f"previous_response_id {r.previous_response_id!r} is not a response this "
                f"server keeps (the last {self._limit} stored, until it restarts)",
                "previous_response_id")
        self._kept.move_to_end(r.previous_response_id)
        return r.model_copy(update={"input": [*_ITEMS.validate_python(kept[1]),
                                              *_own_items(r)]})

    def keep(self, r: ResponsesRequest, response: dict[str, Any]) -> None:
        """Keep a finished ``response`` to ``r`` (already continued), if it asked."""
        if not r.store:
            return
        conversation = [*(item.model_dump(by_alias=True, exclude_none=True)
                          for item in _own_items(r)), *response["output"]]
        size = len(json.dumps(conversation)) + len(json.dumps(response))
        self.delete(response["id"])
        self._kept[response["id"]] = (response, conversation, size)
        self._bytes += size
        while len(self._kept) > self._limit or self._bytes > self._max_bytes:
            self._bytes -= self._kept.popitem(last=False)[1][2]


def _own_items(r: ResponsesRequest) -> list[Any]:
    return [MessageItem(role="user", content=r.input)] if isinstance(r.input, str) else r.input
