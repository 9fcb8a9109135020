"""Fixtures for the KV transfer contract suite: one pair of peer hosts per backend.

Backends run with each role in its own process (spawned peer hosts), except `local`,
which is in-process by design. `nixl-tcp` is the nixl backend with UCX_TLS=tcp set in
the peer processes (the wire path instead of cma). Ray runs as one local cluster for
the session, on a loopback address, shut down at the end.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

from tests.deps import has_nixl

from .peer_host import LocalHost, ProcHost

# contract name -> (backend, extra environment of the peer processes)
VARIANTS: dict[str, tuple[str, dict[str, str]]] = {
    "local": ("local", {}),
    "torch": ("torch", {}),
    "ray": ("ray", {}),
    "nixl": ("nixl", {"UCX_NET_DEVICES": "lo"}),
    "nixl-tcp": ("nixl", {"UCX_NET_DEVICES": "lo", "UCX_TLS": "tcp"}),
}
QUIET = {"NIXL_LOG_LEVEL": "WARN", "RAY_DEDUP_LOGS": "0"}


def _available(variant: str) -> bool:
    backend = VARIANTS[variant][0]
    if backend == "nixl":
        return has_nixl()  # (raises where pyproject installs it)
    return backend != "ray" or importlib.util.find_spec("ray") is not None


@dataclass
class Hosts:
    variant: str
    backend: str
    env: dict[str, str]
    prefill: ProcHost | LocalHost  # where senders live
    decode: ProcHost | LocalHost  # where receivers live
    ray_address: str | None = None
    spares: list[ProcHost] = field(default_factory=list)  # started early, handed out by fresh()
    extra: list[ProcHost] = field(default_factory=list)

    @property
    def local(self) -> bool:
        return self.backend == "local"

    def fresh(self) -> ProcHost | LocalHost:
        """A new host of its own (to be killed); cleaned up with the fixture."""
        if self.local:
            return self.prefill
        host = self.spares.pop() if self.spares else ProcHost(self.env, self.ray_address)
        self.extra.append(host)
        return host


@pytest.fixture(scope="session")
def ray_cluster(ray_address: str) -> str:
    """The session's shared Ray cluster (tests/conftest.py)."""
    return ray_address


@pytest.fixture(scope="module", params=list(VARIANTS))
def hosts(request: pytest.FixtureRequest) -> Iterator[Hosts]:
    variant = request.param
    if not _available(variant):
        pytest.skip(f"{variant} backend not installed")
    backend, env = VARIANTS[variant]
    env = {**QUIET, **env}
    if backend == "local":
        host = LocalHost()
        yield Hosts(variant, backend, env, host, host)
        host.shutdown()
        return
    address = request.getfixturevalue("ray_cluster") if backend == "ray" else None
    prefill, decode = ProcHost(env, address), ProcHost(env, address)
    # The death tests kill hosts of their own; start those now, while other tests run.
    spares = [ProcHost(env, address) for _ in range(2)]
    h = Hosts(variant, backend, env, prefill, decode, address, spares)
    try:
        yield h
    finally:
        for host in [prefill, decode, *h.spares, *h.extra]:
            host.shutdown()
