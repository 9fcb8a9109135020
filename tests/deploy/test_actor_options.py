"""The options every worker actor is created with (deploy/actors.py), on a real Ray."""

from __future__ import annotations

import pytest
import ray

from pdserve.deploy.actors import actor_options
from pdserve.deploy.config import PoolConfig


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
    from pdserve.deploy.config import ClusterConfig

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
    libgomp's short spin (deploy/cluster.py says what the default spin cost)."""
    handle = ray.remote(EnvProbe).options(
        **actor_options(PoolConfig(), False, "probe-env", 0)).remote()
    try:
        assert ray.get(handle.get.remote("GOMP_SPINCOUNT")) == "3000"
    finally:
        ray.kill(handle)
