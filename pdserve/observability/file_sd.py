"""The Prometheus file-SD targets file: every ``/metrics`` endpoint of a cluster
(the router and each worker), one target group each, labelled ``role``, ``worker``
and ``model``.

This module owns the file's format and its updates. Prometheus re-reads the file
when it changes; ``FileSD.update`` writes a temporary file in the same folder and
renames it over the old one, so a reader sees the old list or the new one, never
half a file. ``pdserve top --file-sd`` reads the same file.

The scrape config sets ``honor_labels: true``: the labels a process exports itself
(the workers' ``role``/``worker``) win, and the file's labels fill in the rest (the
router exports no ``worker`` label; it gets ``worker="router"``).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROLES = ("router", "prefill", "decode", "colocated")


@dataclass(frozen=True)
class Target:
    """One ``/metrics`` endpoint."""

    address: str  # "host:port"
    role: str  # "router" | "prefill" | "decode" | "colocated"
    worker: str  # worker id; "router" for the router
    model: str

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        host, sep, port = self.address.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"address must be 'host:port', got {self.address!r}")


def cluster_targets(model: str, router: tuple[str, int] | None,
                    workers: Mapping[str, tuple[str, int]]) -> list[Target]:
    """Targets of a cluster: ``router`` = its (host, port) or ``None``; ``workers`` =
    ``Cluster.metrics_targets()`` (worker id -> (host, port)), whose ids start with
    their role ("prefill-0", "decode-1", "colocated-0")."""
    out = [Target(_address(*router), "router", "router", model)] if router else []
    for wid, (host, port) in sorted(workers.items()):
        role = wid.split("-", 1)[0]
        if role not in ROLES[1:]:
            raise ValueError(f"worker id {wid!r} does not start with a pool name: {ROLES[1:]}")
        out.append(Target(_address(host, port), role, wid, model))
    return out


def _address(host: str, port: int) -> str:
    # 0.0.0.0 is where a server listens, not where a scraper can connect.
    host = "127.0.0.1" if host in ("", "0.0.0.0") else host
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def target_groups(targets: Iterable[Target]) -> list[dict[str, Any]]:
    """``targets`` as Prometheus reads them: a file-SD file's contents, or an HTTP-SD
    answer (the same JSON)."""
    return [{"targets": [t.address], "labels": {"role": t.role, "worker": t.worker,
                                                "model": t.model}}
            for t in sorted(targets, key=lambda t: (ROLES.index(t.role), t.worker))]


class FileSD:
    """The targets file at ``path`` (its folder is created if missing)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def update(self, targets: Iterable[Target]) -> None:
        """Replace the file's contents with ``targets`` (atomically)."""
        groups = target_groups(targets)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", dir=self.path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(groups, f, indent=2)
                f.write("\n")
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, 0o644)  # mkstemp makes it 0600; Prometheus may run as another user
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def read(self) -> list[Target]:
        """The targets in the file ([] when it does not exist yet)."""
        try:
            groups = json.loads(self.path.read_text())
        except FileNotFoundError:
            return []
        out = []
        for g in groups:
            labels = g.get("labels", {})
            for address in g["targets"]:
                out.append(Target(address, labels.get("role", "router"),
                                  labels.get("worker", address), labels.get("model", "")))
        return out

    def remove(self) -> None:
        """Delete the file (on shutdown: no stale targets for Prometheus)."""
        self.path.unlink(missing_ok=True)
