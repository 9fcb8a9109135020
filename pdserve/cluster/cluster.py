"""Bringing a pdserve cluster up and down on Ray: the prefill, decode and colocated
actor pools and a router over them (the router opens the P x D transfer channels and
the token streams itself, at start and whenever a worker restarts).

``Cluster`` is used by ``pdserve serve``, ``pdserve generate --disaggregated``, the
benchmarks and the integration tests (which start it with a small ``num_cpus``).

Start-up fails fast: before any actor is created, the pools' CPUs, GPUs and custom
resources are checked against the Ray cluster's, and a shortfall names the resource,
what the pools need and what the cluster has. Waiting for the actors to load their
model is bounded (``start_timeout_s``) and can be cancelled (``cancel()``, from a
signal handler), so no stop leaves a half-started cluster behind.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray

from pdserve.cluster.actors import (
    NAMESPACE,
    REMOTE,
    ActorSettings,
    RayWorker,
    actor_options,
    forget_restarts,
)
from pdserve.cluster.config import ClusterConfig, PoolConfig
from pdserve.engine.config import EngineConfig, ModelConfig
from pdserve.engine.model.gguf_convert import resolve_model
from pdserve.engine.tokenizer import Tokenizer
from pdserve.router.placement import Slo
from pdserve.router.router import Router
from pdserve.tracing import Tracing

log = logging.getLogger("pdserve.cluster")

# An embedded cluster lives on loopback. Ray replaces 127.0.0.1 with the machine's
# interface address, but keeps any other loopback address.
EMBEDDED_NODE_IP = "127.0.0.2"
# UCX (nixl) opens its own listeners; an embedded cluster keeps them on loopback.
# Its prefill and decode pools share the machine's cores (PoolConfig.shared_cpus), and
# libgomp's threads spin 300,000 times (~3 ms) after a parallel region before they
# sleep: on shared cores those spins take the other worker's core. Served 1P+1D on 2
# cores (SmolLM2-135M bf16, 128-token prompts, 512-token prefill steps), 32 streams:
# 290 tok/s at 100,000 spins, 440 at 3,000 (TTFT p50 1529 / 464 ms); one stream
# 21.3 / 21.8 ms a token.
# Their malloc asks for transparent huge pages (glibc >= 2.35; where THP is "madvise",
# as on these VMs, nothing gets them otherwise): the weights and the KV cache then sit
# in 2 MB pages, and a decode's streams cross no 4 KB page boundary, where the hardware
# prefetcher stops and the TLB misses. Engine alone, AVX512-BF16 class (Zen 4), bf16,
# one sequence: 13.3-14.0 -> 10.0-11.9 ms a token at 256 tokens of context, 25.7-26.5
# -> 19.7-21.0 at 7,680.
EMBEDDED_ENV = {"UCX_NET_DEVICES": "lo", "GOMP_SPINCOUNT": "3000",
                "GLIBC_TUNABLES": ":".join(filter(None, (os.environ.get("GLIBC_TUNABLES"),
                                                         "glibc.malloc.hugetlb=1")))}
# Ray's autoscaler monitor serves its metrics on a fixed port (44217) of every
# interface unless the head is 127.0.0.1; an embedded cluster has no autoscaler to
# watch, so its monitor gets a port that cannot be bound (it logs that and goes on).
EMBEDDED_MONITOR_PORT = {"AUTOSCALER_METRIC_PORT": "-1"}


class StartupError(ValueError):
    """The cluster cannot start as configured (names what is missing); the CLI
    prints it as one line."""


def init_local_ray(num_cpus: int | None = None) -> None:
    """Start an embedded single-node Ray cluster bound to loopback only: always a
    new one of its own (``address="local"``). Without an address Ray would join the
    cluster ``RAY_ADDRESS`` names, or the last one ``ray start`` began on this
    machine (its bootstrap file, even when that cluster is long dead)."""
    os.environ.update(EMBEDDED_MONITOR_PORT)  # read by the monitor process ray.init starts
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=True,
             logging_level=logging.WARNING, _node_ip_address=EMBEDDED_NODE_IP,
             runtime_env={"env_vars": EMBEDDED_ENV})


class Cluster:
    def __init__(self, config: ClusterConfig, num_cpus: int | None = None,
                 progress: Callable[[str], None] = lambda msg: None,
                 start_timeout_s: float = 600.0) -> None:
        self.config = config
        self.num_cpus = num_cpus
        self.progress = progress
        self.start_timeout_s = start_timeout_s
        self.model_dir: Path | None = None
        self.handles: dict[str, Any] = {}  # worker id -> actor handle
        self.roles: dict[str, str] = {}  # worker id -> "prefill" | "decode" | "colocated"
        self._owns_ray = False
        self._has_gpus = False
        self._next_index = dict.fromkeys(self.pools(), 0)  # worker ids are never reused
        self._cancelled = threading.Event()

    def pools(self) -> dict[str, PoolConfig]:
        cfg = self.config
        return {"prefill": cfg.prefill_pool, "decode": cfg.decode_pool, "colocated": cfg.colocated_pool}

    def start(self) -> None:
        cfg = self.config
        self.model_dir = resolve_model(cfg.model)
        if not ray.is_initialized():
            self.progress("starting Ray" + (f" (joining {cfg.address})" if cfg.address else ""))
            if cfg.address:
                ray.init(address=cfg.address, log_to_driver=True, logging_level=logging.WARNING)
            else:
                init_local_ray(self.num_cpus)
            self._owns_ray = cfg.address is None
        self._has_gpus = ray.cluster_resources().get("GPU", 0) > 0
        self._check_resources()
        if cfg.deployment is not None:
            self._attach(cfg.deployment)
        new = [self._create(role) for role, pool in self.pools().items()
               for _ in range(pool.workers - list(self.roles.values()).count(role))]
        if new:
            counts = ", ".join(f"{n} {r}" for r in self.pools()
                               if (n := sum(self.roles[w] == r for w in new)))
            self.progress(f"loading the model on {counts} worker(s)")
            self._wait_built(new)

    def _attach(self, deployment: str) -> None:
        """Take over the live workers of ``deployment`` (this router restarted, or
        another serves them too): they keep their model, caches and requests."""
        found = deployment_workers(deployment)
        if not found:
            return
        assert self.model_dir is not None
        for wid, name in found.items():
            role, _, index = wid.rpartition("-")
            self.handles[wid] = ray.get_actor(name, namespace=NAMESPACE)
            self.roles[wid] = role
            self._next_index[role] = max(self._next_index[role], int(index) + 1)
        self.progress(f"attaching to the {len(found)} live worker(s) of deployment "
                      f"{deployment!r}: {', '.join(sorted(found))}")
        self._wait_built(list(found))
        models = ray.get([self.handles[wid].built_from.remote() for wid in found], timeout=60)
        other = {wid: m for wid, m in zip(found, models, strict=True)
                 if m != str(self.model_dir)}
        if other:
            wid, model = next(iter(other.items()))
            raise StartupError(f"deployment {deployment!r} serves another model ({wid}: "
                               f"{model}; this router's is {self.model_dir}): start it "
                               f"with that --model, "
                               f"or name another --deployment")

    def add_worker(self, role: str) -> RayWorker:
        """One more worker in ``role``'s pool, its model loaded (blocks; run it on a
        thread). ``StartupError`` when the cluster cannot place or build it in
        ``start_timeout_s``; nothing is left behind then."""
        self.check_room({role: 1})
        wid = self._create(role)
        try:
            self._wait_built([wid])
        except BaseException:
            self.remove_worker(wid)
            raise
        return RayWorker(wid, role, self.handles[wid])

    def remove_worker(self, worker_id: str) -> None:
        """Kill a worker's actor for good (the router has drained it first)."""
        handle = self.handles.pop(worker_id)
        self.roles.pop(worker_id)
        with contextlib.suppress(Exception):  # already dead
            ray.kill(handle, no_restart=True)
        forget_restarts(handle)

    def _create(self, role: str) -> str:
        wid = f"{role}-{self._next_index[role]}"
        self._next_index[role] += 1
        cfg = self.config
        settings = ActorSettings(cfg.transfer, cfg.transfer_options, cfg.kv_timeout_s,
                                 self.loopback, cfg.restart_backoff_s, cfg.tracing)
        name = (f"pdserve-{wid}-{time.time_ns()}" if cfg.deployment is None
                else f"{cfg.deployment}:{wid}")
        opts = actor_options(self.pools()[role], self._has_gpus, name, cfg.max_restarts,
                             detached=cfg.deployment is not None)
        assert self.model_dir is not None
        self.handles[wid] = REMOTE[role].options(**opts).remote(
            wid, str(self.model_dir), self.pools()[role], settings)
        self.roles[wid] = role
        return wid

    def cancel(self) -> None:
        """Stop waiting in ``start`` (it raises ``StartupError``); any thread."""
        self._cancelled.set()

    def _check_resources(self) -> None:
        """Every pool fits the cluster: in all (what the pools need together) and per
        node (some node with the pool's labels holds one worker's resources)."""
        need: dict[str, float] = {}
        who: dict[str, list[str]] = {}
        for role, pool in self.pools().items():
            if not pool.workers:
                continue
            self._check_fits(role, pool)
            for res, amount in pool.bundle(self._has_gpus).items():
                need[res] = need.get(res, 0) + amount * pool.workers
                who.setdefault(res, []).append(f"{pool.workers} {role} x {amount:g}")
        have = ray.cluster_resources()
        for res, amount in need.items():
            if have.get(res, 0) + 1e-9 < amount:
                raise StartupError(
                    f"not enough {res} for the worker pools: they need {amount:g} "
                    f"({' + '.join(who[res])}), the Ray cluster has {have.get(res, 0):g}; "
                    f"use fewer workers or a smaller num_cpus/num_gpus per pool")

    def check_room(self, adds: dict[str, int]) -> None:
        """``StartupError`` unless the cluster has room now for ``adds`` (role -> number
        of new workers): each fits some node with its pool's labels, and their
        resources together are free."""
        need: dict[str, float] = {}
        for role, n in adds.items():
            pool = self.pools()[role]
            self._check_fits(role, pool)
            for res, amount in pool.bundle(self._has_gpus).items():
                need[res] = need.get(res, 0) + amount * n
        free = ray.available_resources()
        for res, amount in need.items():
            if free.get(res, 0) + 1e-9 < amount:
                what = " + ".join(f"{n} {role}" for role, n in adds.items() if n)
                raise StartupError(f"cannot add {what} worker(s): they need {res} {amount:g}, "
                                   f"the Ray cluster has {free.get(res, 0):g} free")

    def _check_fits(self, role: str, pool: PoolConfig) -> None:
        """One worker of ``pool`` fits some node with its labels; else ``StartupError``
        naming the pool and the missing label or resource."""
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        matching = [n for n in nodes
                    if all(n.get("Labels", {}).get(k) == v for k, v in pool.labels.items())]
        if not matching:
            seen = sorted({f"{k}={v}" for n in nodes for k, v in n.get("Labels", {}).items()
                           if not k.startswith("ray.io/")})
            raise StartupError(f"the {role} pool needs a node with labels {pool.labels}; no "
                               f"live node of the Ray cluster has them (labels seen: {seen})")
        for res, amount in pool.bundle(self._has_gpus).items():
            most = max(n.get("Resources", {}).get(res, 0) for n in matching)
            if most + 1e-9 < amount:
                where = f" with labels {pool.labels}" if pool.labels else ""
                raise StartupError(f"no node{where} can host a {role} worker: it needs "
                                   f"{res} {amount:g} on one node, the most any node has is "
                                   f"{most:g}")

    def _wait_built(self, worker_ids: list[str]) -> None:
        pending = {self.handles[wid].load.remote(): wid for wid in worker_ids}
        deadline = time.monotonic() + self.start_timeout_s
        while pending:
            if self._cancelled.is_set():
                raise StartupError("start-up cancelled")
            ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=0.5)
            for ref in ready:
                ray.get(ref)  # a constructor that raised fails the start here
                pending.pop(ref)
            if pending and time.monotonic() > deadline:
                raise StartupError(f"workers {sorted(pending.values())} were not up after "
                                   f"{self.start_timeout_s:.0f}s (still loading or not placed)")

    @property
    def loopback(self) -> bool:
        """An embedded cluster lives on this machine: everything binds loopback."""
        return self.config.address is None

    def workers(self) -> list[RayWorker]:
        """The router's handles on every worker."""
        return [RayWorker(wid, self.roles[wid], h) for wid, h in self.handles.items()]

    def make_router(self, metrics: object | None = None) -> Router:
        """A router over this cluster's workers (call inside the asyncio loop)."""
        assert self.model_dir is not None, "start() first"
        mc = ModelConfig.from_dir(self.model_dir)
        token_pool = self.config.decode if self.config.decode.workers else self.config.colocated_pool
        max_len = EngineConfig.from_dict(token_pool.engine).resolve_max_model_len(mc)
        router_cfg = dataclasses.replace(self.config.router, block_size=self.config.block_size)
        cfg = self.config
        slo = Slo(cfg.ttft_slo_ms / 1e3 if cfg.ttft_slo_ms else None,
                  cfg.tpot_slo_ms / 1e3 if cfg.tpot_slo_ms else None)
        tracing = Tracing("pdserve-router", cfg.tracing) if cfg.tracing is not None else None
        return Router(self.model_dir.name, Tokenizer.from_dir(self.model_dir), max_len,
                      self.workers(), router_cfg, metrics, slo, tracing)

    def metrics_targets(self) -> dict[str, tuple[str, int]]:
        """worker id -> (host, port) of its ``/metrics`` (the running incarnation's)."""
        addrs = ray.get([h.metrics_address.remote() for h in self.handles.values()])
        return dict(zip(self.handles, addrs, strict=True))

    def pid(self, worker_id: str) -> int:
        """The worker actor's process id (fault injection: kill -9, SIGSTOP)."""
        return int(ray.get(self.handles[worker_id].process_id.remote(), timeout=30))

    def kill(self, worker_id: str, restart: bool = False) -> None:
        """Fault injection: kill one worker's actor process (Ray restarts it if asked)."""
        ray.kill(self.handles[worker_id], no_restart=not restart)

    def check_integrity(self) -> None:
        """Block-pool integrity on every live worker (raises on the first failure)."""
        for wid, h in self.handles.items():
            try:
                ray.get(h.check_integrity.remote(), timeout=30)
            except ray.exceptions.RayActorError:
                log.info("skipping dead worker %s", wid)

    def stats(self) -> dict[str, Any]:
        """worker id -> its last published ``WorkerMetrics`` (live workers)."""
        out = {}
        for wid, h in self.handles.items():
            try:
                out[wid] = ray.get(h.metrics.remote(), timeout=30)
            except ray.exceptions.RayActorError:
                continue
        return out

    def shutdown(self) -> None:
        """Stop the workers (a deployment's keep running: ``pdserve down`` stops
        them) and the embedded Ray cluster."""
        if self.config.deployment is not None and self.handles:
            self.progress(f"the {len(self.handles)} worker(s) of deployment "
                          f"{self.config.deployment!r} keep running (pdserve down "
                          f"--address {self.config.address} --deployment "
                          f"{self.config.deployment} stops them)")
        else:
            for h in self.handles.values():
                try:
                    ray.kill(h, no_restart=True)
                except Exception as exc:  # already dead
                    log.debug("kill failed: %r", exc)
                forget_restarts(h)
        self.handles.clear()
        self.roles.clear()
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()


def deployment_workers(deployment: str) -> dict[str, str]:
    """worker id -> actor name of the live workers of ``deployment`` (Ray connected)."""
    prefix = f"{deployment}:"
    found = {}
    for entry in ray.util.list_named_actors(all_namespaces=True):
        name = entry["name"]
        if entry["namespace"] != NAMESPACE or not name.startswith(prefix):
            continue
        role, _, index = name[len(prefix):].rpartition("-")
        if role in REMOTE and index.isdigit():
            found[name[len(prefix):]] = name
    return found


def stop_deployment(address: str, deployment: str) -> list[str]:
    """``pdserve down``: kill every worker of ``deployment``; their ids."""
    ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING)
    try:
        found = deployment_workers(deployment)
        for name in found.values():
            with contextlib.suppress(ValueError):  # gone meanwhile
                handle = ray.get_actor(name, namespace=NAMESPACE)
                ray.kill(handle, no_restart=True)
                forget_restarts(handle)
        return sorted(found)
    finally:
        ray.shutdown()
