"""``SimEngine``: one worker's engine on the virtual clock -- the real ``BlockPool``
and ``Scheduler`` (``engine/scheduler.py``), the model replaced by a step time.

It keeps what ``LLMEngine.step`` does around the forward pass: schedule, time the
step (``ScheduledBatch.step_info``, the shape the step-time models read), then
advance every scheduled request by its tokens and append a token to each one whose
computed tokens caught up (its chunk ended its prompt, or it was decoding). Output
tokens are placeholders and every request runs to its ``max_tokens``
(``ignore_eos``: a benchmark's lengths); a prefill engine parks a request after its
first token with its blocks kept, as the real one does.

Prompts carry their full blocks' hashes from the workload (``Request.block_hashes``
filled in advance), so the prefix cache sees exactly the sharing the workload has
without hashing token ids.

``decode_run(reqs, k)``: ``k`` steps at once while nothing but the clock changes -- every
request decoding, none waiting, none finishing before the last of them and no block
needed beyond the free ones within them -- the scheduler's own ``_grow`` and
``advance`` applied ``k`` tokens at a time, the requests the last step ends finished
as a single step finishes them (a test holds it equal to ``k`` single steps).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.engine.block_pool import BlockPool
from pdserve.engine.config import ceil_div
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.results import StepInfo
from pdserve.engine.sampling.sampling_params import SamplingParams
from pdserve.engine.scheduler import ScheduledBatch, Scheduler
from pdserve.sim.clock import EventLoop

TOKEN = 0  # every placeholder token's id


@functools.lru_cache(maxsize=4096)
def params_for(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True)


@functools.lru_cache(maxsize=1024)
def _prompt(n: int) -> list[int]:
    """A prompt of ``n`` placeholder tokens, one list for every request of that length
    (only read: a request's ``token_ids`` is its own copy)."""
    return [TOKEN] * n


@dataclass(frozen=True)
class EngineShape:
    """What the scheduler is given: a worker's KV cache and batch limits."""

    num_blocks: int
    block_size: int
    max_num_batched_tokens: int
    max_num_seqs: int
    enable_prefix_caching: bool = True


class SimEngine:
    def __init__(self, role: str, shape: EngineShape, loop: EventLoop) -> None:
        self.role = role
        self.shape = shape
        self.block_size = shape.block_size
        self.pool = BlockPool(shape.num_blocks, shape.enable_prefix_caching)
        self.scheduler = Scheduler(self.pool, shape.block_size, shape.max_num_batched_tokens,
                                   shape.max_num_seqs, clock=loop.clock)
        self._loop = loop

    def new_request(self, request_id: str, prompt_len: int, max_tokens: int,
                    block_hashes: list[int]) -> Request:
        req = Request(request_id, _prompt(prompt_len), params_for(max_tokens),
                      arrival_time=self._loop.now)
        req.block_hashes = list(block_hashes[: prompt_len // self.block_size])
        return req

    # -------------------------------------------------------- the roles' calls
    def add(self, req: Request) -> None:
        self.scheduler.add(req)

    def admit(self, req: Request) -> bool:
        """Colocated admission (``LLMEngine.admit``'s rule)."""
        if not self.scheduler.room_for(req.num_prompt_tokens):
            return False
        self.scheduler.add(req)
        return True

    def reserve(self, req: Request) -> list[int] | None:
        return self.scheduler.reserve(req)

    def prefill_reserved(self, req: Request) -> None:
        self.scheduler.prefill_reserved(req)

    def start_decode(self, req: Request) -> bool:
        """The KV landed; the first token (the prefill worker's) is appended. True when
        that token already ends the request."""
        self.scheduler.start_decode(req)
        return self._append(req)

    def release(self, req: Request) -> None:
        self.scheduler.release(req)

    # ------------------------------------------------------------- one step
    def schedule(self) -> tuple[ScheduledBatch, StepInfo] | None:
        batch = self.scheduler.schedule()
        if not batch:
            return None
        now = self._loop.now
        for req, _ in batch.work:
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
        return batch, batch.step_info()

    def complete(self, batch: ScheduledBatch) -> list[Request]:
        """The step ended: the requests that got a token (finished or parked ones
        included: see their ``status``)."""
        out = []
        for req, n in batch.work:
            if req.status is not RequestStatus.RUNNING:
                continue  # preempted in this step's scheduling
            self.scheduler.advance(req, n)
            if req.num_computed_tokens == req.num_tokens:
                self._append(req)
                out.append(req)
        return out

    def _append(self, req: Request) -> bool:
        req.token_ids.append(TOKEN)
        if req.first_token_time is None:
            req.first_token_time = self._loop.now
        if self.role == "prefill":
            self.scheduler.finish(req, keep_blocks=True)
            return True
        if req.num_output_tokens >= req.params.max_tokens:
            req.finish_reason = "length"
            self.scheduler.finish(req)
            return True
        return False

    # ------------------------------------------------------------ fast path
    def steady_steps(self) -> int:
        """How many decode-only steps, from now, would each schedule exactly the running
        batch and change nothing but its lengths (the last may finish requests): 0
        when the next step is not such a step. Bounded by the first request to finish
        and by the free blocks."""
        sch = self.scheduler
        if sch.waiting or not sch.running or self.role == "prefill":
            return 0
        if len(sch.running) > sch.budget:
            return 0
        k = -1
        for req in sch.running:
            n = req.num_tokens
            if req.num_computed_tokens + 1 != n or n <= req.num_prompt_tokens or req.spec_token_ids:
                return 0  # not decoding (a prompt's chunk, its last token too), or a draft
            left = req.params.max_tokens - req.num_output_tokens
            if k < 0 or left < k:
                k = left  # (the last of the k tokens finishes a request)
        while k > 0 and not self.fits(sch.running, k):
            k //= 2
        return max(0, k)

    def fits(self, reqs: Sequence[Request], k: int) -> bool:
        """Whether the blocks ``k`` more decode steps of ``reqs`` take are free (each
        request's ``k`` tokens reach into at most ``k // block_size + 1`` new blocks:
        where even that many are free, they are not counted)."""
        free = self.pool.num_free
        return (len(reqs) * (k // self.block_size + 1) <= free
                or self.blocks_needed(reqs, k) <= free)

    def blocks_needed(self, reqs: Sequence[Request], k: int) -> int:
        """Blocks ``k`` more decode steps of ``reqs`` allocate."""
        bs = self.block_size
        return sum(max(0, ceil_div(r.num_computed_tokens + k, bs) - len(r.block_ids))
                   for r in reqs)

    def decode_run(self, reqs: Sequence[Request], k: int) -> list[Request]:
        """``k`` steady steps of ``reqs`` (``steady_steps`` allowed them) at once: their
        ``k`` tokens each, then the scheduler's ``decode_steps``; the requests the last
        step finished (their ``max_tokens`` reached), taken out as ``_append`` does."""
        tail = [TOKEN] * k
        for req in reqs:
            req.token_ids.extend(tail)
        self.scheduler.decode_steps(reqs, k)
        done = [r for r in reqs if r.num_output_tokens >= r.params.max_tokens]
        for req in done:
            req.finish_reason = "length"
            self.scheduler.finish(req)
        return done
