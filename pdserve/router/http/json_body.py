"""Reading an HTTP request body as JSON, with the limits checked around the parser:
the encoding (UTF-8) and nesting depth before it, the numbers as it reads them, the
strings (no lone surrogates) after it.

Why each rule:

* UTF-8: JSON on the wire is UTF-8 (RFC 8259), and Python's ``json.loads`` would
  guess UTF-16 or UTF-32 from the bytes and accept them. The body is decoded as
  strict UTF-8 first (a leading byte order mark, which the RFC lets a parser
  ignore, is dropped).
* Depth: Python's ``json`` recurses once per nesting level, so ``[[[[...`` a few
  thousand deep raises ``RecursionError`` (a 500) and pydantic walks it again.
  No OpenAI body nests deeper than a handful of levels; `MAX_DEPTH` leaves room.
  The depth is counted on the raw bytes with the strings blanked out, so a bracket
  inside a string never counts. (Size is bounded earlier, by the body limit in
  ``http.middleware``.)
* Lone surrogates: JSON allows ``"\\ud800"``, Python turns it into a ``str`` that
  cannot be encoded as UTF-8, and the tokenizer raises ``TypeError`` on it. Such a
  body is refused here, naming the field.
* Numbers as JSON means them: ``5.0`` and ``5`` are the same number (JSON Schema's
  ``integer`` accepts both), so an integral number arrives as an ``int`` and the
  strict models (no ``"5"`` for 5) still accept it where an integer is due.
  ``NaN`` and ``Infinity``, which Python's parser accepts, are not JSON: refused.
* Number size: a number literal of more than `MAX_NUMBER_DIGITS` digits is refused
  before it is converted (Python raises ``ValueError`` -- a 500 -- for an integer
  of more than 4,300 digits, and no field needs a hundred), and so is a number
  that overflows a float (``1e999`` would be ``inf``): out of range.

Every problem is a `BadJson` (a 400 for the caller).
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

MAX_DEPTH = 32  # arrays + objects, outermost counted as 1
MAX_NUMBER_DIGITS = 100  # digits of one number literal (mantissa and exponent)

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
    """The parsed body; `BadJson` when it is not UTF-8, nests deeper than
    ``max_depth``, is not JSON, holds a number too long or out of range, or a string
    with a lone surrogate."""
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise BadJson(f"the request body must be UTF-8: {exc}") from None
    check_depth(raw, max_depth)
    try:
        body = json.loads(text, parse_float=_number, parse_int=_integer,
                          parse_constant=_not_json)
    except json.JSONDecodeError as exc:
        raise BadJson(f"the request body is not valid JSON: {exc}") from None
    where = _find_surrogate(body, "")
    if where is not None:
        top = re.match(r"[^.\[]*", where)
        raise BadJson(f"{where or 'a key of the body'}: text must be valid Unicode (a lone "
                      "surrogate such as \\ud800 is not)", (top and top.group()) or None)
    return body


def _integer(text: str) -> int:
    _check_digits(text)
    return int(text)


def _number(text: str) -> float | int:
    _check_digits(text)
    value = float(text)
    if not math.isfinite(value):
        raise BadJson(f"the number {text} in the request body is out of range")
    return int(value) if value.is_integer() else value


def _check_digits(text: str) -> None:
    # Counted only for a literal that could have too many (token-id lists stay fast).
    if len(text) > MAX_NUMBER_DIGITS and sum(c.isdigit() for c in text) > MAX_NUMBER_DIGITS:
        raise BadJson(f"a number in the request body has more than {MAX_NUMBER_DIGITS} "
                      "digits")


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
