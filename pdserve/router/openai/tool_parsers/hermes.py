"""The Hermes family's tool calls: ``<tool_call>{json}</tool_call>`` blocks, as Hermes
and Qwen models write them and as the default model is prompted to. The default
syntax: a chat template no other family claims gets this one."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from pdserve.router.openai.tool_parsers.base import (
    Event,
    ToolStream,
    ToolSyntax,
    call_of,
    dumps,
    held_back,
)

_DECODER = json.JSONDecoder()


class HermesStream(ToolStream):
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        self._buf = ""  # unsent text; inside a call it starts with OPEN
        self._in_call = False
        self._calls = 0

    def _call(self, raw: str) -> Event:
        """``raw`` (OPEN, JSON, CLOSE or, where the output ended, part of it) as a
        call; text as it is unless that is a whole call."""
        body = raw[len(self.OPEN):]
        try:
            obj, end = _DECODER.raw_decode(body, len(body) - len(body.lstrip()))
        except ValueError:
            return raw
        call = call_of(obj) if self.CLOSE.startswith(body[end:].strip()) else None
        if call is None:
            return raw
        self._calls += 1
        return call

    def _call_end(self) -> int | None:
        """Where the call at the start of the buffer ends (after CLOSE), or None while it
        is unfinished. The JSON is read as JSON, so a CLOSE inside one of its strings
        does not end it; text that is not JSON ends at the first CLOSE (as content)."""
        buf = self._buf
        start = len(self.OPEN) + len(buf[len(self.OPEN):]) - len(buf[len(self.OPEN):].lstrip())
        try:
            _, after = _DECODER.raw_decode(buf, start)
        except ValueError:
            if buf[start:start + 1] in ("{", ""):
                return None  # JSON still coming (or malformed: finish() decides)
            at = buf.find(self.CLOSE)
            return None if at < 0 else at + len(self.CLOSE)
        rest = buf[after:].lstrip()
        if rest.startswith(self.CLOSE):
            return len(buf) - len(rest) + len(self.CLOSE)
        if self.CLOSE.startswith(rest):
            return None  # the closing tag is on its way
        at = buf.find(self.CLOSE, after)
        return None if at < 0 else at + len(self.CLOSE)

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        out: list[Event] = []
        while True:
            if self._in_call:
                end = self._call_end()
                if end is None:
                    return out
                out.append(self._call(self._buf[:end]))
                self._buf, self._in_call = self._buf[end:], False
                continue
            start = self._buf.find(self.OPEN)
            if start >= 0:
                before = self._buf[:start].rstrip()  # the line break before a call is not content
                self._buf, self._in_call = self._buf[start:], True
            else:
                # Held: a possible start of OPEN, and the whitespace before it.
                keep = len(self._buf) - held_back(self._buf, self.OPEN)
                before = self._buf[:keep].rstrip()
                self._buf = self._buf[len(before):]
            if before:
                out.append(before)
            if start < 0:
                return out

    def finish(self) -> list[Event]:
        rest, self._buf = self._buf, ""
        if self._in_call:
            return [self._call(rest)]  # a call the output ended inside of: parsed if whole
        return [rest] if rest and not (self._calls and rest.isspace()) else []


class Hermes(ToolSyntax):
    name, args_key, separator = "hermes", "arguments", "\n"

    def prompt(self, tools: Sequence[Mapping[str, Any]]) -> str:
        listed = "\n".join(dumps(t) for t in tools)
        return ("# Tools\n\nYou may call one or more functions to assist with the user query."
                "\n\nYou are provided with function signatures within <tools></tools> XML "
                f"tags:\n<tools>\n{listed}\n</tools>\n\nFor each function call, return a json "
                "object with function name and arguments within <tool_call></tool_call> XML "
                'tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}'
                "\n</tool_call>")

    def render_call(self, name: str, arguments: Any) -> str:
        return f"<tool_call>\n{dumps({'name': name, 'arguments': arguments})}\n</tool_call>"

    def render_result(self, content: str) -> str:
        return f"<tool_response>\n{content}\n</tool_response>"

    def _call_rule(self, schema: str) -> str:
        return f'"<tool_call>\\n" %json {schema} "\\n</tool_call>"'

    def stream(self) -> ToolStream:
        return HermesStream()


HERMES: ToolSyntax = Hermes()
