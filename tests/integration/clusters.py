"""Bringing up a Ray cluster of prefill and decode pools for a test, and one request
through its router (test_ray_cluster.py, test_scaling.py, test_tp_disaggregated.py)."""

from __future__ import annotations

from pathlib import Path

from pdserve.cluster.cluster import Cluster
from pdserve.cluster.config import ClusterConfig
from pdserve.engine.sampling.sampling_params import SamplingParams
from pdserve.router.router import Router
from pdserve.router.types import FinalChunk, GenerateRequest
from tests.inprocess import collect

GREEDY = SamplingParams(max_tokens=20, ignore_eos=True)


def start(model: Path, transfer: str, prefill: int = 1, decode: int = 1,
          decode_engine: dict[str, object] | None = None, **router: object) -> Cluster:
    cfg = ClusterConfig.from_dict({
        "model": str(model), "transfer": transfer,
        "prefill": {"workers": prefill, "num_cpus": 1, "engine": {"num_blocks": 128}},
        "decode": {"workers": decode, "num_cpus": 1,
                   "engine": decode_engine or {"num_blocks": 512}},
        # tests of the disaggregated path: every prompt goes to a prefill worker
        "router": {"queue_timeout_s": 60, "placement": "static", **router},
        "kv_timeout_s": 10,
    })
    cluster = Cluster(cfg)
    cluster.start()
    return cluster


async def run_one(router: Router, rid: str, prompt: list[int], params: SamplingParams = GREEDY,
                  ) -> tuple[list[int], str, FinalChunk]:
    return await collect(router.generate(GenerateRequest(rid, params, prompt_token_ids=prompt)))
