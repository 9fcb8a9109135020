"""Every listener a worker opens binds the host it is given -- loopback by default, as
in an embedded cluster: the token stream, the torch backend's TCPStore (whose own
server would listen on every interface), nixl's control link and UCX (UCX_NET_DEVICES
= lo, as the embedded cluster sets for its actors). Read from /proc, this process's
sockets opened by the test only."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from pdserve.decode_worker.worker import DecodeWorker
from pdserve.engine.config import EngineConfig

NIXL = any(importlib.util.find_spec(m) for m in ("nixl", "nixl_cu12"))


def listening() -> dict[int, str]:
    """inode -> "ip:port" of every listening TCP socket this process holds."""
    mine = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            mine.add(int(target[8:-1]))
    out = {}
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            if f[3] != "0A" or int(f[9]) not in mine:  # 0A: LISTEN
                continue
            hex_ip, hex_port = f[1].split(":")
            if width == 8:
                ip = ".".join(str(int(hex_ip[i:i + 2], 16)) for i in (6, 4, 2, 0))
            else:
                ip = "::ffff:127.0.0.1" if hex_ip.endswith("0100007F") else hex_ip
            out[int(f[9])] = f"{ip}:{int(hex_port, 16)}"
    return out


@pytest.mark.parametrize("transfer", ["torch", *(["nixl"] if NIXL else [])])
def test_worker_listeners_bind_loopback(tiny_model: Callable[[str], Path], transfer: str,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    before = set(listening())
    worker = DecodeWorker("decode-0", tiny_model("llama-gqa"),
                          EngineConfig(role="decode", num_blocks=16), transfer)
    try:
        opened = {i: a for i, a in listening().items() if i not in before}
        assert len(opened) >= 2, opened  # the token stream and the transfer listener
        wide = [a for a in opened.values() if not a.startswith(("127.", "::ffff:127."))]
        assert not wide, f"listening beyond loopback: {wide}"
    finally:
        worker.close()
