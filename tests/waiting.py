"""Waiting for a condition with a deadline (never a fixed sleep): poll ``ok`` until it
holds, or fail naming what did not happen. The one polling helper of the test suite."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

POLL_S = 0.01


def until(what: str, ok: Callable[[], object], timeout_s: float = 30.0,
          poll_s: float = POLL_S) -> None:
    """Poll ``ok`` (it may assert) until it is true, failing after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not ok():
        assert time.monotonic() < deadline, f"timed out after {timeout_s}s waiting for {what}"
        time.sleep(poll_s)


async def until_async(what: str, ok: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not ok():
        assert time.monotonic() < deadline, f"timed out after {timeout_s}s waiting for {what}"
        await asyncio.sleep(POLL_S)
