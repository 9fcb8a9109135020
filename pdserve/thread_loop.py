"""``ThreadLoop``: one thread that owns an object which is not thread-safe -- a
worker's engine (``worker.loop``), a KV channel (``kv_transfer.driver``).

The loop runs a ``LoopBody`` (what one iteration does: an engine step, a channel
poll); the body's owner holds the loop, it does not inherit from it. Other threads
(Ray actor methods, the router's in-process client) hand work to the loop with
``call``; the loop runs it between iterations and resolves the returned future. When
there is nothing to do it sleeps on a condition (``idle_wait_s`` at most, which the
body may change) instead of spinning (2 cores are precious).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Protocol, TypeVar

T = TypeVar("T")
log = logging.getLogger(__name__)


class LoopStopped(RuntimeError):
    """The loop is not running (any more): a call cannot run."""


class LoopBody(Protocol):
    def iterate(self) -> None:
        """One unit of work (an engine step, polling transfers)."""

    def busy(self) -> bool:
        """True while ``iterate`` has something to do right away."""


class ThreadLoop:
    def __init__(self, name: str, body: LoopBody, idle_wait_s: float = 0.005) -> None:
        self.body = body
        self._cv = threading.Condition()
        self._calls: deque[tuple[Callable[[], Any], Future[Any]]] = deque()
        self._stop = False
        self._iterating = False  # set by start: the body iterates (calls run before it)
        self.idle_wait_s = idle_wait_s
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.error: BaseException | None = None
        # Called on the loop thread when ``iterate`` raised and the loop ended (a Ray
        # actor exits its process, so that Ray restarts it whole).
        self.on_crash: Callable[[BaseException], None] | None = None

    def start(self) -> None:
        """Begin iterating the body (starting the thread, unless ``run`` has)."""
        with self._cv:
            self._iterating = True
            self._cv.notify()
        if self._thread.ident is None:
            self._thread.start()

    def run(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the loop's thread and return its result (or raise its
        exception), starting the thread if it is not running yet; before ``start`` the
        body does not iterate. For state the loop's thread must own from the outset
        (the module docstring says why an engine is)."""
        if self._thread.ident is None:
            self._thread.start()
        return self.call(fn).result()

    def call(self, fn: Callable[[], T]) -> Future[T]:
        """Run ``fn`` on the loop thread between steps; its result or exception
        resolves the future."""
        fut: Future[T] = Future()
        with self._cv:
            if self._stop:
                fut.set_exception(LoopStopped("the loop is stopped"))
                return fut
            self._calls.append((fn, fut))
            self._cv.notify()
        return fut

    def post(self, fn: Callable[[], object]) -> None:
        """``call`` for work nobody waits on: a failure goes to the log (a dropped
        future would hide it, and with it whatever ``fn`` left undone)."""
        self.call(fn).add_done_callback(self._log_failure)

    def _log_failure(self, fut: Future[Any]) -> None:
        exc = fut.exception()
        if exc is not None and not isinstance(exc, LoopStopped):
            log.error("%s: a posted call failed", self._thread.name, exc_info=exc)

    def wake(self) -> None:
        with self._cv:
            self._cv.notify()

    def stop(self, timeout: float = 5.0) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def alive(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        try:
            while True:
                with self._cv:
                    if self._stop:
                        break
                    if not self._calls and not (self._iterating and self.body.busy()):
                        self._cv.wait(self.idle_wait_s)
                    calls = list(self._calls)
                    self._calls.clear()
                for fn, fut in calls:
                    if fut.set_running_or_notify_cancel():
                        try:
                            fut.set_result(fn())
                        except Exception as exc:  # the caller gets it
                            fut.set_exception(exc)
                if self._iterating:
                    self.body.iterate()
        except BaseException as exc:  # a crashed loop must not look alive
            self.error = exc
            if self.on_crash is not None:
                self.on_crash(exc)
            raise
        finally:
            with self._cv:
                self._stop = True
                pending = list(self._calls)
                self._calls.clear()
            for _, fut in pending:
                if not fut.done():
                    fut.set_exception(LoopStopped(f"the loop stopped: {self.error!r}"))


