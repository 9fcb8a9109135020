"""The KV transfer interface: two roles, polled states, no callbacks into the engine.

A decode worker (D) wraps its KV tensor in a `KVReceiver`, a prefill worker (P) wraps its
own in a `KVSender`. One request moves like this:

    D: recv.expect(rid, dst_ids, timeout_s)         blocks D reserved for rid
    D: ep = recv.endpoint()  ──control plane──▶  P: peer = send.connect(ep)   (once per D)
    P: send.send(peer, rid, src_ids, dst_ids, layers=(0, 8))        any number of layer
    P: send.send(peer, rid, src_ids, dst_ids, layers=(8, 16), notify={"token": 42})
    P: send.poll() -> [SendEvent(rid, ok=True)]       P may free its source blocks
    D: recv.poll() -> [RecvEvent(rid, ok=True, notify={"token": 42})]   blocks are filled

A `send` call is FINAL when it carries `notify` or covers all layers (`layers=None`);
the request completes once every message of every call up to the final one has landed,
whatever order they land in. Messages describe themselves (request id, message index,
total on the final one), so requests may finish in any order.

Failure and abort rules (both sides):
* every request ends in exactly one event: ok, or failed with a `FailReason`;
* after a failed RecvEvent no more data for that request will land in its blocks, so D
  may reuse them (backends whose writes D cannot stop wait for the sender to confirm);
* after a failed SendEvent the backend no longer reads the request's source blocks;
* nothing waits forever: expectations time out (``timeout_s`` without a message landing),
  sends time out (``timeout_s`` after the request's last send call), dead peers are
  noticed.

Usage rules: call one sender/receiver from one thread (``driver.ChannelThread``) and
poll it regularly -- some backends make progress only inside poll() (nixl: D's poll
also lets P's writes complete). ``KVReceiver.expect`` is the exception: every backend
only records it under its tracker's lock, so it may be called from any thread, and so
may ``KVSender.dial`` (connect = ``attach(dial(ep))``). A request id names one attempt: once it has ended, sends for it are
dropped, so a retry uses a new id. The KV tensor must outlive the object wrapping it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pdserve.failures import FailReason  # the fault model's reasons, end to end

from .layout import KVLayout

__all__ = ["FailReason", "KVReceiver", "KVSender", "RecvEvent", "SendEvent", "is_final"]


@dataclass(frozen=True)
class RecvEvent:
    """A request finished on the decode side."""

    request_id: str
    ok: bool
    notify: dict[str, Any] | None = None  # payload of P's final send (ok events only)
    reason: FailReason | None = None  # failed events only
    error: str = ""  # human-readable detail of a failure


@dataclass(frozen=True)
class SendEvent:
    """A request finished on the prefill side: its source blocks are no longer read."""

    request_id: str
    ok: bool
    reason: FailReason | None = None
    error: str = ""


class KVReceiver(ABC):
    """Decode role: owns D's KV tensor, accepts writes only into blocks it expects."""

    layout: KVLayout

    @abstractmethod
    def endpoint(self) -> dict[str, Any]:
        """Connection info (picklable; JSON-able except the ray backend's) for P.connect."""

    @abstractmethod
    def expect(self, request_id: str, dst_block_ids: Sequence[int], timeout_s: float) -> None:
        """Register the blocks reserved for request_id; fail it if not done in timeout_s.

        Raises ValueError for a request id already pending or blocks already expected
        by another pending request."""

    @abstractmethod
    def poll(self) -> list[RecvEvent]:
        """Make progress; return requests that completed or failed since the last poll."""

    @abstractmethod
    def abort(self, request_id: str) -> None:
        """Stop expecting request_id (idempotent). Its failed event (ABORTED) is reported
        by poll once no late data can land in its blocks."""

    @abstractmethod
    def close(self) -> None:
        """Fail pending requests (CLOSED), release the channel. Idempotent."""

    @property
    @abstractmethod
    def num_pending(self) -> int:
        """Requests that were expected and have not been reported by poll yet."""

    def __enter__(self) -> KVReceiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class KVSender(ABC):
    """Prefill role: owns P's KV tensor, pushes block ranges into connected receivers."""

    layout: KVLayout

    @abstractmethod
    def connect(self, endpoint: dict[str, Any]) -> str:
        """Open a channel to a receiver; return its peer id.

        Raises KVLayoutMismatch (naming the field) when the layouts differ."""

    def dial(self, endpoint: dict[str, Any]) -> Any:
        """The part of ``connect`` that waits on the receiver, for any thread but the
        channel's: a handshake with a stalled receiver can take the whole connect
        timeout, and on the channel's thread it would hold every other peer's transfers
        that long. Touches nothing that thread uses; ``attach`` finishes the connect
        there. Default: nothing to wait for."""
        return endpoint

    def attach(self, dialed: Any) -> str:
        """Finish ``connect`` with what ``dial`` returned; returns the peer id."""
        return self.connect(dialed)

    @abstractmethod
    def send(
        self,
        peer_id: str,
        request_id: str,
        src_block_ids: Sequence[int],
        dst_block_ids: Sequence[int],
        layers: tuple[int, int] | None = None,
        notify: dict[str, Any] | None = None,
    ) -> None:
        """Start copying kv[src, lo:hi] into the peer's kv[dst, lo:hi]; returns at once.

        Final when notify is given or layers is None (see the module docstring). A send
        for a request that already failed or was aborted is dropped silently."""

    @abstractmethod
    def poll(self) -> list[SendEvent]:
        """Make progress; return requests whose final send finished or that failed."""

    @abstractmethod
    def abort(self, request_id: str) -> None:
        """Stop sending request_id (idempotent); poll reports it failed (ABORTED) once
        its source blocks are no longer read. The receiver is told where possible."""

    @abstractmethod
    def close(self) -> None:
        """Fail pending requests (CLOSED), say goodbye to peers. Idempotent."""

    @property
    @abstractmethod
    def num_pending(self) -> int:
        """Requests sent to and not reported by poll yet."""

    def __enter__(self) -> KVSender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def is_final(layers: tuple[int, int] | None, notify: dict[str, Any] | None) -> bool:
    """The rule for which send call ends a request (see the module docstring)."""
    return notify is not None or layers is None
