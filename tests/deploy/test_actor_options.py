"""The options every worker actor is created with (deploy/actors.py), on a real Ray."""

from __future__ import annotations

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
