"""``pdserve plan --simulate``: choose prefill:decode counts and the tensor-parallel
degree by simulated goodput, not by the closed-form queueing model alone.

For each tensor-parallel degree asked (``--tp-options``), the closed-form planner
(``planner/sizing.py``) proposes prefill and decode counts; the simulator then runs
that size and its neighbours (one more or one fewer of each), and the colocated
deployments of as many GPUs, under the user's workload (Poisson arrivals at
``--rate`` of ``--prompt-len`` / ``--output-len`` requests, ``--duration`` seconds of
them) and SLOs. The choice: the fewest GPUs whose simulated SLO attainment reaches
the target (90%: DistServe's), then the highest attainment, then the most headroom.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from pdserve.client.bench import BenchConfig
from pdserve.cluster.config import ClusterConfig, PoolConfig
from pdserve.planner.sizing import SLO, Bounds, Planner
from pdserve.planner.step_times import StepTimes
from pdserve.sim.deployment import build
from pdserve.sim.link import Link
from pdserve.sim.run import simulate
from pdserve.sim.workload import plan as plan_workload

TARGET = 0.9  # SLO attainment a size must reach (DistServe's goodput convention)


@dataclass(frozen=True)
class Candidate:
    prefill: int
    decode: int
    colocated: int
    tp: int

    @property
    def gpus(self) -> int:
        return (self.prefill + self.decode + self.colocated) * self.tp

    def describe(self) -> str:
        parts = ([f"{self.prefill}P+{self.decode}D"] if self.prefill else []) + (
            [f"{self.colocated} colocated"] if self.colocated else [])
        return " + ".join(parts) + f" at TP {self.tp} ({self.gpus} GPUs)"

    def serve_flags(self, slo: SLO) -> list[str]:
        """``pdserve serve``'s flags for this deployment, its router told ``slo`` (as
        it was simulated)."""
        flags = [f"--prefill-workers {self.prefill}", f"--decode-workers {self.decode}",
                 f"--colocated-workers {self.colocated}"]
        for pool, n in (("prefill", self.prefill), ("decode", self.decode),
                        ("colocated", self.colocated)):
            if n and self.tp > 1:
                flags.append(f"--{pool}-tensor-parallel-size {self.tp}")
        return [*flags, f"--ttft-slo-ms {slo.ttft_ms:g}", f"--tpot-slo-ms {slo.tpot_ms:g}"]

    def config(self, placement: str = "measured", slo: SLO | None = None) -> dict[str, Any]:
        """The deployment's config; ``slo``: the targets its router is told (``serve
        --ttft-slo-ms --tpot-slo-ms``: the placement rule keeps decodes within TPOT)."""
        def pool(n: int) -> dict[str, Any]:
            return {"workers": n, "tensor_parallel_size": self.tp}

        targets = {} if slo is None else {"ttft_slo_ms": slo.ttft_ms, "tpot_slo_ms": slo.tpot_ms}
        return {"prefill": pool(self.prefill), "decode": pool(self.decode),
                "colocated": pool(self.colocated),
                "router": {"placement": placement, "queue_timeout_s": 600}, **targets}


@dataclass(frozen=True)
class Outcome:
    candidate: Candidate
    attainment: float  # share of requests meeting both SLOs
    goodput_rps: float
    ttft_p90_ms: float
    tpot_p90_ms: float
    placement: dict[str, int]

    def to_dict(self) -> dict[str, Any]:
        c = self.candidate
        return {"prefill_workers": c.prefill, "decode_workers": c.decode,
                "colocated_workers": c.colocated, "tp": c.tp, "gpus": c.gpus,
                "slo_attainment": round(self.attainment, 4),
                "goodput_rps": round(self.goodput_rps, 3),
                "ttft_p90_ms": round(self.ttft_p90_ms, 2),
                "tpot_p90_ms": round(self.tpot_p90_ms, 2), "placement": self.placement}


StepsFor = Callable[[int], StepTimes]  # tp -> step times of one worker


def workload(rate: float, prompt_len: int, output_len: int, duration_s: float,
             slo: SLO, seed: int = 0) -> BenchConfig:
    n = max(50, math.ceil(rate * duration_s))
    return BenchConfig("http://simulated", num_prompts=n, random_input_len=prompt_len,
                       random_output_len=output_len, request_rates=(rate,),
                       goodput={"ttft": slo.ttft_ms, "tpot": slo.tpot_ms},
                       percentile_metrics=("ttft", "tpot"), metric_percentiles=(90.0,),
                       seed=seed)


def evaluate(c: Candidate, steps_for: StepsFor, link: Link, cfg: BenchConfig,
             max_model_len: int, placement: str = "measured") -> Outcome:
    """One candidate under the workload, simulated, its router told the workload's
    SLO (its goodput targets), as a deployment serving it would be."""
    g = cfg.goodput or {}
    slo = SLO(g["ttft"], g["tpot"]) if "ttft" in g and "tpot" in g else None
    cluster = ClusterConfig.from_dict(c.config(placement, slo))

    def steps(pool: PoolConfig) -> StepTimes:
        return steps_for(pool.tensor_parallel_size)

    deployment = build(cluster, steps, "gpu", link, max_model_len)
    rate = cfg.request_rates[0]
    r = simulate(deployment, plan_workload(cfg, rate, max_model_len), cfg, rate, {})
    return Outcome(c, r["slo_attainment"] or 0.0, r["request_goodput"] or 0.0,
                   r["p90_ttft_ms"], r["p90_tpot_ms"], r["simulation"]["placement"])


def candidates(steps_for: StepsFor, tps: tuple[int, ...], slo: SLO, bounds: Bounds,
               rate: float, prompt_len: int, output_len: int,
               max_gpus: int | None) -> Iterator[Candidate]:
    """The closed-form sizes per TP degree and their neighbours, and colocated
    deployments of the same GPU counts (each once)."""
    seen = set()
    for tp in tps:
        sized = Planner(steps_for(tp), slo, bounds).plan(rate, prompt_len, output_len)
        p0, d0 = sized.prefill.workers, sized.decode.workers
        pairs = [Candidate(p, d, 0, tp) for p in (p0 - 1, p0, p0 + 1)
                 for d in (d0 - 1, d0, d0 + 1)
                 if bounds.min_prefill <= p <= bounds.max_prefill
                 and bounds.min_decode <= d <= bounds.max_decode]
        colocated = [Candidate(0, 0, n, tp) for n in range(max(1, p0 + d0 - 2), p0 + d0 + 3)]
        for c in pairs + colocated:
            if c not in seen and (max_gpus is None or c.gpus <= max_gpus):
                seen.add(c)
                yield c


def choose(outcomes: list[Outcome], slo: SLO, target: float = TARGET) -> Outcome | None:
    """The fewest GPUs reaching ``target`` attainment; among those, the highest
    attainment, then the most headroom (p90 TTFT and TPOT as shares of their SLOs)."""
    ok = [o for o in outcomes if o.attainment >= target]
    if not ok:
        return None
    return min(ok, key=lambda o: (o.candidate.gpus, -o.attainment,
                                  o.ttft_p90_ms / slo.ttft_ms + o.tpot_p90_ms / slo.tpot_ms))


def run(args: Any) -> int:
    """``pdserve plan --simulate`` (the planner's flags; ``planner/cli.py``): 0 when a
    size reaches the attainment target, 1 when none within the bounds does."""
    import argparse
    import json

    from pdserve.planner.cli import require, times_from_args
    from pdserve.sim.link import get_link

    require(args, ("rate", "prompt_len", "output_len", "ttft_slo", "tpot_slo"))
    if not args.rate > 0:
        raise ValueError(f"--rate must be > 0 req/s, got {args.rate}")
    if not args.duration > 0:
        raise ValueError(f"--duration must be > 0 s, got {args.duration}")
    tps = tuple(int(t) for t in str(args.tp_options or args.tp).split(","))
    if any(t < 1 for t in tps):
        raise ValueError(f"--tp-options must be degrees >= 1, got {args.tp_options!r}")
    if args.profile and tps != (1,):
        raise ValueError("a profile is one worker of one rank: --tp-options needs --hardware")
    cache: dict[int, StepTimes] = {}

    def steps_for(tp: int) -> StepTimes:
        if tp not in cache:
            cache[tp] = times_from_args(argparse.Namespace(**{**vars(args), "tp": tp}))
        return cache[tp]

    gpu = not args.profile and str(args.hardware).lower() != "cpu"
    link = get_link(args.link or ("infiniband" if gpu else "nixl-cpu"))
    slo = SLO(args.ttft_slo, args.tpot_slo)
    bounds = Bounds(args.min_prefill, args.max_prefill, args.min_decode, args.max_decode)
    cfg = workload(args.rate, args.prompt_len, args.output_len, args.duration, slo)
    max_len = args.prompt_len + args.output_len
    outcomes = [evaluate(c, steps_for, link, cfg, max_len)
                for c in candidates(steps_for, tps, slo, bounds, args.rate, args.prompt_len,
                                    args.output_len, args.max_gpus)]
    best = choose(outcomes, slo)
    serve = None if best is None else " ".join(["pdserve serve", *best.candidate.serve_flags(slo)])
    if args.json:
        print(json.dumps({"choice": best.to_dict() if best else None, "serve": serve,
                          "candidates": [o.to_dict() for o in outcomes]}))
    else:
        print(f"{'candidate':<34}{'attainment':>11}{'goodput':>9}{'TTFT p90':>10}{'TPOT p90':>10}")
        for o in sorted(outcomes, key=lambda o: (o.candidate.gpus, -o.goodput_rps)):
            print(f"{o.candidate.describe():<34}{100 * o.attainment:>10.1f}%"
                  f"{o.goodput_rps:>9.2f}{o.ttft_p90_ms:>10.1f}{o.tpot_p90_ms:>10.1f}")
        print(f"choice: {best.candidate.describe()}\nserve it: {serve}" if best else
              f"no candidate reaches {100 * TARGET:.0f}% of requests within both SLOs")
    return 0 if best else 1
