"""Simulated workers: one ``SimEngine`` stepping on the virtual clock, in the three
roles of ``pdserve/worker/`` (prefill, decode, colocated).

A worker steps back to back while its scheduler has work; a step takes the step
model's time for its shape (``StepTimes.step_ms``) plus the worker loop's own
overhead per step. When the next steps can only decode the same batch
(``SimEngine.steady_steps``), they are taken as one *run* with one event at its end.
Anything that changes the engine from outside -- a request added, blocks reserved,
KV landed, the router reading its load -- first calls ``sync``: the steps of the run
that ended by now are applied, and the one in flight becomes an ordinary step, so
the outcome is the one single steps would have had.

A prefill worker sends the blocks each step completed as the step ends (its channel
is a queue, ``link.Pipe``), and the rest with the first token once the request is
parked: the hand-over ends when that send lands (``worker/prefill.py``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.results import StepInfo
from pdserve.engine.scheduler import ScheduledBatch
from pdserve.planner.step_times import StepTimes
from pdserve.sim.clock import Event, EventLoop
from pdserve.sim.engine import SimEngine
from pdserve.sim.link import Pipe


@dataclass(frozen=True)
class StepScale:
    """Served steps over the step model's: prompt tokens' and decoding rows' (where
    the router and the client share the workers' cores, a decode step -- streaming
    tokens all the while -- slows more than a long prompt's). A step's scale is the
    two weighted by its prompt tokens and its decoding rows."""

    prefill: float = 1.0
    decode: float = 1.0

    def of(self, info: StepInfo) -> float:
        prompt = info.num_tokens - info.num_decode
        if not prompt:
            return self.decode
        return (prompt * self.prefill + info.num_decode * self.decode) / info.num_tokens

    @classmethod
    def parse(cls, text: str) -> StepScale:
        """``X`` (both) or ``prefill=X,decode=Y`` (either)."""
        try:
            if "=" not in text:
                scale = cls(float(text), float(text))
            else:
                given = {k.strip(): float(v) for k, v in
                         (part.split("=", 1) for part in text.split(","))}
                if set(given) - {"prefill", "decode"}:
                    raise ValueError(text)
                scale = cls(given.get("prefill", 1.0), given.get("decode", 1.0))
        except ValueError:
            raise ValueError(f"--step-time-scale: expected X or prefill=X,decode=Y; "
                             f"got {text!r}") from None
        if not (scale.prefill > 0 and scale.decode > 0):
            raise ValueError(f"--step-time-scale must be > 0, got {text!r}")
        return scale


class Listener(Protocol):
    def on_tokens(self, worker: SimWorker, reqs: list[Request]) -> None:
        """These requests got a token at this step's end (see their ``status``)."""

    def on_run(self, worker: SimWorker, reqs: Sequence[Request], times: Sequence[float]) -> None:
        """Each of ``reqs`` got one token at each of ``times`` (a run's steps); the last
        step may have finished some (see their ``status``)."""


@dataclass
class _Run:
    """Steady decode steps of ``reqs`` taken as one: step ``j`` (from 1) ends at
    ``end_of(j)`` (each step's context is ``len(reqs)`` tokens longer)."""

    reqs: list[Request]
    start: float
    steps: int
    first_s: float  # the run's first step
    slope_s: float  # what each later step adds (its context grows)
    event: Event | None = None
    grown: bool = False  # the step in flight's blocks are taken (``sync``)

    def ended_by(self, t: float) -> int:
        """Steps of the run complete at time ``t``."""
        elapsed, a, b = t - self.start, self.first_s, self.slope_s
        if b <= 1e-15:
            j = int(elapsed / a + 1e-9)
        else:  # j·a + b·j(j-1)/2 <= elapsed
            j = int((-(a - b / 2) + math.sqrt((a - b / 2) ** 2 + 2 * b * elapsed)) / b + 1e-9)
        while j > 0 and self.end_of(j) > t + 1e-12:
            j -= 1
        return min(j, self.steps)

    def end_of(self, j: int) -> float:
        return self.start + j * self.first_s + self.slope_s * j * (j - 1) / 2


class SimWorker:
    def __init__(self, loop: EventLoop, worker_id: str, engine: SimEngine, steps: StepTimes,
                 listener: Listener, step_overhead_s: float = 0.0, pipe: Pipe | None = None,
                 fast: bool = True, step_scale: StepScale | None = None) -> None:
        self.loop, self.worker_id, self.engine = loop, worker_id, engine
        self.role = engine.role
        self.steps, self.listener = steps, listener
        self.step_overhead_s = step_overhead_s
        self.step_scale = step_scale or StepScale()  # served steps over the model's
        self.pipe = pipe  # prefill role: its outgoing KV channel
        self.fast = fast
        self._step: ScheduledBatch | None = None
        self._run: _Run | None = None
        self.sent: dict[str, int] = {}  # prefill: blocks of a request sent so far
        self.num_steps = 0
        self.busy_s = 0.0  # stepping, summed
        self._started = self._step_end = 0.0  # the single step in flight's start and end
        self._ending = False  # a step's end is being reported (kick: its end schedules)

    # ------------------------------------------------------------- stepping
    def kick(self) -> None:
        """Something was added: start stepping if idle (a step in flight sees it at its
        end, as the real loop does; so does the step that is ending, whose listener
        may add work to this worker before it schedules the next)."""
        if self._step is None and self._run is None and not self._ending:
            self._next()

    def sync(self, batch_changes: bool = True) -> None:
        """Before anything changes the engine: a run's steps that ended by now are
        applied (the pool is as single steps would have left it), and, when the change
        joins the batch (``batch_changes``: a request to compute, KV landed), the run
        ends with the step in flight. A reservation only takes blocks: then call
        ``check_room`` after it."""
        run = self._run
        if run is None:
            return
        done = min(run.ended_by(self.loop.now), run.steps - 1)  # one is in flight
        if done:
            self._apply(run, done)
            start = run.end_of(done)  # the rest of the run, from there
            run.first_s += run.slope_s * done
            run.start, run.steps = start, run.steps - done
            run.grown = False
        if not run.grown:  # the step in flight took its blocks when it started
            self.engine.scheduler.grow_for_decode(run.reqs)
            run.grown = True
        if batch_changes and run.steps > 1:
            self._end_run_at(run, 1)

    def check_room(self) -> None:
        """After blocks were taken during a run: the rest of the run must still find its
        blocks free, else it ends with the step in flight (the next steps, scheduled
        one by one, preempt as the scheduler does)."""
        run = self._run
        if run is not None and run.steps > 1 and not self.engine.fits(run.reqs, run.steps):
            self._end_run_at(run, 1)

    def _end_run_at(self, run: _Run, steps: int) -> None:
        assert run.event is not None
        run.event.cancel()
        run.steps = steps
        run.event = self.loop.at(max(run.end_of(steps), self.loop.now), self._run_done)

    def step_end(self) -> float:
        """When the step in flight ends (now, when idle): when the worker's loop next
        takes a call (a call waits for the step to end)."""
        if self._run is not None:
            return self._run.end_of(min(self._run.ended_by(self.loop.now) + 1, self._run.steps))
        return self._step_end if self._step is not None else self.loop.now

    def free_blocks(self) -> int:
        """The pool's allocatable blocks now (a run's steps that ended counted)."""
        free = self.engine.pool.num_free
        run = self._run
        if run is not None:  # (the step in flight took its blocks when it started)
            free -= self.engine.blocks_needed(
                run.reqs, min(run.ended_by(self.loop.now) + 1, run.steps))
        return free

    def _next(self) -> None:
        k = self.engine.steady_steps() if self.fast else 0
        if k >= 2:
            self._start_run(k)
            return
        nxt = self.engine.schedule()
        if nxt is None:
            return
        batch, info = nxt
        self._started = self.loop.now
        self._step = batch
        self._step_end = self.loop.now + self.step_s(info)
        self.loop.at(self._step_end, self._step_done)

    def step_s(self, info: StepInfo) -> float:
        return self.steps.step_ms(info) * self.step_scale.of(info) / 1e3 + self.step_overhead_s

    def _start_run(self, k: int) -> None:
        running = list(self.engine.scheduler.running)
        rows, ctx, now = len(running), 0, self.loop.now
        for r in running:
            ctx += r.num_computed_tokens + 1
            if r.first_scheduled_time is None:  # (a request whose KV just landed)
                r.first_scheduled_time = now
        first = self.step_s(StepInfo(rows, rows, rows, ctx, 0.0))
        second = self.step_s(StepInfo(rows, rows, rows, ctx + rows, 0.0))
        run = _Run(running, self.loop.now, k, first, max(0.0, second - first))
        run.event = self.loop.at(run.end_of(k), self._run_done)
        self._run = run

    def _run_done(self) -> None:
        run = self._run
        assert run is not None
        self._run = None
        self._ending = True
        try:
            self._apply(run, run.steps)
        finally:
            self._ending = False
        self._next()

    def _apply(self, run: _Run, steps: int) -> None:
        self.engine.decode_run(run.reqs, steps)  # (the requests it finished: see status)
        self.num_steps += steps
        self.busy_s += run.end_of(steps) - run.start
        self.listener.on_run(self, run.reqs, [run.end_of(j) for j in range(1, steps + 1)])

    def _step_done(self) -> None:
        batch, self._step = self._step, None
        assert batch is not None
        self.busy_s += self.loop.now - self._started
        self.num_steps += 1
        got = self.engine.complete(batch)
        if self.pipe is not None:
            self._send_completed(batch)
        self._ending = True
        try:
            self.listener.on_tokens(self, got)
        finally:
            self._ending = False
        self._next()

    # -------------------------------------------------------------- prefill
    def _send_completed(self, batch: ScheduledBatch) -> None:
        """The blocks this step completed leave at once (not those of parked requests:
        their last send is the hand-over's, made by ``hand_over``)."""
        assert self.pipe is not None
        for req, _ in batch.work:
            if req.status is RequestStatus.RUNNING:
                full = req.num_computed_tokens // self.engine.block_size
                new = full - self.sent.get(req.request_id, 0)
                if new > 0:
                    self.pipe.send(self.loop.now, new)
                    self.sent[req.request_id] = full

    def hand_over(self, req: Request, reused_blocks: int) -> float:
        """The parked request's last send (every block not sent yet, but the first
        ``reused_blocks`` the decode worker held): when it lands."""
        assert self.pipe is not None
        sent = max(self.sent.pop(req.request_id, 0), reused_blocks)
        return self.pipe.send(self.loop.now, max(0, len(req.block_ids) - sent))
