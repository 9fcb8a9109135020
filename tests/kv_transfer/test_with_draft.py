"""A target's channel with a draft model's beside it (``kv_transfer.with_draft``): the
draft's prompt KV is part of the request's transfer -- it ends the request with the
target's, its failure fails it -- and two workers that disagree on the draft are
refused at connect, naming it. In one process over the ``local`` backend."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from pdserve.kv_transfer import FailReason, KVLayout, KVLayoutMismatch
from pdserve.kv_transfer.backends.local_conn import LocalReceiver, LocalSender
from pdserve.kv_transfer.with_draft import DraftReceiver, DraftSender

from .kvdata import make_kv
from .test_sharded import WAIT_S, events

TARGET = KVLayout("m", "float32", num_layers=2, num_kv_heads=4, head_dim=16, block_size=16,
                  draft="d")
DRAFT = KVLayout("d", "float32", num_layers=1, num_kv_heads=2, head_dim=8, block_size=16)


@dataclasses.dataclass
class Side:
    channel: Any
    kv: torch.Tensor
    draft_kv: torch.Tensor | None


@pytest.fixture
def side() -> Iterator[Callable[..., Side]]:
    made: list[Side] = []

    def make(role: str, seed: int, target: KVLayout = TARGET,
             draft: KVLayout | None = DRAFT) -> Side:
        kv = make_kv(target, 24, seed)
        dkv = None if draft is None else make_kv(draft, 24, seed + 100 if seed >= 0 else -1)
        cls = LocalSender if role == "send" else LocalReceiver
        ch: Any = cls(kv, target)
        if dkv is not None and draft is not None:
            ch = (DraftSender if role == "send" else DraftReceiver)(ch, cls(dkv, draft))
        made.append(Side(ch, kv, dkv))
        return made[-1]

    yield make
    for s in made:
        s.channel.close()


def test_the_draft_part_lands_with_the_target_and_ends_it(side: Callable[..., Side]) -> None:
    p, d = side("send", 1), side("recv", -1)
    assert p.draft_kv is not None and d.draft_kv is not None
    peer = p.channel.connect(d.channel.endpoint())
    src, dst, dsrc, ddst = [3, 4, 9], [20, 0, 5], [3, 4, 9], [7, 8, 1]
    d.channel.expect("r", dst, WAIT_S, draft_block_ids=ddst)
    p.channel.send(peer, "r", src, dst, layers=(0, 2))
    p.channel.send_draft(peer, "r", dsrc, ddst)
    assert d.channel.poll() == [] and p.channel.poll() == []  # the final send is to come
    p.channel.send(peer, "r", src[2:], dst[2:], notify={"first_token": 5})
    (sent,), (got,) = events(p.channel, 1), events(d.channel, 1)
    assert sent.ok and got.ok and got.notify == {"first_token": 5}, (sent, got)
    assert torch.equal(d.kv[dst], p.kv[src])
    assert torch.equal(d.draft_kv[ddst], p.draft_kv[dsrc])
    assert p.channel.num_pending == 0 and d.channel.num_pending == 0
    # a request without draft blocks is the target's part alone
    d.channel.expect("q", [2], WAIT_S)
    p.channel.send(peer, "q", [6], [2], notify={})
    (sent,), (got,) = events(p.channel, 1), events(d.channel, 1)
    assert sent.ok and got.ok and torch.equal(d.kv[2], p.kv[6])


def test_a_missing_draft_part_fails_the_request(side: Callable[..., Side]) -> None:
    """The target's KV landed, the draft's never comes (its sender went away first):
    the request fails on the draft part's timeout, not as ready."""
    p, d = side("send", 1), side("recv", -1)
    peer = p.channel.connect(d.channel.endpoint())
    d.channel.expect("r", [0, 1], 0.2, draft_block_ids=[0, 1])
    p.channel.send(peer, "r", [3, 4], [0, 1], notify={"first_token": 1})
    (got,) = events(d.channel, 1)
    assert not got.ok and got.reason is FailReason.TIMEOUT, got
    assert d.channel.num_pending == 0


def test_an_abort_stops_both_parts(side: Callable[..., Side]) -> None:
    p, d = side("send", 1), side("recv", -1)
    peer = p.channel.connect(d.channel.endpoint())
    d.channel.expect("r", [0, 1], WAIT_S, draft_block_ids=[5, 6])
    p.channel.send(peer, "r", [3], [0], layers=(0, 2))
    p.channel.send_draft(peer, "r", [3, 4], [5, 6])
    p.channel.abort("r")
    (sent,), (got,) = events(p.channel, 1), events(d.channel, 1)
    assert not sent.ok and sent.reason is FailReason.ABORTED
    assert not got.ok and got.reason is FailReason.ABORTED
    # ended: later sends are dropped, and no second event comes
    p.channel.send(peer, "r", [4], [1], notify={})
    p.channel.send_draft(peer, "r", [3, 4], [5, 6])
    assert p.channel.poll() == []
    # the blocks are free again for the next request
    d.channel.expect("s", [0, 1], WAIT_S, draft_block_ids=[5, 6])


def test_workers_that_disagree_on_the_draft_are_refused_naming_it(
        side: Callable[..., Side]) -> None:
    plain = dataclasses.replace(TARGET, draft=None)
    with_draft, without = side("send", 1), side("recv", -1, plain, None)
    with pytest.raises(KVLayoutMismatch, match=r"draft: local='d' peer=None.*draft model"):
        with_draft.channel.connect(without.channel.endpoint())
    p, d = side("send", 1, plain, None), side("recv", -1)
    with pytest.raises(KVLayoutMismatch, match=r"draft: local=None peer='d'"):
        p.channel.connect(d.channel.endpoint())
    # the same name, other shapes: the draft channel's own handshake names them
    p = side("send", 1, TARGET, dataclasses.replace(DRAFT, num_layers=2))
    with pytest.raises(KVLayoutMismatch, match=r"num_layers: local=2 peer=1"):
        p.channel.connect(d.channel.endpoint())


def test_draft_blocks_another_request_expects_are_refused(side: Callable[..., Side]) -> None:
    d = side("recv", -1)
    d.channel.expect("a", [0], WAIT_S, draft_block_ids=[3])
    with pytest.raises(ValueError, match="draft KV blocks refused"):
        d.channel.expect("b", [1], WAIT_S, draft_block_ids=[3])
    (got,) = events(d.channel, 1)  # b's target part ended too: nothing waits in block 1
    assert got.request_id == "b" and not got.ok
    d.channel.expect("c", [1], WAIT_S)
