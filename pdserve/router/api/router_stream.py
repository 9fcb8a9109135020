"""The rules for ending a router stream, and driving one from a task of its own.

Closing rule: whatever ends a request early (client gone, deadline, server
stopping) must end the router's async generator, because its cleanup is what
aborts the request on the prefill and decode workers. ``close_stream`` does that
for a generator suspended at a ``yield``; ``RouterStream`` runs the generator in a
task of its own so that the cleanup also survives callers whose cancellation is
re-delivered at every ``await`` (anyio cancel scopes, i.e. Starlette/uvicorn).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from pdserve.router.api.common import RouterLike
from pdserve.router.types import ErrorKind, FinalChunk, GenerateRequest, RouterError, StreamChunk

logger = logging.getLogger(__name__)

Item = StreamChunk | FinalChunk | RouterError  # what a RouterStream delivers


async def close_stream(stream: AsyncIterator[Any], request_id: str) -> None:
    """End a router stream that is suspended at a ``yield`` (or already finished)."""
    # aclose() on a finished generator is a no-op; on a suspended one it raises
    # GeneratorExit inside the router, whose cleanup aborts the request on the workers.
    aclose = getattr(stream, "aclose", None)
    if aclose is None:
        return
    try:
        await aclose()
    except Exception:
        logger.exception("closing the router stream of request %s failed", request_id)


class RouterStream:
    """``router.generate(req)`` driven by a task of its own, each item handed to
    ``deliver`` as it comes (the caller's queue: the one hop between the router and
    the response). The last item delivered is the ``FinalChunk`` or a ``RouterError``
    (unexpected exceptions from the router become ``INTERNAL``; a stream that ends
    without its final chunk too), and nothing after it.

    ``close()`` cancels the task: the router sees one ``CancelledError`` at its
    current ``await`` and its cleanup (the aborts on both workers) runs to the end in
    that task, whatever happens to the caller.
    """

    def __init__(self, router: RouterLike, req: GenerateRequest,
                 tasks: set[asyncio.Task[None]], deliver: Callable[[Item], None]):
        self.request_id = req.request_id
        self._deliver = deliver
        self._ended = False  # the last item is delivered
        self._task = asyncio.create_task(self._pump(router.generate(req)),
                                         name=f"router-stream-{req.request_id}")
        # The loop keeps only weak references to tasks: the owner's set holds this
        # one until it has finished its cleanup.
        tasks.add(self._task)
        self._task.add_done_callback(tasks.discard)

    def _put(self, item: Item) -> None:
        if not self._ended:
            self._ended = not isinstance(item, StreamChunk)
            self._deliver(item)

    async def _pump(self, stream: AsyncIterator[StreamChunk | FinalChunk]) -> None:
        try:
            async for item in stream:
                self._put(item)
            self._put(RouterError(ErrorKind.INTERNAL, "stream ended without a final chunk"))
        except RouterError as exc:
            self._put(exc)
        except Exception:
            logger.exception("router failed on request %s", self.request_id)
            self._put(RouterError(ErrorKind.INTERNAL, "internal error"))
        finally:
            await close_stream(stream, self.request_id)

    def close(self, error: RouterError | None = None) -> None:
        """Abort the request unless the router already finished it (idempotent).
        ``error``: delivered in place of the items that will not come."""
        if not self._task.done():
            self._task.cancel()
            if error is not None:
                self._put(error)
