"""``ThreadLoop``: calls run on the loop's thread between iterations; ``post`` (a call
nobody waits on) logs what fails instead of dropping it with its future."""

from __future__ import annotations

import logging
import threading

import pytest

from pdserve.thread_loop import LoopStopped, ThreadLoop


class NoWork:
    def iterate(self) -> None:
        pass

    def busy(self) -> bool:
        return False


def idle_loop(name: str) -> ThreadLoop:
    return ThreadLoop(name, NoWork())


def test_calls_run_on_the_loop_thread_in_order() -> None:
    loop = idle_loop("test-loop")
    loop.start()
    try:
        ran: list[tuple[int, str]] = []
        futs = [loop.call(lambda i=i: ran.append((i, threading.current_thread().name)))
                for i in range(5)]
        for f in futs:
            f.result(10)
        assert ran == [(i, "test-loop") for i in range(5)]
    finally:
        loop.stop()


def test_a_failed_post_is_logged_and_the_loop_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    loop = idle_loop("test-loop")
    loop.start()
    try:
        def boom() -> None:
            raise KeyError("lost event")

        with caplog.at_level(logging.ERROR, logger="pdserve.thread_loop"):
            loop.post(boom)
            assert loop.call(lambda: 7).result(10) == 7  # still serving calls
        failed = [r for r in caplog.records if "a posted call failed" in r.getMessage()]
        assert len(failed) == 1 and failed[0].exc_info is not None
        assert "lost event" in str(failed[0].exc_info[1])
    finally:
        loop.stop()


def test_a_stopped_loop_refuses_calls(caplog: pytest.LogCaptureFixture) -> None:
    loop = idle_loop("test-loop")
    loop.start()
    loop.stop()
    with pytest.raises(LoopStopped):
        loop.call(lambda: 1).result(10)
    with caplog.at_level(logging.ERROR, logger="pdserve.thread_loop"):
        loop.post(lambda: None)  # shutting down is not a failure worth a log line
    assert not caplog.records


class Counting:
    def __init__(self) -> None:
        self.iterations = 0

    def iterate(self) -> None:
        self.iterations += 1

    def busy(self) -> bool:
        return True


def test_run_builds_on_the_loop_thread_before_the_body_iterates() -> None:
    """``run`` is for what the loop's thread must own from the outset (an engine): it
    runs there and returns, and the body's first iteration waits for ``start``."""
    body = Counting()
    loop = ThreadLoop("test-loop", body, idle_wait_s=0.001)
    try:
        assert loop.run(lambda: threading.current_thread().name) == "test-loop"
        with pytest.raises(KeyError, match="no such weights"):
            loop.run(lambda: {}["no such weights"])
        assert loop.call(lambda: body.iterations).result(10) == 0  # a busy body, not started
        loop.start()
        loop.call(lambda: None).result(10)  # its pass iterates after it
        assert loop.call(lambda: body.iterations).result(10) >= 1
    finally:
        loop.stop()
