"""NixlSender on its own (both agents in this process): what it does before it posts a
WRITE. The contract suite (test_contract) covers the backend end to end across processes."""

from __future__ import annotations

import pytest

from pdserve.kv_transfer import FailReason, KVLayout
from pdserve.kv_transfer.backends.nixl_recv import NixlReceiver
from pdserve.kv_transfer.backends.nixl_send import NixlSender
from tests.deps import has_nixl
from tests.waiting import until

from .kvdata import make_kv

if not has_nixl():  # (raises where pyproject installs it)
    pytest.skip("no nixl wheel for this platform", allow_module_level=True)

LAYOUT = KVLayout("test-model", "float32", num_layers=2, num_kv_heads=1, head_dim=8, block_size=4)
WAIT_S = 20.0


def test_no_write_to_a_receiver_that_cut_the_link() -> None:
    """D cuts off a sender that never acks its abort and may reuse the blocks at once:
    the sender's next send() must read the closed link and fail, not post a WRITE (into
    memory D now owns again, or to a dead peer, which can abort UCX)."""
    kv_p, kv_d = make_kv(LAYOUT, 8, 1), make_kv(LAYOUT, 8, -1)
    send = NixlSender(kv_p, LAYOUT)
    recv = NixlReceiver(kv_d, LAYOUT, abort_timeout_s=0.05)
    try:
        peer = send.connect(recv.endpoint())
        recv.expect("r1", [1], 30)
        send.send(peer, "r1", [1], [1], layers=(0, 1))
        def landed() -> bool:
            assert not send.poll() and not recv.poll()
            return not send.state.inflight("r1") and kv_d[1, 0].equal(kv_p[1, 0])

        until("the first write to land", landed, WAIT_S)
        recv.abort("r1")  # the sender stays silent (no poll): D cuts it off
        events: list = []
        until("D to give up on the silent sender", lambda: events.extend(recv.poll()) or events,
              WAIT_S)
        assert [(e.request_id, e.reason) for e in events] == [("r1", FailReason.ABORTED)]
        send.send(peer, "r2", [2], [2])
        assert send.state.inflight("r2") == 0, "a WRITE was posted over a closed link"
        failed = {e.request_id: e for e in send.poll()}
        assert failed["r2"].reason == FailReason.PEER_DIED
        assert not kv_d[2].equal(kv_p[2])
    finally:
        send.close()
        recv.close()
