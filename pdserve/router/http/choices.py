"""The router streams of one HTTP request's choices (``n`` per prompt, prompt-major)
read as one (``Choices``), and the two ways a response is made of them: chunk objects
in arrival order (``chunks``, streamed) or one whole response (``collect_whole``)."""

from __future__ import annotations

import asyncio
import functools
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

from pdserve.router.api.common import RouterLike
from pdserve.router.api.router_stream import Item, RouterStream
from pdserve.router.openai.response_builder import ResponseBuilder
from pdserve.router.types import FinalChunk, GenerateRequest, RouterError, StreamChunk


async def chunks(choices: Choices, out: ResponseBuilder) -> AsyncIterator[dict[str, Any]]:
    """The stream's chunk objects, in arrival order; RouterError if a choice failed."""
    while (got := await choices.next()) is not None:
        i, item = got
        for obj in (out.chunk(item, i) if isinstance(item, StreamChunk)
                    else out.final_chunks(item, i)):
            yield obj


async def collect_whole(choices: Choices, out: ResponseBuilder) -> dict[str, Any]:
    finals: dict[int, FinalChunk] = {}
    while (got := await choices.next()) is not None:
        i, item = got
        if isinstance(item, StreamChunk):
            out.add(item, i)
        else:
            finals[i] = item
    return out.response([finals[i] for i in range(len(finals))])


class Choices:
    """The router streams of one request's choices (``n`` per prompt, prompt-major)
    read as one: ``start`` waits for each choice's first item (so that admission
    errors keep their status), ``next`` gives (choice index, item) in arrival order
    and None once every choice has finished. A choice's error is raised for the whole
    request; ``close`` then ends the others.

    Each prompt's first choice starts at once, its others when it has its first
    token: by then its prompt is in the prefill worker's prefix cache (and a
    colocated worker's), so the prefix-affinity policy sends the others where their
    prompt is computed already and each computes only its last, partial block. One
    prefill per prompt, n decodes."""

    def __init__(self, router: RouterLike, reqs: list[GenerateRequest], n: int,
                 tasks: set[asyncio.Task[None]], request_id: str):
        self.request_id = request_id
        self._router, self._reqs, self._n, self._tasks = router, reqs, n, tasks
        self._calls: list[RouterStream] = []
        # Every choice's RouterStream delivers here, tagged with the choice's index.
        self._queue: asyncio.Queue[tuple[int, Item]] = asyncio.Queue()
        self._ready: deque[tuple[int, StreamChunk | FinalChunk]] = deque()  # read by start
        self._finished = 0
        self._closed = False
        self._waiting = set(range(0, len(reqs), n))  # first choices, their others not started
        for index in sorted(self._waiting):
            self._launch(index)

    def _launch(self, index: int) -> None:
        self._calls.append(RouterStream(self._router, self._reqs[index], self._tasks,
                                        functools.partial(self._deliver, index)))

    def _deliver(self, index: int, item: Item) -> None:
        self._queue.put_nowait((index, item))

    async def _take(self) -> tuple[int, StreamChunk | FinalChunk]:
        index, item = await self._queue.get()
        if isinstance(item, RouterError):
            if item.param == "prompt" and len(self._reqs) > self._n:  # which of the batch
                raise RouterError(item.kind, f"prompt[{index // self._n}]: {item.message}",
                                  item.retry_after_s, item.param)
            raise item
        self._finished += isinstance(item, FinalChunk)
        if index in self._waiting and not self._closed:  # its prompt is prefilled: the rest
            self._waiting.discard(index)
            for i in range(index + 1, index + self._n):
                self._launch(i)
        return index, item

    async def start(self) -> None:
        """Wait until every choice has sent its first item; RouterError if one failed."""
        waiting = set(range(len(self._reqs)))
        while waiting:
            got = await self._take()
            self._ready.append(got)
            waiting.discard(got[0])

    async def next(self) -> tuple[int, StreamChunk | FinalChunk] | None:
        if self._ready:
            return self._ready.popleft()
        if self._finished == len(self._reqs):
            return None
        return await self._take()

    def close(self, error: RouterError | None = None) -> None:
        """Abort every choice the router has not finished, and start no more
        (idempotent). ``error``: what a reader waiting in ``next`` gets instead."""
        self._closed = True
        for call in self._calls:
            call.close(error)
