"""Tensor-parallel channels (``kv_transfer.sharded``): the head plan, and workers of
several ranks moving KV rank to rank -- in one process over the ``local`` backend, the
follower ranks' channels behind real pipes (``RankChannel`` <-> ``serve_rank``)."""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing
import os
import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from pdserve.kv_transfer import FailReason, KVLayout, KVLayoutMismatch
from pdserve.kv_transfer.backends.local_conn import LocalReceiver, LocalSender
from pdserve.kv_transfer.layout import Slice
from pdserve.kv_transfer.rank_channel import RankChannel, serve_rank
from pdserve.kv_transfer.sharded import ShardedReceiver, ShardedSender, plan_pairs
from tests.waiting import until

from .kvdata import make_kv

LAYOUT = KVLayout("m", "float32", num_layers=2, num_kv_heads=4, head_dim=16, block_size=16)
WAIT_S = 10.0


def split(n_heads: int, ranks: int) -> list[tuple[int, int]]:
    return [(r * n_heads // ranks, (r + 1) * n_heads // ranks) for r in range(ranks)]


# ----------------------------------------------------------------- the head plan
def test_many_to_one_is_one_part_per_sender_rank() -> None:
    assert plan_pairs(split(4, 2), [(0, 4)]) == [
        (0, 0, Slice((0, 2), 0, 2)), (1, 0, Slice((2, 4), 1, 2))]


def test_one_to_many_sends_each_receiver_rank_its_heads() -> None:
    assert plan_pairs([(0, 4)], split(4, 2)) == [
        (0, 0, Slice((0, 2), 0, 1)), (0, 1, Slice((2, 4), 0, 1))]


def test_uneven_and_replicated_heads() -> None:
    # 3 heads over 3 sender ranks into 2 receiver ranks (1 + 2 heads)
    assert plan_pairs(split(3, 3), split(3, 2)) == [
        (0, 0, Slice((0, 1), 0, 1)), (1, 1, Slice((1, 2), 0, 2)), (2, 1, Slice((2, 3), 1, 2))]
    # TP=4 over 2 KV heads replicates each on two ranks: the first holder sends it
    assert plan_pairs([(0, 1), (0, 1), (1, 2), (1, 2)], [(0, 2)]) == [
        (0, 0, Slice((0, 1), 0, 2)), (2, 0, Slice((1, 2), 1, 2))]


def test_a_head_no_sender_holds_is_refused_naming_both_sides() -> None:
    with pytest.raises(KVLayoutMismatch, match=r"KV head 3 of receiver rank 1 .* sender ranks "
                                               r"hold \[\[0, 2\], \[2, 3\]\]"):
        plan_pairs([(0, 2), (2, 3)], split(4, 2))


# ------------------------------------------------------------- workers of ranks
@dataclasses.dataclass
class Worker:
    channel: Any
    kvs: list[torch.Tensor]  # every rank's cache
    stop: Callable[[], None]


def make_worker(role: str, ranks: int, seed: int, remote: bool,
                layout: KVLayout = LAYOUT) -> Worker:
    """A worker of ``ranks`` ranks over the local backend; with ``remote``, ranks 1..
    sit behind pipes served on threads (as the follower processes serve them)."""
    heads = split(layout.num_kv_heads, ranks)
    layouts = [dataclasses.replace(layout, heads=h) for h in heads]
    kvs = [make_kv(lay, 24, seed + r if seed >= 0 else -1) for r, lay in enumerate(layouts)]
    cls = LocalSender if role == "send" else LocalReceiver
    chans: list[Any] = [cls(kvs[0], layouts[0])]
    conns: list[Any] = []
    for r in range(1, ranks):
        if not remote:
            chans.append(cls(kvs[r], layouts[r]))
            continue
        mine, theirs = multiprocessing.Pipe()
        threading.Thread(target=serve_rank, args=(theirs, kvs[r], layouts[r], f"r{r}"),
                         daemon=True).start()
        ch = RankChannel(mine, r)
        ch.open(role, "local", {})
        chans.append(ch)
        conns.append(theirs)
    outer = ShardedSender if role == "send" else ShardedReceiver
    return Worker(outer(chans, layout, heads), kvs, lambda: [cut(c) for c in conns])


def cut(conn: Any) -> None:
    """The pipe's far end goes away, as when a follower process dies (both ends see EOF)."""
    with contextlib.suppress(OSError):
        socket.socket(fileno=os.dup(conn.fileno())).shutdown(socket.SHUT_RDWR)


def events(channel: Any, n: int) -> list[Any]:
    got: list[Any] = []
    until(f"{n} events", lambda: got.extend(channel.poll()) or len(got) >= n, WAIT_S)
    assert len(got) == n, got
    return got


@pytest.fixture
def workers() -> Iterator[Callable[..., Worker]]:
    made: list[Worker] = []

    def make(*args: Any) -> Worker:
        made.append(make_worker(*args))
        return made[-1]

    yield make
    for w in made:
        w.channel.close()
        w.stop()


@pytest.mark.parametrize(("p_ranks", "d_ranks"), [(2, 1), (1, 2), (2, 2), (4, 2), (1, 4)])
@pytest.mark.parametrize("remote", [False, True])
def test_every_combination_moves_every_head(workers: Callable[..., Worker], p_ranks: int,
                                            d_ranks: int, remote: bool) -> None:
    p, d = workers("send", p_ranks, 1, remote), workers("recv", d_ranks, -1, remote)
    peer = p.channel.connect(d.channel.endpoint())
    src, dst = [3, 4, 9], [20, 0, 5]
    d.channel.expect("r", dst, WAIT_S)
    p.channel.send(peer, "r", src, dst, layers=(0, 1))
    p.channel.send(peer, "r", src, dst, layers=(1, 2), notify={"first_token": 3})
    (sent,), (got,) = events(p.channel, 1), events(d.channel, 1)
    assert sent.ok and got.ok and got.notify == {"first_token": 3}, (sent, got)
    want = torch.cat([kv[src] for kv in p.kvs], dim=3)
    assert torch.equal(torch.cat([kv[dst] for kv in d.kvs], dim=3), want)
    assert p.channel.num_pending == 0 and d.channel.num_pending == 0
    p.channel.send(peer, "r", src, dst, notify={})  # ended: dropped, no second event
    assert p.channel.poll() == []


@pytest.mark.parametrize(("p_ranks", "d_ranks"), [(2, 1), (1, 2)])
def test_int8_rows_move_whole_across_degrees(workers: Callable[..., Worker], p_ranks: int,
                                            d_ranks: int) -> None:
    """An int8 cache's rows (values and their scale) are cut by heads like any other."""
    int8 = dataclasses.replace(LAYOUT, dtype="int8")
    p, d = workers("send", p_ranks, 1, False, int8), workers("recv", d_ranks, -1, False, int8)
    peer = p.channel.connect(d.channel.endpoint())
    src, dst = [3, 4, 9], [20, 0, 5]
    d.channel.expect("r", dst, WAIT_S)
    p.channel.send(peer, "r", src, dst, notify={"first_token": 3})
    (sent,), (got,) = events(p.channel, 1), events(d.channel, 1)
    assert sent.ok and got.ok, (sent, got)
    assert torch.equal(torch.cat([kv[dst] for kv in d.kvs], dim=3),
                       torch.cat([kv[src] for kv in p.kvs], dim=3))


@pytest.mark.parametrize("remote", [False, True])
def test_an_abort_ends_each_side_once_then_blocks_are_reused(workers: Callable[..., Worker],
                                                             remote: bool) -> None:
    p, d = workers("send", 2, 1, remote), workers("recv", 2, -1, remote)
    peer = p.channel.connect(d.channel.endpoint())
    d.channel.expect("old", [1, 2], WAIT_S)
    p.channel.send(peer, "old", [5, 6], [1, 2], layers=(0, 1))
    d.channel.abort("old")  # the control plane aborts both sides
    p.channel.abort("old")
    (got,) = events(d.channel, 1)
    assert (got.request_id, got.ok, got.reason) == ("old", False, FailReason.ABORTED)
    (sent,) = events(p.channel, 1)
    assert sent.request_id == "old" and not sent.ok
    d.channel.expect("new", [1, 2], WAIT_S)  # every rank's blocks are free again
    p.channel.send(peer, "new", [7, 8], [1, 2], notify={})
    assert all(e.ok for e in events(p.channel, 1) + events(d.channel, 1))
    assert torch.equal(torch.cat([kv[[1, 2]] for kv in d.kvs], dim=3),
                       torch.cat([kv[[7, 8]] for kv in p.kvs], dim=3))


def test_a_rank_gone_fails_its_requests(workers: Callable[..., Worker]) -> None:
    """A follower's pipe closes (its process died): what it had pending fails
    PEER_DIED on both sides, once."""
    p, d = workers("send", 2, 1, True), workers("recv", 2, -1, True)
    peer = p.channel.connect(d.channel.endpoint())
    d.channel.expect("r", [1], WAIT_S)
    p.channel.send(peer, "r", [5], [1], layers=(0, 1))
    d.stop()  # the receiver worker's rank 1 is gone
    (got,) = events(d.channel, 1)
    assert not got.ok and got.reason is FailReason.PEER_DIED and "rank 1" in got.error
    p.stop()
    p.channel.send(peer, "r", [5], [1], layers=(1, 2), notify={})
    (sent,) = events(p.channel, 1)
    assert not sent.ok and sent.reason is FailReason.PEER_DIED


def test_layouts_of_other_models_are_refused(workers: Callable[..., Worker]) -> None:
    p = workers("send", 2, 1, False)
    other = LocalReceiver(make_kv(dataclasses.replace(LAYOUT, head_dim=8), 4, -1),
                          dataclasses.replace(LAYOUT, head_dim=8))
    try:
        with pytest.raises(KVLayoutMismatch, match="head_dim: local=16 peer=8"):
            p.channel.connect(other.endpoint())
    finally:
        other.close()


def test_a_refused_call_leaves_nothing_pending(workers: Callable[..., Worker]) -> None:
    p, d = workers("send", 2, 1, True), workers("recv", 2, -1, True)
    peer = p.channel.connect(d.channel.endpoint())
    with pytest.raises(ValueError, match="out of range"):
        p.channel.send(peer, "r", [99], [1], notify={})
    assert p.channel.num_pending == 0 and p.channel.poll() == []
    d.channel.expect("a", [1, 2], WAIT_S)
    with pytest.raises(ValueError, match="expected by another"):
        d.channel.expect("b", [2, 3], WAIT_S)
    assert d.channel.num_pending == 1  # only "a"
    # A follower whose blocks differ from rank 0's (a bug) refuses: the request ends.
    ch = d.channel._ranks[1]
    ch.expect("c@1", [5], WAIT_S)  # rank 1 alone now holds block 5
    with pytest.raises(ValueError, match="rank 1 refused"):
        d.channel.expect("c", [5], WAIT_S)
    (ended,) = events(d.channel, 1)
    assert ended.request_id == "c" and not ended.ok and d.channel.num_pending == 1


def test_a_post_into_a_pipe_that_just_closed_marks_the_rank_gone() -> None:
    """The follower's end stops reading before rank 0's reader sees EOF (the race
    CI hit): a send or abort then marks the rank gone instead of raising
    BrokenPipeError into the worker, and a call says the rank is gone."""
    a, b = socket.socketpair()
    mine = multiprocessing.connection.Connection(os.dup(a.fileno()))
    a.close()
    b.shutdown(socket.SHUT_RD)  # writes to it now fail; our reader still sees no EOF
    ch = RankChannel(mine, 1)
    try:
        ch.send("peer", "r@1", [5], [1])
        assert ch.dead is not None and "BrokenPipeError" in ch.dead
        ch.abort("r@1")  # dropped: the rank is gone
        with pytest.raises(ConnectionError, match="rank 1"):
            ch.endpoint()
    finally:
        b.close()
        ch._reader.join(WAIT_S)
        mine.close()
