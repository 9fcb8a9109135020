"""Reading an HTTP request body as JSON, with the limits checked before the parser
runs: nesting depth, then the parse, then the strings (no lone surrogates).

Why each rule:

* Depth: Python's ``json`` recurses once per nesting level, so ``[[[[...`` a few
  thousand deep raises ``RecursionError`` (a 500) and pydantic walks it again.
  No OpenAI body nests deeper than a handful of levels; `MAX_DEPTH` leaves room.
  The depth is counted on the raw bytes with the strings blanked out, so a bracket
  inside a string never counts. (Size is bounded earlier, by the body limit in
  ``http_middleware``.)
* Lone surrogates: JSON allows ``"\\ud800"``, Python turns it into a ``str`` that
  cannot be encoded as UTF-8, and the tokenizer raises ``TypeError`` on it. Such a
  body is refused here, naming the field.
* Numbers as JSON means them: ``5.0`` and ``5`` are the same number (JSON Schema's
  ``integer`` accepts both), so an integral number arrives as an ``int`` and the
  strict models (no ``"5"`` for 5) still accept it where an integer is due.
  ``NaN`` and ``Infinity``, which Python's parser accepts, are not JSON: refused.

Every problem is a `BadJson` (a 400 for the caller).
"""

from __future__ import annotations

import json
import re
from typing import Any

MAX_DEPTH = 32  # arrays + objects, outermost counted as 1

# A JSON string: quote, then runs of plain characters or escapes, then quote.
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
_BRACKET = re.compile(rb"[\[\]{}]")
_SURROGATE = re.compile("[\ud800-\udfff]")


class BadJson(ValueError):
    """The body is not acceptable JSON; ``param`` names the field when one is at fault."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param


def parse_json(raw: bytes, max_depth: int = MAX_DEPTH) -> Any:
    """The parsed body; `BadJson` when it nests deeper than ``max_depth``, is not
    JSON, or holds a string with a lone surrogate."""
    check_depth(raw, max_depth)
    try:
        body = json.loads(raw, parse_float=_number, parse_constant=_not_json)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadJson(f"the request body is not valid JSON: {exc}") from None
    where = _find_surrogate(body, "")
    if where is not None:
        top = re.match(r"[^.\[]*", where)
        raise BadJson(f"{where or 'a key of the body'}: text must be valid Unicode (a lone "
                      "surrogate such as \\ud800 is not)", (top and top.group()) or None)
    return body


def _number(text: str) -> float | int:
    value = float(text)
    return int(value) if value.is_integer() else value


def _not_json(name: str) -> None:
    raise BadJson(f"the request body is not valid JSON: {name} is not a JSON number")


def check_depth(raw: bytes, max_depth: int) -> None:
    """`BadJson` when ``raw`` opens more than ``max_depth`` nested arrays/objects."""
    blanked = _STRING.sub(b'""', raw)
    if blanked.count(b"[") + blanked.count(b"{") <= max_depth:
        return  # cannot nest deeper than the number of openers
    depth = 0
    for match in _BRACKET.finditer(blanked):
        if match.group() in (b"[", b"{"):
            depth += 1
            if depth > max_depth:
                raise BadJson(f"the request body nests deeper than {max_depth} levels")
        else:
            depth -= 1


def _find_surrogate(value: Any, path: str) -> str | None:
    """The path (``messages[0].content``) of the first string holding a lone
    surrogate; for a key, the path of the object holding it."""
    if isinstance(value, str):
        return path if _SURROGATE.search(value) else None
    if isinstance(value, dict):
        for key, item in value.items():
            if _SURROGATE.search(key):
                return path
            found = _find_surrogate(item, f"{path}.{key}" if path else key)
            if found is not None:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found = _find_surrogate(item, f"{path}[{i}]")
            if found is not None:
                return found
    return None
