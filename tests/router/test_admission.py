"""Admission's waiting queue without Ray or an engine: one scripted colocated worker
whose room the test sets, a fake ``WorkerSet``. Priority order (lower first), FIFO
within a priority, aging, the bounded wait (OVERLOADED after ``queue_timeout_s``),
and no queueing at all while nobody waits."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from typing import Any, TypeVar

import pytest

from pdserve.engine.sampling.sampling_params import AGING_S, SamplingParams, effective_priority
from pdserve.router import admission as admission_module
from pdserve.router.admission import Admission
from pdserve.router.policies import PrefixIndex, least_loaded
from pdserve.router.types import ErrorKind, RouterError
from pdserve.router.workers import WorkerState
from tests.waiting import until_async

T = TypeVar("T")


class ScriptedWorker:
    """A colocated worker's handle: ``admit`` succeeds while ``room`` > 0."""

    worker_id = "c0"
    role = "colocated"

    def __init__(self, room: int = 0) -> None:
        self.room = room
        self.admitted: list[str] = []
        self.calls = 0  # admit calls made
        self.in_flight = 0
        self.hold: asyncio.Event | None = None  # set: every admit call waits for it

    async def admit(self, attempt_id: str, ids: list[int], params: SamplingParams,
                    router_id: str = "", trace: Any = None) -> bool:
        self.calls += 1
        self.in_flight += 1
        try:
            if self.hold is not None:
                await self.hold.wait()
            if self.room <= 0:
                return False
            self.room -= 1
            self.admitted.append(attempt_id)
            return True
        finally:
            self.in_flight -= 1

    async def abort(self, attempt_id: str) -> None:
        pass


class FakeWorkers:
    """The part of ``WorkerSet`` that admission uses, with one live colocated worker."""

    router_id = "r1"

    def __init__(self, handle: ScriptedWorker) -> None:
        self.state = WorkerState(handle, handle.worker_id, handle.role, alive=True)

    def live(self, *roles: str) -> list[WorkerState]:
        return [self.state] if self.state.role in roles else []

    def prefill_for(self, decode_id: str) -> list[WorkerState]:
        return []

    def ready(self) -> bool:
        return True

    async def call(self, w: WorkerState, coro: Coroutine[Any, Any, T]) -> T:
        return await coro

    def gone(self, worker_id: str, why: str) -> None:
        raise AssertionError(f"unexpected: {worker_id} gone: {why}")

    def attempt_ended(self) -> None:
        pass


def make(worker: ScriptedWorker, queue_timeout_s: float = 30.0) -> Admission:
    return Admission(FakeWorkers(worker), least_loaded, PrefixIndex(),  # type: ignore[arg-type]
                     max_waiting=64, queue_timeout_s=queue_timeout_s, block_size=4)


def admit(adm: Admission, rid: str, priority: int = 0) -> asyncio.Task[Any]:
    loop = asyncio.get_running_loop()
    return asyncio.create_task(adm.admit(rid, [1, 2, 3], SamplingParams(priority=priority),
                                         [], deadline=loop.time() + 60), name=rid)


async def settle(until: Any, timeout_s: float = 5.0) -> None:
    await until_async("admission to settle", until, timeout_s)


async def queue_up(adm: Admission, worker: ScriptedWorker,
                   requests: list[tuple[str, int]]) -> list[asyncio.Task[Any]]:
    """Start the requests one after another, each waiting (no room) before the next."""
    tasks = []
    for rid, priority in requests:
        tasks.append(admit(adm, rid, priority))
        n = len(adm._queue) + 1
        await settle(lambda n=n: len(adm._queue) == n)
    return tasks


async def release(adm: Admission, worker: ScriptedWorker, room: int) -> None:
    """Make room for ``room`` more requests, wake admission, wait until they got in and
    left admission (the worker refuses anything past its room, so no more can)."""
    target = len(worker.admitted) + room
    waiting = adm.num_waiting - room
    worker.room += room
    adm.wake()
    await settle(lambda: len(worker.admitted) >= target and adm.num_waiting == waiting)


def test_effective_priority() -> None:
    assert effective_priority(3, 0.0) == 3
    assert effective_priority(3, 2.5 * AGING_S) == 1
    assert effective_priority(3, 0.5, aging_s=0.1) == -2


def test_waiters_are_served_by_priority_then_fifo() -> None:
    async def main() -> None:
        worker = ScriptedWorker(room=0)
        adm = make(worker)
        order = [("a", 0), ("b", 5), ("c", -1), ("d", 0), ("e", 5)]
        tasks = await queue_up(adm, worker, order)
        # Room for 4 appears at once: they go in turn, the lowest priority last.
        await release(adm, worker, 4)
        assert worker.admitted == ["c", "a", "d", "b"]
        assert not tasks[-1].done() and adm.num_waiting == 1
        await release(adm, worker, 1)
        assert worker.admitted[-1] == "e"
        await asyncio.gather(*tasks)
        assert adm.num_waiting == 0 and adm._queue == []

    asyncio.run(main())


def test_a_new_request_does_not_jump_the_queue() -> None:
    async def main() -> None:
        worker = ScriptedWorker(room=0)
        adm = make(worker)
        (a,) = await queue_up(adm, worker, [("a", 0)])
        worker.room = 1  # room appears, no wake yet: "a" has not retried
        b = admit(adm, "b", 0)  # same priority, later: queues behind "a"
        await settle(lambda: len(adm._queue) == 2)
        assert worker.admitted == [] and worker.calls == 1  # "b" did not even try
        adm.wake()
        await a
        assert worker.admitted == ["a"] and not b.done()
        calls = worker.calls
        urgent = admit(adm, "urgent", -1)  # ranks ahead of "b": tries at once
        await settle(lambda: worker.calls > calls and len(adm._queue) == 2)
        worker.room = 1
        adm.wake()
        await urgent
        worker.room = 1
        adm.wake()
        await b
        assert worker.admitted == ["a", "urgent", "b"]

    asyncio.run(main())


def test_aging_lets_a_low_priority_waiter_through(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [time.monotonic()]

    class FakeTime:
        @staticmethod
        def monotonic() -> float:
            return clock[0]

    monkeypatch.setattr(admission_module, "time", FakeTime)

    async def main() -> None:
        worker = ScriptedWorker(room=0)
        adm = make(worker)
        low, high = await queue_up(adm, worker, [("low", 3), ("high", 0)])
        clock[0] += 2.5 * AGING_S  # low: effective 1, high: -2
        await release(adm, worker, 1)
        assert worker.admitted == ["high"]
        fresh = (await queue_up(adm, worker, [("fresh", 0)]))[0]
        clock[0] += 2 * AGING_S  # low waited 4.5 levels: effective -1; fresh: -2
        await release(adm, worker, 1)
        assert worker.admitted == ["high", "fresh"]
        late = (await queue_up(adm, worker, [("late", 0)]))[0]
        clock[0] += 0.5 * AGING_S  # low: effective -2; late: 0
        await release(adm, worker, 1)
        assert worker.admitted == ["high", "fresh", "low"]
        await release(adm, worker, 1)
        await asyncio.gather(low, high, fresh, late)

    asyncio.run(main())


def test_the_wait_is_still_bounded() -> None:
    async def main() -> None:
        worker = ScriptedWorker(room=0)
        adm = make(worker, queue_timeout_s=0.2)
        first = admit(adm, "first", 0)
        second = admit(adm, "second", 5)
        for t in (first, second):
            with pytest.raises(RouterError) as info:
                await t
            assert info.value.kind is ErrorKind.OVERLOADED
        assert adm.num_waiting == 0 and adm._queue == []

    asyncio.run(main())


def test_a_head_that_leaves_hands_the_turn_on() -> None:
    async def main() -> None:
        worker = ScriptedWorker(room=0)
        adm = make(worker, queue_timeout_s=30)
        head, nxt = await queue_up(adm, worker, [("head", 0), ("next", 0)])
        worker.room = 1  # no wake: only the head's leaving tells "next"
        head.cancel()
        await nxt
        assert worker.admitted == ["next"]
        assert adm.num_waiting == 0 and adm._queue == []

    asyncio.run(main())


def test_without_a_queue_admissions_run_concurrently() -> None:
    async def main() -> None:
        worker = ScriptedWorker(room=3)
        worker.hold = asyncio.Event()
        adm = make(worker)
        tasks = [admit(adm, f"r{i}", i) for i in range(3)]
        await settle(lambda: worker.in_flight == 3)  # all three calls at once
        worker.hold.set()
        await asyncio.gather(*tasks)
        assert sorted(worker.admitted) == ["r0", "r1", "r2"] and adm._queue == []

    asyncio.run(main())
