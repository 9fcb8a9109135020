"""Bringing a pdserve cluster up and down on Ray: the prefill and decode actor
pools, the P x D transfer channels, and a router wired to them.

``Cluster`` is used by ``pdserve serve``, ``pdserve generate --disaggregated``
and the integration tests (which start it with a small ``num_cpus``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray

from pdserve.deploy.actors import RemoteDecode, RemotePrefill, actor_options
from pdserve.deploy.config import ClusterConfig
from pdserve.engine.config import EngineConfig, ModelConfig
from pdserve.engine.gguf_convert import resolve_model
from pdserve.engine.tokenizer import Tokenizer
from pdserve.router.clients import RayDecodeClient, RayPrefillClient
from pdserve.router.router import Router

log = logging.getLogger("pdserve.deploy")

# An embedded cluster lives on loopback. Ray replaces 127.0.0.1 with the machine's
# interface address, but keeps any other loopback address.
EMBEDDED_NODE_IP = "127.0.0.2"


def init_local_ray(num_cpus: int | None = None) -> None:
    """Start an embedded single-node Ray cluster bound to loopback only."""
    ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=True,
             logging_level=logging.WARNING, _node_ip_address=EMBEDDED_NODE_IP)


class Cluster:
    def __init__(self, config: ClusterConfig, num_cpus: int | None = None,
                 progress: Callable[[str], None] = lambda msg: None) -> None:
        self.config = config
        self.num_cpus = num_cpus
        self.progress = progress
        self.model_dir: Path | None = None
        self.prefill: dict[str, Any] = {}  # worker id -> actor handle
        self.decode: dict[str, Any] = {}
        self._owns_ray = False

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
        has_gpus = ray.cluster_resources().get("GPU", 0) > 0
        model = str(self.model_dir)
        for i in range(cfg.prefill.workers):
            wid = f"prefill-{i}"
            opts = actor_options(cfg.prefill, has_gpus, f"pdserve-{wid}-{time.time_ns()}")
            self.prefill[wid] = RemotePrefill.options(**opts).remote(
                wid, model, cfg.prefill, cfg.transfer, cfg.transfer_options, self.loopback)
        for i in range(cfg.decode.workers):
            wid = f"decode-{i}"
            opts = actor_options(cfg.decode, has_gpus, f"pdserve-{wid}-{time.time_ns()}")
            self.decode[wid] = RemoteDecode.options(**opts).remote(
                wid, model, cfg.decode, cfg.transfer, cfg.transfer_options, cfg.kv_timeout_s,
                self.loopback)
        self.progress(f"loading the model on {len(self.prefill)} prefill + "
                      f"{len(self.decode)} decode workers")
        ray.get([h.ping.remote() for h in (self.prefill | self.decode).values()])
        self.progress(f"connecting {len(self.prefill)}x{len(self.decode)} "
                      f"{cfg.transfer} channels")
        endpoints = dict(zip(self.decode, ray.get([h.endpoint.remote()
                                                    for h in self.decode.values()]),
                             strict=True))
        ray.get([p.connect.remote(did, ep) for p in self.prefill.values()
                 for did, ep in endpoints.items()])

    @property
    def loopback(self) -> bool:
        """An embedded cluster lives on this machine: everything binds loopback."""
        return self.config.address is None

    def metrics_targets(self) -> dict[str, tuple[str, int]]:
        """worker id -> (host, port) of its ``/metrics``."""
        handles = self.prefill | self.decode
        addrs = ray.get([h.metrics_address.remote() for h in handles.values()])
        return dict(zip(handles, addrs, strict=True))

    def make_router(self, metrics: object | None = None) -> Router:
        """A router over this cluster's workers (call inside the asyncio loop)."""
        assert self.model_dir is not None, "start() first"
        mc = ModelConfig.from_dir(self.model_dir)
        max_len = EngineConfig.from_dict(self.config.decode.engine).resolve_max_model_len(mc)
        return Router(
            self.model_dir.name, Tokenizer.from_dir(self.model_dir), max_len,
            [RayPrefillClient(w, h) for w, h in self.prefill.items()],
            [RayDecodeClient(w, h) for w, h in self.decode.items()],
            self.config.router, metrics,
        )

    def kill(self, worker_id: str) -> None:
        """Fault injection: kill one worker's actor process."""
        handle = self.prefill.get(worker_id) or self.decode[worker_id]
        ray.kill(handle, no_restart=True)

    def check_integrity(self) -> None:
        """Block-pool integrity on every live worker (raises on the first failure)."""
        for wid, h in (self.prefill | self.decode).items():
            try:
                ray.get(h.check_integrity.remote(), timeout=30)
            except ray.exceptions.RayActorError:
                log.info("skipping dead worker %s", wid)

    def stats(self) -> dict[str, Any]:
        out = {}
        for wid, h in (self.prefill | self.decode).items():
            try:
                out[wid] = ray.get(h.stats.remote(), timeout=30)
            except ray.exceptions.RayActorError:
                continue
        return out

    def shutdown(self) -> None:
        for h in (self.prefill | self.decode).values():
            try:
                ray.kill(h, no_restart=True)
            except Exception as exc:  # already dead
                log.debug("kill failed: %r", exc)
        self.prefill.clear()
        self.decode.clear()
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()
