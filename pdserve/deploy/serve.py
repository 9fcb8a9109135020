"""``pdserve serve``: a cluster, a router and its endpoints, until Ctrl-C.

Also ``run_disaggregated``: one request through a fresh 1 prefill + 1 decode
cluster, for ``pdserve generate --disaggregated``.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
import uuid

from prometheus_client import CollectorRegistry, start_http_server

from pdserve.deploy.cluster import Cluster
from pdserve.deploy.config import ClusterConfig
from pdserve.engine.sampling_params import SamplingParams
from pdserve.router.grpc_server import start_grpc_server
from pdserve.router.metrics import RouterMetrics
from pdserve.router.types import FinalChunk, GenerateRequest, StreamChunk


def _progress(msg: str) -> None:
    print(f"[pdserve] {msg}", file=sys.stderr, flush=True)


async def serve(cfg: ClusterConfig, stop: asyncio.Event | None = None,
                num_cpus: int | None = None) -> None:
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    cluster = Cluster(cfg, num_cpus=num_cpus, progress=_progress)
    grpc_server = None
    router = None
    try:
        await asyncio.to_thread(cluster.start)
        assert cluster.model_dir is not None
        registry = CollectorRegistry()
        router = cluster.make_router(RouterMetrics(registry, cluster.model_dir.name))
        await router.start()
        grpc_server, grpc_port = await start_grpc_server(router, cfg.host, cfg.grpc_port)
        http, _ = start_http_server(cfg.http_port, addr=cfg.host, registry=registry)
        _progress(f"gRPC   {cfg.host}:{grpc_port} (pdserve.v1.Generation, grpc.health.v1)")
        _progress(f"HTTP   http://{cfg.host}:{http.server_port}/metrics (router)")
        for wid, (host, port) in cluster.metrics_targets().items():
            _progress(f"worker {wid}: http://{host}:{port}/metrics")
        _progress(f"serving {cluster.model_dir.name} with {cfg.prefill.workers} prefill + "
                  f"{cfg.decode.workers} decode workers over {cfg.transfer}; Ctrl-C stops")
        await stop.wait()
        http.shutdown()
    finally:
        _progress("shutting down")
        if grpc_server is not None:
            await grpc_server.stop(grace=2)
        if router is not None:
            await router.stop()
        cluster.shutdown()


async def run_disaggregated(cfg: ClusterConfig, prompt_token_ids: list[int],
                            params: SamplingParams, num_cpus: int | None = None,
                            ) -> tuple[list[int], str, FinalChunk]:
    """One request through a fresh cluster; returns (token ids, text, final)."""
    cluster = Cluster(cfg, num_cpus=num_cpus, progress=_progress)
    try:
        await asyncio.to_thread(cluster.start)
        router = cluster.make_router()
        await router.start()
        tokens: list[int] = []
        text = ""
        try:
            req = GenerateRequest(uuid.uuid4().hex, params, prompt_token_ids=prompt_token_ids)
            async for item in router.generate(req):
                if isinstance(item, StreamChunk):
                    tokens += item.token_ids
                    text += item.text
                else:
                    return tokens, text, item
        finally:
            await router.stop()
        raise RuntimeError("stream ended without a final message")
    finally:
        cluster.shutdown()
