"""Every listener a worker opens binds the host it is given -- loopback by default, as
in an embedded cluster: the token stream, the torch backend's TCPStore (whose own
server would listen on every interface), nixl's control link and UCX (UCX_NET_DEVICES
= lo, as the embedded cluster sets for its actors). Read from /proc, this process's
sockets opened by the test only."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from pdserve.engine.config import EngineConfig
from pdserve.worker.decode import DecodeWorker
from tests.deps import has_nixl
from tests.integration.procs import listening_sockets, sockets_of

NIXL = has_nixl()


def listening() -> dict[int, str]:
    """inode -> "ip:port" of every listening TCP socket this process holds."""
    mine = sockets_of("self")
    return {i: f"{ip}:{port}" for i, (ip, port) in listening_sockets().items() if i in mine}


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
        wide = [a for a in opened.values() if not a.startswith("127.")]
        assert not wide, f"listening beyond loopback: {wide}"
    finally:
        worker.close()
