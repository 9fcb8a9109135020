"""The waiting queue's order: priority (lower first), aging, FIFO within a priority.

No model: the runner's part is simulated by ``advance`` (as in test_scheduler.py), and
time is a fake clock so that aging is exact.
"""

from __future__ import annotations

from pdserve.engine.block_pool import BlockPool
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.sampling.sampling_params import AGING_S, SamplingParams, effective_priority
from pdserve.engine.scheduler import Scheduler


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make(clock: Clock, num_blocks: int = 64, max_seqs: int = 1) -> Scheduler:
    return Scheduler(BlockPool(num_blocks), block_size=4, max_num_batched_tokens=64,
                     max_num_seqs=max_seqs, clock=clock)


def req(clock: Clock, rid: str, priority: int = 0, n: int = 4, waited_s: float = 0.0) -> Request:
    first = 1000 * (sum(map(ord, rid)) % 50)  # distinct prompts: no prefix hits
    return Request(rid, list(range(first, first + n)),
                   SamplingParams(max_tokens=4, priority=priority),
                   arrival_time=clock.now - waited_s)


def admission_order(s: Scheduler) -> list[str]:
    """Admit one at a time (max_num_seqs 1), finishing each: the order they ran in."""
    order = []
    while s.waiting:
        batch = s.schedule()
        assert len(batch.work) == 1
        r = batch.work[0][0]
        order.append(r.request_id)
        s.finish(r)
    s.pool.check_integrity()
    return order


def test_effective_priority_ages_one_level_per_aging_s() -> None:
    assert effective_priority(5, 0.0) == 5
    assert effective_priority(5, AGING_S * 0.99) == 5
    assert effective_priority(5, AGING_S * 3.5) == 2
    assert effective_priority(0, -1.0) == 0  # a clock step back is no waiting


def test_lower_priority_value_runs_first_fifo_within_a_priority() -> None:
    clock = Clock()
    s = make(clock)
    for rid, prio in [("a", 0), ("b", 5), ("c", -1), ("d", 5), ("e", 0), ("f", -1)]:
        s.add(req(clock, rid, prio))
    # Plain FIFO (before priorities) would be a, b, c, d, e, f.
    assert admission_order(s) == ["c", "f", "a", "e", "b", "d"]


def test_default_priority_is_plain_fifo_whatever_the_arrival_times() -> None:
    clock = Clock()
    s = make(clock)
    # Queue order, not arrival time, decides within a priority (a preempted request
    # goes back to the front whatever its arrival).
    for rid, waited in [("a", 0.0), ("b", 10.0), ("c", 5.0)]:
        s.add(req(clock, rid, waited_s=waited))
    assert admission_order(s) == ["a", "b", "c"]


def test_aging_lets_a_low_priority_through() -> None:
    clock = Clock()
    s = make(clock)
    s.add(req(clock, "old", priority=3, waited_s=2.5 * AGING_S))  # effective 1
    s.add(req(clock, "new", priority=0))
    assert admission_order(s) == ["new", "old"]

    s.add(req(clock, "old", priority=3, waited_s=4 * AGING_S))  # effective -1
    s.add(req(clock, "new", priority=0))
    assert admission_order(s) == ["old", "new"]

    s.add(req(clock, "old", priority=3, waited_s=3 * AGING_S))  # effective 0: a tie
    s.add(req(clock, "new", priority=0))
    assert admission_order(s) == ["old", "new"]  # ties: nearer the front of the queue


def test_a_starving_request_is_served_within_a_bounded_wait() -> None:
    # A steady stream of fresh priority-0 requests, one admitted per step and one
    # arriving per step; the priority-10 request must get in once it aged enough.
    clock = Clock()
    s = make(clock)
    s.add(req(clock, "low", priority=10))
    s.add(req(clock, "h0", priority=0))
    ran_low_at = None
    for step in range(200):
        batch = s.schedule()
        (r, _), = batch.work
        s.finish(r)
        if r.request_id == "low":
            ran_low_at = clock.now
            break
        clock.now += 0.1 * AGING_S
        s.add(req(clock, f"h{step + 1}", priority=0))
    assert ran_low_at is not None
    assert ran_low_at - 1000.0 <= 11 * AGING_S


def test_aging_keeps_fifo_within_a_priority() -> None:
    clock = Clock()
    s = make(clock)
    s.add(req(clock, "x", priority=5, waited_s=10 * AGING_S))  # effective -5
    s.add(req(clock, "y", priority=5))  # effective 5: behind x, then behind z
    s.add(req(clock, "z", priority=0))
    assert admission_order(s) == ["x", "z", "y"]


def test_a_head_that_does_not_fit_is_not_bypassed() -> None:
    clock = Clock()
    s = make(clock, num_blocks=4, max_seqs=4)
    s.add(req(clock, "big", priority=5, n=12))  # 3 blocks
    s.add(req(clock, "hi", priority=0, n=8))  # 2 blocks
    s.add(req(clock, "small", priority=5, n=4))  # would fit next to "hi"
    assert [r.request_id for r, _ in s.schedule().work] == ["hi"]
    assert [r.request_id for r in s.waiting] == ["big", "small"]
    assert s.pool.num_used == 2  # big's attempt released what it took
    s.pool.check_integrity()


def test_preempted_request_goes_back_to_the_front_of_its_priority() -> None:
    clock = Clock()
    s = make(clock, num_blocks=4, max_seqs=4)
    a = req(clock, "a", priority=1, n=8)
    b = req(clock, "b", priority=1, n=8)
    s.add(a)
    s.add(b)
    for r, n in s.schedule().work:  # both prefill 2 blocks each; the pool is full
        s.advance(r, n)
        r.token_ids.append(7)
    s.add(req(clock, "later", priority=1))
    s.add(req(clock, "worse", priority=2))
    batch = s.schedule()  # a needs a 3rd block: b (admitted last) is preempted
    assert batch.preempted == [b] and b.status is RequestStatus.WAITING
    assert [r.request_id for r in s.waiting] == ["b", "later", "worse"]
    s.finish(a)
    s.max_num_seqs = 1
    assert admission_order(s) == ["b", "later", "worse"]
