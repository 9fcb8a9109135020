"""``pdserve serve`` start-up and shutdown as a user sees them: a deployment the Ray
cluster cannot place fails at once naming the missing resource; SIGTERM -- while the
workers load, or while serving -- stops the server and every process it started."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.integration.procs import kill_marked, marked_env, processes_with
from tests.waiting import until


class Server:
    def __init__(self, model: Path, tmp: Path, *flags: str) -> None:
        self.mark, env = marked_env()
        self.log = tmp / "serve.log"
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "pdserve.cli.main", "serve", "--model", str(model),
                 "--transfer", "torch", "--http-port", "0", "--grpc-port", "0", *flags],
                stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def nothing_left(self) -> None:
        until("every process the server started to end", lambda: not processes_with(self.mark), 30)


@pytest.fixture
def server(tiny_model: Callable[[str], Path], tmp_path: Path) -> Iterator[Callable[..., Server]]:
    made: list[Server] = []

    def start(*flags: str) -> Server:
        made.append(Server(tiny_model("llama-gqa"), tmp_path, *flags))
        return made[-1]

    yield start
    for s in made:
        if s.proc.poll() is None:
            os.killpg(s.proc.pid, signal.SIGKILL)
            s.proc.wait()
        kill_marked(s.mark)


def test_unplaceable_pools_fail_fast_naming_the_resource(server: Callable[..., Server]) -> None:
    n = (os.cpu_count() or 1) + 1  # more prefill workers than the machine has CPUs
    s = server("--prefill-workers", str(n), "--decode-workers", "1")
    assert s.proc.wait(timeout=120) == 2, s.text()[-2000:]
    assert f"not enough CPU for the worker pools: they need {n + 1}" in s.text()
    assert "Traceback" not in s.text()
    s.nothing_left()


@pytest.mark.parametrize("when", ["loading the model", "serving"])
def test_sigterm_leaves_nothing_behind(server: Callable[..., Server], when: str) -> None:
    s = server()
    def reached() -> bool:
        assert s.proc.poll() is None, s.text()[-2000:]
        return f"] {when}" in s.text()

    until(f"the server {when}", reached, 150, poll_s=0.05)
    s.proc.send_signal(signal.SIGTERM)
    assert s.proc.wait(timeout=60) == 0, s.text()[-3000:]
    s.nothing_left()
