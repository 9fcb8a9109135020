"""One simulated benchmark run: the deployment's workers and router on one event loop,
driven by the workload as ``pdserve bench`` sends it (arrival times, the
``--max-concurrency`` cap), reported as ``pdserve bench`` reports it
(``calculate_metrics``, ``build_result``: the same result JSON), plus a
``simulation`` section (where prompts were computed, each worker's busy share, the
events run and the wall time taken)."""

from __future__ import annotations

import dataclasses
import gc
import time
from collections import Counter, deque
from collections.abc import Sequence
from typing import Any

from pdserve.client.bench import BenchConfig
from pdserve.client.metrics import calculate_metrics
from pdserve.client.openai_stream import RequestOutput
from pdserve.client.report import build_result, rate_field
from pdserve.engine.request import Request
from pdserve.sim.clock import EventLoop
from pdserve.sim.deployment import Deployment, compute_of
from pdserve.sim.engine import SimEngine, params_for
from pdserve.sim.flight import Flight
from pdserve.sim.link import Pipe
from pdserve.sim.router import SimRouter
from pdserve.sim.stages import Stages
from pdserve.sim.workers import SimWorker
from pdserve.sim.workload import Planned, shares_blocks

MAX_EVENTS_PER_REQUEST = 100_000  # a bound on a runaway model, not a limit in practice


class Simulation:
    def __init__(self, deployment: Deployment, planned: Sequence[Planned],
                 max_concurrency: int | None = None, keep_itl: bool = True,
                 fast: bool = True, model: str = "model") -> None:
        self.deployment, self.planned = deployment, list(planned)
        self.max_concurrency, self.keep_itl = max_concurrency, keep_itl
        self.loop = EventLoop()
        cfg = deployment.cluster.router
        bs = cfg.block_size
        mean_ctx = (sum(p.prompt_len + p.output_len / 2 for p in self.planned)
                    / max(1, len(self.planned)))
        workers, computes = [], {}
        shared = shares_blocks(self.planned, bs)
        for pool in deployment.pools:
            if pool.shape.block_size != bs:
                raise ValueError(f"the {pool.role} pool's block_size {pool.shape.block_size} "
                                 f"differs from the router's {bs}")
            compute = compute_of(pool.steps, mean_ctx, pool.shape.max_num_seqs,
                                 deployment.max_model_len)
            shape = pool.shape
            if shape.enable_prefix_caching and not shared:  # no hit possible: none kept
                shape = dataclasses.replace(shape, enable_prefix_caching=False)
            for i in range(pool.workers):
                wid = f"{pool.role}-{i}"
                pipe = None
                if pool.role == "prefill":
                    pipe = Pipe(deployment.link, pool.steps.kv_bytes_per_token * bs, pool.ranks)
                workers.append(SimWorker(self.loop, wid, SimEngine(pool.role, shape, self.loop),
                                         pool.steps, self, deployment.step_overhead_s, pipe, fast,
                                         deployment.step_scale))
                computes[wid] = compute
        self.workers = workers
        self.router = SimRouter(self.loop, workers, cfg, deployment.slo, computes,
                                deployment.overheads, self._done)
        self.outputs: list[RequestOutput | None] = [None] * len(self.planned)
        self.stages = Stages(model)
        self.placements: Counter[str] = Counter()
        self.end = 0.0  # the last request's end
        self._in_flight = 0
        self._pending: deque[Planned] = deque()
        self.token_seconds: Counter[int] = Counter()  # output tokens, per second of the run
        self._t0 = min((p.offset for p in self.planned), default=0.0)  # the first send
        self._seen_after = deployment.overheads.token_s  # a token's way to the client

    # the workers' listener (``workers.Listener``) is the router, made after them; the
    # tokens are counted per second of the run as the client sees them (its peak
    # output throughput, without keeping every token's time)
    def on_tokens(self, worker: SimWorker, reqs: list[Request]) -> None:
        self.router.on_tokens(worker, reqs)
        if reqs:
            self.token_seconds[int(self.loop.now + self._seen_after - self._t0)] += len(reqs)

    def on_run(self, worker: SimWorker, reqs: Sequence[Request], times: Sequence[float]) -> None:
        self.router.on_run(worker, reqs, times)
        n, seen, counts = len(reqs), self._seen_after - self._t0, self.token_seconds
        for t in times:
            counts[int(t + seen)] += n

    def run(self) -> tuple[list[RequestOutput], float]:
        self.router.expecting = len(self.planned)
        self._arrivals = sorted(range(len(self.planned)), key=lambda i: self.planned[i].offset)
        self._next_arrival(0)
        # A run makes objects by the million and few cycles: the collector's young
        # generation is checked a hundredth as often (5% of an hour's run, before)
        threshold = gc.get_threshold()
        gc.set_threshold(100 * threshold[0], *threshold[1:])
        try:
            self.loop.run(max_events=MAX_EVENTS_PER_REQUEST * max(1, len(self.planned)))
        finally:
            gc.set_threshold(*threshold)
        outputs = [o for o in self.outputs if o is not None]
        assert len(outputs) == len(self.planned), "a request never ended"
        return outputs, self.end

    def _next_arrival(self, k: int) -> None:
        """The ``k``-th request by send time is added when it is next (stable: ties
        in the workload's order)."""
        if k < len(self._arrivals):
            p = self.planned[self._arrivals[k]]
            self.loop.due(p.offset, k, self._due, p, k)

    def _due(self, p: Planned, k: int) -> None:
        self._next_arrival(k + 1)
        if self.max_concurrency and self._in_flight >= self.max_concurrency:
            self._pending.append(p)
            return
        self._send(p)

    def _send(self, p: Planned) -> None:
        self._in_flight += 1
        bs = self.deployment.cluster.router.block_size
        f = Flight(f"sim-{p.index}", p.index, p.prompt_len, p.output_len, p.block_hashes(bs),
                   params_for(p.output_len), p.offset, self.loop.now, self.keep_itl)
        self.loop.after(self.deployment.overheads.request_s, self._arrive, f)

    def _arrive(self, f: Flight) -> None:
        self.router.expecting -= 1
        self.router.arrive(f)

    def _done(self, f: Flight) -> None:
        self.placements[f.placement] += bool(f.placement)
        end = f.end if f.end is not None else self.loop.now
        self.end = max(self.end, end)
        self.outputs[f.index] = _output(f)
        if f.timings is not None:
            self.stages.observe(f, f.timings)
        self.loop.at(max(end, self.loop.now), self._slot_free)

    def _slot_free(self) -> None:
        """The client has the request's last token: its slot takes the next one."""
        self._in_flight -= 1
        if self._pending:
            self._send(self._pending.popleft())

    def summary(self, wall_s: float) -> dict[str, Any]:
        span = self.loop.now or 1.0
        return {
            "deployment": self.deployment.describe(),
            "placement": {k: v for k, v in sorted(self.placements.items()) if v},
            "busy": {w.worker_id: round(w.busy_s / span, 4) for w in self.workers},
            "steps": {w.worker_id: w.num_steps for w in self.workers},
            "preemptions": {w.worker_id: w.engine.scheduler.num_preemptions
                            for w in self.workers},
            "kv_bytes_sent": sum(w.pipe.bytes_sent for w in self.workers if w.pipe),
            "events": self.loop.events_run,
            "simulated_s": self.loop.now,
            "wall_s": wall_s,
        }


def _output(f: Flight) -> RequestOutput:
    end = f.end if f.end is not None else f.sent
    if f.error:
        return RequestOutput(False, prompt_len=f.prompt_len, latency=end - f.sent,
                             start_time=f.sent, queue_time=f.sent - f.due, status=429,
                             error=f.error)
    assert f.first_s is not None
    return RequestOutput(True, prompt_len=f.prompt_len, output_tokens=f.num_tokens,
                         usage_reported=True, ttft=f.first_s - f.sent, itl=list(f.itl),
                         latency=end - f.sent, start_time=f.sent, queue_time=f.sent - f.due,
                         status=200, finish_reason="length")


def simulate(deployment: Deployment, planned: Sequence[Planned], cfg: BenchConfig,
             rate: float, setup: dict[str, Any], fast: bool = True) -> dict[str, Any]:
    """One run: ``pdserve bench``'s result object, with its ``server_metrics`` and
    ``server_placements`` (as ``--scrape-metrics`` reads them) and a ``simulation``
    section."""
    started = time.perf_counter()
    sim = Simulation(deployment, planned, cfg.max_concurrency,
                     keep_itl="itl" in cfg.percentile_metrics, fast=fast,
                     model=str(setup.get("model_id", "model")))
    outputs, duration = sim.run()
    metrics = calculate_metrics(outputs, duration, cfg.metric_percentiles, cfg.goodput)
    if not sim.keep_itl:  # (the client's count needs every token's time)
        metrics = dataclasses.replace(metrics, max_output_tokens_per_s=float(
            max(sim.token_seconds.values(), default=0)))
    result = {**setup, **build_result(metrics, outputs, duration,
                                      {"request_rate": rate_field(rate)})}
    result["server_metrics"] = sim.stages.breakdown()
    result["server_placements"] = {k: v for k, v in sorted(sim.placements.items()) if v}
    result["simulation"] = sim.summary(time.perf_counter() - started)
    return result
