"""The stream fan-out: every token worker's output stream feeds the inboxes of the
attempts it serves, in one hop.

``Fanout.deliver`` is the stream protocol's ``on_batch`` (called synchronously as a
frame is parsed; see ``output_stream``): per delta, one dict lookup and one
``Inbox.push`` -- a deque append, plus waking the attempt if it is waiting. No task,
no queue object and no future per token: the attempt's ``get`` makes a future only
when its inbox is empty.

An attempt's inbox also receives, from elsewhere, the other events that end or
advance it (``attempt.Event``): the prefill worker's answers, a worker's failure
(``fail_worker``: every attempt on it gets a ``WorkerFailed``) and its deadline.
"""

from __future__ import annotations

import asyncio
from collections import deque

from pdserve.failures import FailReason
from pdserve.messages import RequestDelta
from pdserve.router.attempt import Event, MoveRequested, WorkerFailed


class Inbox:
    """One attempt's events, in arrival order; read by one coroutine."""

    __slots__ = ("_items", "_waiter", "workers")

    def __init__(self, workers: tuple[str, ...]) -> None:
        self._items: deque[Event] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self.workers = workers  # the workers whose failure ends this attempt

    def push(self, item: Event) -> None:
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def get(self) -> Event:
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._items.popleft()


class Fanout:
    def __init__(self) -> None:
        self._inboxes: dict[str, Inbox] = {}  # attempt id -> inbox

    def open(self, attempt_id: str, workers: tuple[str, ...]) -> Inbox:
        inbox = self._inboxes[attempt_id] = Inbox(workers)
        return inbox

    def attach(self, attempt_id: str, worker_id: str) -> None:
        """``worker_id``'s failure now ends the attempt too (its prefill worker)."""
        inbox = self._inboxes[attempt_id]
        inbox.workers = (*inbox.workers, worker_id)

    def detach(self, attempt_id: str, worker_id: str) -> None:
        """The attempt no longer needs ``worker_id`` (its prefill is done: the KV is on
        the decode worker), so that worker leaving does not end it."""
        inbox = self._inboxes.get(attempt_id)
        if inbox is not None:
            inbox.workers = tuple(w for w in inbox.workers if w != worker_id)

    def close(self, attempt_id: str) -> None:
        self._inboxes.pop(attempt_id, None)

    def deliver(self, batch: list[RequestDelta]) -> None:
        inboxes = self._inboxes
        for delta in batch:
            inbox = inboxes.get(delta.request_id)
            if inbox is not None:  # else: late tokens of an attempt already given up
                inbox.push(delta)

    def fail_worker(self, worker_id: str, reason: FailReason, message: str) -> None:
        failure = WorkerFailed(reason, message)
        for inbox in self._inboxes.values():
            if worker_id in inbox.workers:
                inbox.push(failure)

    def request_moves(self, worker_id: str, reason: str, limit: int | None = None) -> int:
        """Ask the attempts whose tokens come from ``worker_id`` (every one, or the
        ``limit`` oldest) to move elsewhere (``MoveRequested``; each moves once it
        can). Returns how many were asked."""
        event = MoveRequested(reason)
        asked = 0
        for inbox in self._inboxes.values():  # (in the order they were opened)
            if limit is not None and asked >= limit:
                break
            if inbox.workers[:1] == (worker_id,):
                inbox.push(event)
                asked += 1
        return asked

    def workers_of(self, request_id: str) -> set[str]:
        """The workers serving the attempts of a client request now."""
        prefix = f"{request_id}#"
        return {w for aid, inbox in self._inboxes.items() if aid.startswith(prefix)
                for w in inbox.workers}

    def __len__(self) -> int:
        return len(self._inboxes)
