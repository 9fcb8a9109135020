"""Decode-side bookkeeping shared by every backend: which blocks each request expects,
which of its messages have landed, deadlines, and the one event each request ends with.

Thread-safe (one re-entrant lock): backends that write on a background thread hold
`lock` across "may I write? -> scatter -> landed()" so an abort can never interleave
with a half-written message.

A request is in one of three states:

    live ──(all messages landed)──────────────▶ done   (RecvEvent ok)
      │  ──end()───────────────────────────────▶ failed (RecvEvent failed)
      └──start_ending()──▶ ending ──finish()──▶ failed  (backends whose writes D cannot
                                                         stop: wait for the sender's ack)

Writes are accepted only for live requests and only into their expected blocks; late
messages for ended requests are dropped. A request whose messages all landed but left
an expected block unwritten fails (``FailReason.TRANSPORT``, "KV incomplete"; the blocks
its final notify's ``COVERS`` names, when it says) instead of reporting done: its decode would read whatever the block held before -- silently wrong
tokens, and a wrong block in the prefix cache for every later request sharing it.

A request may come in parts (tensor parallel: several sender ranks each write their KV
heads into one receiver rank, ``layout.Slice``): every message says its part and how
many parts there are; each part is numbered and ends like a whole request, and the
request is done when every part is.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .base import FailReason, RecvEvent
from .layout import check_block_ids

log = logging.getLogger(__name__)
COVERS = "covers"  # a final notify's key: the expected blocks the sender fills (the rest stay)


@dataclass
class _Expected:
    dst_set: frozenset[int]
    deadline: float
    timeout_s: float  # each landed message moves the deadline this far ahead
    peers: set[str] = field(default_factory=set)  # senders that touched it (death -> fail)
    seen: set[tuple[int, int]] = field(default_factory=set)  # (part, message index) landed
    totals: dict[int, int] = field(default_factory=dict)  # part -> its number of messages
    parts: int = 1  # the parts the request comes in (every message says)
    notify: dict[str, Any] | None = None
    ending: tuple[FailReason, str] | None = None  # set while waiting for a sender's ack
    # part -> the blocks its messages wrote; None once a message did not say (unchecked)
    written: dict[int, set[int]] | None = field(default_factory=dict)


class RecvTracker:
    def __init__(self, num_blocks: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.lock = threading.RLock()
        self._num_blocks = num_blocks
        self._clock = clock
        self._live: dict[str, _Expected] = {}
        self._events: list[RecvEvent] = []

    # --- D's calls -----------------------------------------------------------------

    def expect(self, request_id: str, dst_block_ids: Sequence[int], timeout_s: float) -> None:
        ids = [int(b) for b in dst_block_ids]
        check_block_ids(ids, self._num_blocks, "destination")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        with self.lock:
            if request_id in self._live:
                raise ValueError(f"request {request_id!r} is already expected")
            taken = {b for e in self._live.values() for b in e.dst_set}
            clash = taken.intersection(ids)
            if clash:
                raise ValueError(f"blocks {sorted(clash)[:8]} are expected by another request")
            self._live[request_id] = _Expected(frozenset(ids), self._clock() + timeout_s,
                                               timeout_s)

    def expire_and_drain(self) -> list[RecvEvent]:
        """Fail expectations past their timeout, then hand out every finished event
        (the tail of a backend's ``poll`` whose late data cannot land anyway)."""
        for rid in self.expired():
            self.end(rid, FailReason.TIMEOUT, "no complete KV within the timeout")
        return self.drain()

    def drain(self) -> list[RecvEvent]:
        with self.lock:
            events, self._events = self._events, []
            return events

    @property
    def num_pending(self) -> int:
        with self.lock:
            return len(self._live)

    # --- what backends report ------------------------------------------------------

    def may_write(self, request_id: str, dst_block_ids: Sequence[int]) -> bool:
        """True if a message for request_id may be written into dst_block_ids now."""
        with self.lock:
            exp = self._live.get(request_id)
            return exp is not None and exp.ending is None and exp.dst_set.issuperset(dst_block_ids)

    def is_known(self, request_id: str) -> bool:
        with self.lock:
            return request_id in self._live

    def touch(self, request_id: str, peer: str) -> None:
        """Record that `peer` is sending request_id (its death then fails the request)."""
        with self.lock:
            exp = self._live.get(request_id)
            if exp is not None:
                exp.peers.add(peer)

    def landed(
        self,
        request_id: str,
        seq: int,
        total: int | None,
        notify: dict[str, Any] | None,
        peer: str = "",
        part: int = 0,
        parts: int = 1,
        blocks: Sequence[int] | None = None,
    ) -> None:
        """Message `seq` of part `part` (of `parts`) of request_id is in place; `total`
        (that part's number of messages) is set on the part's final message. `blocks`:
        the destination blocks it wrote (None: the backend cannot say; the request's
        coverage is then not checked)."""
        with self.lock:
            exp = self._live.get(request_id)
            if exp is None or exp.ending is not None:
                return
            if peer:
                exp.peers.add(peer)
            exp.seen.add((part, seq))
            exp.parts = parts
            exp.deadline = max(exp.deadline, self._clock() + exp.timeout_s)
            if exp.written is not None:
                if blocks is None:
                    exp.written = None
                else:
                    exp.written.setdefault(part, set()).update(blocks)
            if total is not None:
                exp.totals[part] = total
                exp.notify = exp.notify or notify
            if len(exp.totals) >= exp.parts and len(exp.seen) >= sum(exp.totals.values()):
                missing = self._unwritten(exp)
                if missing:  # a sender's bug, never the data's: say so loudly
                    why = (f"KV incomplete: {len(missing)} of {len(exp.dst_set)} blocks never "
                           f"written (blocks {missing[:8]}, {len(exp.seen)} messages)")
                    log.error("request %s: %s", request_id, why)
                    self.end(request_id, FailReason.TRANSPORT, why)
                    return
                del self._live[request_id]
                self._events.append(RecvEvent(request_id, True, notify=exp.notify or {}))

    @staticmethod
    def _unwritten(exp: _Expected) -> list[int]:
        """Expected blocks some part's messages did not write (sorted; [] when every
        part covered them all, or when coverage is unknown). A sender that fills only
        some of them (a moved request's tail: as many as its tokens need) names those
        in its final notify (``COVERS``)."""
        if exp.written is None:
            return []
        want = exp.dst_set
        covers = (exp.notify or {}).get(COVERS)
        if covers is not None:
            want = want & frozenset(int(b) for b in covers)
        return sorted({b for p in range(exp.parts) for b in want - exp.written.get(p, set())})

    def end(self, request_id: str, reason: FailReason, error: str) -> bool:
        """Fail a live or ending request now; False if it is not pending."""
        with self.lock:
            if self._live.pop(request_id, None) is None:
                return False
            self._events.append(RecvEvent(request_id, False, reason=reason, error=error))
            return True

    def start_ending(self, request_id: str, reason: FailReason, error: str) -> bool:
        """Stop accepting data; the failure is reported by finish(). False if not live."""
        with self.lock:
            exp = self._live.get(request_id)
            if exp is None or exp.ending is not None:
                return False
            exp.ending = (reason, error)
            return True

    def finish(self, request_id: str, note: str = "") -> None:
        """Report an ending request's failure (its sender confirmed, or died)."""
        with self.lock:
            exp = self._live.get(request_id)
            if exp is not None and exp.ending is not None:
                reason, error = exp.ending
                self.end(request_id, reason, error + note)

    def ending(self) -> list[str]:
        with self.lock:
            return [rid for rid, e in self._live.items() if e.ending is not None]

    def requests_of(self, peer: str) -> list[str]:
        with self.lock:
            return [rid for rid, e in self._live.items() if peer in e.peers]

    def expired(self) -> list[str]:
        """Live (not ending) requests whose deadline has passed."""
        now = self._clock()
        with self.lock:
            return [r for r, e in self._live.items() if e.ending is None and e.deadline <= now]

    def pending_ids(self) -> list[str]:
        with self.lock:
            return list(self._live)
