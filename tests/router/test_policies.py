"""Routing policies are pure functions of a snapshot."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pdserve.router.policies import (
    ClusterSnapshot,
    PrefixIndex,
    RouteInput,
    WorkerView,
    get_policy,
    least_loaded,
    prefix_affinity,
    round_robin,
)

P = [WorkerView("p0", outstanding_tokens=500), WorkerView("p1", outstanding_tokens=20)]
D = [WorkerView("d0", free_blocks=10, total_blocks=100),
     WorkerView("d1", free_blocks=80, total_blocks=100)]
REQ = RouteInput(64, [11, 22, 33, 44])


def test_round_robin_cycles() -> None:
    picks = [round_robin(ClusterSnapshot(P, D, sequence=i), REQ) for i in range(4)]
    assert [p for p, _ in picks] == ["p0", "p1", "p0", "p1"]
    assert [d[0] for _, d in picks] == ["d0", "d1", "d0", "d1"]
    assert all(sorted(d) == ["d0", "d1"] for _, d in picks)  # every worker is a fallback


def test_least_loaded_prefers_short_queue_and_free_blocks() -> None:
    p, d = least_loaded(ClusterSnapshot(P, D), REQ)
    assert p == "p1" and d == ["d1", "d0"]


def test_prefix_affinity_follows_the_cache_unless_far_busier() -> None:
    owner = {11: "p0", 22: "p0", 33: "p0"}
    busy = [WorkerView("p0", outstanding_tokens=100), WorkerView("p1")]
    p, _ = prefix_affinity(ClusterSnapshot(busy, D, prefix_owner=owner), REQ)
    assert p == "p0"  # 3 cached blocks (48 tokens) outweigh 100 queued tokens
    swamped = [WorkerView("p0", outstanding_tokens=10_000), WorkerView("p1")]
    p, _ = prefix_affinity(ClusterSnapshot(swamped, D, prefix_owner=owner), REQ)
    assert p == "p1"
    p, _ = prefix_affinity(ClusterSnapshot(P, D, prefix_owner={}), REQ)
    assert p == "p1"  # no affinity: least loaded


def test_prefix_affinity_weighs_the_blocks_it_saves_at_their_size() -> None:
    """3 cached blocks save 48 tokens of 16-token blocks and 96 of 32-token blocks: 300
    extra queued tokens are worth waiting for with the larger blocks only."""
    owner = {11: "p0", 22: "p0", 33: "p0"}
    busy = [WorkerView("p0", outstanding_tokens=300), WorkerView("p1")]
    small = RouteInput(64, [11, 22, 33, 44], block_size=16)
    large = RouteInput(128, [11, 22, 33, 44], block_size=32)
    assert prefix_affinity(ClusterSnapshot(busy, D, prefix_owner=owner), small)[0] == "p1"
    assert prefix_affinity(ClusterSnapshot(busy, D, prefix_owner=owner), large)[0] == "p0"


def test_prefix_affinity_sends_a_conversation_back_to_the_decode_worker_holding_it() -> None:
    """d0 holds the prompt's first 3 blocks (an earlier turn): it goes first although d1
    has more room, as long as d0 has room for the one block it lacks."""
    held = {11: "d0", 22: "d0", 33: "d0"}
    _, d = prefix_affinity(ClusterSnapshot(P, D, token_prefix_owner=held), REQ)
    assert d == ["d0", "d1"]
    full = [WorkerView("d0", free_blocks=0, total_blocks=100), D[1]]
    _, d = prefix_affinity(ClusterSnapshot(P, full, token_prefix_owner=held), REQ)
    assert d == ["d1", "d0"]  # no room for the rest there: most room first
    _, d = least_loaded(ClusterSnapshot(P, D, token_prefix_owner=held), REQ)
    assert d == ["d1", "d0"]  # only prefix_affinity follows it


def test_prefix_index_is_bounded_and_forgets_dead_workers() -> None:
    idx = PrefixIndex(capacity=3)
    idx.record([1, 2, 3], "p0")
    idx.record([4], "p1")
    assert 1 not in idx.view() and idx.view()[4] == "p1"
    idx.forget_worker("p0")
    assert set(idx.view()) == {4}


def test_unknown_policy_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="round_robin"):
        get_policy("random")


def test_router_never_imports_torch_or_ray() -> None:
    code = ("import sys, pdserve.router.router, pdserve.router.grpc.server, "
            "pdserve.router.metrics; "
            "bad = [m for m in ('torch', 'ray') if m in sys.modules]; "
            "sys.exit(f'router imported {bad}' if bad else 0)")
    subprocess.run([sys.executable, "-c", code], check=True)
