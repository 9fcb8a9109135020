"""Prefill side of the `nixl` backend: one-sided WRITEs from P's registered KV tensor
into D's, one NIXL transfer per send() call, each carrying a notification.

Descriptors: whole blocks whose ids run consecutively on both sides merge into one
descriptor; a layer range is one descriptor per block, a slice of the KV heads one per
block, layer and K/V (regions.byte_regions). A notify-only final (no blocks) goes as a bare NIXL
notification.

poll() drives everything: transfer states (check_xfer_state), control messages from
each receiver (control_link), and the replies that must wait until a request has no
transfer in flight ("ack" for D's abort, "aborted" for our own).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from ..base import FailReason, SendEvent
from ..layout import KVLayout
from ..regions import byte_regions
from ..send_state import Numbered
from ..sender_base import BaseSender, Outgoing
from .control_link import Link
from .nixl_agent import decode_metadata, descs, device_id, encode_notif, mem_type, new_agent

log = logging.getLogger(__name__)


@dataclass
class _Peer:
    link: Link
    base: int  # address of D's kv[0]
    dev: int
    mem: str
    num_blocks: int
    layout: KVLayout  # D's (its KV heads: where a slice lands)


class NixlSender(BaseSender):
    def __init__(
        self,
        kv: torch.Tensor,
        layout: KVLayout,
        timeout_s: float = 30.0,
        connect_timeout_s: float = 10.0,
    ) -> None:
        super().__init__(kv, layout, timeout_s)
        self._connect_timeout_s = connect_timeout_s
        self._agent, self._name = new_agent("send")
        self._reg = self._agent.register_memory(kv)
        self._peers: dict[str, _Peer] = {}
        self._xfers: dict[str, list[Any]] = {}  # request id -> transfer handles in flight
        self._replies: list[tuple[str, str, dict[str, Any]]] = []  # (peer, rid, msg) to send

    def connect(self, endpoint: dict[str, Any]) -> str:
        cut = self._plan(endpoint)
        host, port = endpoint["control"]
        link = Link.connect(host, int(port), self._connect_timeout_s)
        name = self._agent.add_remote_agent(decode_metadata(endpoint["metadata"]))
        peer = name.decode() if isinstance(name, bytes) else str(name)
        link.peer = peer
        link.send({"t": "hello", "agent": self._name, "layout": self.layout.to_dict()})
        self._peers[peer] = _Peer(
            link,
            int(endpoint["base"]),
            int(endpoint["device_id"]),
            str(endpoint["mem"]),
            int(endpoint["num_blocks"]),
            KVLayout.from_dict(endpoint["layout"]),
        )
        return self._bind(peer, cut)

    def _peer_blocks(self, peer_id: str) -> int:
        return self._peers[peer_id].num_blocks

    def _transmit(self, peer_id: str, jobs: list[Outgoing], numbered: Numbered) -> None:
        ((msg, src),) = jobs  # one WRITE per send() call
        request_id, peer = msg.request_id, self._peers[peer_id]
        # Read the link first: a receiver that died since the last poll has closed it,
        # and UCX may abort a sender whose WRITE is posted to a dead peer.
        self._read_link(peer_id, peer)
        if peer.link.closed is not None:
            self.state.message_done(request_id, (FailReason.PEER_DIED, peer.link.closed))
            return
        if numbered.cancel.set:  # D's abort was just read: write nothing more
            self.state.message_done(request_id, None)
            return
        if numbered.first_seq == 0:  # D now fails rid if this link dies
            peer.link.send({"t": "begin", "r": request_id})
        note = encode_notif(request_id, msg.seq, msg.total, msg.notify, msg.part, msg.parts,
                            msg.dst)
        regions = byte_regions(self.layout, src, list(msg.dst), msg.layers, peer.layout,
                               msg.heads)
        try:
            if not regions:
                self._agent.send_notif(peer_id, note)
                self.state.message_done(request_id, None)
                return
            handle = self._agent.initialize_xfer(
                "WRITE",
                self._agent.get_xfer_descs(
                    descs(self.kv.data_ptr(), device_id(self.kv), [(s, n) for s, _, n in regions]),
                    mem_type(self.kv),
                ),
                self._agent.get_xfer_descs(
                    descs(peer.base, peer.dev, [(d, n) for _, d, n in regions]), peer.mem
                ),
                peer_id,
                note,
            )
            status = self._agent.transfer(handle)
        except Exception as exc:  # nixlBind raises its own error types
            self.state.message_done(request_id, _failure(exc))
            return
        if status == "ERR":
            handle.release()
            self.state.message_done(request_id, (FailReason.TRANSPORT, "transfer failed"))
            return
        self._xfers.setdefault(request_id, []).append(handle)

    def poll(self) -> list[SendEvent]:
        for peer_id, peer in self._peers.items():
            self._read_link(peer_id, peer)
            if peer.link.closed is not None:
                self.state.fail_peer(peer_id, FailReason.PEER_DIED, peer.link.closed)
        self._check_transfers()
        events = self.state.drain()
        self._drop_orphans()
        self._send_replies()
        return events

    def _tell_abort(self, peer_id: str, request_id: str) -> None:
        self._replies.append((peer_id, request_id, {"t": "aborted", "r": request_id}))

    def _goodbye(self) -> None:
        self._drop_orphans()
        for peer in self._peers.values():
            peer.link.close()
        self._peers.clear()
        try:
            self._agent.deregister_memory(self._reg)
        except Exception as exc:
            log.warning("NIXL deregister failed: %s", exc)

    # --- helpers -------------------------------------------------------------------

    def _read_link(self, peer_id: str, peer: _Peer) -> None:
        for msg in peer.link.receive():
            self._on_message(peer_id, msg)

    def _on_message(self, peer_id: str, msg: dict[str, Any]) -> None:
        if msg.get("t") == "abort":  # D gave up: stop, ack once nothing is in flight
            rid = str(msg["r"])
            self.state.fail(rid, FailReason.ABORTED, "aborted by receiver")
            self.state.fail_unknown(rid, FailReason.ABORTED, "aborted by receiver")
            self._replies.append((peer_id, rid, {"t": "ack", "r": rid}))
        elif msg.get("t") == "reject":  # D found a layout mismatch we did not
            self._peers[peer_id].link.close()
            self.state.fail_peer(peer_id, FailReason.TRANSPORT, str(msg.get("error")))

    def _check_transfers(self) -> None:
        for rid, handles in list(self._xfers.items()):
            for h in list(handles):
                failure: tuple[FailReason, str] | None = None
                try:
                    status = self._agent.check_xfer_state(h)
                except Exception as exc:  # a dead receiver: REMOTE_DISCONNECT, every poll
                    status, failure = "ERR", _failure(exc)
                if status == "PROC":
                    continue
                handles.remove(h)
                try:
                    h.release()
                except Exception as exc:
                    log.debug("NIXL transfer for %s not released: %s", rid, exc)
                if status != "DONE":
                    failure = failure or (FailReason.TRANSPORT, "transfer failed")
                self.state.message_done(rid, failure)
            if not handles:
                del self._xfers[rid]

    def _drop_orphans(self) -> None:
        """Requests already reported (dead peer, timeout, close): cancel their transfers."""
        pending = set(self.state.pending_ids())
        for rid in [r for r in self._xfers if r not in pending]:
            for h in self._xfers.pop(rid):
                try:
                    h.release()  # cancels if still running
                except Exception as exc:
                    log.debug("NIXL transfer for %s not cancelled: %s", rid, exc)

    def _send_replies(self) -> None:
        keep = []
        for peer_id, rid, msg in self._replies:
            if rid in self._xfers:
                keep.append((peer_id, rid, msg))  # writes still in flight: not yet
            elif peer_id in self._peers:
                self._peers[peer_id].link.send(msg)
        self._replies = keep


def _failure(exc: Exception) -> tuple[FailReason, str]:
    """A NIXL error as a send failure (the agent may notice a dead receiver before our
    control link does)."""
    dead = "REMOTE_DISCONNECT" in str(exc) or "RemoteDisconnect" in type(exc).__name__
    return (FailReason.PEER_DIED if dead else FailReason.TRANSPORT, str(exc) or type(exc).__name__)
