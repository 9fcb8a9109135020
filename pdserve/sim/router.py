"""``SimRouter``: the router's decisions on the virtual clock.

The decisions are the router's own objects: ``Ranking`` (``router/ranking.py``: the
routing policy over ``WorkerView`` snapshots, from each worker's last published load
less the blocks claimed since), its ``Placer`` (the disaggregation rule,
``placement.decide``, with its counts, its decaying prompt share and its learnt TTFT
corrections) and ``LocalPrefill`` (what a decode worker computes itself). This
module only sequences them as ``Admission.admit`` / ``_try`` and the orchestrator do,
without their awaits: an admission tries the policy's workers in order and reserves
on the first with room, else waits in a FIFO queue woken whenever a request ends
(at most ``max_waiting``, each up to ``queue_timeout_s``: then HTTP 429).

Workers publish their loads every ``stats_interval_s`` (the health probe's period);
router costs are constants (``Overheads``): before admission, per call to a
worker, per streamed token.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pdserve.engine.request import Request, RequestStatus
from pdserve.messages import Compute, Reservation, WorkerLoad
from pdserve.router.placement import Slo
from pdserve.router.placing import Target
from pdserve.router.policies import PrefixIndex, RouteInput, get_policy
from pdserve.router.ranking import Ranking
from pdserve.router.router import RouterConfig
from pdserve.router.workers import WorkerState
from pdserve.sim.clock import EventLoop
from pdserve.sim.flight import Flight
from pdserve.sim.stages import timings_of
from pdserve.sim.workers import SimWorker


@dataclass(frozen=True)
class Overheads:
    """The router's own time per request (HTTP, tokenizing, admission), per call to a
    worker (one way), and per streamed token (relay to the client)."""

    request_s: float = 0.0
    call_s: float = 0.0
    token_s: float = 0.0


class SimRouter:
    def __init__(self, loop: EventLoop, workers: Sequence[SimWorker], config: RouterConfig,
                 slo: Slo, computes: dict[str, Compute], overheads: Overheads,
                 on_done: Callable[[Flight], None]) -> None:
        """``computes``: each worker's step costs as its ``WorkerLoad`` carries them (what
        the placement rule reads); ``on_done``: told when a request ends (or fails)."""
        self.loop, self.config, self.overheads = loop, config, overheads
        self.on_done = on_done
        self.flights: dict[str, Flight] = {}
        self.expecting = 0  # requests the client has yet to send
        self.workers = {w.worker_id: w for w in workers}
        self.states = {w.worker_id: WorkerState(None, w.worker_id, w.role, alive=True)  # type: ignore[arg-type]
                       for w in workers}
        self._live: dict[tuple[str, ...], list[WorkerState]] = {}
        self._computes = computes
        self.prefix = PrefixIndex()
        self.ranking = Ranking(self, get_policy(config.policy), self.prefix, config.block_size,
                               config.local_prefill_max_tokens, config.placement, slo,
                               clock=loop.clock)
        self.block_size = config.block_size
        self._queue: deque[Flight] = deque()
        self._granted: dict[str, int] = dict.fromkeys(self.workers, 0)
        self.publish()

    # ------------------------------------------ what the ranking reads (WorkerSource)
    def live(self, *roles: str) -> list[WorkerState]:
        """(Every worker lives for the whole run: one list per roles asked, read only.)"""
        got = self._live.get(roles)
        if got is None:
            got = self._live[roles] = [s for s in self.states.values() if s.role in roles]
        return got

    def prefill_for(self, decode_id: str) -> list[WorkerState]:
        return self.live("prefill")

    def publish(self) -> None:
        """Every worker's load as its next probe answers it (then again in a period)."""
        for wid, w in self.workers.items():
            sch = w.engine.scheduler
            self.states[wid].load = WorkerLoad(
                wid, w.role, "sim", len(sch.running), len(sch.waiting), len(sch.waiting_for_kv),
                w.free_blocks(), w.engine.shape.num_blocks,
                sum(r.num_new_tokens for r in sch.waiting), self._granted[wid],
                self._computes.get(wid))
        if self.expecting or self.flights:
            self.loop.after(self.config.stats_interval_s, self.publish)

    # ------------------------------------------------------------ admission
    def arrive(self, f: Flight) -> None:
        """A request reached the router (its own costs before admission paid)."""
        f.admit_start = self.loop.now
        self.flights[f.request_id] = f
        if self._queue:
            self._enqueue(f)
            return
        if not self._admit(f):
            self._enqueue(f)

    def _enqueue(self, f: Flight) -> None:
        if len(self._queue) >= self.config.max_waiting:
            self._fail(f, "HTTP 429: the router's waiting queue is full")
            return
        self._queue.append(f)
        f.timeout = self.loop.after(self.config.queue_timeout_s, self._timed_out, f)

    def _timed_out(self, f: Flight) -> None:
        self._queue.remove(f)
        self._fail(f, "HTTP 429: no decode worker has room for this request")
        self._wake()

    def _wake(self) -> None:
        while self._queue and self._admit(self._queue[0]):
            f = self._queue.popleft()
            if f.timeout is not None:
                f.timeout.cancel()

    def _admit(self, f: Flight) -> bool:
        route = RouteInput(f.prompt_len, f.hashes, block_size=self.block_size)
        ranked, faster = self.ranking.order(route, f.params)
        for s in ranked:
            target = self._try(s, f, route)
            if target is not None:
                if s is faster:
                    target.reason = "faster_colocated"
                f.queue_s = self.loop.now - f.admit_start
                self._dispatch(f, target)
                return True
        return False

    def _try(self, s: WorkerState, f: Flight, route: RouteInput) -> Target | None:
        need = -(-f.prompt_len // self.block_size)
        rk, w = self.ranking, self.workers[s.worker_id]
        rk.claims.ask(s, need)
        s.outstanding_requests += 1
        target: Target | None = None
        w.sync(batch_changes=False)
        req = w.engine.new_request(f.request_id, f.prompt_len, f.output_len, f.hashes)
        if s.role == "decode":
            placing = rk.placer.prepare(s, rk.pick_prefill(s.worker_id, route), route,
                                         f.params)
            got = self._reserve(w, req, placing.local)
            placing.claim.undo()
            if got is not None:
                target = rk.placer.placed(placing, got)
        else:
            w.sync()  # a colocated worker's new prompt joins its next step
            if w.engine.admit(req):
                target = Target(s, None, uncached=f.prompt_len, clock=self.loop.clock)
        w.check_room()
        granted = target is not None
        rk.claims.answered(s, need, granted)
        if not granted:
            s.outstanding_requests -= 1
            return None
        self._granted[s.worker_id] += need
        f.token_req, f.token_worker = req, w
        f.received = w.step_end()  # (a prompt computed there: its loop takes it then)
        w.kick()
        return target

    @staticmethod
    def _reserve(w: SimWorker, req: Request, local: object) -> Reservation | None:
        """The decode worker's ``reserve`` (``worker/decode.py``)."""
        blocks = w.engine.reserve(req)
        if blocks is None:
            return None
        reused = req.num_cached_tokens // w.engine.block_size
        if local.applies(req.num_prompt_tokens - reused * w.engine.block_size, reused):  # type: ignore[attr-defined]
            w.sync()  # its prompt joins the next step
            w.engine.prefill_reserved(req)
            return Reservation(blocks, reused, local=True)
        return Reservation(blocks, reused)

    def _dispatch(self, f: Flight, target: Target) -> None:
        f.target = target
        f.placement = target.placement
        if target.placement != "remote":
            f.local_pending = target.uncached if target.placement == "local" else 0
            return
        assert target.prefill is not None and target.reservation is not None
        p = self.workers[target.prefill.worker_id]
        f.reused = target.reservation.reused
        if self.ranking.tracks_token_prefix:  # (the only policy that reads it)
            self.prefix.record(f.hashes, p.worker_id)
        self.loop.after(2 * self.overheads.call_s, self._to_prefill, f, p)

    def _to_prefill(self, f: Flight, p: SimWorker) -> None:
        p.sync()
        f.prefill_req = p.engine.new_request(f.request_id, f.prompt_len, f.output_len, f.hashes)
        f.sent_to_prefill = self.loop.now
        f.prefill_worker = p
        p.engine.add(f.prefill_req)
        p.kick()

    # ---------------------------------------------------------------- tokens
    def on_tokens(self, worker: SimWorker, reqs: list[Request]) -> None:
        now = self.loop.now + self.overheads.token_s
        for req in reqs:
            f = self.flights[req.request_id]
            if worker.role == "prefill":
                self._prefilled(f, worker, now)
                continue
            if f.first_s is None:
                self._first(f, now)
            else:
                f.token(now)
            if req.status is RequestStatus.FINISHED:
                self._finished(f)

    def on_run(self, worker: SimWorker, reqs: Sequence[Request], times: Sequence[float]) -> None:
        dt, flights = self.overheads.token_s, self.flights
        for req in reqs:
            f = flights[req.request_id]
            f.tokens(times, dt)
            if req.status is RequestStatus.FINISHED:
                self._finished(f)

    def _first(self, f: Flight, now: float) -> None:
        f.first(now)
        assert f.target is not None and f.token_worker is not None
        if f.local_pending:
            self.states[f.token_worker.worker_id].local_tokens -= f.local_pending
            f.local_pending = 0
        f.target.first_token()

    def _prefilled(self, f: Flight, p: SimWorker, now: float) -> None:
        assert f.prefill_req is not None and f.target is not None
        f.prefill_done = self.loop.now
        self._first(f, now)
        lands = p.hand_over(f.prefill_req, f.reused)
        self.loop.at(lands + self.overheads.call_s, self._landed, f, p)

    def _landed(self, f: Flight, p: SimWorker) -> None:
        assert f.prefill_req is not None and f.token_worker is not None
        f.landed = self.loop.now
        d = f.token_worker
        p.sync()
        p.engine.release(f.prefill_req)
        ps = self.states[p.worker_id]
        ps.outstanding_tokens -= f.prompt_len
        ps.outstanding_requests -= 1
        d.sync()
        if d.engine.start_decode(f.token_req):  # type: ignore[arg-type]
            self._finished(f)
        d.kick()

    def _finished(self, f: Flight) -> None:
        assert f.token_worker is not None
        s = self.states[f.token_worker.worker_id]
        s.outstanding_requests -= 1
        if self.ranking.tracks_token_prefix and f.token_req is not None:
            held = f.token_req.block_hashes[: (f.prompt_len + f.output_len - 1) // self.block_size]
            self.ranking.token_prefix.record(held, s.worker_id)
        f.done(self.loop.now + self.overheads.token_s)
        f.timings = timings_of(f)
        del self.flights[f.request_id]
        f.token_req = f.prefill_req = None  # (their token lists: the run's memory)
        f.hashes = []
        self.on_done(f)
        self._wake()

    def _fail(self, f: Flight, error: str) -> None:
        f.fail(self.loop.now, error)
        self.flights.pop(f.request_id, None)
        self.on_done(f)
