"""Finding the processes a test started: each gets a unique mark in its environment
(inherited by everything it starts, Ray's processes included)."""

from __future__ import annotations

import os
import signal
import socket
import uuid
from pathlib import Path

MARK_VAR = "PDSERVE_TEST_MARK"


def marked_env(mark: str | None = None) -> tuple[str, dict[str, str]]:
    """A fresh mark and the environment to start processes with (no RAY_ADDRESS: a
    server started with it brings up its own embedded cluster)."""
    mark = mark or uuid.uuid4().hex
    env = {**os.environ, MARK_VAR: mark}
    env.pop("RAY_ADDRESS", None)
    return mark, env


def processes_with(mark: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if f"{MARK_VAR}={mark}".encode() in (entry / "environ").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue  # gone meanwhile, or not ours to read
    return found


def kill_marked(mark: str) -> None:
    for pid in processes_with(mark):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            continue


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
