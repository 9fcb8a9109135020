"""Decode side of the `torch` backend (torch.distributed point-to-point, gloo or NCCL).

D hosts a TCPStore on a socket bound to ``host`` (port 0 -> the real port goes in its
endpoint). An accept thread
watches the "pairs" counter and starts one receive thread per prefill worker that joins
(see torch_group for the rendezvous). A receive thread loops: header -> payload ->
scatter into the expected blocks (under the tracker lock, dropped if the request was
aborted or the blocks are not the ones reserved) -> landed. A receive error means the
sender died (or went silent past peer_timeout_s despite its pings): every request it
touched fails PEER_DIED.

close() cannot interrupt a thread blocked in recv (gloo has no way): it stops writes at
once and waits for the threads to end at their sender's next PING/BYE or error.
"""

from __future__ import annotations

import datetime
import json
import logging
import socket
import threading
from typing import Any

import torch
import torch.distributed as dist

from ..base import FailReason
from ..layout import KVLayout, KVLayoutMismatch
from ..receiver_base import BaseReceiver
from ..regions import scatter
from ..send_worker import describe
from ..wire import HEADER_LEN, Kind, decode_header, local_heads, unpack
from .torch_group import (
    PING_INTERVAL_S,
    RECEIVER_RANK,
    SENDER_RANK,
    TAG,
    make_groups,
    pair_prefix,
    sync,
)

log = logging.getLogger(__name__)


class TorchReceiver(BaseReceiver):
    def __init__(
        self,
        kv: torch.Tensor,
        layout: KVLayout,
        host: str = "127.0.0.1",
        port: int = 0,
        connect_timeout_s: float = 30.0,
        peer_timeout_s: float = 10.0,
    ) -> None:
        super().__init__(kv, layout)
        self._connect_timeout_s = connect_timeout_s
        self._peer_timeout_s = peer_timeout_s
        # TCPStore's own server listens on every interface: hand it a socket bound to
        # ``host`` instead (loopback in an embedded cluster). The store owns the fd.
        listener = socket.create_server((host, port))
        self._store = dist.TCPStore(
            host,
            listener.getsockname()[1],
            is_master=True,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=connect_timeout_s),
            master_listen_fd=listener.detach(),
            use_libuv=False,  # the libuv server ignores master_listen_fd
        )
        self._host = host
        self._closed = threading.Event()
        self._threads: list[threading.Thread] = []
        self._accept = threading.Thread(target=self._accept_loop, name="kv-accept", daemon=True)
        self._accept.start()

    def endpoint(self) -> dict[str, Any]:
        return self._endpoint("torch", host=self._host, port=self._store.port)

    def close(self) -> None:
        with self._state.lock:
            self._closed.set()
            self._fail_pending()
        self._accept.join(2.0)
        # A receive thread wakes at its sender's next PING/BYE (or error) and exits.
        for t in self._threads:
            t.join(2 * PING_INTERVAL_S)

    # --- background threads ------------------------------------------------------------

    def _accept_loop(self) -> None:
        joined = 0
        while not self._closed.wait(0.1):
            try:
                count = self._store.add("pairs", 0)
            except Exception:  # store shut down under us
                return
            while joined < count:
                t = threading.Thread(
                    target=self._pair_loop, args=(joined,), name=f"kv-recv-{joined}", daemon=True
                )
                t.start()
                self._threads.append(t)
                joined += 1

    def _handshake(self, n: int) -> bool:
        """Answer pair n's hello; True if its layout matches ours."""
        key = pair_prefix(n)
        self._store.wait([key + "hello"], datetime.timedelta(seconds=self._connect_timeout_s))
        peer_layout = KVLayout.from_dict(json.loads(self._store.get(key + "hello")))
        try:
            self.layout.check_compatible(peer_layout)
        except KVLayoutMismatch as exc:
            self._store.set(key + "reply", f"error: {exc}")
            return False
        self._store.set(key + "reply", "ok")
        return True

    def _pair_loop(self, n: int) -> None:
        peer = f"pair{n}"
        try:
            if not self._handshake(n):
                return
            ctrl, bulk = make_groups(
                self._store, n, RECEIVER_RANK, self.kv.device, self._peer_timeout_s
            )
        except Exception as exc:
            log.warning("KV pair %d failed to join: %s", n, describe(exc))
            return
        header = torch.empty(HEADER_LEN, dtype=torch.int64)
        buf = torch.empty(0, dtype=torch.uint8, device=self.kv.device)
        try:
            while not self._closed.is_set():
                ctrl.recv([header], SENDER_RANK, TAG).wait()
                values = header.tolist()
                kind, size = decode_header(values)
                if kind == Kind.BYE:
                    self._peer_gone(peer, "sender closed")
                    return
                if kind == Kind.PING:
                    continue
                if buf.numel() < size:
                    buf = torch.empty(size, dtype=torch.uint8, device=self.kv.device)
                bulk.recv([buf[:size]], SENDER_RANK, TAG).wait()
                sync(self.kv.device)
                self._apply(peer, values, buf[:size])
        except Exception as exc:
            if not self._closed.is_set():
                self._peer_gone(peer, f"sender died: {describe(exc)}")

    def _apply(self, peer: str, values: list[int], payload: torch.Tensor) -> None:
        msg, data = unpack(values, payload, self.layout)
        if msg.kind == Kind.ABORT:
            self._state.end(msg.request_id, FailReason.ABORTED, "aborted by sender")
            return
        with self._state.lock:
            if self._closed.is_set() or not self._state.may_write(msg.request_id, msg.dst):
                return  # aborted, timed out, or not ours: drop
            if msg.dst:
                scatter(self.kv, list(msg.dst), msg.layers, data,
                        local_heads(self.layout, msg.heads))
                sync(self.kv.device)
            self._state.landed(msg.request_id, msg.seq, msg.total, msg.notify, peer,
                               msg.part, msg.parts, msg.dst)

    def _peer_gone(self, peer: str, why: str) -> None:
        for rid in self._state.requests_of(peer):
            self._state.end(rid, FailReason.PEER_DIED, why)
