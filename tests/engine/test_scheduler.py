"""Scheduler unit tests: no model, the runner's part is simulated by ``advance``."""

from __future__ import annotations

from pdserve.engine.block_pool import BlockPool
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.sampling.sampling_params import SamplingParams
from pdserve.engine.scheduler import Scheduler


def make(num_blocks: int = 16, budget: int = 64, max_seqs: int = 8) -> Scheduler:
    return Scheduler(BlockPool(num_blocks), block_size=4, max_num_batched_tokens=budget,
                     max_num_seqs=max_seqs)


def req(rid: str, n: int, first: int = 0) -> Request:
    return Request(rid, list(range(first, first + n)), SamplingParams(max_tokens=8))


def run_step(s: Scheduler, sample: int = 7) -> list[tuple[str, int]]:
    batch = s.schedule()
    for r, n in batch.work:
        s.advance(r, n)
        if r.num_computed_tokens == r.num_tokens:
            r.token_ids.append(sample)
    return [(r.request_id, n) for r, n in batch.work]


def test_budget_chunks_a_long_prompt() -> None:
    s = make(budget=8)
    s.add(req("a", 20))
    assert run_step(s) == [("a", 8)]
    assert run_step(s) == [("a", 8)]
    assert run_step(s) == [("a", 4)]  # caught up: sampled
    assert run_step(s) == [("a", 1)]  # decode
    s.pool.check_integrity()


def test_running_decodes_go_before_new_prefills() -> None:
    s = make(budget=6)
    s.add(req("a", 3))
    run_step(s)
    s.add(req("b", 10))
    assert run_step(s) == [("a", 1), ("b", 5)]


def test_prefix_hit_skips_computation_but_not_the_last_token() -> None:
    s = make()
    a = req("a", 8)
    s.add(a)
    run_step(s)
    s.finish(a)
    assert s.pool.num_cached == 2
    b = req("b", 8)  # same 8 tokens: both blocks cached, yet one token must run
    s.add(b)
    assert run_step(s) == [("b", 4)]  # the last block is recomputed
    assert b.num_cached_tokens == 4
    c = req("c", 10)  # 8 shared tokens + 2 new
    s.add(c)
    work = dict(run_step(s))
    assert work["c"] == 2 and c.num_cached_tokens == 8
    s.pool.check_integrity()


def test_without_a_prefix_cache_nothing_is_hashed_or_shared() -> None:
    s = Scheduler(BlockPool(16, enable_prefix_caching=False), block_size=4,
                  max_num_batched_tokens=64, max_num_seqs=8)
    a = req("a", 8)
    s.add(a)
    run_step(s)
    run_step(s)
    assert a.num_registered_blocks == 2 and not a.block_hashes
    s.finish(a)
    assert s.pool.num_cached == 0 and s.pool.num_free == 16
    b = req("b", 8)
    s.add(b)
    assert run_step(s) == [("b", 8)] and b.num_cached_tokens == 0 and not b.block_hashes
    d = req("d", 8)
    assert s.reserve(d) is not None and d.num_cached_tokens == 0 and not d.block_hashes
    s.pool.check_integrity()


def test_preemption_frees_the_newest_and_recomputes_it() -> None:
    s = make(num_blocks=4, budget=64)
    a, b = req("a", 8), req("b", 8, first=100)
    s.add(a)
    s.add(b)
    run_step(s)  # both prefilled: 2 full blocks each, plus one sampled token
    assert s.pool.num_free == 0
    work = run_step(s)  # each needs a 3rd block: b is preempted for a
    assert work == [("a", 1)]
    assert b.status is RequestStatus.WAITING and b.block_ids == []
    assert b.num_computed_tokens == 0 and b.num_output_tokens == 1  # keeps its token
    s.finish(a)
    work = run_step(s)
    # b recomputes prompt + its generated token (9), less its head block, which
    # stayed in the prefix cache: a's new block evicted only b's tail block.
    assert work == [("b", 5)]
    s.pool.check_integrity()


def test_admission_waits_for_blocks() -> None:
    s = make(num_blocks=3)
    s.add(req("a", 8))
    s.add(req("b", 8, first=50))
    assert [r for r, _ in run_step(s)] == ["a"]  # b does not fit next to a
    assert s.num_waiting == 1


def test_max_num_seqs() -> None:
    s = make(max_seqs=2)
    for i in range(3):
        s.add(req(str(i), 2, first=10 * i))
    assert len(run_step(s)) == 2


def test_prefill_role_keeps_blocks_until_release() -> None:
    s = make()
    a = req("a", 6)
    s.add(a)
    run_step(s)
    s.finish(a, keep_blocks=True)
    assert a.status is RequestStatus.PREFILLED and len(a.block_ids) == 2
    assert s.pool.num_used == 2
    s.release(a)
    assert s.pool.num_used == 0
    s.pool.check_integrity()


def test_decode_role_reserve_then_start() -> None:
    s = make(num_blocks=4, max_seqs=2)
    a = req("a", 6)
    blocks = s.reserve(a)
    assert blocks is not None and len(blocks) == 2
    assert a.status is RequestStatus.WAITING_FOR_KV
    assert run_step(s) == []  # nothing runs until the KV is there
    a.token_ids.append(9)  # first token, sampled by the prefill worker
    s.start_decode(a)
    assert run_step(s) == [("a", 1)]
    assert s.reserve(req("b", 12, first=50)) is None  # 3 blocks do not fit: None, not an error
    s.pool.check_integrity()


def test_decode_role_prefills_a_reserved_suffix_itself() -> None:
    """``prefill_reserved``: a reservation that shared a prefix computes the rest of the
    prompt here, as one chunk of the next step, in the blocks already reserved."""
    s = make(num_blocks=6, max_seqs=4)
    a = req("a", 9)
    assert s.reserve(a) is not None
    a.token_ids.append(9)  # first token, sampled by the prefill worker
    s.start_decode(a)  # its full blocks [0..3], [4..7] join the prefix cache
    b = req("b", 11)  # shares those two; tokens 8..10 are left
    got = s.reserve(b)
    assert got is not None and b.num_cached_tokens == 8
    used = s.pool.num_used
    s.prefill_reserved(b)
    assert b.status is RequestStatus.RUNNING and b.num_computed_tokens == 8
    assert sorted(run_step(s)) == [("a", 1), ("b", 3)]  # the suffix beside a's decode
    assert s.pool.num_used == used and b.block_ids == got  # nothing more allocated
    assert run_step(s) == [("a", 1), ("b", 1)]  # b decodes from here
    s.finish(a)
    s.finish(b)
    assert s.pool.num_used == 0
    s.pool.check_integrity()


def test_decode_role_reserve_takes_its_hits_before_evicting() -> None:
    """A reservation whose fresh blocks must come from evicting cached ones never
    evicts its own hits: it takes references on them first, then evicts others, or,
    with nothing else to evict, gets no room and leaves the cache as it was."""
    s = make(num_blocks=4, max_seqs=4)
    a = req("a", 9)  # [0..3], [4..7] cached once it ends; [8] is not a full block
    z = req("z", 4, first=100)  # [100..103] cached
    for r in (a, z):
        assert s.reserve(r) is not None
        r.token_ids.append(9)
        s.start_decode(r)
        s.finish(r)
    assert s.pool.num_cached == 3 and s.pool.num_free == 4
    b = req("b", 16)  # a's two blocks, then two fresh: the one free block and z's
    got = s.reserve(b)
    assert got is not None and b.num_cached_tokens == 8
    assert s.pool.lookup(s._block_hashes(req("zz", 4, first=100), 1)) == []  # z's evicted
    s.finish(b)
    # b never got its KV, so only a's blocks are cached: c hits them and needs three
    # fresh ones, and the other two blocks are all there is besides its own hits
    c = req("c", 20)
    assert s.reserve(c) is None
    assert len(s.pool.lookup(s._block_hashes(c, 2))) == 2  # a's blocks stayed cached
    s.pool.check_integrity()


def test_decode_role_reserve_shares_the_blocks_it_holds() -> None:
    """A prompt that starts with blocks this decode pool holds (an earlier turn) shares
    them; only the rest is fresh, and the block of its last token always is."""
    s = make(num_blocks=6, max_seqs=4)
    a = req("a", 9)  # blocks [0..3], [4..7], [8]
    assert s.reserve(a) is not None
    s.start_decode(a)  # KV arrived: its full blocks join the prefix cache
    b = req("b", 12)  # [0..3] and [4..7] are a's; [8..11] is new
    got = s.reserve(b)
    assert got is not None and got[:2] == a.block_ids[:2] and got[2] not in a.block_ids
    assert b.num_cached_tokens == 8 and s.pool.prefix_hits == 2
    assert [s.pool.ref_count(x) for x in got] == [2, 2, 1]
    c = req("c", 8)  # both blocks are a's, but the last token's block is always fresh
    got_c = s.reserve(c)
    assert got_c is not None and got_c[0] == a.block_ids[0] and c.num_cached_tokens == 4
    assert s.reserve(req("d", 13, first=100)) is None  # 4 fresh blocks: no room; hits kept
    s.finish(b)
    s.finish(c)
    s.finish(a)
    assert s.pool.num_used == 0
    s.pool.check_integrity()
