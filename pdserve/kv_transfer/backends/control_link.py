"""A polled control connection between one sender and one receiver (nixl backend).

NIXL moves the data one-sided, so D cannot stop P's writes by itself and learns nothing
when P dies. This plain TCP connection (P connects to D's listener) carries the few
control messages the contract needs and doubles as the liveness signal: the kernel
closes it when either process dies, even on SIGKILL, and keepalive probes notice a dead
machine.

Frames: 4-byte big-endian length, then one JSON object. Messages:

    P -> D  {"t": "hello", "agent": name, "layout": {...}}   once, on connect
    P -> D  {"t": "begin", "r": rid}       P starts sending rid (its death now fails rid)
    P -> D  {"t": "aborted", "r": rid}     P gave up on rid; none of its writes are in flight
    D -> P  {"t": "abort", "r": rid}       D gives up on rid; P stops, then answers
    P -> D  {"t": "ack", "r": rid}         ... this, once none of rid's writes are in flight
    D -> P  {"t": "reject", "error": msg}  layout mismatch found by D; D then closes

Nothing here blocks except a send to a full socket buffer (bounded by a timeout).
"""

from __future__ import annotations

import contextlib
import json
import select
import socket
import struct
from typing import Any

SEND_TIMEOUT_S = 5.0
_LEN = struct.Struct(">I")


def _keepalive(sock: socket.socket) -> None:
    """Notice a dead machine (no FIN/RST) within ~10 s."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for opt, value in (("TCP_KEEPIDLE", 4), ("TCP_KEEPINTVL", 2), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, opt):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), value)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class Link:
    """One framed JSON connection; `closed` says why it is unusable (None: open)."""

    def __init__(self, sock: socket.socket) -> None:
        _keepalive(sock)
        sock.settimeout(SEND_TIMEOUT_S)
        self._sock = sock
        self._buf = bytearray()
        self.closed: str | None = None
        self.peer = ""  # filled by the owner (the other side's agent name)

    @classmethod
    def connect(cls, host: str, port: int, timeout_s: float) -> Link:
        return cls(socket.create_connection((host, port), timeout=timeout_s))

    def send(self, msg: dict[str, Any]) -> None:
        if self.closed is not None:
            return
        data = json.dumps(msg).encode()
        try:
            self._sock.sendall(_LEN.pack(len(data)) + data)
        except OSError as exc:
            self._close(f"send failed: {exc}")

    def receive(self) -> list[dict[str, Any]]:
        """Every complete message that has arrived; never blocks."""
        while self.closed is None:
            try:
                readable, _, _ = select.select([self._sock], [], [], 0)
                if not readable:
                    break
                chunk = self._sock.recv(1 << 16)
            except OSError as exc:
                self._close(f"connection error: {exc}")
                break
            if not chunk:
                self._close("connection closed by peer")
                break
            self._buf += chunk
        return self._frames()

    def close(self) -> None:
        self._close("closed locally")

    def _frames(self) -> list[dict[str, Any]]:
        out = []
        while len(self._buf) >= _LEN.size:
            (size,) = _LEN.unpack_from(self._buf)
            if len(self._buf) < _LEN.size + size:
                break
            out.append(json.loads(self._buf[_LEN.size : _LEN.size + size]))
            del self._buf[: _LEN.size + size]
        return out

    def _close(self, why: str) -> None:
        if self.closed is None:
            self.closed = why
            with contextlib.suppress(OSError):
                self._sock.close()


class Listener:
    """D's listening socket; accept() never blocks."""

    def __init__(self, host: str) -> None:
        self._sock = socket.create_server((host, 0))
        self._sock.setblocking(False)
        self.address: tuple[str, int] = (host, self._sock.getsockname()[1])

    def accept(self) -> list[Link]:
        links: list[Link] = []
        while True:
            try:
                sock, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return links
            except OSError:
                return links
            links.append(Link(sock))

    def close(self) -> None:
        self._sock.close()
