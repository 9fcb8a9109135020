"""The Ray actors: the one place where workers become actors.

Each actor builds its worker (a plain class) and forwards calls to it. Actors are
async so that many in-flight prefills (each awaiting its transfer's ack) do not
each hold a thread; blocking waits go through the worker's futures.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import ray

from pdserve.deploy.config import PoolConfig
from pdserve.engine.sampling_params import SamplingParams
from pdserve.messages import DecodeOutput, PrefillResult, PrefillTask, WorkerStats


def _device() -> str:
    import torch

    return "cuda" if ray.get_gpu_ids() and torch.cuda.is_available() else "cpu"


class _MetricsMixin:
    """Starts the worker's own ``/metrics`` server next to it."""

    worker: Any

    def _serve_metrics(self, model_dir: str, loopback: bool) -> None:
        from pdserve.deploy.worker_metrics import serve_worker_metrics

        self.metrics_host = "127.0.0.1" if loopback else ray.util.get_node_ip_address()
        self.metrics_port = serve_worker_metrics(
            os.path.basename(model_dir), lambda: self.worker.stats().result(timeout=10),
            host=self.metrics_host)

    async def metrics_address(self) -> tuple[str, int]:
        return self.metrics_host, self.metrics_port


class PrefillActor(_MetricsMixin):
    def __init__(self, worker_id: str, model_dir: str, pool: PoolConfig, transfer: str,
                 transfer_options: dict[str, Any], loopback: bool) -> None:
        from pdserve.prefill_worker.worker import PrefillWorker

        self.worker = PrefillWorker(worker_id, model_dir, pool.engine_config("prefill", _device()),
                                    transfer, transfer_options)
        self._serve_metrics(model_dir, loopback)

    async def ping(self) -> int:
        return os.getpid()

    async def connect(self, decode_worker: str, endpoint: dict[str, Any]) -> None:
        await asyncio.wrap_future(self.worker.connect(decode_worker, endpoint))

    async def prefill(self, task: PrefillTask) -> PrefillResult:
        return await asyncio.wrap_future(self.worker.submit(task))

    async def abort(self, request_id: str) -> None:
        self.worker.abort(request_id)

    async def stats(self) -> WorkerStats:
        return await asyncio.wrap_future(self.worker.stats())

    async def check_integrity(self) -> None:
        await asyncio.wrap_future(self.worker.check_integrity())


class DecodeActor(_MetricsMixin):
    def __init__(self, worker_id: str, model_dir: str, pool: PoolConfig, transfer: str,
                 transfer_options: dict[str, Any], kv_timeout_s: float, loopback: bool) -> None:
        from pdserve.decode_worker.worker import DecodeWorker

        if transfer in ("torch", "nixl") and not loopback and "host" not in transfer_options:
            # The receiver listens where prefill workers on other nodes can reach it.
            transfer_options = {**transfer_options, "host": ray.util.get_node_ip_address()}
        self.worker = DecodeWorker(worker_id, model_dir, pool.engine_config("decode", _device()),
                                   transfer, transfer_options, kv_timeout_s)
        self._serve_metrics(model_dir, loopback)

    async def ping(self) -> int:
        return os.getpid()

    async def endpoint(self) -> dict[str, Any]:
        return await asyncio.wrap_future(self.worker.endpoint())

    async def reserve(self, request_id: str, prompt_token_ids: list[int],
                      params: SamplingParams) -> list[int] | None:
        return await asyncio.wrap_future(self.worker.reserve(request_id, prompt_token_ids, params))

    async def abort(self, request_id: str) -> None:
        self.worker.abort(request_id)

    async def poll_outputs(self, timeout_s: float) -> list[DecodeOutput]:
        return await asyncio.to_thread(self.worker.poll_outputs, timeout_s)

    async def stats(self) -> WorkerStats:
        return await asyncio.wrap_future(self.worker.stats())

    async def check_integrity(self) -> None:
        await asyncio.wrap_future(self.worker.check_integrity())


def actor_options(pool: PoolConfig, cluster_has_gpus: bool, name: str) -> dict[str, Any]:
    gpus = pool.num_gpus if pool.num_gpus is not None else (1 if cluster_has_gpus else 0)
    return {
        "num_cpus": pool.num_cpus,
        "num_gpus": gpus,
        "resources": dict(pool.resources),
        "name": name,
        "max_concurrency": 1000,  # concurrent awaits, not threads
        "max_restarts": 0,  # the router retries on live workers instead
    }


RemotePrefill = ray.remote(PrefillActor)
RemoteDecode = ray.remote(DecodeActor)
