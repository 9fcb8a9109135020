"""``Flight``: one simulated request, as its client and the router see it."""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pdserve.engine.sampling.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pdserve.engine.request import Request
    from pdserve.router.placing import Target
    from pdserve.router.types import StageTimings
    from pdserve.sim.clock import Event
    from pdserve.sim.workers import SimWorker


@dataclass(eq=False)
class Flight:
    request_id: str
    index: int  # in the workload
    prompt_len: int
    output_len: int
    hashes: list[int]  # the prompt's full blocks
    params: SamplingParams
    due: float  # the workload's send time
    sent: float = 0.0  # sent (after waiting for a --max-concurrency slot)
    keep_itl: bool = True
    # router
    admit_start: float = 0.0
    queue_s: float = 0.0  # in the router's waiting queue
    timeout: Event | None = None
    target: Target | None = None
    placement: str = ""
    token_worker: SimWorker | None = None
    token_req: Request | None = None
    prefill_worker: SimWorker | None = None
    prefill_req: Request | None = None
    reused: int = 0  # blocks the decode worker held already
    local_pending: int = 0
    sent_to_prefill: float = 0.0  # the prefill worker got it
    received: float = 0.0  # the token worker's loop took it (between two of its steps)
    prefill_done: float | None = None  # its first token sampled there
    landed: float | None = None  # its KV in the decode worker's blocks
    timings: StageTimings | None = None  # once finished
    # client
    first_s: float | None = None
    last_s: float = 0.0
    num_tokens: int = 0
    itl: array = field(default_factory=lambda: array("d"))
    end: float | None = None
    error: str = ""

    def first(self, t: float) -> None:
        self.first_s = self.last_s = t
        self.num_tokens = 1

    def token(self, t: float) -> None:
        if self.keep_itl:
            self.itl.append(t - self.last_s)
        self.last_s = t
        self.num_tokens += 1

    def tokens(self, times: Sequence[float], delay: float) -> None:
        """One token at each of ``times`` (a run's steps), seen ``delay`` later."""
        if self.keep_itl:
            last = self.last_s
            for t in times:
                self.itl.append(t + delay - last)
                last = t + delay
        self.last_s = times[-1] + delay
        self.num_tokens += len(times)

    def done(self, t: float) -> None:
        self.end = max(t, self.last_s)

    def fail(self, t: float, error: str) -> None:
        self.end, self.error = t, error
