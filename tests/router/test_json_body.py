"""Request bodies as JSON: UTF-8 only, depth counted before parsing, numbers bounded
in length and range, lone surrogates refused."""

from __future__ import annotations

import pytest

from pdserve.router.http.json_body import MAX_NUMBER_DIGITS, BadJson, check_depth, parse_json


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
    for raw in (b"{not json", b""):
        with pytest.raises(BadJson, match="not valid JSON"):
            parse_json(raw)


def test_numbers_as_json_means_them() -> None:
    assert parse_json(b'{"seed": 14754126133531.0, "t": 0.5, "n": 1e2}') == {
        "seed": 14754126133531, "t": 0.5, "n": 100}
    for raw in (b'{"t": NaN}', b'{"t": Infinity}', b'{"t": -Infinity}'):
        with pytest.raises(BadJson, match="not a JSON number"):
            parse_json(raw)


def test_numbers_are_bounded() -> None:
    bound = MAX_NUMBER_DIGITS
    top = int("9" * bound)
    assert parse_json(b'{"seed": ' + b"9" * bound + b', "n": -' + b"9" * bound + b"}") == {
        "seed": top, "n": -top}
    assert parse_json(b'{"t": 1e-999, "u": 0.' + b"5" * (bound - 1) + b"}") == {
        "t": 0, "u": pytest.approx(5 / 9)}
    long = b"1" * 5000  # past Python's 4,300-digit int conversion limit (a ValueError)
    too_long = [b"1" * (bound + 1), long, b"-" + long, long + b".5", b"0." + long,
                b"1e" + long, b"1" + b"0" * bound + b"e-5", b"-1" + b"0" * 4400 + b".0"]
    for number in too_long:
        for raw in (b'{"max_tokens": ' + number + b"}",
                    b'{"messages": [{"role": "user", "content": [' + number + b"]}]}"):
            with pytest.raises(BadJson, match=f"more than {bound} digits"):
                parse_json(raw)
    for number in (b"1e999", b"-1e999", b"1.5E+400", b"9" * 90 + b"e300"):
        with pytest.raises(BadJson, match="out of range"):
            parse_json(b'{"temperature": ' + number + b"}")


def test_only_utf8() -> None:
    body = {"prompt": "caf\u00e9"}
    assert parse_json('{"prompt": "café"}'.encode()) == body
    assert parse_json('\ufeff{"prompt": "café"}'.encode()) == body  # a UTF-8 BOM is ignored
    for encoding in ("utf-16", "utf-16-le", "utf-16-be", "utf-32", "utf-32-le", "latin-1"):
        with pytest.raises(BadJson):
            parse_json('{"prompt": "café"}'.encode(encoding))
    for raw in (b"\xff\xfe\x00", '{"prompt": "x"}'.encode("utf-16"), b'{"prompt": "\xe9"}'):
        with pytest.raises(BadJson, match="must be UTF-8"):
            parse_json(raw)
