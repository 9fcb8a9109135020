"""``BaseSender``: the half of ``KVSender`` every backend shares, written once.

The prologue of a send -- check the call (``check_send``), cut it into messages, number
them (``SendTracker.begin``: first index, total on the final call's last message, drop a
request that already ended), stamp each message's destination blocks, layer range and
(final only) notify payload -- plus abort and close bookkeeping and ``num_pending``.

A backend says how far a message may go (``chunk_bytes``: None = one message per call)
and supplies the parts that differ:

* ``connect`` -- checks the peer's layout and learns what to write there with
  ``_plan(endpoint)`` (``layout.plan_slice``), then records it with ``_bind``;
* ``_peer_blocks(peer)`` -- the receiver's number of blocks (checked in the prologue);
* ``_transmit(peer, outgoing, numbered)`` -- hand the numbered messages, each with its
  source block ids, to the transport (report each one through ``state``);
* ``_tell_abort(peer, request_id)`` -- let the receiver know where possible;
* ``_goodbye()`` -- release peers on close;
* ``poll()`` -- make progress, then ``state.drain()``.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence
from typing import Any

import torch

from .base import FailReason, KVSender, is_final
from .layout import KVLayout, Slice, check_send, plan_slice
from .regions import chunk_slices
from .send_state import Numbered, SendTracker
from .wire import Kind, Message

Outgoing = tuple[Message, list[int]]  # a numbered message and its source block ids


class BaseSender(KVSender):
    chunk_bytes: int | None = None  # messages of at most this many bytes (None: one per call)

    def __init__(self, kv: torch.Tensor, layout: KVLayout, timeout_s: float) -> None:
        self.layout = layout
        self.kv = kv
        self.num_blocks = layout.check_tensor(kv)
        self.state = SendTracker(timeout_s)
        self._slices: dict[str, Slice] = {}  # peer id -> what this sender writes there

    def _plan(self, endpoint: dict[str, Any]) -> Slice:
        """The peer's layout checked, and the heads (and part) to write there."""
        return plan_slice(self.layout, KVLayout.from_dict(endpoint["layout"]),
                          endpoint.get("slice"))

    def _bind(self, peer_id: str, cut: Slice) -> str:
        self._slices[peer_id] = cut
        return peer_id

    def send(
        self,
        peer_id: str,
        request_id: str,
        src_block_ids: Sequence[int],
        dst_block_ids: Sequence[int],
        layers: tuple[int, int] | None = None,
        notify: dict[str, Any] | None = None,
    ) -> None:
        src, dst, rng = check_send(self.layout, src_block_ids, dst_block_ids, self.num_blocks,
                                   self._peer_blocks(peer_id), layers)
        cut = self._slices[peer_id]
        if self.chunk_bytes is None:
            slices = [slice(0, len(src))]
        else:
            width = cut.heads[1] - cut.heads[0]
            per_block = (rng[1] - rng[0]) * self.layout.layer_bytes_of(width)
            slices = chunk_slices(len(src), per_block, self.chunk_bytes) or [slice(0, 0)]
        numbered = self.state.begin(peer_id, request_id, is_final(layers, notify), len(slices))
        if numbered is None:
            return
        jobs: list[Outgoing] = []
        for i, sl in enumerate(slices):
            total = numbered.total if i == len(slices) - 1 else None
            msg = Message(Kind.DATA, request_id, numbered.first_seq + i, total, tuple(dst[sl]),
                          rng, notify if total is not None else None, cut.heads, cut.part,
                          cut.parts)
            jobs.append((msg, src[sl]))
        self._transmit(peer_id, jobs, numbered)

    def abort(self, request_id: str) -> None:
        peer = self.state.peer_of(request_id)
        self.state.fail(request_id, FailReason.ABORTED, "aborted by sender")
        if peer is not None:
            self._tell_abort(peer, request_id)

    def close(self) -> None:
        for rid in self.state.pending_ids():
            self.state.fail(rid, FailReason.CLOSED, "sender closed", now=True)
        self._goodbye()

    @property
    def num_pending(self) -> int:
        return self.state.num_pending

    @abstractmethod
    def _peer_blocks(self, peer_id: str) -> int: ...

    @abstractmethod
    def _transmit(self, peer_id: str, jobs: list[Outgoing], numbered: Numbered) -> None: ...

    @abstractmethod
    def _tell_abort(self, peer_id: str, request_id: str) -> None: ...

    @abstractmethod
    def _goodbye(self) -> None: ...
