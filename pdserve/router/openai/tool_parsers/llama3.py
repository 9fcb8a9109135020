"""The Llama 3 family's tool calls: a bare ``{"name": .., "parameters": ..}`` JSON
(several separated by ``;``), possibly after ``<|python_tag|>``. A chat template is
this family's when it mentions ``<|python_tag|>`` or a ``"parameters"`` key (and not
Hermes' ``<tool_call>``)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from pdserve.router.openai.tool_parsers.base import (
    Event,
    ToolCall,
    ToolStream,
    ToolSyntax,
    call_of,
    dumps,
)


class Llama3Stream(ToolStream):
    TAG = "<|python_tag|>"

    def __init__(self) -> None:
        self._buf = ""
        self._mode: str | None = None  # None: undecided; "call": buffering; "text"

    def feed(self, text: str) -> list[Event]:
        if self._mode == "text":
            return [text] if text else []
        self._buf += text
        head = self._buf.lstrip()
        if self._mode == "call" or not head or (self.TAG.startswith(head) and head != self.TAG):
            return []
        if head.startswith((self.TAG, "{")):
            self._mode = "call"
            return []
        self._mode, out, self._buf = "text", self._buf, ""
        return [out]

    def finish(self) -> list[Event]:
        rest, self._buf = self._buf, ""
        if self._mode == "call":
            calls = _json_calls(rest.strip().removeprefix(self.TAG))
            if calls:
                return list(calls)
        return [rest] if rest else []


def _json_calls(text: str) -> list[ToolCall] | None:
    """JSON call objects separated by ``;`` or whitespace; None unless all of it is."""
    decoder = json.JSONDecoder()
    calls: list[ToolCall] = []
    pos = 0
    while True:
        while pos < len(text) and (text[pos].isspace() or (calls and text[pos] == ";")):
            pos += 1
        if pos == len(text):
            return calls or None
        try:
            obj, pos = decoder.raw_decode(text, pos)
        except ValueError:
            return None
        call = call_of(obj)
        if call is None:
            return None
        calls.append(call)


class Llama3(ToolSyntax):
    name, args_key, separator = "llama3", "parameters", "; "

    def claims(self, chat_template: str) -> bool:
        return "<tool_call>" not in chat_template and (
            "<|python_tag|>" in chat_template or '"parameters"' in chat_template)

    def prompt(self, tools: Sequence[Mapping[str, Any]]) -> str:
        listed = "\n\n".join(json.dumps(t, indent=4, ensure_ascii=False) for t in tools)
        return ("Given the following functions, please respond with a JSON for a function call "
                "with its proper arguments that best answers the given prompt.\n\nRespond in "
                'the format {"name": function name, "parameters": dictionary of argument name '
                f"and its value}}. Do not use variables.\n\n{listed}")

    def render_call(self, name: str, arguments: Any) -> str:
        return dumps({"name": name, "parameters": arguments})

    def render_result(self, content: str) -> str:
        return content

    def _call_rule(self, schema: str) -> str:
        return f"%json {schema}"

    def stream(self) -> ToolStream:
        return Llama3Stream()


LLAMA3: ToolSyntax = Llama3()
