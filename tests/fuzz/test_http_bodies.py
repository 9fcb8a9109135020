"""Hypothesis against the live server's generate routes with bodies no schema
would produce: known fields set to any JSON value (strings with lone surrogates,
huge and non-integral numbers, nesting thousands deep), number literals no Python
value prints (integers of thousands of digits, exponents past a float's range,
fractions of thousands of digits) at the top level or nested in messages, random
bytes, and any Content-Type. Asserted for each: the answer is not a 5xx (a 504
only for a body that set ``timeout_s``), a number literal past the parser's
bounds is a 400, an error is OpenAI's error object, and the call ends before its
deadline (no hang)."""

from __future__ import annotations

import json
from typing import Any

import hypothesis.strategies as st
import requests
from hypothesis import HealthCheck, given, settings

from pdserve.router.openai.chat_request import ChatCompletionRequest
from pdserve.router.openai.completion_request import CompletionRequest
from tests.fuzz.conftest import AUTH, STATS
from tests.integration.live_server import CALL_TIMEOUT_S, LiveServer

MAX_EXAMPLES = 300
PATHS = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest}
BASES = {"/v1/completions": {"prompt": "hi", "max_tokens": 2},
         "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}],
                                  "max_tokens": 2}}
SURROGATES = st.sampled_from(["\ud800", "\udbff", "\udc00", "\udfff"])
TEXT = st.text(alphabet=st.characters() | SURROGATES, max_size=30)
NUMBERS = st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.integers(
    -(2**70), 2**70)
LEAVES = st.none() | st.booleans() | NUMBERS | TEXT
VALUES = st.recursive(LEAVES, lambda inner: st.lists(inner, max_size=4)
                      | st.dictionaries(TEXT, inner, max_size=4), max_leaves=12)
# Past http.json_body's bounds (MAX_NUMBER_DIGITS, a float's range); thousands of digits
# also pass Python's 4,300-digit integer conversion limit.
DIGITS = st.integers(1, 6000).map(lambda n: "1" * n)
HUGE_NUMBERS = st.one_of(
    st.integers(4301, 6000).map(lambda n: "9" * n),  # integer
    st.integers(4301, 6000).map(lambda n: "-" + "9" * n),  # negative integer
    st.integers(309, 10**6).map(lambda e: f"1e{e}"),  # float overflowing to inf
    st.integers(309, 10**6).map(lambda e: f"-2.5E+{e}"),
    st.tuples(DIGITS, st.integers(1000, 6000)).map(lambda t: f"{t[0]}.{'5' * t[1]}"),
    st.integers(1000, 6000).map(lambda n: f"-0.{'0' * n}1"),  # fraction of thousands of digits
    st.integers(1000, 6000).map(lambda n: f"1{'0' * n}e-{n}"),
)
PLACEHOLDER = "pdserve-fuzz-huge-number"
CONTENT_TYPES = st.sampled_from(["application/json"] * 6 + [
    "application/json; charset=utf-8", "text/plain", "application/x-www-form-urlencoded", ""])


@st.composite
def bodies(draw: st.DrawFn) -> tuple[str, bytes, str, bool]:
    """(path, body bytes, content type, whether it must be refused with a 400)."""
    path = draw(st.sampled_from(sorted(PATHS)))
    how = draw(st.sampled_from(["fields", "fields", "fields", "deep", "huge", "bytes"]))
    if how == "bytes":
        return path, draw(st.binary(max_size=200)), draw(CONTENT_TYPES), False
    body: dict[str, Any] = dict(BASES[path])
    names = st.sampled_from(sorted(PATHS[path].model_fields)) | TEXT
    for name in draw(st.lists(names, max_size=4)):
        body[name] = draw(VALUES)
    if how == "huge":  # the number's text replaces a placeholder string once dumped
        return path, huge_number_body(draw, body, names), "application/json", True
    raw = json.dumps(body).encode()  # escapes lone surrogates as \\udXXX
    if how == "deep":
        depth = draw(st.integers(1, 5000))
        raw = raw[:-1] + b', "deep": ' + b"[" * depth + b"]" * depth + b"}"
    return path, raw, draw(CONTENT_TYPES), False


def huge_number_body(draw: st.DrawFn, body: dict[str, Any], names: st.SearchStrategy[str]
                     ) -> bytes:
    """``body`` with a number past the parser's bounds in a top-level field, in a
    list or object there, or in a message (its content, a content part, a tool call)."""
    where = draw(st.sampled_from(["field", "list", "object", "content", "part", "tool"]))
    if where in ("field", "list", "object"):
        body[draw(names)] = {"field": PLACEHOLDER, "list": [1, PLACEHOLDER],
                             "object": {"a": PLACEHOLDER}}[where]
    else:
        message = {"content": {"role": "user", "content": PLACEHOLDER},
                   "part": {"role": "user", "content": [{"type": "text", "text": "hi",
                                                         "n": PLACEHOLDER}]},
                   "tool": {"role": "assistant", "tool_calls": [
                       {"id": "c", "type": "function",
                        "function": {"name": "f", "arguments": "{}", "x": PLACEHOLDER}}]},
                   }[where]
        body["messages"] = [message, {"role": "user", "content": "hi"}]
    raw = json.dumps(body).replace(json.dumps(PLACEHOLDER), draw(HUGE_NUMBERS))
    return raw.encode()


def test_arbitrary_bodies(live: LiveServer) -> None:
    session = requests.Session()

    @settings(max_examples=MAX_EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(case=bodies())
    def one(case: tuple[str, bytes, str, bool]) -> None:
        path, raw, content_type, refused = case
        headers = {**AUTH, **({"Content-Type": content_type} if content_type else {})}
        r = session.post(f"{live.http_url}{path}", data=raw, headers=headers,
                         timeout=CALL_TIMEOUT_S)
        STATS.record("http bodies", str(r.status_code))
        asked_deadline = b'"timeout_s"' in raw
        assert r.status_code < 500 or (r.status_code == 504 and asked_deadline), r.text
        assert r.status_code == 400 or not refused, r.text
        if r.status_code != 200:
            error = r.json()["error"]
            assert isinstance(error["message"], str) and error["type"], error

    one()
