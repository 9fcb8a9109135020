"""Block pool: unit tests and a hypothesis state machine over allocate/free/share."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pdserve.engine.block_pool import (
    ROOT_HASH,
    BlockPool,
    hash_block,
    prefix_block_hashes,
    root_hash,
)


def test_allocate_until_full_returns_none() -> None:
    pool = BlockPool(4)
    a = pool.allocate(3)
    assert a is not None and len(set(a)) == 3
    assert pool.allocate(2) is None  # no room: None, not an exception
    assert pool.num_free == 1
    pool.free(a)
    assert pool.num_free == 4
    pool.check_integrity()


def test_double_free_is_an_error() -> None:
    pool = BlockPool(2)
    a = pool.allocate(1)
    assert a is not None
    pool.free(a)
    with pytest.raises(RuntimeError, match="double free"):
        pool.free(a)


def test_prefix_hit_shares_and_eviction_forgets() -> None:
    pool = BlockPool(3)
    tokens = list(range(32))
    hashes = prefix_block_hashes(tokens, 16)
    blocks = pool.allocate(2)
    assert blocks is not None
    pool.register(blocks, hashes)
    assert pool.lookup(hashes) == blocks
    pool.free(blocks)  # ref 0 but cached
    assert pool.num_cached == 2 and pool.num_free == 3
    pool.check_integrity()
    hits = pool.lookup(hashes)
    pool.acquire(hits)
    assert pool.num_cached == 0 and pool.ref_count(blocks[0]) == 1
    pool.free(hits)
    # Allocating everything evicts the cached blocks, tail block first.
    got = pool.allocate(3)
    assert got is not None
    assert pool.lookup(hashes) == []
    pool.free(got)
    pool.check_integrity()


def test_tail_block_is_evicted_before_head() -> None:
    pool = BlockPool(3)
    hashes = prefix_block_hashes(list(range(32)), 16)
    blocks = pool.allocate(2)
    assert blocks is not None
    pool.register(blocks, hashes)
    pool.free(blocks)
    pool.allocate(2)  # one free block + one eviction: the tail goes
    assert pool.lookup(hashes) == blocks[:1]


def test_chained_hash_depends_on_parent() -> None:
    assert hash_block(0, [1, 2]) != hash_block(1, [1, 2])
    a = prefix_block_hashes([1, 2, 3, 4], 2)
    b = prefix_block_hashes([9, 9, 3, 4], 2)
    assert a[1] != b[1]  # same block tokens, different prefix
    assert prefix_block_hashes([1, 2, 3], 2) == a[:1]  # partial blocks are not hashed


def test_integrity_check_detects_corruption() -> None:
    pool = BlockPool(4)
    pool.allocate(1)
    pool._free.append(pool._free[0])  # corrupt: a block twice in the free list
    with pytest.raises(AssertionError, match="integrity"):
        pool.check_integrity()


class PoolMachine(RuleBasedStateMachine):
    """Random allocate/free/share/register sequences never double-allocate, never
    leak, and always satisfy the integrity check."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(16)
        self.owners: list[list[int]] = []  # each owner holds one ref on each block
        self.next_hash = 1

    @rule(n=st.integers(1, 6))
    def allocate(self, n: int) -> None:
        before = self.pool.num_free
        got = self.pool.allocate(n)
        if got is None:
            assert n > before
            return
        assert len(set(got)) == n
        held = {b for o in self.owners for b in o}
        assert not held & set(got), "allocated a block someone holds"
        self.owners.append(got)

    @precondition(lambda self: self.owners)
    @rule(i=st.integers(0, 100))
    def free(self, i: int) -> None:
        self.pool.free(self.owners.pop(i % len(self.owners)))

    @precondition(lambda self: self.owners)
    @rule(i=st.integers(0, 100))
    def register_and_share(self, i: int) -> None:
        blocks = self.owners[i % len(self.owners)]
        hashes = []
        for b in blocks:
            self.pool.register([b], [self.next_hash])
            hashes.append(self.next_hash)
            self.next_hash += 1
        hits = self.pool.lookup(hashes)
        self.pool.acquire(hits)
        self.owners.append(hits)

    @invariant()
    def consistent(self) -> None:
        self.pool.check_integrity()
        refs: dict[int, int] = {}
        for o in self.owners:
            for b in o:
                refs[b] = refs.get(b, 0) + 1
        for b in range(self.pool.num_blocks):
            assert self.pool.ref_count(b) == refs.get(b, 0)
        assert self.pool.num_used == len(refs)

    def teardown(self) -> None:
        for o in self.owners:
            self.pool.free(o)
        assert self.pool.num_free == self.pool.num_blocks  # nothing leaked
        self.pool.check_integrity()


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_prefix_hashes_continue_from_known_ones() -> None:
    tokens = list(range(100, 171))  # 4 full blocks of 16, and 7 tokens
    whole = prefix_block_hashes(tokens, 16)
    assert len(whole) == 4
    assert prefix_block_hashes(tokens, 16, prefix_block_hashes(tokens[:40], 16)) == whole
    assert prefix_block_hashes(tokens, 16, whole[:1]) == whole


def test_a_salt_roots_its_own_chain() -> None:
    tokens = list(range(48))
    plain = prefix_block_hashes(tokens, 16)
    assert root_hash(None) == ROOT_HASH
    salted = prefix_block_hashes(tokens, 16, root=root_hash("a"))
    assert root_hash("a") == root_hash("a") != root_hash("b")
    assert not set(salted) & set(plain)
    assert not set(salted) & set(prefix_block_hashes(tokens, 16, root=root_hash("b")))
    assert prefix_block_hashes(tokens, 16, salted[:1], root_hash("a")) == salted
