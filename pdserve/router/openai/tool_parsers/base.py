"""What every tool-call syntax shares: a call (``ToolCall``) and its OpenAI shapes
(``call_object``, ``call_deltas``), the parser of one streamed output (``ToolStream``)
and a family's syntax (``ToolSyntax``): the prompt that declares tools, earlier calls
and results written in it, the grammar that forces calls (llguidance's Lark around
inline JSON schemas, compact JSON), and reading calls out of a whole output."""

from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pdserve.engine.sampling.structured import JSON_OPTIONS, closed_objects

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


def dumps(value: Any) -> str:
    # The compact shape the grammar generates (JSON_OPTIONS' separators).
    return json.dumps(value, ensure_ascii=False)


def call_of(obj: Any) -> ToolCall | None:
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
    return ToolCall(obj["name"], dumps(args))


def held_back(text: str, marker: str) -> int:
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


class ToolSyntax(ABC):
    """One model family's tool-call syntax."""

    name: str
    args_key: str  # the arguments' key in a call's JSON
    separator: str  # between parallel calls

    def claims(self, chat_template: str) -> bool:
        """Whether ``chat_template`` writes calls in this syntax (the registry asks
        every family but the default one)."""
        return False

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
                      self.args_key: rooted(NO_PARAMETERS if f.get("parameters") is None
                                             else f["parameters"], f"f{i}.", defs)},
                  "required": ["name", self.args_key], "additionalProperties": False}
                 for i, f in enumerate(functions)]
        schema = {"x-guidance": JSON_OPTIONS, "anyOf": calls, **({"$defs": defs} if defs else {})}
        more = f" ({json.dumps(self.separator)} call)*" if parallel else ""
        return f"start: call{more}\ncall: {self._call_rule(dumps(schema))}\n"

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """A whole output -> (content, calls). With calls, content is the text outside
        them, stripped (None when empty); without, the text as it is."""
        s = self.stream()
        events = [*s.feed(text), *s.finish()]
        calls = [e for e in events if isinstance(e, ToolCall)]
        if not calls:
            return text, []
        return "".join(e for e in events if isinstance(e, str)).strip() or None, calls


def rooted(parameters: Mapping[str, Any], prefix: str, defs: dict[str, Any]) -> Any:
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
