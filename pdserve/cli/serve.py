"""``pdserve serve``: a cluster, a router and its endpoints (gRPC, the OpenAI HTTP API
with ``/health`` and the router's ``/metrics`` on one port, and the Prometheus file-SD
targets file when configured) until Ctrl-C (SIGINT) or SIGTERM, then a graceful drain:
nothing new is admitted and the requests in flight get ``shutdown_timeout_s`` to finish.

Also ``run_disaggregated``: one request through a fresh 1 prefill + 1 decode
cluster, for ``pdserve generate --disaggregated``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
import uuid
from collections.abc import Callable

from prometheus_client import CollectorRegistry

from pdserve.cluster.autoscale import AutoscaleLoop, build_autoscaler
from pdserve.cluster.cluster import Cluster, StartupError
from pdserve.cluster.config import ClusterConfig
from pdserve.cluster.scaler import Scaler
from pdserve.engine import kernels
from pdserve.engine.sampling.sampling_params import SamplingParams
from pdserve.observability.file_sd import FileSD, cluster_targets, target_groups
from pdserve.planner.step_times import Profile
from pdserve.router.api.keys import ApiKeys
from pdserve.router.grpc.server import start_grpc_server
from pdserve.router.http.app import build_app, start_http_server
from pdserve.router.metrics import RouterMetrics
from pdserve.router.router import Router
from pdserve.router.types import FinalChunk, GenerateRequest, StreamChunk


def _progress(msg: str) -> None:
    print(f"[pdserve] {msg}", file=sys.stderr, flush=True)


async def serve(cfg: ClusterConfig, stop: asyncio.Event | None = None,
                num_cpus: int | None = None) -> None:
    # One line per HTTP request (with its request id) and the router's warnings;
    # a logging setup made by the caller wins.
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    _on_stop_signals(loop, stop.set)
    keys = ApiKeys.load(cfg.api_key, cfg.api_key_file)  # a bad key file fails before start-up
    profile = (Profile.load(cfg.autoscale_profile)  # and so does a bad profile
               if cfg.autoscale and cfg.autoscale_profile else None)
    # The CPU kernels: an installed package compiles them at first use -- here, once per
    # machine, not in every worker at once (a no-op where they are built or cannot run)
    await asyncio.to_thread(kernels.load)
    cluster = Cluster(cfg, num_cpus=num_cpus, progress=_progress)
    grpc_server = None
    http_server = None
    router = None
    scaler: Scaler | None = None
    autoscale: AutoscaleLoop | None = None
    file_sd = FileSD(cfg.file_sd_path) if cfg.file_sd_path else None
    tasks: list[asyncio.Task[None]] = []
    try:
        if not await _start(cluster, stop):
            return
        # ray.init (in cluster.start) put Ray's failure-signal handler (absl's) in front
        # of ours: on SIGTERM it printed a stack trace, armed alarm(3) and passed the
        # signal on, and 3 s later SIGALRM aborted the process (SIGABRT) whatever the
        # drain was doing: every graceful shutdown that took longer than that cut its
        # streams. Ours alone again:
        _on_stop_signals(loop, stop.set)
        assert cluster.model_dir is not None
        registry = CollectorRegistry()
        router = cluster.make_router(RouterMetrics(
            registry, cluster.model_dir.name,
            ttft_slo_s=cfg.ttft_slo_ms / 1e3 if cfg.ttft_slo_ms else None,
            tpot_slo_s=cfg.tpot_slo_ms / 1e3 if cfg.tpot_slo_ms else None))
        await router.start()
        scaler = Scaler(cluster, router)
        scaler.start()
        if cfg.autoscale:
            autoscaler = await asyncio.to_thread(build_autoscaler, cfg, cluster.model_dir, profile)
            autoscale = AutoscaleLoop(router, scaler, autoscaler, cfg.autoscale_interval_s)
            autoscale.start()
            _progress(f"autoscaling every {cfg.autoscale_interval_s:g}s: prefill "
                      f"{cfg.autoscale_min_prefill}-{cfg.autoscale_max_prefill}, decode "
                      f"{cfg.autoscale_min_decode}-{cfg.autoscale_max_decode} worker(s) for TTFT "
                      f"{cfg.ttft_slo_ms:g} ms, TPOT {cfg.tpot_slo_ms:g} ms "
                      f"({autoscaler.planner.times.describe()})")
        grpc_server, grpc_port = await start_grpc_server(
            router, cfg.host, cfg.grpc_port, api_keys=keys, protect_probes=cfg.protect_probes)
        app = build_app(router, router.model_name, registry, api_keys=keys,
                        protect_probes=cfg.protect_probes, admin=scaler,
                        targets=lambda here: target_groups(cluster_targets(
                            router.model_name, here, router.metrics_targets())))
        http_server, http_port = await start_http_server(app, cfg.host, cfg.http_port)
        base = f"http://{_url_host(cfg.host)}:{http_port}"
        _progress(f"gRPC   {cfg.host}:{grpc_port} (pdserve.v1.Generation, grpc.health.v1)")
        _progress(f"HTTP   {base}/v1 (OpenAI: /v1/completions, /v1/chat/completions, "
                  f"/v1/responses, /v1/models; vLLM's /tokenize, /detokenize"
                  f"{f'; {len(keys)} Bearer key(s) required' if keys else ''})")
        _progress(f"HTTP   {base}/health, {base}/metrics (router), {base}/metrics/targets "
                  f"(Prometheus HTTP service discovery; "
                  f"{'key required' if keys and cfg.protect_probes else 'open'})")
        _progress(f"HTTP   {base}/admin/workers, {base}/admin/scale (pdserve workers, pdserve "
                  f"scale; {'key required' if keys else 'OPEN: no API key is set'})")
        for wid, (host, port) in router.metrics_targets().items():
            _progress(f"worker {wid}: http://{host}:{port}/metrics")
        if file_sd is not None:
            tasks.append(asyncio.create_task(_track_workers(
                file_sd, router, (cfg.host, http_port))))
            _progress(f"Prometheus file-SD targets: {file_sd.path}")
        pools = ", ".join(f"{p.workers} {role}" for role, p in cluster.pools().items()
                          if p.workers)
        _progress(f"serving {cluster.model_dir.name} with {pools} worker(s) over "
                  f"{cfg.transfer}; Ctrl-C stops")
        await stop.wait()
        await _drain(router, cfg.shutdown_timeout_s, loop)
    finally:
        _progress("shutting down")
        if autoscale is not None:
            await autoscale.stop()  # no decision while the rest stops
        for task in tasks:
            task.cancel()
        if file_sd is not None:
            file_sd.remove()
        if http_server is not None:
            await http_server.stop()
        if grpc_server is not None:
            await grpc_server.stop(grace=2)
        if scaler is not None:
            cluster.cancel()  # a worker still loading for the scaler is stopped
            await scaler.stop()
        if router is not None:
            await router.stop()
        cluster.shutdown()


async def _drain(router: Router, timeout_s: float, loop: asyncio.AbstractEventLoop) -> None:
    """Graceful shutdown: admit nothing more (new requests get 503 / UNAVAILABLE with a
    retry hint, ``/health`` and grpc.health.v1 turn NOT_SERVING) and let the requests in
    flight finish, for at most ``timeout_s``; a second signal ends the wait."""
    router.begin_drain()
    if not router.num_in_flight or timeout_s <= 0:
        return
    again = asyncio.Event()
    _on_stop_signals(loop, again.set)
    _progress(f"draining: {router.num_in_flight} request(s) in flight get up to "
              f"{timeout_s:g} s to finish (signal again to stop now)")
    waiting = asyncio.ensure_future(router.drained(timeout_s))
    signalled = asyncio.ensure_future(again.wait())
    await asyncio.wait({waiting, signalled}, return_when=asyncio.FIRST_COMPLETED)
    signalled.cancel()
    waiting.cancel()
    if router.num_in_flight:
        _progress(f"{router.num_in_flight} request(s) still in flight: ending them")


def _on_stop_signals(loop: asyncio.AbstractEventLoop, handler: Callable[[], object]) -> None:
    """SIGINT and SIGTERM call ``handler`` on ``loop`` (where the platform allows)."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, handler)


async def _start(cluster: Cluster, stop: asyncio.Event) -> bool:
    """``cluster.start()`` on a thread, abandoned (cancelled) if ``stop`` is set first;
    True once started."""
    starting = asyncio.ensure_future(asyncio.to_thread(cluster.start))
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
    stopping.cancel()
    if not starting.done():
        cluster.cancel()
        with contextlib.suppress(StartupError):
            await starting
        return False
    starting.result()  # raises what the start-up raised
    return True


async def _track_workers(file_sd: FileSD, router: Router, router_addr: tuple[str, int],
                         interval_s: float = 1.0) -> None:
    """Keep the file-SD targets to the workers in routing, with their current
    ``/metrics`` addresses (a restarted worker has a new one)."""
    listed: dict[str, tuple[str, int]] | None = None
    while True:
        live = router.metrics_targets()
        if live != listed:
            listed = live
            file_sd.update(cluster_targets(router.model_name, router_addr, live))
        await asyncio.sleep(interval_s)


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


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
