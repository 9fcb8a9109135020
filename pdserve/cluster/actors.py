"""The Ray side of the workers: the one place where worker classes become actors, and
``RayWorker``, the router's proxy for one actor.

The actor classes are thin adapters that hold a plain worker (the one a test or an
in-process router builds): they wait out the restart back-off, build the worker
from the deployment's config, start its own ``/metrics`` server, and forward the
calls of router/clients.py's protocols (mypy holds them to those, below). ``RayWorker`` exposes the workers'
async methods (router/clients.py) as Ray calls and turns Ray's errors into the fault
model's: a dead or restarting actor -> ``WorkerGone``; an error the worker raised
-> that error (``AttemptFailed``, ``ValueError``), never a Ray traceback; anything
else -> ``AttemptFailed(TRANSPORT)``. ``abort`` is fire-and-forget: a stalled actor
gets it when it resumes.

Restarts: actors run with ``max_restarts`` (-1, the default: without limit); a
restarted actor sleeps ``restart_backoff_s * 2**(n-1)`` (at most ``MAX_BACKOFF_S``)
before building its engine, ``n`` being its restarts in a row, kept in Ray's GCS
key-value store with the time its last incarnation started. An incarnation that ran
``STABLE_S`` or longer starts the count over (``restart_backoff``), as Kubernetes resets
a crash-looping container's back-off: a worker that crashes now and then comes back
after the short wait every time, one that crashes as it starts waits ever longer.
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import signal
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import ray
from ray.exceptions import RayActorError, RayTaskError

from pdserve.cluster.config import PoolConfig
from pdserve.engine.sampling.sampling_params import SamplingParams
from pdserve.failures import AttemptFailed, FailReason, WorkerGone
from pdserve.messages import (
    NO_LOCAL_PREFILL,
    FirstToken,
    JoinInfo,
    LocalPrefill,
    PrefillResult,
    PrefillTask,
    Reservation,
    WorkerLoad,
    WorkerMetrics,
)
from pdserve.router.clients import ColocatedHandle, DecodeHandle, PrefillHandle
from pdserve.tracing import Carrier, Tracing, TracingConfig
from pdserve.worker.colocated import ColocatedWorker
from pdserve.worker.core_share import CoreShare
from pdserve.worker.decode import DecodeWorker
from pdserve.worker.loop import WorkerLoop
from pdserve.worker.prefill import PrefillWorker

MAX_BACKOFF_S = 60.0
STABLE_S = 600.0  # an incarnation that ran this long: its next restart is a first one
NAMESPACE = "pdserve"  # where a deployment's (detached, named) worker actors live


@dataclass(frozen=True)
class ActorSettings:
    """What every actor of a cluster is built with (besides its pool's config)."""

    transfer: str
    transfer_options: dict[str, Any]
    kv_timeout_s: float
    loopback: bool  # embedded cluster: every listener binds 127.0.0.1
    restart_backoff_s: float
    tracing: TracingConfig | None = None  # the deployment's traces (None: off)

    def tracer(self, role: str, worker_id: str) -> Tracing | None:
        """This worker process's tracer (tracing.py), when traces are on."""
        if self.tracing is None:
            return None
        return Tracing(f"pdserve-{role}", self.tracing, {"pdserve.worker": worker_id})

    def host(self) -> str:
        return "127.0.0.1" if self.loopback else ray.util.get_node_ip_address()

    def sender_options(self) -> dict[str, Any]:
        """A transfer that makes no progress for ``kv_timeout_s`` fails, on both sides."""
        return {"timeout_s": self.kv_timeout_s, **self.transfer_options}

    def receiver_options(self) -> dict[str, Any]:
        opts = self.transfer_options
        if self.transfer in ("torch", "nixl") and "host" not in opts:
            # The receiver listens where prefill workers can reach it (loopback when
            # embedded; the node's address in a joined cluster).
            opts = {**opts, "host": self.host()}
        return opts


def _device() -> str:
    import torch

    return "cuda" if ray.get_gpu_ids() and torch.cuda.is_available() else "cpu"


def restart_backoff(previous: tuple[int, float] | None, now: float,
                    base_s: float) -> tuple[int, float]:
    """(restarts in a row, seconds to wait) of an actor restarting at ``now``, after
    ``previous`` = (restarts in a row, start time) of the incarnation that died (None:
    not known): the wait doubles with each restart in a row, up to ``MAX_BACKOFF_S``,
    and an incarnation that ran ``STABLE_S`` or longer makes this the first again."""
    n = 1 if previous is None or now - previous[1] >= STABLE_S else previous[0] + 1
    return n, min(MAX_BACKOFF_S, base_s * 2 ** (n - 1))


def restarts_key(actor_id: str) -> bytes:
    """The GCS key of an actor's restart record (written at each of its starts)."""
    return f"pdserve-restarts-{actor_id}".encode()


def forget_restarts(handle: ray.actor.ActorHandle) -> None:
    """Delete the restart record of a worker stopped for good (it would stay in the
    GCS for the cluster's life: one per actor ever started)."""
    from ray.experimental import internal_kv

    with contextlib.suppress(Exception):  # Ray gone already: so is the record
        internal_kv._internal_kv_del(restarts_key(handle._actor_id.hex()))


def _cores(pool: PoolConfig) -> CoreShare | None:
    """This worker's place in its node's core sharing, if its pool shares cores."""
    limits = pool.lends_cores(_device())
    return CoreShare(*limits) if limits is not None else None


def _restart_backoff(settings: ActorSettings) -> None:
    """Sleep before rebuilding a restarted actor; keeps its restarts in a row and its
    start time in the GCS."""
    from ray.experimental import internal_kv

    ctx = ray.get_runtime_context()
    with warnings.catch_warnings():  # Ray's own property uses a deprecated one inside
        warnings.simplefilter("ignore", DeprecationWarning)
        restarted = ctx.was_current_actor_reconstructed
    actor_id = ctx.get_actor_id()
    assert actor_id is not None  # (called in an actor's constructor)
    key = restarts_key(actor_id)
    n = 0
    if restarted:
        stored = internal_kv._internal_kv_get(key)
        previous = None
        if stored:
            count, started = stored.decode().split()
            previous = (int(count), float(started))
        n, wait_s = restart_backoff(previous, time.time(), settings.restart_backoff_s)
        time.sleep(wait_s)
    internal_kv._internal_kv_put(key, f"{n} {time.time()}".encode(), overwrite=True)


class _WorkerActor:
    """A worker inside its actor process, held (not inherited): the actor builds the
    plain worker, starts its ``/metrics`` server next to it, makes an engine-loop
    crash end the process (Ray restarts it), and forwards what the router and the
    cluster call. Nothing else lives here."""

    worker: WorkerLoop
    worker_id: str
    role: str

    def _adopt(self, worker: WorkerLoop, settings: ActorSettings) -> None:
        from pdserve.observability.efficiency import detect_peaks
        from pdserve.observability.worker_metrics import serve_worker_metrics

        self.worker = worker
        self.worker_id, self.role = worker.worker_id, worker.role
        host = settings.host()
        # MFU/MBU against all the worker's ranks' peaks (the step costs are the whole
        # model's), measured on the loop thread with the engine's threads (the one
        # thread of the process that multiplies on several: thread_loop.py).
        ranks = worker.engine.config.tensor_parallel_size
        peaks = worker.loop.call(lambda: detect_peaks(ranks=ranks)).result()
        port = serve_worker_metrics(os.path.basename(worker.model_dir), worker.metrics,
                                    host=host, peaks=peaks, tensor_parallel_size=ranks)
        worker.metrics_at = (host, port)

        def crashed(exc: BaseException) -> None:
            logging.getLogger("pdserve.worker").error("engine loop crashed: %r; exiting so "
                                                      "Ray restarts this worker", exc)
            os._exit(1)

        worker.loop.on_crash = crashed
        # `kill -USR1 PID`: every thread's stack into the worker's log (a stuck worker)
        faulthandler.register(signal.SIGUSR1, all_threads=True)

    async def load(self) -> WorkerLoad:
        return await self.worker.load()

    async def join_info(self) -> JoinInfo:
        return await self.worker.join_info()

    async def abort(self, request_id: str) -> None:
        await self.worker.abort(request_id)

    async def check_integrity(self) -> None:
        await self.worker.check_integrity()

    def metrics(self) -> WorkerMetrics:
        return self.worker.metrics()

    def metrics_address(self) -> tuple[str, int] | None:
        return self.worker.metrics_address()

    def process_id(self) -> int:
        """For fault injection (kill -9, SIGSTOP)."""
        return os.getpid()

    def built_from(self) -> str:
        """The model directory this worker serves."""
        return self.worker.model_dir


class PrefillActor(_WorkerActor):
    def __init__(self, worker_id: str, model_dir: str, pool: PoolConfig,
                 settings: ActorSettings) -> None:
        _restart_backoff(settings)
        self.prefill_worker = PrefillWorker(worker_id, model_dir,
                                            pool.engine_config("prefill", _device()),
                                            settings.transfer, settings.sender_options(),
                                            _cores(pool), settings.tracer("prefill", worker_id))
        self._adopt(self.prefill_worker, settings)

    async def connect(self, decode_worker: str, endpoint: dict[str, Any]) -> None:
        await self.prefill_worker.connect(decode_worker, endpoint)

    async def prefill(self, task: PrefillTask) -> FirstToken:
        return await self.prefill_worker.prefill(task)

    async def handoff(self, request_id: str) -> PrefillResult:
        return await self.prefill_worker.handoff(request_id)


class DecodeActor(_WorkerActor):
    def __init__(self, worker_id: str, model_dir: str, pool: PoolConfig,
                 settings: ActorSettings) -> None:
        _restart_backoff(settings)
        self.decode_worker = DecodeWorker(worker_id, model_dir,
                                          pool.engine_config("decode", _device()),
                                          settings.transfer, settings.receiver_options(),
                                          settings.kv_timeout_s, settings.host(),
                                          _cores(pool), settings.tracer("decode", worker_id),
                                          settings.sender_options())
        self._adopt(self.decode_worker, settings)

    async def reserve(self, request_id: str, prompt_token_ids: Sequence[int],
                      params: SamplingParams, local: LocalPrefill = NO_LOCAL_PREFILL,
                      router_id: str = "", trace: Carrier | None = None,
                      ) -> Reservation | None:
        return await self.decode_worker.reserve(request_id, prompt_token_ids, params, local,
                                                router_id, trace)

    async def move_connect(self, worker_id: str, endpoint: dict[str, Any]) -> None:
        await self.decode_worker.move_connect(worker_id, endpoint)

    async def reserve_moved(self, request_id: str, token_ids: Sequence[int],
                            params: SamplingParams, head_blocks: int, spare_blocks: int,
                            router_id: str = "", trace: Carrier | None = None,
                            ) -> Reservation | None:
        return await self.decode_worker.reserve_moved(request_id, token_ids, params,
                                                      head_blocks, spare_blocks, router_id,
                                                      trace)

    async def move_blocks(self, request_id: str, send_id: str, worker_id: str,
                          first_block: int, dst_blocks: Sequence[int]) -> int:
        return await self.decode_worker.move_blocks(request_id, send_id, worker_id,
                                                    first_block, dst_blocks)

    async def move_stop(self, request_id: str, send_id: str, worker_id: str,
                        first_block: int, dst_blocks: Sequence[int],
                        known_tokens: int) -> tuple[int, int]:
        return await self.decode_worker.move_stop(request_id, send_id, worker_id,
                                                  first_block, dst_blocks, known_tokens)


class ColocatedActor(_WorkerActor):
    def __init__(self, worker_id: str, model_dir: str, pool: PoolConfig,
                 settings: ActorSettings) -> None:
        _restart_backoff(settings)
        self.colocated_worker = ColocatedWorker(worker_id, model_dir,
                                                pool.engine_config("colocated", _device()),
                                                settings.host(), _cores(pool),
                                                settings.tracer("colocated", worker_id))
        self._adopt(self.colocated_worker, settings)

    async def admit(self, request_id: str, prompt_token_ids: Sequence[int],
                    params: SamplingParams, router_id: str = "",
                    trace: Carrier | None = None) -> bool:
        return await self.colocated_worker.admit(request_id, prompt_token_ids, params,
                                                 router_id, trace)


REMOTE: dict[str, Any] = {"prefill": ray.remote(PrefillActor), "decode": ray.remote(DecodeActor),
          "colocated": ray.remote(ColocatedActor)}


def actor_options(pool: PoolConfig, cluster_has_gpus: bool, name: str,
                  max_restarts: int, detached: bool = False) -> dict[str, Any]:
    """Ray options of one worker actor; ``detached``: it outlives the router that
    started it, under ``name`` in ``NAMESPACE`` (a deployment's worker)."""
    bundle = pool.bundle(cluster_has_gpus)
    placement = {"label_selector": dict(pool.labels)} if pool.labels else {}
    lifetime = ({"lifetime": "detached", "namespace": NAMESPACE, "get_if_exists": True}
                if detached else {})
    return {
        **placement,
        **lifetime,
        "num_cpus": bundle.get("CPU", 0),
        "num_gpus": bundle.get("GPU", 0),
        "resources": dict(pool.resources),
        "name": name,
        "max_concurrency": 1000,  # concurrent awaits, not threads
        "max_restarts": max_restarts,
        "max_task_retries": 0,  # a call on a dead actor fails; the router decides
        # Every request makes several calls here (reserve, prefill, handoff, abort) and
        # the health probes one per worker every 0.25 s: Ray would keep an event record
        # of each in its GCS, up to 100,000 tasks (the GCS grew ~1.8 MiB a minute at 1
        # request/s, for hours). Nothing reads them.
        "enable_task_events": False,
    }


class RayWorker:
    """The router's handle on one worker actor: the worker's own async methods."""

    def __init__(self, worker_id: str, role: str, handle: Any) -> None:
        self.worker_id = worker_id
        self.role = role
        self.handle = handle

    async def _call(self, method: str, *args: Any) -> Any:
        try:
            return await getattr(self.handle, method).remote(*args)
        except RayActorError as exc:
            raise WorkerGone(f"actor of {self.worker_id}: {type(exc).__name__}") from None
        except RayTaskError as exc:
            cause = exc.cause
            if isinstance(cause, AttemptFailed | WorkerGone | ValueError):
                raise cause from None
            raise AttemptFailed(FailReason.TRANSPORT,
                                f"{self.worker_id}.{method}: {type(cause).__name__}") from None

    async def load(self) -> WorkerLoad:
        return await self._call("load")

    async def join_info(self) -> JoinInfo:
        return await self._call("join_info")

    async def abort(self, request_id: str) -> None:
        with contextlib.suppress(Exception):  # fire and forget
            self.handle.abort.remote(request_id)

    async def connect(self, decode_worker: str, endpoint: dict[str, Any]) -> None:
        await self._call("connect", decode_worker, endpoint)

    async def prefill(self, task: PrefillTask) -> FirstToken:
        return await self._call("prefill", task)

    async def handoff(self, request_id: str) -> PrefillResult:
        return await self._call("handoff", request_id)

    async def reserve(self, request_id: str, prompt_token_ids: Sequence[int],
                      params: SamplingParams, local: LocalPrefill = NO_LOCAL_PREFILL,
                      router_id: str = "", trace: Carrier | None = None,
                      ) -> Reservation | None:
        return await self._call("reserve", request_id, list(prompt_token_ids), params,
                                local, router_id, trace)

    async def move_connect(self, worker_id: str, endpoint: dict[str, Any]) -> None:
        await self._call("move_connect", worker_id, endpoint)

    async def reserve_moved(self, request_id: str, token_ids: Sequence[int],
                            params: SamplingParams, head_blocks: int, spare_blocks: int,
                            router_id: str = "", trace: Carrier | None = None,
                            ) -> Reservation | None:
        return await self._call("reserve_moved", request_id, list(token_ids), params,
                                head_blocks, spare_blocks, router_id, trace)

    async def move_blocks(self, request_id: str, send_id: str, worker_id: str,
                          first_block: int, dst_blocks: Sequence[int]) -> int:
        return int(await self._call("move_blocks", request_id, send_id, worker_id,
                                    first_block, list(dst_blocks)))

    async def move_stop(self, request_id: str, send_id: str, worker_id: str,
                        first_block: int, dst_blocks: Sequence[int],
                        known_tokens: int) -> tuple[int, int]:
        length, nbytes = await self._call("move_stop", request_id, send_id, worker_id,
                                          first_block, list(dst_blocks), known_tokens)
        return int(length), int(nbytes)

    async def admit(self, request_id: str, prompt_token_ids: Sequence[int],
                    params: SamplingParams, router_id: str = "",
                    trace: Carrier | None = None) -> bool:
        return bool(await self._call("admit", request_id, list(prompt_token_ids), params,
                                     router_id, trace))


if TYPE_CHECKING:  # mypy holds every worker class, and the Ray proxy, to what the router calls
    _P: type[PrefillHandle] = PrefillWorker
    _D: type[DecodeHandle] = DecodeWorker
    _C: type[ColocatedHandle] = ColocatedWorker
    _RP: type[PrefillHandle] = RayWorker
    _RD: type[DecodeHandle] = RayWorker
    _RC: type[ColocatedHandle] = RayWorker
    _AP: type[PrefillHandle] = PrefillActor
    _AD: type[DecodeHandle] = DecodeActor
    _AC: type[ColocatedHandle] = ColocatedActor
