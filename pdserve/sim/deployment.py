"""What is simulated: ``pdserve serve``'s deployment (``ClusterConfig``: pools, their
engines and tensor parallelism, the router's policy and placement, the SLOs) with a
step-time source and a link.

Step times: ``--profile FILE`` (measured by ``pdserve plan --measure-profile`` on the
target machine: every pool steps as that profile says) or ``--hardware NAME --model
M`` (``AnalyticModel``: each pool at its own tensor-parallel degree). A worker's KV
blocks: its engine's ``num_blocks`` or ``kv_cache_bytes`` when the config sets them,
else the step source's capacity (a GPU's memory less the weights; a profile's
engine's default cache).

The placement rule reads each worker's step costs (``Compute``) as a real worker
publishes them (``worker/step_fit.py``); here they are the step model's own, at the
workload's mean context.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from pdserve.cluster.config import ClusterConfig, PoolConfig
from pdserve.engine.results import StepInfo
from pdserve.messages import Compute, StepCost
from pdserve.planner.step_times import StepTimes
from pdserve.router.placement import MIN_STEPS, Slo
from pdserve.sim.engine import EngineShape
from pdserve.sim.link import Link
from pdserve.sim.router import Overheads
from pdserve.sim.workers import StepScale

# The router's and the worker loop's own costs when nothing better is known: small
# fixed guesses (a GPU deployment's Python router on cores of its own), not
# measurements. `benchmarks/simulate.py` calibrates them per deployment against served
# runs (on this machine's two shared cores the router's cost per request came out at
# 14-67 ms); give `--overheads-ms` what that, or your own served runs, measured.
DEFAULT_OVERHEADS = Overheads(request_s=2.0e-3, call_s=0.5e-3, token_s=0.3e-3)
DEFAULT_STEP_OVERHEAD_S = 0.5e-3


@dataclass(frozen=True)
class PoolPlan:
    role: str
    workers: int
    shape: EngineShape
    steps: StepTimes
    ranks: int  # tensor-parallel degree (the link's parallel lanes)


@dataclass(frozen=True)
class Deployment:
    cluster: ClusterConfig
    pools: tuple[PoolPlan, ...]
    link: Link
    max_model_len: int
    slo: Slo = field(default_factory=Slo)
    overheads: Overheads = DEFAULT_OVERHEADS
    step_overhead_s: float = DEFAULT_STEP_OVERHEAD_S
    # the served engine's steps over the step model's: 1 where the workers have their
    # cores to themselves; more where the router and the client share them (measured:
    # benchmarks/simulate.py calibrates it from single streams)
    step_scale: StepScale = field(default_factory=StepScale)

    def describe(self) -> str:
        parts = [f"{p.workers} {p.role}" + (f" (TP {p.ranks})" if p.ranks > 1 else "")
                 for p in self.pools if p.workers]
        return ", ".join(parts) + f"; link {self.link.name}"


def with_overheads(d: Deployment, text: str) -> Deployment:
    """``d`` with the costs ``request=MS,call=MS,token=MS,step=MS`` (any of them) given."""
    given: dict[str, float] = {}
    for part in text.split(","):
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep or key not in ("request", "call", "token", "step"):
            raise ValueError(f"--overheads-ms: expected request=MS,call=MS,token=MS,step=MS; "
                             f"got {part!r}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"--overheads-ms: {key}={value!r} is not a number") from None
        if not ms >= 0:
            raise ValueError(f"--overheads-ms: {key} must be >= 0 ms, got {value}")
        given[key] = ms / 1e3
    o = d.overheads
    return replace(d, overheads=Overheads(given.get("request", o.request_s),
                                          given.get("call", o.call_s),
                                          given.get("token", o.token_s)),
                   step_overhead_s=given.get("step", d.step_overhead_s))


def build(cluster: ClusterConfig, steps_for: Callable[[PoolConfig], StepTimes], device: str,
          link: Link, max_model_len: int) -> Deployment:
    """``steps_for(pool)``: the step times of one of the pool's workers."""
    pools = []
    for role, pool in (("prefill", cluster.prefill), ("decode", cluster.decode),
                       ("colocated", cluster.colocated_pool)):
        if role != "colocated" and (cluster.prefill.workers == 0 or cluster.decode.workers == 0):
            continue  # pairs need both pools
        if pool.workers == 0:
            continue
        steps = steps_for(pool)
        pools.append(PoolPlan(role, pool.workers, _shape(pool, role, device, steps), steps,
                              pool.tensor_parallel_size))
    if not pools:
        raise ValueError("the deployment has no workers: give prefill and decode workers, "
                         "or colocated ones")
    slo = Slo(None if cluster.ttft_slo_ms is None else cluster.ttft_slo_ms / 1e3,
              None if cluster.tpot_slo_ms is None else cluster.tpot_slo_ms / 1e3)
    return Deployment(cluster, tuple(pools), link, max_model_len, slo)


def _shape(pool: PoolConfig, role: str, device: str, steps: StepTimes) -> EngineShape:
    cfg = pool.engine_config(role, device)
    bs = cfg.block_size
    if cfg.num_blocks is not None:
        blocks = cfg.num_blocks
    elif "kv_cache_bytes" in pool.engine:
        blocks = cfg.kv_cache_bytes // (steps.kv_bytes_per_token * bs)
    else:
        tokens = steps.default_kv_tokens
        if tokens is None:
            raise ValueError(f"the {role} pool's KV cache size is unknown: set "
                             "engine: {num_blocks: N}")
        blocks = tokens // bs
    if blocks < 2:
        raise ValueError(f"the {role} pool's workers hold {blocks} KV blocks: the model "
                         "does not fit (more tensor parallelism, or a bigger device)")
    return EngineShape(blocks, bs, cfg.max_num_batched_tokens, cfg.max_num_seqs,
                       cfg.enable_prefix_caching)


# ---------------------------------------------------- what placement reads
PROMPT_SIZES = (16, 64, 256, 1024, 4096)


def compute_of(steps: StepTimes, context: float, max_rows: int, max_len: int) -> Compute:
    """The step costs a worker stepping as ``steps`` would publish, fitted the way
    ``worker/step_fit.py`` fits its own: decode steps by batch size (at ``context``
    tokens each), prompt steps as a fixed part plus per token and per attended pair."""
    rows, table = 1, []
    while rows <= max_rows:
        table.append((float(rows), steps.decode_ms(rows, context) / 1e3))
        rows *= 2
    sizes = [n for n in PROMPT_SIZES if n < max_len] or [max(1, max_len - 1)]
    x = np.array([[1.0, n, n * (n + 1) / 2] for n in sizes])
    y = np.array([steps.step_ms(StepInfo(1, n, 0, n, 0.0)) / 1e3 for n in sizes])
    base, token, pair = np.linalg.lstsq(x, y, rcond=None)[0]
    cost = StepCost(tuple(table), max(0.0, float(base)), max(0.0, float(token)),
                    max(0.0, float(pair)), 10 * MIN_STEPS, 10 * MIN_STEPS)
    return Compute(1, 1, None, {1: cost})
