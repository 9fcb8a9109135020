"""The KV transfer contract, run over every backend (see conftest.VARIANTS).

Each test builds a fresh sender (in the prefill host) and receiver (in the decode host),
moves random KV, and checks bit-exact block contents by digest plus the event rules of
pdserve.kv_transfer.base: one event per request, ok or failed with a reason, and nothing
pending afterwards.
"""

from __future__ import annotations

import dataclasses
import json
import random
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from pdserve.kv_transfer import FailReason, KVLayout, KVLayoutMismatch
from tests.waiting import until

from .conftest import Hosts
from .kvdata import digest, expected_digest, make_kv
from .peer_host import Peer, collect

# 4 layers x 2 kv heads x head_dim 16 x 16 tokens: 4 KiB per layer, 16 KiB per block in
# float32; 256 source blocks = 4 MiB.
LAYOUT = KVLayout("test-model", "float32", num_layers=4, num_kv_heads=2, head_dim=16, block_size=16)
P_BLOCKS, D_BLOCKS = 256, 300
P_SEED = 1
WAIT_S = 20.0


class Pair:
    """A connected sender/receiver for one test."""

    def __init__(
        self,
        hosts: Hosts,
        layout: KVLayout = LAYOUT,
        n_src: int = P_BLOCKS,
        n_dst: int = D_BLOCKS,
        send_opts: dict[str, Any] | None = None,
        prefill: Any = None,
        decode: Any = None,
    ) -> None:
        self.layout, self.n_src = layout, n_src
        self.recv = Peer.make(decode or hosts.decode, "receiver", hosts.backend, layout, n_dst, -1)
        self.send = Peer.make(
            prefill or hosts.prefill,
            "sender",
            hosts.backend,
            layout,
            n_src,
            P_SEED,
            **(send_opts or {}),
        )
        endpoint = self.recv.endpoint()
        json.dumps(endpoint)  # the control plane may ship it as JSON
        self.peer = self.send.connect(endpoint)

    def expected(self, src: list[int], layers: tuple[int, int] | None = None) -> str:
        return expected_digest(self.layout, self.n_src, P_SEED, src, layers)

    def close(self) -> None:
        self.send.close()
        self.recv.close()


@pytest.fixture
def pair(hosts: Hosts) -> Iterator[Pair]:
    p = Pair(hosts)
    yield p
    p.close()


def by_id(events: list[Any]) -> dict[str, Any]:
    ids = [e.request_id for e in events]
    assert len(ids) == len(set(ids)), f"more than one event for a request: {ids}"
    return {e.request_id: e for e in events}


def wait_landed(recv: Peer, expected: str, ids: list[int], layers: tuple[int, int]) -> None:
    """Poll the receiver (some backends write inside poll) until kv[ids, layers] holds
    the sender's data; no request may end meanwhile."""
    def landed() -> bool:
        assert not recv.events(), "a request ended while its first message was landing"
        return recv.digest(ids, layers) == expected

    until(f"blocks {ids} layers {layers} to land", landed, WAIT_S)


def shuffled_ids(rng: random.Random, pool: int, n: int) -> list[int]:
    """n distinct ids with some consecutive runs (exercises descriptor merging)."""
    start = rng.randrange(0, pool - n + 1)
    ids = list(range(start, start + n))
    cut = rng.randrange(1, n) if n > 1 else 1
    return ids[cut:] + ids[:cut] if rng.random() < 0.5 else rng.sample(range(pool), n)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "int8"])
def test_roundtrip_bit_exact(hosts: Hosts, dtype: str) -> None:
    layout = KVLayout("test-model", dtype, 3, 2, 8, 16)
    p = Pair(hosts, layout, n_src=32, n_dst=40)
    try:
        src, dst = [3, 4, 5, 9, 0], [10, 11, 12, 2, 39]
        p.recv.expect("r", dst, WAIT_S)
        p.send.send(p.peer, "r", src, dst, notify={"first_token": 7})
        sent, got = collect([p.send, p.recv], [1, 1], WAIT_S)
        assert sent[0].ok and got[0].ok, (sent, got)
        assert got[0].notify == {"first_token": 7}
        assert p.recv.digest(dst) == p.expected(src)
    finally:
        p.close()


def test_many_blocks(pair: Pair) -> None:
    rng = random.Random(0)
    src, dst = shuffled_ids(rng, P_BLOCKS, 256), shuffled_ids(rng, D_BLOCKS, 256)
    pair.recv.expect("big", dst, WAIT_S)
    pair.send.send(pair.peer, "big", src, dst, notify={})
    sent, got = collect([pair.send, pair.recv], [1, 1], WAIT_S)
    assert sent[0].ok and got[0].ok, (sent, got)
    assert pair.recv.digest(dst) == pair.expected(src)
    assert pair.send.num_pending() == 0 and pair.recv.num_pending() == 0


def test_large_request_in_chunks(hosts: Hosts) -> None:
    """The one larger case: 40 MiB in one request, cut into 8 MiB messages where the
    backend sends messages (torch, ray)."""
    layout = KVLayout("test-model", "float32", 8, 4, 64, 16)  # 256 KiB per block
    opts = {"chunk_bytes": 8 << 20} if hosts.backend in ("torch", "ray") else {}
    p = Pair(hosts, layout, n_src=160, n_dst=170, send_opts=opts)
    try:
        rng = random.Random(2)
        src, dst = shuffled_ids(rng, 160, 160), shuffled_ids(rng, 170, 160)
        p.recv.expect("large", dst, WAIT_S)
        p.send.send(p.peer, "large", src, dst, notify={"n": 160})
        sent, got = collect([p.send, p.recv], [1, 1], WAIT_S)
        assert sent[0].ok and got[0].ok, (sent, got)
        assert p.recv.digest(dst) == p.expected(src)
    finally:
        p.close()


def test_layer_ranges_then_final_notify(pair: Pair) -> None:
    src, dst = [7, 8, 9, 30], [100, 101, 5, 6]
    pair.recv.expect("r", dst, WAIT_S)
    pair.send.send(pair.peer, "r", src, dst, layers=(0, 1))
    pair.send.send(pair.peer, "r", src, dst, layers=(1, 3))
    _, early = collect([pair.send, pair.recv], [0, 1], 0.3)
    assert early == [], "completed before the final send"
    pair.send.send(pair.peer, "r", src, dst, layers=(3, 4), notify={"first_token": 11})
    sent, got = collect([pair.send, pair.recv], [1, 1], WAIT_S)
    assert sent[0].ok and got[0].ok and got[0].notify == {"first_token": 11}
    assert pair.recv.digest(dst) == pair.expected(src)


def test_a_block_left_unwritten_fails_the_request(pair: Pair) -> None:
    """Every message landed, but one reserved block got none of them (a sender that
    skipped it): the request fails as a transport error, never reports its KV ready
    (the decode would read the block's old bytes -- silently wrong tokens)."""
    pair.recv.expect("r", [10, 11, 12], WAIT_S)
    pair.send.send(pair.peer, "r", [1, 2], [10, 11], layers=(0, 4))
    pair.send.send(pair.peer, "r", [], [], notify={"first_token": 3})
    _, got = collect([pair.send, pair.recv], [1, 1], WAIT_S)
    assert [(e.ok, e.reason) for e in got] == [(False, FailReason.TRANSPORT)]
    assert "KV incomplete: 1 of 3 blocks never written (blocks [12]" in got[0].error
    assert pair.recv.num_pending() == 0


def test_out_of_order_completion(pair: Pair) -> None:
    plan = {"a": ([1, 2], [10, 11]), "b": ([3], [20]), "c": ([4, 5, 6], [30, 31, 32])}
    for rid, (_, dst) in plan.items():  # reserved a, b, c
        pair.recv.expect(rid, dst, WAIT_S)
    for rid in ["c", "a", "b"]:  # finished c, a, b
        src, dst = plan[rid]
        pair.send.send(pair.peer, rid, src, dst, notify={"rid": rid})
    sent, got = collect([pair.send, pair.recv], [3, 3], WAIT_S)
    assert all(e.ok for e in sent) and set(by_id(sent)) == set(plan)
    for rid, event in by_id(got).items():
        assert event.ok and event.notify == {"rid": rid}
        assert pair.recv.digest(plan[rid][1]) == pair.expected(plan[rid][0])


def test_concurrent_layered_requests(pair: Pair) -> None:
    rng = random.Random(1)
    dst_pool = rng.sample(range(D_BLOCKS), 8 * 6)
    plan = {
        f"r{i}": (rng.sample(range(P_BLOCKS), 6), dst_pool[6 * i : 6 * i + 6]) for i in range(8)
    }
    for rid, (_, dst) in plan.items():
        pair.recv.expect(rid, dst, WAIT_S)
    groups = [(0, 1), (1, 2), (2, 4)]
    for g, layers in enumerate(groups):
        for rid, (src, dst) in plan.items():
            notify = {"rid": rid} if g == len(groups) - 1 else None
            pair.send.send(pair.peer, rid, src, dst, layers=layers, notify=notify)
    sent, got = collect([pair.send, pair.recv], [8, 8], WAIT_S)
    assert all(e.ok for e in sent) and len(by_id(sent)) == 8
    assert all(e.ok for e in got) and len(by_id(got)) == 8
    for src, dst in plan.values():
        assert pair.recv.digest(dst) == pair.expected(src)


def shard(layout: KVLayout, heads: tuple[int, int]) -> KVLayout:
    return dataclasses.replace(layout, heads=heads)


def test_two_sender_ranks_fill_one_receiver_in_parts(hosts: Hosts) -> None:
    """Tensor parallel, many to one: two senders each hold one of the two KV heads and
    write it into a receiver holding both, as parts 0 and 1 of one request; it is done
    only when both are in, and holds each sender's head bit-exactly."""
    layout = KVLayout("test-model", "bfloat16", 3, 2, 16, 16)
    recv = Peer.make(hosts.decode, "receiver", hosts.backend, layout, 40, -1)
    sends, src, dst = [], [3, 4, 5, 9], [10, 11, 30, 2]
    try:
        for h in (0, 1):
            sends.append(Peer.make(hosts.prefill, "sender", hosts.backend,
                                   shard(layout, (h, h + 1)), 32, P_SEED + h))
        ep = recv.endpoint()
        peers = [s.connect({**ep, "slice": {"heads": [h, h + 1], "part": h, "parts": 2}})
                 for h, s in enumerate(sends)]
        recv.expect("r", dst, WAIT_S)
        sends[0].send(peers[0], "r", src, dst, layers=(0, 3), notify={"first_token": 5})
        (sent0,) = collect([sends[0]], [1], WAIT_S)
        _, early = collect([sends[0], recv], [0, 1], 0.3)
        assert sent0[0].ok and early == [], "one part of two completed the request"
        sends[1].send(peers[1], "r", src, dst, layers=(0, 1))
        sends[1].send(peers[1], "r", src, dst, layers=(1, 3), notify={"first_token": 5})
        sent1, got = collect([sends[1], recv], [1, 1], WAIT_S)
        assert sent1[0].ok and got[0].ok and got[0].notify == {"first_token": 5}, (sent1, got)
        want = torch.cat([make_kv(shard(layout, (h, h + 1)), 32, P_SEED + h)[src]
                          for h in (0, 1)], dim=3)
        assert recv.digest(dst) == digest(want)
    finally:
        for peer in [*sends, recv]:
            peer.close()


def test_one_sender_feeds_receiver_ranks_their_heads(hosts: Hosts) -> None:
    """Tensor parallel, one to many: a sender holding both KV heads writes each into
    the receiver (rank) that holds it; the slice comes from the receiver's layout."""
    layout = KVLayout("test-model", "float32", 2, 2, 16, 16)
    send = Peer.make(hosts.prefill, "sender", hosts.backend, layout, 32, P_SEED)
    recvs = [Peer.make(hosts.decode, "receiver", hosts.backend, shard(layout, (h, h + 1)), 40,
                       -1) for h in (0, 1)]
    src, dst = [1, 2, 7], [0, 1, 39]
    try:
        peers = [send.connect(r.endpoint()) for r in recvs]
        for h, r in enumerate(recvs):
            r.expect(f"r@{h}", dst, WAIT_S)
            send.send(peers[h], f"r@{h}", src, dst, notify={})
        sent, got0, got1 = collect([send, *recvs], [2, 1, 1], WAIT_S)
        assert all(e.ok for e in sent + got0 + got1), (sent, got0, got1)
        full = make_kv(layout, 32, P_SEED)[src]
        for h, r in enumerate(recvs):
            assert r.digest(dst) == digest(full[:, :, :, h : h + 1])
    finally:
        for peer in [send, *recvs]:
            peer.close()


def test_a_slice_the_sender_lacks_is_refused_naming_both(hosts: Hosts) -> None:
    layout = KVLayout("test-model", "float32", 2, 4, 16, 16)
    recv = Peer.make(hosts.decode, "receiver", hosts.backend, layout, 8, -1)
    send = Peer.make(hosts.prefill, "sender", hosts.backend, shard(layout, (0, 2)), 8, P_SEED)
    try:
        with pytest.raises(KVLayoutMismatch, match=r"sender holding heads \[0, 2\] to a "
                                                   r"receiver holding \[0, 4\]"):
            send.connect(recv.endpoint())  # no slice: it would have to fill all 4 heads
    finally:
        send.close()
        recv.close()


def test_receiver_abort_then_reuse(pair: Pair) -> None:
    src_old, src_new, dst = [1, 2, 3], [50, 51, 52], [7, 8, 9]
    pair.recv.expect("old", dst, WAIT_S)
    pair.send.send(pair.peer, "old", src_old, dst, layers=(0, 2))
    wait_landed(pair.recv, pair.expected(src_old, (0, 2)), dst, (0, 2))
    pair.recv.abort("old")
    pair.recv.abort("old")  # idempotent
    sent_early, got = collect([pair.send, pair.recv], [0, 1], WAIT_S)
    assert [(e.request_id, e.ok, e.reason) for e in got] == [("old", False, FailReason.ABORTED)]
    assert pair.recv.num_pending() == 0
    # D reuses the blocks; late data for "old" must not land in them.
    pair.recv.expect("new", dst, WAIT_S)
    pair.send.send(pair.peer, "old", src_old, dst, layers=(2, 4), notify={"late": True})
    pair.send.send(pair.peer, "new", src_new, dst, notify={"fresh": True})
    pair.send.abort("old")  # the control plane aborts both sides
    sent, got = collect([pair.send, pair.recv], [2 - len(sent_early), 1], WAIT_S)
    sent += sent_early  # nixl: P hears of D's abort and reports "old" at once
    assert set(by_id(sent)) == {"old", "new"} and by_id(sent)["new"].ok
    assert [(e.request_id, e.ok) for e in got] == [("new", True)]
    assert pair.recv.digest(dst) == pair.expected(src_new)
    assert pair.send.num_pending() == 0 and pair.recv.num_pending() == 0


def test_sender_abort_releases_both_sides(pair: Pair) -> None:
    pair.recv.expect("r", [1, 2], WAIT_S)
    pair.send.send(pair.peer, "r", [3, 4], [1, 2], layers=(0, 1))
    pair.send.abort("r")
    sent, got = collect([pair.send, pair.recv], [1, 1], WAIT_S)
    assert [(e.ok, e.reason) for e in sent] == [(False, FailReason.ABORTED)]
    assert [(e.ok, e.reason) for e in got] == [(False, FailReason.ABORTED)]
    assert pair.send.num_pending() == 0 and pair.recv.num_pending() == 0


def test_expect_timeout(pair: Pair) -> None:
    pair.recv.expect("never", [1], 0.3)
    _, got = collect([pair.send, pair.recv], [0, 1], WAIT_S)
    assert [(e.request_id, e.reason) for e in got] == [("never", FailReason.TIMEOUT)]
    assert pair.recv.num_pending() == 0


def test_bad_arguments(pair: Pair) -> None:
    with pytest.raises(ValueError, match="destination"):
        pair.send.send(pair.peer, "r", [1, 2], [3])
    with pytest.raises(ValueError, match="out of range"):
        pair.send.send(pair.peer, "r", [1], [D_BLOCKS])
    with pytest.raises(ValueError, match="layer range"):
        pair.send.send(pair.peer, "r", [1], [2], layers=(2, 9))
    pair.recv.expect("r", [1, 2], WAIT_S)
    with pytest.raises(ValueError, match="expected by another"):
        pair.recv.expect("s", [2, 3], WAIT_S)


def test_layout_mismatch_names_the_field(hosts: Hosts) -> None:
    recv = Peer.make(hosts.decode, "receiver", hosts.backend, LAYOUT, 8, -1)
    other = KVLayout("test-model", "float32", 5, 2, 16, 16)  # num_layers differs
    send = Peer.make(hosts.prefill, "sender", hosts.backend, other, 8, P_SEED)
    try:
        with pytest.raises(KVLayoutMismatch, match=r"num_layers: local=5 peer=4"):
            send.connect(recv.endpoint())
    finally:
        send.close()
        recv.close()


def _kill(hosts: Hosts, host: Any, peer: Peer) -> None:
    """Kill a peer's process (local backend: close it, the in-process equivalent)."""
    if hosts.local:
        peer.close()
    else:
        host.kill()
        peer.closed = True


def test_sender_death_fails_receiver_in_time(hosts: Hosts) -> None:
    host = hosts.fresh()
    p = Pair(hosts, prefill=host)
    timeout_s = 4.0
    p.recv.expect("r", [1, 2, 3], timeout_s)
    p.send.send(p.peer, "r", [1, 2, 3], [1, 2, 3], layers=(0, 1))
    wait_landed(p.recv, p.expected([1, 2, 3], (0, 1)), [1, 2, 3], (0, 1))
    _kill(hosts, host, p.send)
    (got,) = collect([p.recv], [1], WAIT_S)  # it ends: by the expectation timeout at the latest
    assert len(got) == 1 and not got[0].ok, got
    # Ray cannot tell a dead sender from a slow one between messages: it times out.
    allowed = (
        {FailReason.PEER_DIED, FailReason.TIMEOUT}
        if hosts.backend == "ray"
        else {FailReason.PEER_DIED}
    )
    assert got[0].reason in allowed, got
    assert p.recv.num_pending() == 0
    p.recv.close()


def test_receiver_death_fails_sender_in_time(hosts: Hosts) -> None:
    host = hosts.fresh()
    timeout_s = 5.0
    p = Pair(hosts, decode=host, send_opts={"timeout_s": timeout_s})
    p.recv.expect("r", [1, 2], 30)
    p.send.send(p.peer, "r", [1, 2], [1, 2], layers=(0, 1))
    wait_landed(p.recv, p.expected([1, 2], (0, 1)), [1, 2], (0, 1))
    # ... and the sender is done with that message (nixl over cma: UCX may crash a
    # sender whose one-sided write is still in flight when its peer dies).
    until("the first message to complete", lambda: not p.send.inflight("r"), WAIT_S)
    _kill(hosts, host, p.recv)
    # Each send ends (by the send timeout at the latest). Ray: a put into the dead
    # receiver's queue succeeds until Ray has reaped that queue actor (its owner's death
    # is noticed asynchronously), so a send just after the kill may still be reported
    # delivered; the sends after it fail.
    deadline = time.monotonic() + WAIT_S
    for i in range(100):
        # the first ends request r (its last message); a retry is a request of its own
        p.send.send(p.peer, f"r{i or ''}", [1, 2], [1, 2], layers=(1, 4), notify={})
        (sent,) = collect([p.send], [1], WAIT_S)
        assert len(sent) == 1, sent
        if not sent[0].ok or hosts.backend != "ray" or time.monotonic() > deadline:
            break
    assert not sent[0].ok, sent
    assert sent[0].reason in {FailReason.PEER_DIED, FailReason.TIMEOUT}
    assert p.send.num_pending() == 0
    p.send.close()
