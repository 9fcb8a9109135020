"""Request bodies as JSON: depth counted before parsing, lone surrogates refused."""

from __future__ import annotations

import pytest

from pdserve.router.json_body import BadJson, check_depth, parse_json


def test_depth_is_counted_outside_strings() -> None:
    check_depth(b"[" * 32 + b"]" * 32, 32)
    with pytest.raises(BadJson, match="deeper than 32"):
        check_depth(b"[" * 33 + b"]" * 33, 32)
    with pytest.raises(BadJson):
        check_depth(b'{"a": ' * 40 + b"1" + b"}" * 40, 32)
    # Brackets in strings (escaped quotes too) and wide but shallow bodies are fine.
    check_depth(b'["' + b"[" * 1000 + b'\\"[[[", "{{{{"]', 4)
    check_depth(b"[" + b"[]," * 5000 + b"[]]", 2)
    # 100k deep: refused before json (whose recursion would raise RecursionError).
    with pytest.raises(BadJson):
        parse_json(b"[" * 100_000 + b"]" * 100_000)


def test_lone_surrogates_name_the_field() -> None:
    assert parse_json(b'{"prompt": "caf\\u00e9 \\ud83d\\ude00"}') == {"prompt": "café 😀"}
    cases = {
        b'{"prompt": "\\ud800"}': ("prompt", "prompt"),
        b'{"messages": [{"role": "user", "content": "x\\udfffy"}]}':
            ("messages[0].content", "messages"),
        b'{"a": {"\\udc00": 1}}': ("a", "a"),
        b'{"\\udc00": 1}': ("a key of the body", None),
    }
    for raw, (where, param) in cases.items():
        with pytest.raises(BadJson) as info:
            parse_json(raw)
        assert info.value.message.startswith(f"{where}: ") and info.value.param == param


def test_not_json() -> None:
    for raw in (b"{not json", b"\xff\xfe\x00", b""):
        with pytest.raises(BadJson, match="not valid JSON"):
            parse_json(raw)


def test_numbers_as_json_means_them() -> None:
    assert parse_json(b'{"seed": 14754126133531.0, "t": 0.5, "n": 1e2}') == {
        "seed": 14754126133531, "t": 0.5, "n": 100}
    for raw in (b'{"t": NaN}', b'{"t": Infinity}', b'{"t": -Infinity}'):
        with pytest.raises(BadJson, match="not a JSON number"):
            parse_json(raw)
