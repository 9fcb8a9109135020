"""What the router calls on a worker: one protocol per worker kind.

The worker classes themselves (``PrefillWorker``, ``DecodeWorker``,
``ColocatedWorker``) implement these with async methods, so the in-process "client"
is the worker object; ``pdserve/cluster/actors.py`` wraps the same classes as Ray actors and
hands the router ``RayWorker`` proxies with the same methods. That is the one
forwarding layer: router -> (Ray) -> worker -> its engine loop.

Errors a call may raise (``pdserve.failures``): ``AttemptFailed`` -- this request's
attempt failed, the worker is fine; ``WorkerGone`` -- the worker is not running;
``ValueError`` -- the request can never be served (the client's fault). Anything
else is a transport problem the health probes judge. ``abort`` never raises and
never waits for a worker that does not answer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from pdserve.engine.sampling.sampling_params import SamplingParams
from pdserve.messages import (
    NO_LOCAL_PREFILL,
    FirstToken,
    JoinInfo,
    LocalPrefill,
    PrefillResult,
    PrefillTask,
    Reservation,
    WorkerLoad,
)
from pdserve.tracing import Carrier


class WorkerHandle(Protocol):
    @property
    def worker_id(self) -> str: ...
    @property
    def role(self) -> str: ...  # "prefill" | "decode" | "colocated"

    async def load(self) -> WorkerLoad: ...
    async def join_info(self) -> JoinInfo: ...
    async def abort(self, request_id: str) -> None: ...


class PrefillHandle(WorkerHandle, Protocol):
    async def connect(self, decode_worker: str, endpoint: dict[str, Any]) -> None: ...
    async def prefill(self, task: PrefillTask) -> FirstToken: ...
    async def handoff(self, request_id: str) -> PrefillResult: ...


class DecodeHandle(WorkerHandle, Protocol):
    async def reserve(self, request_id: str, prompt_token_ids: Sequence[int],
                      params: SamplingParams, local: LocalPrefill = NO_LOCAL_PREFILL,
                      router_id: str = "", trace: Carrier | None = None,
                      ) -> Reservation | None: ...
    # moving a running request to another decode worker (worker/moves.py)
    async def move_connect(self, worker_id: str, endpoint: dict[str, Any]) -> None: ...
    async def reserve_moved(self, request_id: str, token_ids: Sequence[int],
                            params: SamplingParams, head_blocks: int, spare_blocks: int,
                            router_id: str = "", trace: Carrier | None = None,
                            ) -> Reservation | None: ...
    async def move_blocks(self, request_id: str, send_id: str, worker_id: str,
                          first_block: int, dst_blocks: Sequence[int]) -> int: ...
    async def move_stop(self, request_id: str, send_id: str, worker_id: str,
                        first_block: int, dst_blocks: Sequence[int],
                        known_tokens: int) -> tuple[int, int]: ...


class ColocatedHandle(WorkerHandle, Protocol):
    async def admit(self, request_id: str, prompt_token_ids: Sequence[int],
                    params: SamplingParams, router_id: str = "",
                    trace: Carrier | None = None) -> bool: ...
