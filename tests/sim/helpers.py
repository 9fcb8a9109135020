"""Deployments the simulator tests share: a small GPU model on the analytic step
times (quick to simulate, no measuring)."""

from __future__ import annotations

from typing import Any

from pdserve.client.bench import BenchConfig
from pdserve.cluster.config import ClusterConfig, PoolConfig
from pdserve.planner.step_times import (
    AnalyticModel,
    StepTimes,
    resolve_hardware,
    resolve_model_config,
)
from pdserve.sim.deployment import Deployment, build
from pdserve.sim.link import get_link

MODEL = resolve_model_config("llama-3-8b")
H100 = resolve_hardware("h100")


def analytic(pool: PoolConfig) -> StepTimes:
    return AnalyticModel(MODEL, H100, tp=pool.tensor_parallel_size)


def deployment(config: dict[str, Any], link: str = "infiniband") -> Deployment:
    return build(ClusterConfig.from_dict(config), analytic, "gpu", get_link(link), 8192)


def workload(**kw: Any) -> BenchConfig:
    base: dict[str, Any] = {"num_prompts": 120, "random_input_len": 1024,
                            "random_output_len": 64, "random_range_ratio": 0.5,
                            "percentile_metrics": ("ttft", "tpot", "itl", "e2el"),
                            "metric_percentiles": (50.0, 90.0, 99.0)}
    return BenchConfig("http://simulated", **{**base, **kw})
