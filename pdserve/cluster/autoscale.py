"""``AutoscaleLoop``: ``pdserve serve --autoscale`` -- the planner's ``Autoscaler``
(``autoscaler.py``) driving the runtime ``Scaler`` (``scaler.py``).

Every ``interval_s`` the loop reads the live router and scaler into a
``LoadSnapshot``, asks ``Autoscaler.decide`` for the prefill and decode pools' sizes,
and hands a decision that differs from the scaler's targets to
``Scaler.set_targets``. After a failed add the scaler waits for new targets, so a
decision that still differs from the pools' sizes goes again even if it equals the
failed targets: the add is tried every interval while the load needs it. Only the
prefill and decode pools are autoscaled: a colocated pool keeps the size it was
given (``pdserve scale`` still changes it).

One snapshot, per pool (its workers in routing and not draining):

* ``workers``: the scaler's target, so workers still starting count (as the
  ``Autoscaler`` requires); after a failed add (``status()["error"]``) the pool's
  current size instead;
* ``waiting``: prefill: the prompts queued on the workers; decode: the requests
  waiting in the router's admission for KV room plus those queued on the engines;
* ``running``: requests using the pool's workers (``outstanding_requests``);
* ``kv_usage``: 1 - free / total KV blocks over the workers' last probe answers;

and over the window since the last decision: the arrival rate (requests ended plus
the change in requests in flight, per second: every request that started has ended
or is still in flight; a stream the client abandoned is not seen), the p90 TTFT and
TPOT and the mean prompt and output lengths of the requests that finished (none
finished: no p90, the configured lengths).

The window is fed by a tap on ``router.metrics`` (``MetricsTap``): every call still
reaches the router's ``RouterMetrics``; ``stop()`` takes the tap out again.

While the scaler is busy (starting or draining workers) nothing is decided: the
window grows until the step after it is done.
"""

from __future__ import annotations

import asyncio
import logging
import math
import statistics
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pdserve.cluster.config import ClusterConfig
from pdserve.cluster.scaler import Scaler
from pdserve.owned_task import OwnedTask
from pdserve.planner.autoscaler import POOLS, Autoscaler, LoadSnapshot, PoolLoad
from pdserve.planner.sizing import SLO, Bounds, Planner
from pdserve.planner.step_times import (
    AnalyticModel,
    Profile,
    StepTimes,
    resolve_hardware,
    resolve_model_config,
)
from pdserve.router.router import Router
from pdserve.router.types import ErrorKind, FinalChunk

log = logging.getLogger("pdserve.cluster")
WINDOW_MAX = 10_000  # observations kept per window (the newest; a long busy spell)


def p90(values: Sequence[float]) -> float | None:
    """Nearest-rank 90th percentile; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.9 * len(ordered)) - 1)]


class Window:
    """What the requests that ended since the last decision showed."""

    def __init__(self) -> None:
        self.ended = 0  # requests finished (any finish reason) or rejected
        self.prompt_tokens = 0  # of the finished ones
        self.ttft_ms: deque[float] = deque(maxlen=WINDOW_MAX)
        self.tpot_ms: deque[float] = deque(maxlen=WINDOW_MAX)
        self.prompt_lens: deque[int] = deque(maxlen=WINDOW_MAX)  # served (stop / length)
        self.output_lens: deque[int] = deque(maxlen=WINDOW_MAX)

    def finished(self, final: FinalChunk) -> None:
        self.ended += 1
        self.prompt_tokens += final.usage.prompt_tokens
        t = final.timings
        if t.ttft is not None:
            self.ttft_ms.append(t.ttft * 1e3)
        if t.tpot is not None:
            self.tpot_ms.append(t.tpot * 1e3)
        if final.finish_reason in ("stop", "length"):
            self.prompt_lens.append(final.usage.prompt_tokens)
            self.output_lens.append(final.usage.completion_tokens)


class MetricsTap:
    """The router's metrics seen through: every call goes on to the real metrics
    object (``inner``, None: none), and requests ending also feed ``window``."""

    def __init__(self, inner: Any, window: Window) -> None:
        self.inner = inner
        self.window = window

    def observe_finished(self, final: FinalChunk) -> None:
        self.window.finished(final)
        if self.inner is not None:
            self.inner.observe_finished(final)

    def observe_rejected(self, kind: ErrorKind) -> None:
        self.window.ended += 1
        if self.inner is not None:
            self.inner.observe_rejected(kind)

    def observe_attempt_failed(self, reason: Any) -> None:
        if self.inner is not None:
            self.inner.observe_attempt_failed(reason)

    def watch(self, max_model_len: int, loads: Any, block_size: int) -> None:
        if self.inner is not None:
            self.inner.watch(max_model_len, loads, block_size)

    def observe_worker(self, worker: str, pool: str, what: str, in_routing: int) -> None:
        if self.inner is not None:
            self.inner.observe_worker(worker, pool, what, in_routing)

    def observe_placement(self, where: str, reason: str) -> None:
        if self.inner is not None:
            self.inner.observe_placement(where, reason)

    def __getattr__(self, name: str) -> Any:  # anything else the metrics object has
        if name in ("inner", "window"):
            raise AttributeError(name)
        return getattr(self.inner, name)


def _mean(values: Sequence[float]) -> float | None:
    return statistics.fmean(values) if values else None


class AutoscaleLoop:
    """Every ``interval_s``: ``step()`` (see the module docstring). ``clock``: the
    window's time base (seconds, monotonic)."""

    def __init__(self, router: Router, scaler: Scaler, autoscaler: Autoscaler,
                 interval_s: float = 5.0, clock: Callable[[], float] = time.monotonic) -> None:
        if not interval_s > 0:
            raise ValueError(f"autoscale interval must be > 0 s, got {interval_s}")
        self.router = router
        self.scaler = scaler
        self.autoscaler = autoscaler
        self.interval_s = interval_s
        self._clock = clock
        self.window = Window()
        self._tap = MetricsTap(router.metrics, self.window)
        router.metrics = self._tap
        self._since = clock()
        self._in_flight = self._in_flight_now()
        self.last_snapshot: LoadSnapshot | None = None
        self.last_decision: dict[str, int] | None = None
        self._last_error: str | None = None
        self._last_hold: str | None = None
        self._task = OwnedTask("autoscale", self._run)

    # ------------------------------------------------------------- lifecycle
    def start(self) -> None:
        self._task.start()

    async def stop(self) -> None:
        await self._task.stop()
        if self.router.metrics is self._tap:
            self.router.metrics = self._tap.inner

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                self.step()
            except Exception:  # keep deciding; the log says why this one failed
                log.exception("autoscale step failed")

    # ------------------------------------------------------------- one period
    def step(self) -> dict[str, int] | None:
        """One decision, applied when it differs from the scaler's targets, or from
        the pools' sizes after a failed add (tried again). None while the scaler is
        busy: nothing decided, the window keeps growing."""
        status = self.scaler.status()
        if status["busy"]:
            log.debug("autoscale: the scaler is busy (targets %s); no decision", status["targets"])
            return None
        if status["error"] and status["error"] != self._last_error:
            log.warning("autoscale: the last scaling failed (%s); deciding from the current "
                        "sizes %s", status["error"], status["current"])
        self._last_error = status["error"]
        snap = self.snapshot(status)
        decision = self.autoscaler.decide(snap)
        self.last_snapshot, self.last_decision = snap, decision
        targets = status["targets"]
        why = "; ".join(f"{p}: {self.autoscaler.reasons.get(p, '')}" for p in POOLS)
        # After a failed add the scaler waits for new targets: a decision equal to the
        # failed ones (the load still needs the workers) tries again.
        retry = status["error"] is not None and any(
            decision[p] != status["current"][p] for p in POOLS)
        if all(decision[p] == targets[p] for p in POOLS) and not retry:
            level = logging.DEBUG if why == self._last_hold else logging.INFO
            self._last_hold = why
            log.log(level, "autoscale: hold prefill %d, decode %d (%s)",
                    targets["prefill"], targets["decode"], why)
            return decision
        self._last_hold = None
        was = status["current"] if retry else targets
        log.info("autoscale: prefill %d -> %d, decode %d -> %d%s (%s)", was["prefill"],
                 decision["prefill"], was["decode"], decision["decode"],
                 ", again after the failed add" if retry else "", why)
        try:
            self.scaler.set_targets(dict(decision))
        except ValueError as exc:
            log.warning("autoscale: the scaler refused %s: %s", decision, exc)
        return decision

    def snapshot(self, status: dict[str, Any] | None = None) -> LoadSnapshot:
        """The load now and over the window since the last snapshot (which this
        one ends: the next window starts now)."""
        status = status or self.scaler.status()
        now = self._clock()
        elapsed = now - self._since
        in_flight = self._in_flight_now()
        w = self.window
        arrivals = max(0, w.ended + in_flight - self._in_flight)
        sizes = status["current"] if status["error"] else status["targets"]
        prefill_tps = w.prompt_tokens / elapsed if elapsed > 0 else 0.0
        snap = LoadSnapshot(
            prefill=self._pool("prefill", sizes["prefill"], prefill_tps),
            decode=self._pool("decode", sizes["decode"], 0.0),
            arrival_rate=arrivals / elapsed if elapsed > 0 else None,
            ttft_p90_ms=p90(w.ttft_ms), tpot_p90_ms=p90(w.tpot_ms),
            prompt_len=_mean(w.prompt_lens), output_len=_mean(w.output_lens))
        self.window = self._tap.window = Window()
        self._since, self._in_flight = now, in_flight
        return snap

    def _pool(self, pool: str, workers: int, prefill_tps: float) -> PoolLoad:
        live = self.router.workers.live(pool)
        loads = [w.load for w in live if w.load is not None]
        total = sum(ld.num_blocks for ld in loads)
        free = sum(ld.num_free_blocks for ld in loads)
        waiting = sum(ld.num_waiting for ld in loads)
        if pool == "decode":
            waiting += self.router.admission.num_waiting
        return PoolLoad(workers=workers, waiting=waiting,
                        running=sum(w.outstanding_requests for w in live),
                        kv_usage=min(1.0, max(0.0, 1 - free / total)) if total else 0.0,
                        prefill_tokens_per_s=prefill_tps)

    def _in_flight_now(self) -> int:
        return len(getattr(self.router, "_active", ()))


def build_autoscaler(cfg: ClusterConfig, model_dir: str | Path,
                     profile: Profile | None = None) -> Autoscaler:
    """The ``Autoscaler`` for ``cfg``'s SLOs and ``autoscale_*`` bounds, planning on
    ``profile`` (else ``cfg.autoscale_profile``, loaded) or, with neither, an
    ``AnalyticModel`` of the model at ``model_dir`` over this machine's CPU peaks,
    measured with the decode pool's threads (about 0.5 s; blocks: run it on a
    thread). The decode pool's engine settings give the batch and KV limits."""
    if cfg.ttft_slo_ms is None or cfg.tpot_slo_ms is None:
        raise ValueError("autoscaling needs ttft_slo_ms and tpot_slo_ms")
    eng = cfg.decode.engine_config("decode", "cpu")
    if profile is None and cfg.autoscale_profile:
        profile = Profile.load(cfg.autoscale_profile)
    times: StepTimes
    if profile is not None:
        times = profile
    else:
        hw = resolve_hardware("cpu", threads=eng.num_threads or 1)
        times = AnalyticModel(resolve_model_config(str(model_dir)), hw, dtype=eng.dtype,
                              quantization=eng.quantization)
    kv_tokens = (eng.num_blocks * eng.block_size if eng.num_blocks
                 else eng.kv_cache_bytes // times.kv_bytes_per_token)
    planner = Planner(times, SLO(cfg.ttft_slo_ms, cfg.tpot_slo_ms),
                      Bounds(cfg.autoscale_min_prefill, cfg.autoscale_max_prefill,
                             cfg.autoscale_min_decode, cfg.autoscale_max_decode),
                      max_batch=eng.max_num_seqs, kv_tokens=kv_tokens,
                      block_size=eng.block_size)
    return Autoscaler(planner, cfg.autoscale_prompt_len, cfg.autoscale_output_len)
