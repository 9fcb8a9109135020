"""Prefill-side bookkeeping shared by every backend: message numbering per request,
messages in flight, deadlines, and the one event each request ends with.

Used from the thread that calls send/poll/abort only; background workers report
finished messages through `completions` (a thread-safe queue) and read `Cancel.set`.

Message numbering: each send() call becomes n >= 1 messages numbered next_seq ..
next_seq + n - 1; the final call stamps total = next_seq + n on its last message, so the
receiver knows when it has everything no matter the order messages land in.

A request's event is emitted when its final call's messages all finished (ok), or once
it failed AND nothing of it is in flight any more (so its source blocks are no longer
read) — except a dead peer or an expired deadline, which report at once.
"""

from __future__ import annotations

import queue
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from .base import FailReason, SendEvent

MAX_TOMBSTONES = 65536


@dataclass
class Cancel:
    """Shared with background workers: queued messages of a cancelled request are skipped."""

    set: bool = False


@dataclass
class _Outgoing:
    peer: str
    deadline: float
    next_seq: int = 0
    inflight: int = 0
    final_sent: bool = False
    failure: tuple[FailReason, str] | None = None
    cancel: Cancel = field(default_factory=Cancel)


@dataclass(frozen=True)
class Numbered:
    """What send() needs to stamp on its messages."""

    first_seq: int
    total: int | None  # set when this call is the final one
    cancel: Cancel


class SendTracker:
    def __init__(self, timeout_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._timeout_s = timeout_s
        self._clock = clock
        self._out: dict[str, _Outgoing] = {}
        self._events: list[SendEvent] = []
        # ended request id -> failure to report if a send for it comes later (None: done/
        # already reported). Lets "receiver aborted before P sent anything" still end in
        # exactly one event.
        self._ended: OrderedDict[str, tuple[FailReason, str] | None] = OrderedDict()
        self.completions: queue.SimpleQueue[tuple[str, tuple[FailReason, str] | None]] = (
            queue.SimpleQueue()
        )

    def begin(self, peer: str, request_id: str, final: bool, n_messages: int) -> Numbered | None:
        """Number the messages of one send() call; None = drop it (request already over)."""
        if request_id in self._ended:
            owed = self._ended[request_id]
            if owed is not None:  # failed before P knew the request: report it now
                self._ended[request_id] = None
                self._events.append(SendEvent(request_id, False, owed[0], owed[1]))
            return None
        out = self._out.get(request_id)
        deadline = self._clock() + self._timeout_s
        if out is None:
            out = self._out[request_id] = _Outgoing(peer, deadline)
        out.deadline = deadline  # a request sent in chunks times out between sends, not in all
        if out.peer != peer:
            raise ValueError(f"request {request_id!r} is already being sent to {out.peer}")
        if out.final_sent:
            raise ValueError(f"request {request_id!r} already had its final send")
        if out.failure is not None:
            return None
        first = out.next_seq
        out.next_seq += n_messages
        out.inflight += n_messages
        out.final_sent = final
        return Numbered(first, out.next_seq if final else None, out.cancel)

    def message_done(self, request_id: str, failure: tuple[FailReason, str] | None) -> None:
        out = self._out.get(request_id)
        if out is None:
            return
        out.inflight -= 1
        if failure is not None and out.failure is None:
            self.fail(request_id, *failure)  # settles
        else:
            self._settle(request_id)

    def fail(self, request_id: str, reason: FailReason, error: str, now: bool = False) -> None:
        """Mark failed; reported once nothing is in flight (or at once when now=True)."""
        out = self._out.get(request_id)
        if out is None:
            return
        if out.failure is None:
            out.failure = (reason, error)
            out.cancel.set = True
        if now:
            out.inflight = 0
        self._settle(request_id)

    def fail_unknown(self, request_id: str, reason: FailReason, error: str) -> None:
        """The receiver gave up on a request P has not sent yet: owe it a failed event."""
        if request_id not in self._out and request_id not in self._ended:
            self._remember(request_id, (reason, error))

    def fail_peer(self, peer: str, reason: FailReason, error: str) -> None:
        for rid in [r for r, o in self._out.items() if o.peer == peer]:
            self.fail(rid, reason, error, now=True)

    def check_deadlines(self) -> None:
        now = self._clock()
        for rid in [r for r, o in self._out.items() if o.deadline <= now]:
            self.fail(rid, FailReason.TIMEOUT, f"not sent within {self._timeout_s}s", now=True)

    def pump(self) -> None:
        """Apply completions reported by background workers."""
        while True:
            try:
                rid, failure = self.completions.get_nowait()
            except queue.Empty:
                return
            self.message_done(rid, failure)

    def drain(self) -> list[SendEvent]:
        self.pump()
        self.check_deadlines()
        events, self._events = self._events, []
        return events

    def inflight(self, request_id: str) -> int:
        out = self._out.get(request_id)
        return out.inflight if out else 0

    def peer_of(self, request_id: str) -> str | None:
        out = self._out.get(request_id)
        return out.peer if out else None

    def pending_ids(self) -> list[str]:
        return list(self._out)

    @property
    def num_pending(self) -> int:
        return len(self._out)

    def _settle(self, request_id: str) -> None:
        out = self._out.get(request_id)
        if out is None or out.inflight > 0:
            return
        if out.failure is not None:
            event = SendEvent(request_id, False, out.failure[0], out.failure[1])
        elif out.final_sent:
            event = SendEvent(request_id, True)
        else:
            return
        del self._out[request_id]
        self._remember(request_id, None)
        self._events.append(event)

    def _remember(self, request_id: str, owed: tuple[FailReason, str] | None) -> None:
        self._ended[request_id] = owed
        while len(self._ended) > MAX_TOMBSTONES:
            self._ended.popitem(last=False)
