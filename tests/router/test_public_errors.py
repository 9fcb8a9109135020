"""What a client may see of an error message."""

from __future__ import annotations

import pytest

from pdserve.router.api.public_errors import GENERIC, MAX_CHARS, public_message
from pdserve.router.types import ErrorKind

LEAKS = [
    "Traceback (most recent call last):",
    "worker failed: \x1b[36mray::DecodeActor\x1b[0m",
    'File "/home/u/pdserve/x.py", line 3',
    "failed at 10.0.3.7:4421",
    "peer fe80::1:2 went away",
    "pid=812 died",
    "actor 2f9e0c5d1a7b3e6f4c8d9a0b1c2d3e4f is gone",
    "cannot open /var/lib/pdserve/cache",
    "two\nlines",
]


@pytest.mark.parametrize("message", LEAKS)
def test_internals_are_replaced_and_logged(message: str, caplog: pytest.LogCaptureFixture) -> None:
    assert public_message(ErrorKind.INVALID, message, "r1") == GENERIC[ErrorKind.INVALID]
    (record,) = caplog.records
    assert "r1" in record.getMessage() and message.splitlines()[0] in record.getMessage()


def test_plain_messages_pass_and_long_ones_are_cut() -> None:
    fine = ["prompt has 3000 tokens; the model's context is 2048 tokens",
            "top_p must be in (0, 1], got 1.5",
            "request 0123456789abcdef0123456789abcdef passed its deadline"]
    for message in fine:
        rid = "0123456789abcdef0123456789abcdef"  # the request's own id is no secret
        assert public_message(ErrorKind.INVALID, message, rid) == message
    cut = public_message(ErrorKind.INVALID, "n=" + "1" * 5000 + " is not supported", "r")
    assert len(cut) == MAX_CHARS and cut.endswith("…")


def test_internal_errors_never_show_their_text() -> None:
    shown = public_message(ErrorKind.INTERNAL, "decode worker decode-0 is gone", "r9")
    assert shown == "internal error (request id r9; details are in the server log)"
