"""A worker's KV channel when speculative decoding runs a draft model: the draft's
prompt KV, made on the prefill worker, travels beside the target's in one transfer.

Two channels under one request: the target's (any backend, tensor parallel or not)
and one over the draft model's KV cache (the same backend and options, its own
``KVLayout``: the draft's shapes). A request's draft part travels under the wire id
``rid#draft`` and ends the request with the target's the way a tensor-parallel
rank's part does (``sharded.Fanout``): ok once every part landed, else failed with
the first failure after the rest were aborted, so nothing still writes into either
cache's blocks::

    D: recv.expect(rid, dst, timeout_s, draft_block_ids=draft_dst)
    P: send.send(peer, rid, src, dst, layers=(0, L))       the target's, as ever
    P: send.send_draft(peer, rid, draft_src, draft_dst)    the draft's, whole
    P: send.send(peer, rid, src, dst, notify={...})        final (after send_draft)

The draft part is sent before the target's final send, so a request cannot end on
the sender before its draft part is known. A request without draft blocks (the
decode worker had no room for them: its draft catches up itself) is the target's
part alone.

Endpoint: the target channel's, with the draft channel's under ``"draft"``. The
target's layout names the draft (``KVLayout.draft``), so two workers that disagree
on it are refused at connect, naming it; the draft channel's own handshake checks
the draft's shapes.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import torch

from .base import FailReason, KVReceiver, KVSender
from .factory import make_receiver, make_sender
from .layout import KVLayout, KVLayoutMismatch
from .sharded import FanoutReceiver, FanoutSender

DRAFT_SUFFIX = "#draft"


class DraftSender(FanoutSender):
    """Prefill role: the target's sender and the draft cache's, one request each."""

    def __init__(self, main: KVSender, draft: KVSender) -> None:
        super().__init__([main, draft], main.layout, [])
        self._peers: dict[str, tuple[str, str]] = {}  # -> (target peer, draft peer)
        self._peer_ids = itertools.count()

    @property
    def draft_layout(self) -> KVLayout:
        """The draft cache's layout."""
        layout: KVLayout = self._ranks[1].layout
        return layout

    def connect(self, endpoint: dict[str, Any]) -> str:
        return self.attach(self.dial(endpoint))

    def dial(self, endpoint: dict[str, Any]) -> tuple[Any, Any]:
        # the target's layout first: its ``draft`` names a mismatch
        self.layout.check_compatible(KVLayout.from_dict(endpoint["layout"]))
        if "draft" not in endpoint:
            raise KVLayoutMismatch(f"KV layout mismatch: the decode worker's endpoint has no "
                                   f"channel for draft {self.layout.draft!r}")
        main_ep = {k: v for k, v in endpoint.items() if k != "draft"}
        return self._ranks[0].dial(main_ep), self._ranks[1].dial(endpoint["draft"])

    def attach(self, dialed: tuple[Any, Any]) -> str:
        peer_id = f"draft-{next(self._peer_ids)}"
        self._peers[peer_id] = (self._ranks[0].attach(dialed[0]),
                                self._ranks[1].attach(dialed[1]))
        return peer_id

    def send(self, peer_id: str, request_id: str, src_block_ids: Sequence[int],
             dst_block_ids: Sequence[int], layers: tuple[int, int] | None = None,
             notify: dict[str, Any] | None = None) -> None:
        with self._lock:
            p, new = self._pending_for(request_id, [(0, request_id)])
            if p is None:
                return
        try:
            self._ranks[0].send(self._peers[peer_id][0], request_id, src_block_ids,
                                dst_block_ids, layers, notify)
        except ValueError:
            if new:  # as if never called
                with self._lock:
                    self._forget(request_id)
            raise

    def send_draft(self, peer_id: str, request_id: str, src_block_ids: Sequence[int],
                   dst_block_ids: Sequence[int]) -> None:
        """Copy the draft cache's ``src`` blocks (all its layers) into the peer's
        draft ``dst``: the request's draft part, whole. Before its final ``send``."""
        wire = request_id + DRAFT_SUFFIX
        with self._lock:
            p, new = self._pending_for(request_id, [(0, request_id), (1, wire)])
            if p is None:
                return
            if not new:
                p.left.add((1, wire))
                p.keys.append((1, wire))
                self._sub[(1, wire)] = request_id
        try:
            self._ranks[1].send(self._peers[peer_id][1], wire, src_block_ids, dst_block_ids)
        except ValueError as exc:  # the target's part may be under way: fail it all
            self._part_failed((1, wire), f"draft KV: {exc}")
            raise

    def _part_failed(self, part: tuple[int, str], error: str) -> None:
        with self._lock:
            self._part_ended(part, False, FailReason.ABORTED, error, None)


class DraftReceiver(FanoutReceiver):
    """Decode role: a request is ready when its target KV and its draft KV landed."""

    def __init__(self, main: KVReceiver, draft: KVReceiver) -> None:
        super().__init__([main, draft], main.layout, [])

    def endpoint(self) -> dict[str, Any]:
        return {**self._ranks[0].endpoint(), "draft": self._ranks[1].endpoint()}

    def expect(self, request_id: str, dst_block_ids: Sequence[int], timeout_s: float,
               draft_block_ids: Sequence[int] = ()) -> None:
        """As ``KVReceiver.expect``; with ``draft_block_ids``, the request also waits
        for its draft KV there."""
        wire = request_id + DRAFT_SUFFIX
        keys = [(0, request_id)] + ([(1, wire)] if draft_block_ids else [])
        with self._lock:
            if request_id in self._pending:
                raise ValueError(f"request {request_id!r} is already expected")
            self._ranks[0].expect(request_id, dst_block_ids, timeout_s)
            p = self._register(request_id, keys)
        if not draft_block_ids:
            return
        try:
            self._ranks[1].expect(wire, draft_block_ids, timeout_s)
        except ValueError as exc:  # the draft's blocks are not free: never write there
            with self._lock:  # the target's part ends it (failed)
                p.left = {keys[0]}
                p.failure = (FailReason.ABORTED, "the draft's blocks were refused")
            self.abort(request_id)
            raise ValueError(f"draft KV blocks refused for {request_id!r}: {exc}") from exc


def with_draft(role: str, main: KVSender | KVReceiver, backend: str, kv: torch.Tensor,
               layout: KVLayout, options: dict[str, Any] | None = None,
               ) -> DraftSender | DraftReceiver:
    """``main`` (the target's channel for ``role``, "send" | "recv") with a channel of
    the same backend over the draft's cache ``kv`` (its ``layout``) beside it."""
    try:
        if role == "send":
            assert isinstance(main, KVSender)
            return DraftSender(main, make_sender(backend, kv, layout, **(options or {})))
        assert isinstance(main, KVReceiver)
        return DraftReceiver(main, make_receiver(backend, kv, layout, **(options or {})))
    except BaseException:
        main.close()
        raise
