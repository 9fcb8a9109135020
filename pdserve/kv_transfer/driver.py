"""``ChannelThread``: a sender or receiver driven by a thread of its own, so transfers
make progress and are reported while the engine steps.

Without it a worker polls its channel between engine steps: a prefill chunk of a few
seconds on CPU holds every acknowledgement (and, for nixl, the transfer itself, which
progresses only inside ``poll``) for that long. Measured before this change at 2 req/s
of 128/32 tokens: the ``kv_transfer`` stage had p50 17 ms, mean 246 ms, p99 1,420 ms.

The thread is the channel's one caller (the backends' usage rule): the worker hands it
work with ``call(fn)`` (``ThreadLoop.call``: ``fn`` runs on the thread between polls,
its result resolves the returned future) -- except ``KVReceiver.expect``, which only records an expectation
under the tracker's lock and may be called from the engine loop directly, and a sender's
``dial`` (``connect`` here runs it on a thread of its own). Events go to
``on_events(events, when)`` on this thread, with the monotonic time of the poll that
found them; the worker forwards them to its engine loop.

The thread's own torch work (copying blocks in and out of the cache) runs on one
thread: an OpenMP pool of its own beside the engine's would put the engine's workers to
sleep between parallel regions (``thread_loop.py``: the process would hold more OpenMP
threads than cores). ``torch.set_num_threads`` also sets the count for threads that have
not yet run parallel work, so a worker builds its engine (on its loop thread, which keeps
its own count) before opening a channel.

While requests are pending the thread polls every ``MIN_POLL_S``, backing off to
``MAX_POLL_S`` over polls that find nothing; with nothing pending it sleeps until a
call arrives.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Generic, TypeVar

import torch

from pdserve.thread_loop import ThreadLoop

from .base import KVReceiver, KVSender, RecvEvent, SendEvent

C = TypeVar("C", KVSender, KVReceiver)
T = TypeVar("T")
log = logging.getLogger(__name__)

MIN_POLL_S = 0.0005
MAX_POLL_S = 0.01
IDLE_S = 1.0


class ChannelThread(Generic[C]):
    """A channel driven by a ``ThreadLoop`` of its own, one ``poll`` per iteration."""

    def __init__(self, channel: C,
                 on_events: Callable[[list[Any], float], None], name: str) -> None:
        self.channel: C = channel
        self._on_events = on_events
        self._wait = MIN_POLL_S
        self._pending = 0
        self._loop = ThreadLoop(name, self, IDLE_S)
        self._loop.post(lambda: torch.set_num_threads(1))  # (the module docstring)
        self._loop.start()

    def call(self, fn: Callable[[], T]) -> Future[T]:
        """Run ``fn`` on the channel's thread between polls (``ThreadLoop.call``)."""
        return self._loop.call(fn)

    def post(self, fn: Callable[[], object]) -> None:
        self._loop.post(fn)

    def wake(self) -> None:
        self._loop.wake()

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the thread, then close the channel (pending requests fail CLOSED)."""
        self._loop.stop(timeout_s)
        self.channel.close()

    def connect(self: ChannelThread[KVSender], endpoint: dict[str, Any]) -> Future[str]:
        """The sender's ``connect``, its handshake (``dial``) on a thread of its own:
        against a stalled receiver that waits its whole timeout, and this thread keeps
        carrying the other peers' transfers meanwhile. ``attach`` runs here. Resolves
        to the peer id."""
        done: Future[str] = Future()
        sender = self.channel

        def dial() -> None:
            try:
                dialed = sender.dial(endpoint)
                done.set_result(self.call(lambda: sender.attach(dialed)).result())
            except Exception as exc:
                done.set_exception(exc)

        threading.Thread(target=dial, name="kv-dial", daemon=True).start()
        return done

    def busy(self) -> bool:
        return False  # the next poll waits ``idle_wait_s`` (set by iterate) or a call

    def iterate(self) -> None:
        try:
            events: list[SendEvent] | list[RecvEvent] = self.channel.poll()
        except Exception:
            log.exception("transfer channel poll failed")
            events = []
        if events:
            self._on_events(events, time.monotonic())
        pending = self.channel.num_pending
        busier = pending > self._pending  # a new request: poll it soon
        self._pending = pending
        self._wait = MIN_POLL_S if events or busier else min(MAX_POLL_S, self._wait * 2)
        self._loop.idle_wait_s = self._wait if pending else IDLE_S
