"""The deployment config: pool sizes, per-worker resources, transfer backend,
ports, router knobs. One frozen dataclass tree, built from a YAML file and CLI
flags (flags win), validated once; unknown keys are errors naming the key.

Example YAML::

    model: SmolLM2-135M-Instruct
    transfer: nixl
    prefill: {workers: 2, num_cpus: 1, resources: {prefill_node: 1},
              engine: {max_num_batched_tokens: 2048}}
    decode:  {workers: 1, num_cpus: 1, labels: {pdserve/pool: decode},
              engine: {num_blocks: 2048}}
    colocated: {workers: 1}    # both phases in one engine, beside the pairs
    router:  {policy: prefix_affinity, max_waiting: 512}

Pools: ``prefill`` + ``decode`` (disaggregated pairs) and ``colocated``; a deployment
has pairs, colocated workers, or both (``prefill: {workers: 0}, decode: {workers: 0},
colocated: {workers: 1}`` is colocated only). A colocated worker's ``num_cpus``
defaults to one prefill plus one decode worker's, so an A/B of the two modes compares
equal hardware (docs/operations.md says how to choose).

Placement: a pool is pinned to nodes by custom ``resources`` (each worker takes that
much of them) and/or by Ray node ``labels`` (every label must match; the actors get a
``label_selector``). ``workers`` is the size at start; ``pdserve scale`` changes it at
runtime.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field, replace
from dataclasses import fields as fields_of
from pathlib import Path
from typing import Any

import yaml

from pdserve.engine.config import EngineConfig
from pdserve.kv_transfer.sharded import PER_RANK_BACKENDS
from pdserve.router.router import RouterConfig
from pdserve.tracing import TracingConfig

log = logging.getLogger(__name__)

TRANSFER_BACKENDS = ("nixl", "torch", "ray", "local")
DEPLOYMENT_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")


# A CPU prefill worker's token budget per step (the engine's default is 2048; a pool's
# `engine: {max_num_batched_tokens: N}` overrides it). A step's prompts get their first
# tokens only when the whole step ends, and on CPU a 2048-token step takes about a
# second: when many prompts arrive together, smaller steps let the first ones out
# sooner. Served 1P+1D on 2 cores (AMX Xeon, SmolLM2-135M bf16, 128-token prompts, 32
# streams, two rounds): TTFT p50 1382 / 1298 ms at 2048, 611 / 609 at 512, 550 / 505 at
# 256; output 393 / 383, 379 / 384 and 341 / 376 tok/s. One 1024-token prompt alone:
# 433 / 449 ms at 2048, 454 / 487 at 512; a 3000-token one 2128 / 1974 and 1921 / 1918.
CPU_PREFILL_STEP_TOKENS = 512
CORE_SHARING = ("phase", "static")


@dataclass(frozen=True)
class PoolConfig:
    workers: int = 1
    num_cpus: float = 1  # Ray CPUs per worker; also the engine's CPU threads
    num_gpus: float | None = None  # None: 1 when the cluster has GPUs, else 0
    resources: dict[str, float] = field(default_factory=dict)  # custom, for pinning pools
    labels: dict[str, str] = field(default_factory=dict)  # Ray node labels the nodes must have
    # Ranks per worker (engine/tp/): one process each, on one node; num_cpus is the
    # whole worker's (num_cpus // ranks threads per rank), num_gpus defaults to one per rank.
    tensor_parallel_size: int = 1
    engine: dict[str, Any] = field(default_factory=dict)  # EngineConfig overrides
    # CPU: engine threads beyond num_cpus, on cores that another pool on the same node
    # reserved in Ray. Prefill is bursty and compute-bound, decode continuous and
    # memory-bound: a lone decode stream reads its weights faster on two cores than on
    # one, a prefill burst finishes sooner on them, and where both run the OS shares
    # the cores. None: on the embedded cluster (one machine) each of the prefill and
    # decode pools takes the other's CPUs, split among its workers; else 0. Its workers
    # spin less between parallel regions (GOMP_SPINCOUNT: pdserve/cluster/cluster.py).
    shared_cpus: float | None = None
    # How a pool with shared_cpus uses them (pdserve/worker/core_share.py): "phase" -- its
    # workers borrow the other pools' cores only while those have nothing to compute,
    # and give them back at their next step boundary (no two workers' threads on one
    # core); "static" -- always num_cpus + shared_cpus threads, the OS sharing the cores
    # between workers that compute together (oversubscribed).
    core_sharing: str = "phase"

    def __post_init__(self) -> None:
        if self.core_sharing not in CORE_SHARING:
            raise ValueError(f"core_sharing must be one of {CORE_SHARING}, got "
                             f"{self.core_sharing!r}")
        if self.workers < 0:
            raise ValueError(f"pool workers must be >= 0, got {self.workers}")
        if self.num_cpus <= 0:
            raise ValueError(f"num_cpus must be > 0, got {self.num_cpus}")
        if self.shared_cpus is not None and self.shared_cpus < 0:
            raise ValueError(f"shared_cpus must be >= 0, got {self.shared_cpus}")
        if self.num_gpus is not None and self.num_gpus < 0:
            raise ValueError(f"num_gpus must be >= 0, got {self.num_gpus}")
        if not isinstance(self.resources, dict) or any(
                not isinstance(v, int | float) or v < 0 for v in self.resources.values()):
            raise ValueError(f"resources must map names to amounts >= 0, got {self.resources!r}")
        if not isinstance(self.labels, dict) or any(
                not isinstance(k, str) or not isinstance(v, str) for k, v in self.labels.items()):
            raise ValueError(f"labels must map label names to strings, got {self.labels!r}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        bad = {"role", "device", "tensor_parallel_size"} & set(self.engine)
        if bad:
            raise ValueError(f"engine keys {sorted(bad)} are set by the deployment, not under "
                             "engine (tensor_parallel_size is a key of the pool itself)")
        EngineConfig.from_dict(self.engine)  # validates names and values

    def bundle(self, cluster_has_gpus: bool) -> dict[str, float]:
        """The Ray resources one worker of this pool takes (zero amounts left out);
        ``num_gpus`` unset means 1 GPU on a cluster that has GPUs, else none."""
        gpus = self.num_gpus if self.num_gpus is not None else (
            self.tensor_parallel_size if cluster_has_gpus else 0)
        return {k: v for k, v in {"CPU": self.num_cpus, "GPU": gpus, **self.resources}.items()
                if v}

    def lends_cores(self, device: str) -> tuple[int, int] | None:
        """(own, most) threads of a worker that joins its node's core sharing
        (``core_sharing: phase`` with cores to borrow, on the CPU, one rank); else None."""
        if (device != "cpu" or self.core_sharing != "phase" or not self.shared_cpus
                or self.tensor_parallel_size != 1):
            return None
        own = max(1, int(self.num_cpus))
        return own, own + int(self.shared_cpus)

    def engine_config(self, role: str, device: str) -> EngineConfig:
        tp = self.tensor_parallel_size
        own = int(self.num_cpus + (self.shared_cpus or 0))
        threads = max(1, own // tp) if device == "cpu" else None
        if device == "cpu" and self.num_cpus < tp:
            log.warning("the %s pool's workers have %g Ray CPU(s) for %d tensor-parallel ranks: "
                        "the ranks share cores (set num_cpus to ranks x threads)",
                        role, self.num_cpus, tp)
        budget = ({"max_num_batched_tokens": CPU_PREFILL_STEP_TOKENS}
                  if role == "prefill" and device == "cpu" else {})
        return EngineConfig.from_dict({"num_threads": threads, "dtype": "auto", **budget,
                                       **self.engine, "role": role, "device": device,
                                       "tensor_parallel_size": tp})


@dataclass(frozen=True)
class ClusterConfig:
    model: str | None = None  # directory or name; None = the default model
    transfer: str = "nixl"
    transfer_options: dict[str, Any] = field(default_factory=dict)
    address: str | None = None  # None: embedded local Ray cluster; "auto" / "ray://..."
    # Workers that outlive the router (named, detached actors): a router started with
    # the same name re-attaches to them; several routers may serve them at once.
    deployment: str | None = None
    host: str = "127.0.0.1"
    grpc_port: int = 50051
    http_port: int = 8000
    prefill: PoolConfig = field(default_factory=PoolConfig)
    decode: PoolConfig = field(default_factory=PoolConfig)
    # None: 0 workers with one prefill + one decode worker's CPUs and GPUs each
    colocated: PoolConfig | None = None
    router: RouterConfig = field(default_factory=RouterConfig)
    kv_timeout_s: float = 30.0  # a KV transfer without progress this long fails (P and D)
    # SIGTERM / SIGINT: admission stops at once (503 + Retry-After, /health 503) and the
    # requests in flight get this long to finish before the rest are ended (0: at once).
    shutdown_timeout_s: float = 30.0
    # Ray restarts a dead worker actor, at most this often (-1: without limit) ...
    max_restarts: int = -1
    # ... waiting this long, doubling with each restart in a row (at most 60 s; an
    # incarnation that ran 10 minutes starts the count over)
    restart_backoff_s: float = 1.0
    api_key: str | None = None  # HTTP + gRPC: required Bearer token (None = open) ...
    api_key_file: str | None = None  # ... and/or a file of them, one per line
    protect_probes: bool = False  # the keys guard /health, /metrics, grpc.health.v1 too
    file_sd_path: str | None = None  # Prometheus file-SD targets file (None = not written)
    ttft_slo_ms: float | None = None  # SLO targets for the attainment counters
    tpot_slo_ms: float | None = None
    # OpenTelemetry traces (pdserve/tracing.py): every process of the deployment
    # exports its spans to this OTLP endpoint (None: off), of this share of requests
    otlp_traces_endpoint: str | None = None
    trace_sample_ratio: float = 1.0
    # Autoscaling (pdserve/cluster/autoscale.py): the prefill/decode pools sized to the
    # SLOs above at runtime, within these bounds, every interval.
    autoscale: bool = False
    autoscale_interval_s: float = 5.0
    autoscale_min_prefill: int = 1
    autoscale_max_prefill: int = 4
    autoscale_min_decode: int = 1
    autoscale_max_decode: int = 4
    autoscale_profile: str | None = None  # `pdserve plan --measure-profile` JSON; None: analytic
    autoscale_prompt_len: int = 512  # the lengths planned for until requests are observed
    autoscale_output_len: int = 128

    def __post_init__(self) -> None:
        if self.transfer not in TRANSFER_BACKENDS:
            raise ValueError(f"transfer must be one of {TRANSFER_BACKENDS}, got {self.transfer!r}")
        wide = [f"{name} (tensor_parallel_size {pool.tensor_parallel_size})"
                for name, pool in (("prefill", self.prefill), ("decode", self.decode))
                if pool.workers and pool.tensor_parallel_size > 1]
        if wide and self.transfer not in PER_RANK_BACKENDS:
            raise ValueError(f"transfer {self.transfer!r} cannot serve the {' and '.join(wide)} "
                             f"pool: every rank moves its own KV heads, over one of "
                             f"{', '.join(PER_RANK_BACKENDS)}")
        for name in ("grpc_port", "http_port"):
            port = getattr(self, name)
            if not 0 <= port <= 65535:
                raise ValueError(f"{name} must be in [0, 65535], got {port}")
        if self.deployment is not None:
            if not DEPLOYMENT_NAME.fullmatch(self.deployment):
                raise ValueError(f"deployment must be 1-64 letters, digits, '.', '_' or '-', "
                                 f"got {self.deployment!r}")
            if self.address is None:
                raise ValueError("a deployment's workers outlive the router, and an embedded "
                                 "Ray cluster ends with it: give --address of a Ray cluster "
                                 "(ray start --head) with --deployment")
        if self.kv_timeout_s <= 0:
            raise ValueError("kv_timeout_s must be > 0")
        if not self.shutdown_timeout_s >= 0:
            raise ValueError(f"shutdown_timeout_s must be >= 0, got {self.shutdown_timeout_s}")
        if self.max_restarts < -1 or self.restart_backoff_s < 0:
            raise ValueError("max_restarts must be >= 0 or -1 (without limit), and "
                             "restart_backoff_s >= 0")
        if (self.prefill.workers == 0) != (self.decode.workers == 0):
            raise ValueError("prefill and decode workers come in pairs: give both or neither "
                             f"(got {self.prefill.workers} prefill, {self.decode.workers} decode)")
        if self.prefill.workers == 0 and self.colocated_pool.workers == 0:
            raise ValueError("no workers: give prefill + decode workers, colocated workers, "
                             "or both")
        _ = self.block_size  # the pools agree on one
        formats = {name: _kv_format(pool.engine) for name, pool in
                   (("prefill", self.prefill), ("decode", self.decode)) if pool.workers}
        if len(set(formats.values())) > 1:
            raise ValueError("the prefill and decode pools must keep their KV caches in one "
                             "format (a hand-off copies blocks as they are), got " + ", ".join(
                                 f"{name} {fmt}" for name, fmt in formats.items())
                             + ": set engine.kv_cache_dtype (and dtype) alike on both")
        _ = self.tracing  # checks the ratio and the endpoint
        for name in ("ttft_slo_ms", "tpot_slo_ms"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        if self.autoscale:
            missing = [n for n in ("ttft_slo_ms", "tpot_slo_ms") if getattr(self, n) is None]
            if missing:
                raise ValueError(f"autoscale needs {' and '.join(missing)} (--ttft-slo-ms, "
                                 "--tpot-slo-ms): the pools are sized to meet them")
            if self.prefill.workers == 0:
                raise ValueError("autoscale sizes the prefill/decode pools, and this deployment "
                                 "has none (colocated pools are not autoscaled)")
            for pool in ("prefill", "decode"):
                lo, hi = getattr(self, f"autoscale_min_{pool}"), getattr(self, f"autoscale_max_{pool}")
                if not 1 <= lo <= hi:
                    raise ValueError(f"autoscale bounds: need 1 <= autoscale_min_{pool} ({lo}) "
                                     f"<= autoscale_max_{pool} ({hi})")
            if not self.autoscale_interval_s > 0:
                raise ValueError("autoscale_interval_s must be > 0")
            if self.autoscale_prompt_len < 1 or self.autoscale_output_len < 2:
                raise ValueError("autoscale_prompt_len must be >= 1, autoscale_output_len >= 2")

    @property
    def block_size(self) -> int:
        """The KV block size of every pool with workers (the router counts blocks and
        hashes prompts by it); ``ValueError`` if the pools disagree."""
        sizes = {name: EngineConfig.from_dict(pool.engine).block_size
                 for name, pool in (("prefill", self.prefill), ("decode", self.decode),
                                    ("colocated", self.colocated_pool)) if pool.workers}
        if len(set(sizes.values())) > 1:
            raise ValueError("every pool must use one KV block size (the router counts and "
                             "hashes blocks by it), got " + ", ".join(
                                 f"{name} {size}" for name, size in sizes.items()))
        return next(iter(sizes.values()), EngineConfig().block_size)

    @property
    def tracing(self) -> TracingConfig | None:
        if self.otlp_traces_endpoint is None:
            if self.trace_sample_ratio != 1.0:
                raise ValueError("trace_sample_ratio needs otlp_traces_endpoint")
            return None
        return TracingConfig(self.otlp_traces_endpoint, self.trace_sample_ratio)

    @property
    def prefill_pool(self) -> PoolConfig:
        """The prefill pool with ``shared_cpus`` resolved (see PoolConfig)."""
        return self._sharing(self.prefill, self.decode)

    @property
    def decode_pool(self) -> PoolConfig:
        """The decode pool with ``shared_cpus`` resolved (see PoolConfig)."""
        return self._sharing(self.decode, self.prefill)

    def _sharing(self, pool: PoolConfig, other: PoolConfig) -> PoolConfig:
        if pool.shared_cpus is not None:
            return pool
        shared = (int(other.num_cpus) * other.workers // pool.workers
                  if self.address is None and pool.workers else 0)
        return replace(pool, shared_cpus=shared)

    @property
    def colocated_pool(self) -> PoolConfig:
        """The colocated pool with its defaults filled in."""
        c = self.colocated
        if c is None:
            return PoolConfig(workers=0, num_cpus=self.prefill.num_cpus + self.decode.num_cpus)
        return c

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
            if value is not None:  # "decode.engine.quantization" -> nested, merged
                data = _merged(data, key.split("."), value)
        return cls.from_dict(data)


def _kv_format(engine: dict[str, Any]) -> str:
    """A pool's KV cache format as configured ("auto": as its dtype, itself maybe auto)."""
    kv = engine.get("kv_cache_dtype", "auto")
    return str(engine.get("dtype", "auto")) if kv == "auto" else str(kv)


def _merged(data: dict[str, Any], path: list[str], value: Any) -> dict[str, Any]:
    """``data`` with ``value`` at the nested ``path`` (inner mappings merged, not replaced)."""
    head, rest = path[0], path[1:]
    if not rest:
        return {**data, head: value}
    inner = data.get(head) or {}
    if not isinstance(inner, dict):
        raise ValueError(f"config key {head!r} must be a mapping to set {'.'.join(path)}")
    return {**data, head: _merged(inner, rest, value)}


def _build(cls: type, d: dict[str, Any], where: str) -> Any:
    if not isinstance(d, dict):
        raise ValueError(f"{where} must be a mapping, got {type(d).__name__}")
    fields = {f.name: f for f in fields_of(cls)}
    unknown = sorted(set(d) - set(fields))
    if unknown:
        raise ValueError(f"unknown key(s) in {where}: {unknown}; known: {sorted(fields)}")
    kwargs = {}
    for key, value in d.items():
        sub = {"prefill": PoolConfig, "decode": PoolConfig, "colocated": PoolConfig,
               "router": RouterConfig}.get(key)
        kwargs[key] = _build(sub, value, f"{where}.{key}") if sub and cls is ClusterConfig else value
    if cls is ClusterConfig and isinstance(d.get("colocated"), dict) \
            and "num_cpus" not in d["colocated"]:
        # A colocated worker does both phases: by default it gets both workers' CPUs.
        cpus = sum(kwargs.get(pool, PoolConfig()).num_cpus for pool in ("prefill", "decode"))
        kwargs["colocated"] = replace(kwargs["colocated"], num_cpus=cpus)
    return cls(**kwargs)
