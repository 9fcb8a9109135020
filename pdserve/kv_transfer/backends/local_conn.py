"""The `local` backend: sender and receiver in one process, blocks copied tensor to tensor.

For unit tests and colocated mode. Receivers register in a process-wide table keyed by
the id in their endpoint (the only way two objects in one process find each other
through a JSON-able endpoint). A send copies synchronously inside send(); the receiver
takes its lock for the copy, so an abort on either side stops later writes at once.
"""

from __future__ import annotations

import threading
import uuid
from typing import Any

import torch

from ..base import FailReason, SendEvent
from ..layout import KVLayout
from ..receiver_base import BaseReceiver
from ..regions import Staging, scatter
from ..send_state import Numbered
from ..sender_base import BaseSender, Outgoing
from ..wire import Message, local_heads

# endpoint id -> receiver; guarded by _TABLE_LOCK.
_TABLE: dict[str, LocalReceiver] = {}
_TABLE_LOCK = threading.Lock()


class LocalReceiver(BaseReceiver):
    def __init__(self, kv: torch.Tensor, layout: KVLayout) -> None:
        super().__init__(kv, layout)
        self._id = f"local-{uuid.uuid4().hex[:12]}"
        self._closed = False
        with _TABLE_LOCK:
            _TABLE[self._id] = self

    def endpoint(self) -> dict[str, Any]:
        return self._endpoint("local", id=self._id)

    def close(self) -> None:
        with self._state.lock:
            self._closed = True
            self._fail_pending()
        with _TABLE_LOCK:
            _TABLE.pop(self._id, None)

    # --- called by LocalSender -------------------------------------------------------

    def deliver(self, peer: str, msg: Message, data: torch.Tensor) -> None:
        with self._state.lock:
            if self._closed:
                raise ConnectionError("receiver closed")
            if self._state.may_write(msg.request_id, msg.dst):
                scatter(self.kv, list(msg.dst), msg.layers, data,
                        local_heads(self.layout, msg.heads))
                self._state.landed(msg.request_id, msg.seq, msg.total, msg.notify, peer,
                                   msg.part, msg.parts, msg.dst)

    def sender_gone(self, peer: str, request_id: str | None, reason: FailReason, why: str) -> None:
        """A sender aborted one request (request_id) or closed (None: all it touched)."""
        rids = [request_id] if request_id else self._state.requests_of(peer)
        for rid in rids:
            self._state.end(rid, reason, why)


class LocalSender(BaseSender):
    def __init__(self, kv: torch.Tensor, layout: KVLayout, timeout_s: float = 30.0) -> None:
        super().__init__(kv, layout, timeout_s)
        self._peers: dict[str, LocalReceiver] = {}
        self._me = f"local-sender-{uuid.uuid4().hex[:12]}"
        self._staging = Staging(kv.device)

    def connect(self, endpoint: dict[str, Any]) -> str:
        cut = self._plan(endpoint)
        with _TABLE_LOCK:
            receiver = _TABLE.get(endpoint["id"])
        if receiver is None:
            raise ConnectionError(f"no local receiver {endpoint['id']} in this process")
        self._peers[endpoint["id"]] = receiver
        return self._bind(str(endpoint["id"]), cut)

    def poll(self) -> list[SendEvent]:
        return self.state.drain()

    def _peer_blocks(self, peer_id: str) -> int:
        return self._peers[peer_id].num_blocks

    def _transmit(self, peer_id: str, jobs: list[Outgoing], numbered: Numbered) -> None:
        for msg, src in jobs:  # copied now, under the receiver's lock
            failure: tuple[FailReason, str] | None = None
            try:
                self._peers[peer_id].deliver(self._me, msg, self._staging.gather(
                    self.kv, src, msg.layers, local_heads(self.layout, msg.heads)))
            except ConnectionError as exc:
                failure = (FailReason.PEER_DIED, str(exc))
            self.state.message_done(msg.request_id, failure)

    def _tell_abort(self, peer_id: str, request_id: str) -> None:
        self._peers[peer_id].sender_gone(self._me, request_id, FailReason.ABORTED,
                                         "aborted by sender")

    def _goodbye(self) -> None:
        for receiver in self._peers.values():
            receiver.sender_gone(self._me, None, FailReason.PEER_DIED, "sender closed")
        self._peers.clear()
