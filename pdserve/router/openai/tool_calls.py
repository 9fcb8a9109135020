"""Tool calling in chat completions: each model family's tool-call syntax.

This module owns, per family (``HERMES``: ``<tool_call>{json}</tool_call>`` blocks, as
Hermes and Qwen models write them and as the default model is prompted to; ``LLAMA3``:
a bare ``{"name": .., "parameters": ..}`` JSON, possibly after ``<|python_tag|>``):

* the text a request's tools become for a chat template that does not render them:
  a system prompt listing the tools, and earlier calls and tool results written in
  the family's syntax (``with_tools``, ``render_calls``, ``render_result``);
* the grammar that holds ``tool_choice`` ``required`` or a named function to valid
  calls (llguidance's Lark around inline JSON schemas, compact JSON);
* reading calls out of the output, whole (``parse``) or streamed (``ToolStream``:
  text that could still open a call is held back), and their OpenAI shapes
  (``call_object``, ``call_deltas``).

``syntax_for(chat_template)`` picks the family from the model's template.
"""

from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pdserve.engine.structured import JSON_OPTIONS, closed_objects

_DECODER = json.JSONDecoder()
# A function declared without parameters takes none.
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {},
                                 "additionalProperties": False}


def _call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclass(frozen=True)
class ToolCall:
    """One call the model made: ``arguments`` is JSON text (OpenAI's form)."""

    name: str
    arguments: str
    id: str = field(default_factory=_call_id)


Event = str | ToolCall  # what a ToolStream yields: content text, or a complete call


def call_object(call: ToolCall) -> dict[str, Any]:
    """A call as the response message's ``tool_calls`` entry."""
    return {"id": call.id, "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}


def call_deltas(index: int, call: ToolCall) -> list[dict[str, Any]]:
    """A call as stream ``delta.tool_calls`` entries, one per chunk: the opening one
    (id, type, name, empty arguments), then the arguments."""
    return [{"index": index, "id": call.id, "type": "function",
             "function": {"name": call.name, "arguments": ""}},
            {"index": index, "function": {"arguments": call.arguments}}]


def _dumps(value: Any) -> str:
    # The compact shape the grammar generates (JSON_OPTIONS' separators).
    return json.dumps(value, ensure_ascii=False)


def _call_of(obj: Any) -> ToolCall | None:
    """A parsed ``{"name": .., "arguments" | "parameters": {..}}`` as a call, or None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], _dumps(args))


def _held(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


class ToolStream(ABC):
    """One output's text, fed as it streams, turned into content and calls."""

    @abstractmethod
    def feed(self, text: str) -> list[Event]:
        """Content that is safe to show and the calls completed by ``text``."""

    @abstractmethod
    def finish(self) -> list[Event]:
        """At the end of the output: what was held back (an unfinished or malformed
        call is content)."""


class _HermesStream(ToolStream):
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
        call = _call_of(obj) if self.CLOSE.startswith(body[end:].strip()) else None
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
                keep = len(self._buf) - _held(self._buf, self.OPEN)
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


class _Llama3Stream(ToolStream):
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
        call = _call_of(obj)
        if call is None:
            return None
        calls.append(call)


class ToolSyntax(ABC):
    """One model family's tool-call syntax."""

    name: str
    args_key: str  # the arguments' key in a call's JSON
    separator: str  # between parallel calls

    @abstractmethod
    def prompt(self, tools: Sequence[Mapping[str, Any]]) -> str:
        """The system prompt that declares ``tools`` (OpenAI tool objects)."""

    @abstractmethod
    def render_call(self, name: str, arguments: Any) -> str:
        """One earlier call as the assistant wrote it."""

    @abstractmethod
    def render_result(self, content: str) -> str:
        """A tool's result as the ``tool`` message's content."""

    @abstractmethod
    def _call_rule(self, schema: str) -> str:
        """The Lark rule of one call, ``schema`` being its inline JSON schema."""

    @abstractmethod
    def stream(self) -> ToolStream:
        """A parser for one output."""

    def render_calls(self, calls: Sequence[tuple[str, str]]) -> str:
        """Earlier calls (name, arguments JSON text) as the assistant wrote them."""

        def value(arguments: str) -> Any:
            try:
                return json.loads(arguments)
            except ValueError:
                return arguments  # shown as the client sent it

        return self.separator.join(self.render_call(name, value(args)) for name, args in calls)

    def with_tools(self, messages: list[dict[str, str]],
                   tools: Sequence[Mapping[str, Any]]) -> list[dict[str, str]]:
        """``messages`` with the tools' prompt after the system message's content (or as
        a new system message)."""
        prompt = self.prompt(tools)
        if messages and messages[0]["role"] == "system":
            first = messages[0]["content"]
            return [{"role": "system", "content": f"{first}\n\n{prompt}" if first else prompt},
                    *messages[1:]]
        return [{"role": "system", "content": prompt}, *messages]

    def grammar(self, functions: Sequence[Mapping[str, Any]], parallel: bool) -> str:
        """A Lark grammar (llguidance) whose sentences are one call, or several when
        ``parallel``, each to one of ``functions`` (OpenAI ``function`` objects) with
        arguments valid for its ``parameters``."""
        defs: dict[str, Any] = {}
        calls = [{"type": "object", "properties": {
                      "name": {"const": f["name"]},
                      self.args_key: _rooted(NO_PARAMETERS if f.get("parameters") is None
                                             else f["parameters"], f"f{i}.", defs)},
                  "required": ["name", self.args_key], "additionalProperties": False}
                 for i, f in enumerate(functions)]
        schema = {"x-guidance": JSON_OPTIONS, "anyOf": calls, **({"$defs": defs} if defs else {})}
        more = f" ({json.dumps(self.separator)} call)*" if parallel else ""
        return f"start: call{more}\ncall: {self._call_rule(_dumps(schema))}\n"

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """A whole output -> (content, calls). With calls, content is the text outside
        them, stripped (None when empty); without, the text as it is."""
        s = self.stream()
        events = [*s.feed(text), *s.finish()]
        calls = [e for e in events if isinstance(e, ToolCall)]
        if not calls:
            return text, []
        return "".join(e for e in events if isinstance(e, str)).strip() or None, calls


def _rooted(parameters: Mapping[str, Any], prefix: str, defs: dict[str, Any]) -> Any:
    """``parameters`` made to sit inside a larger schema: its ``$defs`` / ``definitions``
    move to the root's ``$defs`` under ``prefix`` (pydantic models put nested models
    there) and every ``$ref`` to them, or to its own root, follows. Objects are closed
    as in a response format (``closed_objects``)."""
    recursive = False

    def ref(target: str) -> str:
        nonlocal recursive
        if target == "#":
            recursive = True
            return f"#/$defs/{prefix}root"
        for base in ("#/$defs/", "#/definitions/"):
            if target.startswith(base):
                return f"#/$defs/{prefix}{target[len(base):]}"
        return target

    def walk(node: Any) -> Any:
        if isinstance(node, Mapping):
            return {k: ref(v) if k == "$ref" and isinstance(v, str) else walk(v)
                    for k, v in node.items()}
        if isinstance(node, list):
            return [walk(v) for v in node]
        return node

    parameters = closed_objects(parameters)
    own = {k: v for k, v in parameters.items() if k not in ("$defs", "definitions")}
    for key in ("$defs", "definitions"):
        for name, sub in (parameters.get(key) or {}).items():
            defs[f"{prefix}{name}"] = walk(sub)
    body = walk(own)
    if recursive:  # it refers to its own root
        defs[f"{prefix}root"] = body
    return body


class _Hermes(ToolSyntax):
    name, args_key, separator = "hermes", "arguments", "\n"

    def prompt(self, tools: Sequence[Mapping[str, Any]]) -> str:
        listed = "\n".join(_dumps(t) for t in tools)
        return ("# Tools\n\nYou may call one or more functions to assist with the user query."
                "\n\nYou are provided with function signatures within <tools></tools> XML "
                f"tags:\n<tools>\n{listed}\n</tools>\n\nFor each function call, return a json "
                "object with function name and arguments within <tool_call></tool_call> XML "
                'tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}'
                "\n</tool_call>")

    def render_call(self, name: str, arguments: Any) -> str:
        return f"<tool_call>\n{_dumps({'name': name, 'arguments': arguments})}\n</tool_call>"

    def render_result(self, content: str) -> str:
        return f"<tool_response>\n{content}\n</tool_response>"

    def _call_rule(self, schema: str) -> str:
        return f'"<tool_call>\\n" %json {schema} "\\n</tool_call>"'

    def stream(self) -> ToolStream:
        return _HermesStream()


class _Llama3(ToolSyntax):
    name, args_key, separator = "llama3", "parameters", "; "

    def prompt(self, tools: Sequence[Mapping[str, Any]]) -> str:
        listed = "\n\n".join(json.dumps(t, indent=4, ensure_ascii=False) for t in tools)
        return ("Given the following functions, please respond with a JSON for a function call "
                "with its proper arguments that best answers the given prompt.\n\nRespond in "
                'the format {"name": function name, "parameters": dictionary of argument name '
                f"and its value}}. Do not use variables.\n\n{listed}")

    def render_call(self, name: str, arguments: Any) -> str:
        return _dumps({"name": name, "parameters": arguments})

    def render_result(self, content: str) -> str:
        return content

    def _call_rule(self, schema: str) -> str:
        return f"%json {schema}"

    def stream(self) -> ToolStream:
        return _Llama3Stream()


HERMES: ToolSyntax = _Hermes()
LLAMA3: ToolSyntax = _Llama3()


def syntax_for(chat_template: str | None) -> ToolSyntax:
    """The family a chat template belongs to: Llama 3 when it mentions
    ``<|python_tag|>`` or a ``"parameters"`` key (and not ``<tool_call>``), else Hermes."""
    t = chat_template or ""
    if "<tool_call>" not in t and ("<|python_tag|>" in t or '"parameters"' in t):
        return LLAMA3
    return HERMES
