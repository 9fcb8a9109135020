"""How the router talks to workers: two async client protocols, with an
in-process implementation (plain worker objects; unit tests, ``generate
--disaggregated`` without Ray) and a Ray one (actor handles from ``deploy/``).

Any exception from a client call means the worker is unusable for that request
(dead actor, crashed loop, transfer failure); the router retries elsewhere.
``ValueError`` is the exception: it is the request's fault.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any, Protocol

from pdserve.engine.sampling_params import SamplingParams
from pdserve.messages import DecodeOutput, PrefillResult, PrefillTask, WorkerStats


class PrefillClient(Protocol):
    worker_id: str

    async def prefill(self, task: PrefillTask) -> PrefillResult: ...
    async def abort(self, request_id: str) -> None: ...
    async def stats(self) -> WorkerStats: ...


class DecodeClient(Protocol):
    worker_id: str

    async def reserve(self, request_id: str, prompt_token_ids: Sequence[int],
                      params: SamplingParams) -> list[int] | None: ...
    async def abort(self, request_id: str) -> None: ...
    async def poll_outputs(self, timeout_s: float) -> list[DecodeOutput]: ...
    async def stats(self) -> WorkerStats: ...


class LocalPrefillClient:
    """Wraps a ``PrefillWorker`` living in this process."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker
        self.worker_id: str = worker.worker_id

    async def prefill(self, task: PrefillTask) -> PrefillResult:
        return await asyncio.wrap_future(self.worker.submit(task))

    async def abort(self, request_id: str) -> None:
        self.worker.abort(request_id)

    async def stats(self) -> WorkerStats:
        return await asyncio.wrap_future(self.worker.stats())


class LocalDecodeClient:
    """Wraps a ``DecodeWorker`` living in this process."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker
        self.worker_id: str = worker.worker_id

    async def reserve(self, request_id: str, prompt_token_ids: Sequence[int],
                      params: SamplingParams) -> list[int] | None:
        return await asyncio.wrap_future(self.worker.reserve(request_id, prompt_token_ids, params))

    async def abort(self, request_id: str) -> None:
        self.worker.abort(request_id)

    async def poll_outputs(self, timeout_s: float) -> list[DecodeOutput]:
        return await asyncio.to_thread(self.worker.poll_outputs, timeout_s)

    async def stats(self) -> WorkerStats:
        return await asyncio.wrap_future(self.worker.stats())


class RayPrefillClient:
    """Wraps a prefill worker actor handle (see ``deploy/actors.py``)."""

    def __init__(self, worker_id: str, handle: Any) -> None:
        self.worker_id = worker_id
        self.handle = handle

    async def prefill(self, task: PrefillTask) -> PrefillResult:
        return await self.handle.prefill.remote(task)

    async def abort(self, request_id: str) -> None:
        self.handle.abort.remote(request_id)

    async def stats(self) -> WorkerStats:
        return await self.handle.stats.remote()


class RayDecodeClient:
    """Wraps a decode worker actor handle (see ``deploy/actors.py``)."""

    def __init__(self, worker_id: str, handle: Any) -> None:
        self.worker_id = worker_id
        self.handle = handle

    async def reserve(self, request_id: str, prompt_token_ids: Sequence[int],
                      params: SamplingParams) -> list[int] | None:
        try:
            return await self.handle.reserve.remote(request_id, list(prompt_token_ids), params)
        except Exception as exc:
            # A ValueError raised in the actor arrives wrapped with the remote
            # traceback; the client gets the plain message.
            cause = getattr(exc, "cause", None)
            if isinstance(cause, ValueError):
                raise ValueError(str(cause)) from None
            raise

    async def abort(self, request_id: str) -> None:
        self.handle.abort.remote(request_id)

    async def poll_outputs(self, timeout_s: float) -> list[DecodeOutput]:
        return await self.handle.poll_outputs.remote(timeout_s)

    async def stats(self) -> WorkerStats:
        return await self.handle.stats.remote()
