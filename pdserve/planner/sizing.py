"""``pdserve plan``: size the prefill and decode pools for a rate and two SLOs, on the
step times of ``step_times.py``. Formulas and their limits are in ``docs/planner.md``;
in short:

* a prefill worker is an M/D/1 queue: at utilisation rho = (R/P)·S the predicted
  TTFT is ``S·(1 + rho / (2·(1 - rho)))`` (S = prefill time), so the most it serves
  within the TTFT SLO T is ``rho_max / S`` with ``rho_max = 2x / (1 + 2x)``,
  ``x = T/S - 1``;
* a decode worker runs the largest batch B whose step time meets the TPOT SLO and
  whose requests fit its KV cache (and ``max_batch``): ``B / ((M - 1)·decode_ms(B))``
  requests/s (context = N + M/2, the mean over a request's decode);
* P and D are the smallest counts within the bounds whose capacity covers R.

The command line is ``cli.py``; the live decision is ``autoscaler.py``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from pdserve.engine import defaults
from pdserve.planner.step_times import StepTimes


@dataclass(frozen=True)
class SLO:
    ttft_ms: float
    tpot_ms: float

    def __post_init__(self) -> None:
        for name in ("ttft_ms", "tpot_ms"):
            v = getattr(self, name)
            if not v > 0:
                raise ValueError(f"--{name.split('_')[0]}-slo must be > 0 ms, got {v}")


@dataclass(frozen=True)
class Bounds:
    min_prefill: int = 1
    max_prefill: int = 64
    min_decode: int = 1
    max_decode: int = 64

    def __post_init__(self) -> None:
        for pool in ("prefill", "decode"):
            lo, hi = getattr(self, f"min_{pool}"), getattr(self, f"max_{pool}")
            if lo < 0 or hi < 1 or lo > hi:
                raise ValueError(f"bad {pool} bounds: need 0 <= --min-{pool} ({lo}) <= "
                                 f"--max-{pool} ({hi}) and --max-{pool} >= 1")

    def clamp(self, pool: str, n: int) -> int:
        return max(getattr(self, f"min_{pool}"), min(getattr(self, f"max_{pool}"), n))


@dataclass(frozen=True)
class PrefillEstimate:
    workers: int
    prefill_ms: float  # one prompt, unloaded
    capacity_rps: float  # per worker, with the predicted TTFT within the SLO
    utilisation: float  # rho = (rate / workers) x prefill time
    ttft_ms: float | None  # predicted mean (M/D/1) at rho; None when rho >= 1


@dataclass(frozen=True)
class DecodeEstimate:
    workers: int
    step_ms_batch1: float  # the TPOT floor
    max_batch: int  # largest batch within the TPOT SLO that fits KV and max_batch
    batch_limit: int  # what KV and max_batch allow, SLO aside
    capacity_rps: float  # per worker, at max_batch
    utilisation: float  # (rate / workers) / capacity
    batch: float | None  # steady-state running requests per worker (Little's law)
    tpot_ms: float | None  # predicted at that batch; None when the pool cannot keep up


@dataclass(frozen=True)
class Plan:
    rate: float
    prompt_len: int
    output_len: int
    slo: SLO
    prefill: PrefillEstimate
    decode: DecodeEstimate
    goodput_rps: float  # the most of `rate` these sizes serve within both SLOs
    problems: tuple[str, ...]  # empty when feasible
    model: str

    @property
    def feasible(self) -> bool:
        return not self.problems

    @property
    def sizes(self) -> dict[str, int]:
        return {"prefill": self.prefill.workers, "decode": self.decode.workers}

    @property
    def ratio(self) -> str:
        return f"{self.prefill.workers}:{self.decode.workers}"

    def to_dict(self) -> dict[str, Any]:
        def num(v: float | None, nd: int = 3) -> float | None:
            return None if v is None or math.isinf(v) else round(v, nd)

        p, d = self.prefill, self.decode
        return {
            "feasible": self.feasible, "problems": list(self.problems),
            "prefill_workers": p.workers, "decode_workers": d.workers, "ratio": self.ratio,
            "ttft_ms": num(p.ttft_ms), "tpot_ms": num(d.tpot_ms),
            "goodput_rps": num(self.goodput_rps, 4), "rate_rps": self.rate,
            "prompt_len": self.prompt_len, "output_len": self.output_len,
            "ttft_slo_ms": self.slo.ttft_ms, "tpot_slo_ms": self.slo.tpot_ms,
            "prefill": {"workers": p.workers, "prefill_ms": num(p.prefill_ms),
                        "capacity_rps_per_worker": num(p.capacity_rps, 4),
                        "utilisation": num(p.utilisation, 4), "ttft_ms": num(p.ttft_ms)},
            "decode": {"workers": d.workers, "step_ms_batch1": num(d.step_ms_batch1),
                       "max_batch": d.max_batch, "batch_limit": d.batch_limit,
                       "capacity_rps_per_worker": num(d.capacity_rps, 4),
                       "utilisation": num(d.utilisation, 4), "batch": num(d.batch, 2),
                       "tpot_ms": num(d.tpot_ms)},
            "model": self.model,
        }

    def describe(self) -> str:
        p, d = self.prefill, self.decode

        def ms(v: float | None) -> str:
            return "unbounded (queue grows)" if v is None else f"{v:.1f} ms"

        lines = [
            f"pdserve plan: {self.model}",
            f"  workload: {self.rate:g} req/s, {self.prompt_len}-token prompts, "
            f"{self.output_len} output tokens; SLOs TTFT {self.slo.ttft_ms:g} ms, "
            f"TPOT {self.slo.tpot_ms:g} ms",
            f"  {'recommended' if self.feasible else 'best within bounds'} P:D = {self.ratio}",
            f"  prefill {p.workers:>3} worker(s): {p.prefill_ms:.1f} ms per prompt, "
            f"{p.capacity_rps:.3g} req/s each within the TTFT SLO, utilisation "
            f"{p.utilisation:.0%}, predicted TTFT {ms(p.ttft_ms)}",
            f"  decode  {d.workers:>3} worker(s): batch {'-' if d.batch is None else f'{d.batch:.1f}'}"
            f" of at most {d.max_batch} within the TPOT SLO, {d.capacity_rps:.3g} req/s each, "
            f"utilisation {d.utilisation:.0%}, predicted TPOT {ms(d.tpot_ms)}",
            f"  goodput {self.goodput_rps:.3g} req/s of {self.rate:g} within both SLOs",
        ]
        if self.problems:
            lines.append("  NOT FEASIBLE within the bounds:")
            lines += [f"    - {m}" for m in self.problems]
        return "\n".join(lines)


def _ceil(x: float) -> int:
    return max(0, math.ceil(x - 1e-9))


def ttft_mdl(prefill_ms: float, rho: float) -> float | None:
    """Mean TTFT of an M/D/1 queue (Poisson arrivals, deterministic service S):
    S·(1 + rho / (2(1 - rho))); None when rho >= 1 (the queue grows)."""
    if rho >= 1:
        return None
    return prefill_ms * (1 + rho / (2 * (1 - rho)))


class Planner:
    """Pool sizes for a rate and two SLOs on ``times`` (an ``AnalyticModel`` or a
    ``Profile``). ``kv_tokens``: one decode worker's KV capacity in tokens (default:
    the step-time model's); ``max_batch``: the decode engine's ``max_num_seqs``."""

    def __init__(self, times: StepTimes, slo: SLO, bounds: Bounds | None = None, *,
                 max_batch: int = defaults.MAX_NUM_SEQS, kv_tokens: int | None = None,
                 block_size: int = defaults.BLOCK_SIZE) -> None:
        if max_batch < 1:
            raise ValueError(f"--max-batch must be >= 1, got {max_batch}")
        if block_size < 1:
            raise ValueError(f"--block-size must be >= 1, got {block_size}")
        self.times = times
        self.slo = slo
        self.bounds = bounds or Bounds()
        self.max_batch = max_batch
        self.kv_tokens = times.default_kv_tokens if kv_tokens is None else kv_tokens
        self.block_size = block_size

    # per worker
    def prefill_capacity(self, prompt_len: int) -> tuple[float, float]:
        """(prefill ms, req/s one prefill worker serves with mean TTFT <= the SLO)."""
        s = max(self.times.prefill_ms(prompt_len), 1e-9)
        x = self.slo.ttft_ms / s - 1
        if x <= 0:
            return s, 0.0
        return s, (2 * x / (1 + 2 * x)) / s * 1e3

    def decode_limits(self, prompt_len: int, output_len: int) -> tuple[int, int]:
        """(batch KV and max_batch allow, largest such batch within the TPOT SLO)."""
        need = -(-(prompt_len + output_len) // self.block_size) * self.block_size
        limit = self.max_batch
        if self.kv_tokens is not None:
            limit = min(limit, self.kv_tokens // need)
        ctx = prompt_len + output_len / 2
        lo, hi = 0, limit  # largest B in [1, limit] with decode_ms(B) <= SLO (monotone)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.times.decode_ms(mid, ctx) <= self.slo.tpot_ms:
                lo = mid
            else:
                hi = mid - 1
        return limit, lo

    def _steady_batch(self, rate: float, prompt_len: int, output_len: int,
                      limit: int) -> float | None:
        """Running requests per decode worker at ``rate``: b = rate·(M-1)·step(b)."""
        ctx = prompt_len + output_len / 2
        steps = output_len - 1

        def excess(b: float) -> float:
            return rate * steps * self.times.decode_ms(max(b, 1.0), ctx) / 1e3 - b

        if limit < 1 or excess(limit) > 0:
            return None
        lo, hi = 0.0, float(limit)
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if excess(mid) > 0 else (lo, mid)
        return hi

    def plan(self, rate: float, prompt_len: int, output_len: int) -> Plan:
        if not rate > 0:
            raise ValueError(f"--rate must be > 0 req/s, got {rate}")
        if prompt_len < 1:
            raise ValueError(f"--prompt-len must be >= 1, got {prompt_len}")
        if output_len < 2:
            raise ValueError(f"--output-len must be >= 2 (TPOT is between output tokens), "
                             f"got {output_len}")
        b, slo = self.bounds, self.slo
        problems: list[str] = []

        # prefill pool
        s, cap_p = self.prefill_capacity(prompt_len)
        if cap_p <= 0:
            need_p = b.max_prefill
            problems.append(
                f"prefill: the TTFT SLO ({slo.ttft_ms:g} ms) is below the unloaded prefill "
                f"time of a {prompt_len}-token prompt ({s:.1f} ms): no number of prefill "
                "workers meets it (more --tp, faster hardware, or shorter prompts)")
        else:
            need_p = _ceil(rate / cap_p)
            if need_p > b.max_prefill:
                problems.append(
                    f"prefill: {rate:g} req/s needs {need_p} prefill workers to keep TTFT <= "
                    f"{slo.ttft_ms:g} ms (each serves {cap_p:.3g} req/s); --max-prefill is "
                    f"{b.max_prefill}")
        p = b.clamp("prefill", need_p)
        rho = rate / p * s / 1e3 if p else math.inf
        prefill = PrefillEstimate(p, s, cap_p, rho, ttft_mdl(s, rho) if p else None)

        # decode pool
        ctx = prompt_len + output_len / 2
        step1 = self.times.decode_ms(1, ctx)
        limit, bmax = self.decode_limits(prompt_len, output_len)
        cap_d = bmax / ((output_len - 1) * self.times.decode_ms(bmax, ctx) / 1e3) if bmax else 0.0
        if limit < 1:
            need_d = b.max_decode
            problems.append(
                f"decode: a request of {prompt_len}+{output_len} tokens does not fit a decode "
                f"worker's KV cache ({self.kv_tokens} tokens; set --kv-cache-gb)")
        elif bmax < 1:
            need_d = b.max_decode
            problems.append(
                f"decode: the TPOT SLO ({slo.tpot_ms:g} ms) is below a batch-1 decode step "
                f"({step1:.2f} ms): no number of decode workers meets it")
        else:
            need_d = _ceil(rate / cap_d)
            if need_d > b.max_decode:
                problems.append(
                    f"decode: {rate:g} req/s needs {need_d} decode workers to keep TPOT <= "
                    f"{slo.tpot_ms:g} ms (each runs at most batch {bmax}, {cap_d:.3g} req/s); "
                    f"--max-decode is {b.max_decode}")
        d = b.clamp("decode", need_d)
        per_d = rate / d if d else math.inf
        batch = self._steady_batch(per_d, prompt_len, output_len, limit) if d else None
        tpot = None if batch is None else self.times.decode_ms(max(batch, 1.0), ctx)
        decode = DecodeEstimate(d, step1, bmax, limit, cap_d,
                                per_d / cap_d if cap_d else math.inf, batch, tpot)

        goodput = min(rate, p * cap_p, d * cap_d)
        return Plan(rate, prompt_len, output_len, slo, prefill, decode, goodput,
                    tuple(problems), self.times.describe())
