"""Decode side of the `nixl` backend: D's registered KV memory, written one-sided by P.

D cannot refuse a one-sided WRITE, so an abort (or a timeout) is a handshake over the
control links (control_link): D stops counting the request, asks every connected sender
to stop ("abort"), and reports the failed event only when each has answered "ack" (none
of its writes for the request are in flight any more) or is gone. Only then may the
engine reuse the blocks. A sender that stays silent past abort_timeout_s is cut off
(its link closed, so it fails everything it sends here) and the event says so.

Known gap: a sender that connects while an abort is pending is not asked about it; the
control plane hands a request to P only after connect, so this needs P to be handed a
request it was never given.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from ..base import FailReason, RecvEvent
from ..layout import KVLayout, KVLayoutMismatch
from ..receiver_base import BaseReceiver
from .control_link import Link, Listener
from .nixl_agent import decode_notif, device_id, encode_metadata, mem_type, new_agent

log = logging.getLogger(__name__)


class NixlReceiver(BaseReceiver):
    def __init__(
        self,
        kv: torch.Tensor,
        layout: KVLayout,
        host: str = "127.0.0.1",
        abort_timeout_s: float = 10.0,
    ) -> None:
        super().__init__(kv, layout)
        self._abort_timeout_s = abort_timeout_s
        self._agent, self._name = new_agent("recv")
        self._reg = self._agent.register_memory(kv)
        self._listener = Listener(host)
        self._links: list[Link] = []
        # request id -> (senders that still owe an ack, give-up time)
        self._aborting: dict[str, tuple[set[str], float]] = {}
        self._closed = False

    def endpoint(self) -> dict[str, Any]:
        return self._endpoint(
            "nixl", agent=self._name, metadata=encode_metadata(self._agent.get_agent_metadata()),
            base=self.kv.data_ptr(), device_id=device_id(self.kv), mem=mem_type(self.kv),
            control=list(self._listener.address))

    def poll(self) -> list[RecvEvent]:
        if self._closed:
            return self._state.drain()
        self._poll_links()
        for sender, notifs in self._agent.get_new_notifs().items():
            for raw in notifs:
                rid, seq, total, notify, part, parts, blocks = decode_notif(raw)
                self._state.landed(rid, seq, total, notify, str(sender), part, parts, blocks)
        for rid in self._state.expired():
            self._start_abort(rid, FailReason.TIMEOUT, "no complete KV within the timeout")
        self._settle_aborts()
        return self._state.drain()

    def abort(self, request_id: str) -> None:
        self._start_abort(request_id, FailReason.ABORTED, "aborted by receiver")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._fail_pending()
        for link in self._links:
            link.close()
        self._listener.close()
        try:
            self._agent.deregister_memory(self._reg)
        except Exception as exc:  # best effort: the agent goes away with us
            log.warning("NIXL deregister failed: %s", exc)

    # --- control links -----------------------------------------------------------------

    def _poll_links(self) -> None:
        self._links.extend(self._listener.accept())
        for link in list(self._links):
            for msg in link.receive():
                self._on_message(link, msg)
            if link.closed is not None:
                self._links.remove(link)
                if link.peer:
                    self._sender_gone(link.peer, f"sender gone ({link.closed})")

    def _on_message(self, link: Link, msg: dict[str, Any]) -> None:
        kind = msg.get("t")
        if kind == "hello":
            try:
                self.layout.check_compatible(KVLayout.from_dict(msg["layout"]))
            except KVLayoutMismatch as exc:
                link.send({"t": "reject", "error": str(exc)})
                link.close()
                return
            link.peer = str(msg["agent"])
        elif kind == "begin":
            self._state.touch(msg["r"], link.peer)
        elif kind == "ack":
            self._acked(msg["r"], link.peer)
        elif kind == "aborted":
            self._state.end(msg["r"], FailReason.ABORTED, "aborted by sender")
            self._acked(msg["r"], link.peer)

    def _sender_gone(self, peer: str, why: str) -> None:
        for rid in self._state.requests_of(peer):
            self._state.end(rid, FailReason.PEER_DIED, why)
        for rid in list(self._aborting):
            self._acked(rid, peer)

    # --- abort handshake ---------------------------------------------------------------

    def _start_abort(self, rid: str, reason: FailReason, why: str) -> None:
        if not self._state.start_ending(rid, reason, why):
            return
        senders = {link.peer for link in self._links if link.peer and link.closed is None}
        for link in self._links:
            if link.peer in senders:
                link.send({"t": "abort", "r": rid})
        self._aborting[rid] = (senders, time.monotonic() + self._abort_timeout_s)
        self._settle_aborts()

    def _acked(self, rid: str, peer: str) -> None:
        if rid in self._aborting:
            self._aborting[rid][0].discard(peer)

    def _settle_aborts(self) -> None:
        now = time.monotonic()
        for rid, (owing, give_up) in list(self._aborting.items()):
            if not self._state.is_known(rid):  # ended another way (sender aborted, died)
                del self._aborting[rid]
            elif not owing:
                del self._aborting[rid]
                self._state.finish(rid)
            elif now >= give_up:
                del self._aborting[rid]
                for link in self._links:
                    if link.peer in owing:
                        link.close()  # the sender now fails whatever it sends here
                self._state.finish(rid, f" (unconfirmed by {sorted(owing)}: cut off)")
