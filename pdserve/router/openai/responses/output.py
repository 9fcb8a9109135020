"""The Responses API's answers, made of the chat answer: the response object before
any output (``skeleton``), the whole response (``response_object``) and the stream's
typed events (``ResponseEvents``)."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from pdserve.router.openai.responses.request import FunctionChoice, PlainText, ResponsesRequest
from pdserve.router.types import RouterError


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
