"""The options every worker actor is created with (pdserve/cluster/actors.py), on a real Ray."""

from __future__ import annotations

import pytest
import ray

from pdserve.cluster.actors import MAX_BACKOFF_S, STABLE_S, actor_options, restart_backoff
from pdserve.cluster.config import ClusterConfig, PoolConfig
from tests.waiting import until


class Probe:
    def load(self) -> int:
        return 1


def test_worker_actor_calls_leave_no_task_events(ray_address: str) -> None:
    """Health probes (every 0.25 s per worker) and the calls of every request would
    each leave a task event in Ray's GCS (up to 100,000 of them: the GCS grew for
    hours); Ray takes the option and records none for the actor's methods."""
    handle = ray.remote(Probe).options(
        **actor_options(PoolConfig(), False, "probe-task-events", 0)).remote()
    try:
        assert ray.get(handle.load.remote()) == 1
        assert handle._ray_enable_task_events is False
        assert handle.load._enable_task_events is False  # what each call carries
    finally:
        ray.kill(handle)


def test_a_deployment_needs_a_ray_cluster_that_outlives_the_router() -> None:
    """``--deployment`` workers outlive the router; an embedded Ray cluster ends with
    it, so the pair is refused up front, as is a name Ray's actor names cannot carry."""
    with pytest.raises(ValueError, match="give --address of a Ray cluster"):
        ClusterConfig(transfer="local", deployment="prod")
    with pytest.raises(ValueError, match="deployment must be 1-64 letters"):
        ClusterConfig(transfer="local", address="auto", deployment="a:b")
    assert ClusterConfig(transfer="local", address="auto", deployment="prod-1").deployment


def test_deployment_workers_are_detached_and_named() -> None:
    opts = actor_options(PoolConfig(), False, "dep:prefill-0", 0, detached=True)
    assert (opts["lifetime"], opts["namespace"], opts["name"]) == ("detached", "pdserve",
                                                                   "dep:prefill-0")
    assert opts["get_if_exists"]  # two routers starting at once share the one worker
    assert "lifetime" not in actor_options(PoolConfig(), False, "p", 0)



class EnvProbe:
    def get(self, name: str) -> str | None:
        import os

        return os.environ.get(name)


def test_embedded_workers_spin_less_between_parallel_regions(ray_address: str) -> None:
    """The embedded cluster's pools share its cores: its worker processes start with
    libgomp's short spin (pdserve/cluster/cluster.py says what the default spin cost)."""
    handle = ray.remote(EnvProbe).options(
        **actor_options(PoolConfig(), False, "probe-env", 0)).remote()
    try:
        assert ray.get(handle.get.remote("GOMP_SPINCOUNT")) == "3000"
        # and malloc in transparent huge pages (the weights', the KV cache's streams)
        assert "glibc.malloc.hugetlb=1" in ray.get(handle.get.remote("GLIBC_TUNABLES"))
    finally:
        ray.kill(handle)


def _answers(handle: ray.actor.ActorHandle) -> bool:
    try:
        return bool(ray.get(handle.load.remote(), timeout=5) == 1)
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
        return False


def test_a_worker_is_restarted_however_often_it_dies(ray_address: str) -> None:
    """The default ``max_restarts`` (-1) restarts a dead worker every time: with the old
    cap of 5 the only decode worker of ``make serve`` stayed down after its sixth crash
    (kill -9 in a user trial), and every request got 503 from then on."""
    cfg = ClusterConfig(transfer="local")
    assert cfg.max_restarts == -1
    handle = ray.remote(Probe).options(
        **actor_options(PoolConfig(), False, "probe-restarts", cfg.max_restarts)).remote()
    try:
        for _ in range(7):
            until("the actor answering", lambda: _answers(handle), 60, poll_s=0.05)
            ray.kill(handle, no_restart=False)
        until("the actor answering after its 7th death", lambda: _answers(handle), 60,
              poll_s=0.05)
    finally:
        ray.kill(handle)
    with pytest.raises(ValueError, match="max_restarts must be >= 0 or -1"):
        ClusterConfig(transfer="local", max_restarts=-2)


def test_the_restart_backoff_doubles_in_a_row_and_starts_over_after_a_stable_run() -> None:
    assert restart_backoff(None, 1000.0, 0.5) == (1, 0.5)
    # each restart a minute after the last: in a row, the wait doubles up to the cap
    waits = []
    previous = (0, 0.0)
    for i in range(1, 10):
        n, wait_s = restart_backoff(previous, 60.0 * i, 0.5)
        waits.append(wait_s)
        previous = (n, 60.0 * i)
    assert waits == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, MAX_BACKOFF_S, MAX_BACKOFF_S]
    # an incarnation that ran STABLE_S: the next restart is a first one again
    assert restart_backoff((9, 100.0), 100.0 + STABLE_S, 0.5) == (1, 0.5)
    assert restart_backoff((9, 100.0), 100.0 + STABLE_S - 1, 0.5) == (10, MAX_BACKOFF_S)
