"""The deployment config: pool sizes, per-worker resources, transfer backend,
ports, router knobs. One frozen dataclass tree, built from a YAML file and CLI
flags (flags win), validated once; unknown keys are errors naming the key.

Example YAML::

    model: SmolLM2-135M-Instruct
    transfer: nixl
    prefill: {workers: 2, num_cpus: 1, resources: {prefill_node: 1},
              engine: {max_num_batched_tokens: 2048}}
    decode:  {workers: 1, num_cpus: 1, engine: {num_blocks: 2048}}
    router:  {policy: prefix_affinity, max_waiting: 512}
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from pdserve.engine.config import EngineConfig
from pdserve.router.router import RouterConfig

TRANSFER_BACKENDS = ("nixl", "torch", "ray", "local")


@dataclass(frozen=True)
class PoolConfig:
    workers: int = 1
    num_cpus: float = 1  # Ray CPUs per worker; also the engine's CPU threads
    num_gpus: float | None = None  # None: 1 when the cluster has GPUs, else 0
    resources: dict[str, float] = field(default_factory=dict)  # custom, for pinning pools
    engine: dict[str, Any] = field(default_factory=dict)  # EngineConfig overrides

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError(f"pool workers must be >= 1, got {self.workers}")
        if self.num_cpus <= 0:
            raise ValueError(f"num_cpus must be > 0, got {self.num_cpus}")
        if self.num_gpus is not None and self.num_gpus < 0:
            raise ValueError(f"num_gpus must be >= 0, got {self.num_gpus}")
        bad = {"role", "device"} & set(self.engine)
        if bad:
            raise ValueError(f"engine keys {sorted(bad)} are set by the deployment, not the config")
        EngineConfig.from_dict(self.engine)  # validates names and values

    def engine_config(self, role: str, device: str) -> EngineConfig:
        threads = max(1, int(self.num_cpus)) if device == "cpu" else None
        return EngineConfig.from_dict(
            {"num_threads": threads, **self.engine, "role": role, "device": device})


@dataclass(frozen=True)
class ClusterConfig:
    model: str | None = None  # directory or name; None = the default model
    transfer: str = "nixl"
    transfer_options: dict[str, Any] = field(default_factory=dict)
    address: str | None = None  # None: embedded local Ray cluster; "auto" / "ray://..."
    host: str = "127.0.0.1"
    grpc_port: int = 50051
    http_port: int = 8000
    prefill: PoolConfig = field(default_factory=PoolConfig)
    decode: PoolConfig = field(default_factory=PoolConfig)
    router: RouterConfig = field(default_factory=RouterConfig)
    kv_timeout_s: float = 30.0  # decode side: KV must arrive this soon after reserve
    api_key: str | None = None  # HTTP + gRPC: required Bearer token (None = open) ...
    api_key_file: str | None = None  # ... and/or a file of them, one per line
    protect_probes: bool = False  # the keys guard /health, /metrics, grpc.health.v1 too
    file_sd_path: str | None = None  # Prometheus file-SD targets file (None = not written)
    ttft_slo_ms: float | None = None  # SLO targets for the attainment counters
    tpot_slo_ms: float | None = None

    def __post_init__(self) -> None:
        if self.transfer not in TRANSFER_BACKENDS:
            raise ValueError(f"transfer must be one of {TRANSFER_BACKENDS}, got {self.transfer!r}")
        for name in ("grpc_port", "http_port"):
            port = getattr(self, name)
            if not 0 <= port <= 65535:
                raise ValueError(f"{name} must be in [0, 65535], got {port}")
        if self.kv_timeout_s <= 0:
            raise ValueError("kv_timeout_s must be > 0")
        for name in ("ttft_slo_ms", "tpot_slo_ms"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be > 0, got {value}")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ClusterConfig:
        return _build(cls, d, "config")

    @classmethod
    def load(cls, path: str | Path | None, overrides: dict[str, Any]) -> ClusterConfig:
        """YAML file (optional) + overrides; an override of None means "not given"."""
        data: dict[str, Any] = {}
        if path is not None:
            loaded = yaml.safe_load(Path(path).read_text()) or {}
            if not isinstance(loaded, dict):
                raise ValueError(f"{path}: the top level must be a mapping")
            data = loaded
        for key, value in overrides.items():
            if value is None:
                continue
            if "." in key:  # "prefill.workers" -> nested
                outer, inner = key.split(".", 1)
                data = {**data, outer: {**(data.get(outer) or {}), inner: value}}
            else:
                data = {**data, key: value}
        return cls.from_dict(data)


def _build(cls: type, d: dict[str, Any], where: str) -> Any:
    if not isinstance(d, dict):
        raise ValueError(f"{where} must be a mapping, got {type(d).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - set(fields))
    if unknown:
        raise ValueError(f"unknown key(s) in {where}: {unknown}; known: {sorted(fields)}")
    kwargs = {}
    for key, value in d.items():
        sub = {"prefill": PoolConfig, "decode": PoolConfig, "router": RouterConfig}.get(key)
        kwargs[key] = _build(sub, value, f"{where}.{key}") if sub and cls is ClusterConfig else value
    return cls(**kwargs)
