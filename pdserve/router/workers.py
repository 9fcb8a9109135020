"""``WorkerSet``: the router's view of every worker -- who is in routing, their load,
their token streams and transfer channels -- and the fault model's rules for when a
worker leaves routing and how it comes back.

Health (one probe task per worker, every ``stats_interval_s``): the probe is
``load()``, answered from the worker's last published load without waiting for its
engine, so a busy worker answers. A worker leaves routing when

* a call says it is gone (``WorkerGone``: its actor died, its loop stopped), or
* its probes have failed (errors, no answer in ``probe_timeout_s``) for
  ``health_timeout_s`` in a row (a stalled process, an unreachable one), or
* its token stream to the router broke;

never because one request's attempt failed on it. Leaving fails every attempt that
depends on it (their inboxes get an ``AttemptFailed``; the requests retry elsewhere).

Joining (``_join``), on the first answered probe of an incarnation -- the first one,
the same one back after a stall, or a new one after Ray restarted the actor: read its
``JoinInfo``, connect its token stream, open the P x D transfer channels that involve
it, then put it in routing. A new incarnation counts as a restart. Channels that
could not be opened are retried on every probe.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

from pdserve.failures import AttemptFailed, FailReason, WorkerGone
from pdserve.messages import ServingLimits, WorkerLoad
from pdserve.output_stream import connect_stream
from pdserve.router.clients import ColocatedHandle, DecodeHandle, PrefillHandle, WorkerHandle
from pdserve.router.fanout import Fanout
from pdserve.router.placement import SHARE_WINDOW_S, DecayedSum

log = logging.getLogger("pdserve.router")
T = TypeVar("T")
TOKEN_ROLES = ("decode", "colocated")


@dataclass
class WorkerState:
    handle: WorkerHandle  # by role also a Prefill/Decode/ColocatedHandle (clients.py)
    worker_id: str
    role: str
    alive: bool = False  # joined (its stream and channels are up)
    draining: bool = False  # takes no new requests; finishing the ones it has
    incarnation: str | None = None  # of the last join
    load: WorkerLoad | None = None  # last probe answer
    failing_since: float | None = None  # first failed probe of the current run
    stream: asyncio.BaseTransport | None = None  # token workers: the output stream
    kv_endpoint: dict[str, Any] | None = None  # decode: its receiver
    metrics: tuple[str, int] | None = None  # its /metrics
    outstanding_tokens: int = 0  # prefill: prompt tokens dispatched, not yet prefilled
    outstanding_requests: int = 0  # attempts using it
    # decode workers, for the placement rule (placement.py): the prompt tokens it
    # computes itself and has not answered yet, and the prompt compute time it was
    # given lately (decayed)
    local_tokens: int = 0
    prompt_time: DecayedSum = field(default_factory=lambda: DecayedSum(SHARE_WINDOW_S))
    # prefill and decode workers: what the first tokens of prompts computed here took
    # beyond the rule's prediction (placement.learn)
    ttft_bias_s: float = 0.0
    restarts: int = 0
    refused: str | None = None  # why its incarnation ``refused_incarnation`` may not join
    refused_incarnation: str | None = None
    peers: set[str] = field(default_factory=set)  # prefill: decode workers it has channels to
    left: asyncio.Event | None = None  # set when this join's stay in routing ends

    @property
    def prefill(self) -> PrefillHandle:
        """The handle as what a prefill worker answers (``TypeError`` on another role)."""
        return cast(PrefillHandle, self._as("prefill"))

    @property
    def decode(self) -> DecodeHandle:
        return cast(DecodeHandle, self._as("decode"))

    @property
    def colocated(self) -> ColocatedHandle:
        return cast(ColocatedHandle, self._as("colocated"))

    def _as(self, role: str) -> WorkerHandle:
        if self.role != role:
            raise TypeError(f"worker {self.worker_id} is a {self.role} worker, not {role}")
        return self.handle

    @property
    def routable(self) -> bool:
        """In routing: joined and not draining."""
        return self.alive and not self.draining

    @property
    def state(self) -> str:
        """What an operator sees: joining | serving | draining | down | refused."""
        if self.alive:
            return "draining" if self.draining else "serving"
        if self.refused is not None:
            return "refused"
        return "joining" if self.incarnation is None else "down"


@dataclass(frozen=True)
class HealthConfig:
    interval_s: float = 0.25  # probe period
    probe_timeout_s: float = 2.0  # one probe's answer
    health_timeout_s: float = 10.0  # failed probes this long in a row: out of routing
    join_timeout_s: float = 30.0  # join info, stream, channels


class WorkerSet:
    def __init__(self, handles: Sequence[WorkerHandle], fanout: Fanout, health: HealthConfig,
                 limits: ServingLimits,
                 on_change: Callable[[WorkerState, str], None] = lambda w, what: None) -> None:
        self.workers = {h.worker_id: WorkerState(h, h.worker_id, h.role) for h in handles}
        # This router among any others serving the same workers: its requests' tokens
        # come on its own connection of each worker's output stream.
        self.router_id = uuid.uuid4().hex[:12]
        self._fanout = fanout
        self._health = health
        self._limits = limits  # the router's: every worker must agree (at join)
        # (worker, "joined" | "left" | "restarted" | "draining" | "removed")
        self._on_change = on_change
        self._tasks: list[asyncio.Task[None]] = []
        self._joins: dict[str, asyncio.Task[None]] = {}
        self._drained = asyncio.Event()  # set when an attempt ends (drains wait on it)
        self._stopping = False

    # --------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        """Probe and join every worker once, then keep probing."""
        await asyncio.gather(*(self._probe(w) for w in self.workers.values()))
        await asyncio.gather(*self._joins.values(), return_exceptions=True)
        self._tasks = [asyncio.create_task(self._probe_loop(w), name=f"probe-{w.worker_id}")
                       for w in self.workers.values()]

    async def stop(self) -> None:
        self._stopping = True  # closing the streams below is not their workers leaving
        for t in [*self._tasks, *self._joins.values()]:
            t.cancel()
        for t in [*self._tasks, *self._joins.values()]:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._tasks.clear()
        for w in self.workers.values():
            self._close_stream(w)

    # ------------------------------------------------------------ runtime changes
    async def add(self, handle: WorkerHandle) -> WorkerState:
        """A worker started at runtime: probe it, join it (bounded by the join
        timeout; a late one joins on a later probe), keep probing it."""
        if handle.worker_id in self.workers:
            raise ValueError(f"worker {handle.worker_id} is already known")
        w = self.workers[handle.worker_id] = WorkerState(handle, handle.worker_id, handle.role)
        await self._probe(w)
        join = self._joins.get(w.worker_id)
        if join is not None:
            await asyncio.gather(join, return_exceptions=True)
        self._tasks.append(asyncio.create_task(self._probe_loop(w), name=f"probe-{w.worker_id}"))
        return w

    async def drain(self, worker_id: str, timeout_s: float,
                    evacuate: Callable[[], object] | None = None) -> int:
        """Take ``worker_id`` out of routing for new requests, ``evacuate`` it (its
        attempts asked to move elsewhere), wait (at most ``timeout_s``) until none of
        its attempts is left, then remove it: its channels close with nothing in
        flight. Attempts still on it at the timeout fail over (retried elsewhere).
        Returns how many were cut off."""
        w = self.workers[worker_id]
        w.draining = True
        self._on_change(w, "draining")
        if evacuate is not None:
            evacuate()
        deadline = time.monotonic() + timeout_s
        while w.alive and w.outstanding_requests > 0 and time.monotonic() < deadline:
            self._drained.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(deadline - time.monotonic()):
                    await self._drained.wait()
        left = w.outstanding_requests if w.alive else 0
        self.remove(worker_id)
        return left

    def attempt_ended(self) -> None:
        """An attempt released its workers (a drain may be waiting for that)."""
        self._drained.set()

    def remove(self, worker_id: str) -> None:
        """Forget a worker (its actor is about to be stopped): out of routing, its
        probes stopped."""
        w = self.workers[worker_id]
        for t in [self._joins.get(worker_id), *self._tasks]:
            if t is not None and t.get_name() in (f"probe-{worker_id}", f"join-{worker_id}"):
                t.cancel()
        self._tasks = [t for t in self._tasks if t.get_name() != f"probe-{worker_id}"]
        self._leave(w, FailReason.UNHEALTHY, "removed (drained)", planned=True)
        del self.workers[worker_id]
        self._on_change(w, "removed")

    # ------------------------------------------------------------------ queries
    def live(self, *roles: str) -> list[WorkerState]:
        """The workers in routing (joined, not draining) of these roles."""
        return [w for w in self.workers.values() if w.routable and w.role in roles]

    def prefill_for(self, decode_id: str) -> list[WorkerState]:
        """Live prefill workers with a channel to ``decode_id``."""
        return [w for w in self.live("prefill") if decode_id in w.peers]

    def ready(self) -> bool:
        """Some token path is in routing: a colocated worker, or a connected P + D."""
        if self.live("colocated"):
            return True
        return any(self.prefill_for(d.worker_id) for d in self.live("decode"))

    async def call(self, w: WorkerState, coro: Coroutine[Any, Any, T]) -> T:
        """Await a call on ``w``, given up (``AttemptFailed``) if ``w`` leaves routing
        first: a stalled worker never holds a request in admission."""
        left = w.left
        if left is None or left.is_set():
            coro.close()
            raise AttemptFailed(FailReason.UNHEALTHY, f"worker {w.worker_id} is not in routing")
        task = asyncio.ensure_future(coro)
        leaving = asyncio.ensure_future(left.wait())
        try:
            await asyncio.wait({task, leaving}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            leaving.cancel()
            if not task.done():
                task.cancel()
        if not task.done() or task.cancelled():
            raise AttemptFailed(FailReason.UNHEALTHY, f"worker {w.worker_id} left routing")
        return task.result()

    def channel_lost(self, prefill_id: str, decode_id: str) -> None:
        """A transfer found the P -> D channel gone: not used until a probe reopens it."""
        p = self.workers.get(prefill_id)
        if p is not None:
            p.peers.discard(decode_id)

    def gone(self, worker_id: str, why: str) -> None:
        """A call said the worker is not running: out of routing now."""
        w = self.workers.get(worker_id)
        if w is not None:
            self._leave(w, FailReason.WORKER_DIED, why)

    # ------------------------------------------------------------------- health
    async def _probe_loop(self, w: WorkerState) -> None:
        # Not ``while True``: stop() / remove() end the loop even if a cancellation were
        # lost (Python 3.11's wait_for lost them, gh-86296: timeouts here use
        # asyncio.timeout, which does not).
        while not self._stopping and self.workers.get(w.worker_id) is w:
            await asyncio.sleep(self._health.interval_s)
            await self._probe(w)

    async def _probe(self, w: WorkerState) -> None:
        now = time.monotonic()
        try:
            async with asyncio.timeout(self._health.probe_timeout_s):
                load: WorkerLoad = await w.handle.load()
        except asyncio.CancelledError:
            raise
        except WorkerGone as exc:
            self._leave(w, FailReason.WORKER_DIED, str(exc))
            return
        except Exception as exc:  # no answer, transport error: the health timeout decides
            w.failing_since = w.failing_since or now
            if now - w.failing_since >= self._health.health_timeout_s:
                self._leave(w, FailReason.UNHEALTHY, f"no health answer for "
                            f"{now - w.failing_since:.1f}s ({type(exc).__name__})")
            return
        w.failing_since = None
        if w.alive and load.incarnation != w.incarnation:
            self._leave(w, FailReason.WORKER_DIED, "restarted")
        w.load = load
        if (not w.alive and w.worker_id not in self._joins
                and w.refused_incarnation != load.incarnation):
            task = asyncio.create_task(self._join(w, load), name=f"join-{w.worker_id}")
            self._joins[w.worker_id] = task
            task.add_done_callback(lambda _: self._joins.pop(w.worker_id, None))
        elif w.routable:
            await self._open_channels(w)

    async def _join(self, w: WorkerState, load: WorkerLoad) -> None:
        timeout = self._health.join_timeout_s
        try:
            async with asyncio.timeout(timeout):
                info = await w.handle.join_info()
            if info.incarnation != load.incarnation:
                return  # restarted again meanwhile: the next probe joins the new one
            problem = self._disagreement(info.limits)
            if problem is not None:
                w.refused, w.refused_incarnation = problem, info.incarnation
                log.error("worker %s (%s) refused: %s", w.worker_id, w.role, problem)
                return
            if w.role in TOKEN_ROLES:
                assert info.stream is not None
                incarnation = info.incarnation
                w.stream = await connect_stream(
                    info.stream, self._fanout.deliver,
                    lambda why: self._stream_lost(w, incarnation, why), timeout,
                    router_id=self.router_id)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.warning("worker %s could not join: %r", w.worker_id, exc)
            self._close_stream(w)
            return
        w.refused = w.refused_incarnation = None
        restarted = w.incarnation is not None and w.incarnation != info.incarnation
        w.incarnation, w.kv_endpoint, w.metrics = info.incarnation, info.kv_endpoint, info.metrics
        w.peers.clear()
        for p in self.workers.values():
            p.peers.discard(w.worker_id)
        w.alive = True
        w.left = asyncio.Event()
        if restarted:
            w.restarts += 1
        log.info("worker %s (%s) %s", w.worker_id, w.role, "rejoined" if restarted else "joined")
        await self._open_channels(w)
        self._on_change(w, "restarted" if restarted else "joined")

    def _disagreement(self, theirs: ServingLimits) -> str | None:
        """Why a worker with these limits cannot serve behind this router (None: it can)."""
        ours = self._limits
        if theirs.model != ours.model:
            return f"it serves model {theirs.model!r}, the router {ours.model!r}"
        if theirs.block_size != ours.block_size:
            return (f"its KV block size is {theirs.block_size} tokens, the router's "
                    f"{ours.block_size} (block_size must be the same on every pool)")
        if theirs.max_model_len < ours.max_model_len:
            return (f"it serves sequences of at most {theirs.max_model_len} tokens, the "
                    f"router admits {ours.max_model_len} (max_model_len)")
        return None

    async def _open_channels(self, w: WorkerState) -> None:
        """Open the transfer channels of the P x D pairs that involve ``w``."""
        if w.role == "prefill":
            pairs = [(w, d) for d in self.live("decode") if d.worker_id not in w.peers]
        elif w.role == "decode":
            pairs = [(p, w) for p in self.live("prefill") if w.worker_id not in p.peers]
        else:
            return
        for p, d in pairs:
            if d.kv_endpoint is None:  # not joined as a decode worker (its join sets it)
                continue
            try:
                async with asyncio.timeout(self._health.join_timeout_s):
                    await p.prefill.connect(d.worker_id, d.kv_endpoint)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("channel %s -> %s not open yet: %r", p.worker_id, d.worker_id, exc)
                continue
            if p.alive and d.alive:
                p.peers.add(d.worker_id)

    def _stream_lost(self, w: WorkerState, incarnation: str, why: str) -> None:
        if w.alive and w.incarnation == incarnation and not self._stopping:
            self._leave(w, FailReason.STREAM_LOST, f"token stream lost: {why}")

    def _leave(self, w: WorkerState, reason: FailReason, why: str,
               planned: bool = False) -> None:
        """Out of routing; logged as an error unless ``planned`` (a drained worker)."""
        if not w.alive:
            return
        log.log(logging.INFO if planned else logging.ERROR,
                "worker %s (%s) leaves routing: %s", w.worker_id, w.role, why)
        w.alive = False
        if w.left is not None:
            w.left.set()
        self._close_stream(w)
        w.peers.clear()
        for p in self.workers.values():
            p.peers.discard(w.worker_id)
        self._fanout.fail_worker(w.worker_id, reason, f"worker {w.worker_id}: {why}")
        self._on_change(w, "left")

    @staticmethod
    def _close_stream(w: WorkerState) -> None:
        if w.stream is not None:
            w.stream.close()
            w.stream = None
