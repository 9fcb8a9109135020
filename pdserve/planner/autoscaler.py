"""``Autoscaler``: target pool sizes from periodic load snapshots, on the planner's
sizing (pure logic: no Ray, no clock). ``autoscale.py`` runs it against a live cluster.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from itertools import pairwise

from pdserve.planner.sizing import Plan, Planner


@dataclass(frozen=True)
class PoolLoad:
    """One pool's live load, summed (or averaged, ``kv_usage``) over its workers."""

    workers: int  # workers in the pool, including any being started (the last target)
    waiting: int = 0  # requests queued for the pool (decode: waiting for KV or a slot)
    running: int = 0  # requests in the engines' running batches (decode: batch size)
    kv_usage: float = 0.0  # mean KV-cache occupancy 0..1
    prefill_tokens_per_s: float = 0.0  # prompt tokens computed per second (prefill pool)


@dataclass(frozen=True)
class LoadSnapshot:
    """What the cluster looks like now (one per autoscale period)."""

    prefill: PoolLoad
    decode: PoolLoad
    arrival_rate: float | None = None  # req/s; None: prefill tokens/s / prompt length
    ttft_p90_ms: float | None = None  # over the last period; None when unknown
    tpot_p90_ms: float | None = None
    prompt_len: float | None = None  # observed mean lengths; None: the configured ones
    output_len: float | None = None


POOLS = ("prefill", "decode")


class Autoscaler:
    """Target pool sizes from periodic ``LoadSnapshot``s (pure logic: no Ray, no clock).

    Call ``decide(snapshot)`` once per period (e.g. every 10-30 s) with the pools'
    current sizes and load; apply the returned ``{"prefill": P, "decode": D}`` with the
    cluster's scaling API. ``reasons`` then says why each pool moved (or did not).
    Rules per pool, every step within ``planner.bounds`` and at most one worker:

    * **required** = ``planner.plan(rate, prompt_len, output_len)``'s size for the
      pool (rate = ``arrival_rate``, else prefill tokens/s / prompt length; rate <= 0:
      the minimum). Below it, the pool grows by one per decision.
    * **at risk** (grow by one even if the plan says the size suffices): prefill: TTFT
      p90 > ``up_fraction`` x SLO, or the prefill queue grew in each of the last
      ``queue_growth`` snapshots; decode: TPOT p90 > ``up_fraction`` x SLO, the decode
      queue grew ``queue_growth`` times running, KV occupancy >= ``kv_high``, or the
      running batch per worker > ``up_fraction`` x the largest batch within the TPOT
      SLO. For ``settle`` decisions after a pool changed, its risk signals are not
      acted on (a new worker needs time to take load); the rate rule still is.
    * **down** by one only after the requirement has been below the current size for
      ``cooldown`` consecutive snapshots with no risk and the pool's observed p90
      at most ``down_fraction`` x SLO (the band between ``down_fraction`` and
      ``up_fraction`` is the hysteresis); then the count starts again. Never below
      the requirement.

    ``workers`` in a snapshot must count workers being started, so a decision is not
    repeated while its worker comes up.
    """

    def __init__(self, planner: Planner, prompt_len: int, output_len: int, *,
                 up_fraction: float = 0.9, down_fraction: float = 0.7, queue_growth: int = 3,
                 cooldown: int = 5, settle: int = 2, kv_high: float = 0.9) -> None:
        if not 0 < down_fraction < up_fraction:
            raise ValueError("need 0 < down_fraction < up_fraction")
        if queue_growth < 1 or cooldown < 1 or settle < 0:
            raise ValueError("need queue_growth >= 1, cooldown >= 1, settle >= 0")
        if not 0 < kv_high <= 1:
            raise ValueError("kv_high must be in (0, 1]")
        self.planner = planner
        self.prompt_len = prompt_len
        self.output_len = output_len
        self.up_fraction = up_fraction
        self.down_fraction = down_fraction
        self.queue_growth = queue_growth
        self.cooldown = cooldown
        self.settle = settle
        self.kv_high = kv_high
        self._waiting = {p: deque[int](maxlen=queue_growth + 1) for p in POOLS}
        self._lower = dict.fromkeys(POOLS, 0)
        self._settling = dict.fromkeys(POOLS, 0)
        self.reasons: dict[str, str] = {}
        self.last_plan: Plan | None = None

    def _required(self, snap: LoadSnapshot, n_in: int, n_out: int) -> dict[str, int]:
        rate = snap.arrival_rate
        if rate is None:
            rate = snap.prefill.prefill_tokens_per_s / n_in
        b = self.planner.bounds
        if rate <= 0:
            self.last_plan = None
            return {"prefill": b.min_prefill, "decode": b.min_decode}
        self.last_plan = self.planner.plan(rate, n_in, n_out)
        return self.last_plan.sizes

    def _growing(self, pool: str) -> bool:
        h = self._waiting[pool]
        return len(h) == h.maxlen and all(a < b for a, b in pairwise(h))

    def _risk(self, pool: str, load: PoolLoad, snap: LoadSnapshot, bslo: int) -> str | None:
        slo = self.planner.slo
        p90, target = ((snap.ttft_p90_ms, slo.ttft_ms) if pool == "prefill"
                       else (snap.tpot_p90_ms, slo.tpot_ms))
        name = "TTFT" if pool == "prefill" else "TPOT"
        if p90 is not None and p90 > self.up_fraction * target:
            return f"{name} p90 {p90:.1f} ms > {self.up_fraction:g} x SLO {target:g} ms"
        if self._growing(pool):
            return f"queue grew {self.queue_growth} times running ({load.waiting} waiting)"
        if pool == "decode":
            if load.kv_usage >= self.kv_high:
                return f"KV occupancy {load.kv_usage:.0%} >= {self.kv_high:.0%}"
            if bslo and load.workers and load.running / load.workers > self.up_fraction * bslo:
                return (f"batch {load.running / load.workers:.1f} per worker near the "
                        f"TPOT limit {bslo}")
        return None

    def _safe(self, pool: str, load: PoolLoad, snap: LoadSnapshot) -> bool:
        slo = self.planner.slo
        p90, target = ((snap.ttft_p90_ms, slo.ttft_ms) if pool == "prefill"
                       else (snap.tpot_p90_ms, slo.tpot_ms))
        if p90 is not None and p90 > self.down_fraction * target:
            return False
        return not (pool == "decode" and load.kv_usage >= self.down_fraction * self.kv_high)

    def decide(self, snap: LoadSnapshot) -> dict[str, int]:
        n_in = max(1, round(snap.prompt_len or self.prompt_len))
        n_out = max(2, round(snap.output_len or self.output_len))
        required = self._required(snap, n_in, n_out)
        _, bslo = self.planner.decode_limits(n_in, n_out)
        out: dict[str, int] = {}
        for pool in POOLS:
            load: PoolLoad = getattr(snap, pool)
            cur, req = load.workers, required[pool]
            self._waiting[pool].append(load.waiting)
            settling = self._settling[pool] > 0
            self._settling[pool] = max(0, self._settling[pool] - 1)
            risk = self._risk(pool, load, snap, bslo)
            lo = getattr(self.planner.bounds, f"min_{pool}")
            hi = getattr(self.planner.bounds, f"max_{pool}")
            lowering = req < cur and not risk and self._safe(pool, load, snap)
            self._lower[pool] = self._lower[pool] + 1 if lowering else 0
            target, why = cur, f"hold at {cur} (required {req})"
            if cur > hi:
                target, why = cur - 1, f"above --max-{pool} {hi}"
            elif req > cur:
                target, why = cur + 1, f"rate needs {req}"
            elif risk and not settling:
                target, why = cur + 1, f"at risk: {risk}"
            elif risk:
                why = f"hold at {cur}: settling after a change ({risk})"
            elif lowering and self._lower[pool] >= self.cooldown:
                target, why = cur - 1, f"required {req} for {self._lower[pool]} snapshots"
            elif lowering:
                why = f"hold at {cur}: required {req}, cool-down {self._lower[pool]}/{self.cooldown}"
            target = max(cur - 1, min(cur + 1, max(lo, min(hi, target))))
            if target != cur:
                self._lower[pool] = 0
                self._settling[pool] = self.settle
            out[pool] = target
            self.reasons[pool] = why
        return out
