"""The router is not a single point of failure (``pdserve serve --deployment``): on a
Ray cluster started with ``ray start --head`` (127.0.0.5), a router's workers are
named, detached actors that outlive it. The router is killed -9 under load; its
clients' requests end (a refused or reset connection: retryable); a new router
started with the same deployment re-attaches to the live workers -- no worker
restarted, no model reloaded, no block leaked -- and serves the engine's greedy
output. A second router serves the same workers at the same time, and
``pdserve down`` stops them."""

from __future__ import annotations

import http.client
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml

from tests.integration.procs import (
    ServeProcess,
    check_golden,
    free_port,
    golden,
    kill_marked,
    marked_env,
)
from tests.integration.ray_nodes import CLUSTER_ENV, RayNode
from tests.waiting import POLL_S, until

HEAD_IP = "127.0.0.5"
DEPLOYMENT = "restart-test"
PROMPTS = [[5 + (i * 17 + j) % 400 for j in range(6 + 9 * i)] for i in range(4)]
MAX_TOKENS = 12


HEAD_START_S = 60  # a head that has not said it started by then is started again
HEAD_ATTEMPTS = 3
HEAD_UP = "Ray runtime started"  # what ``ray start`` prints once the node is up


class Head:
    """A one-node Ray cluster of its own (``ray start --head --block``), up (its log
    says so). A head that does not come up (its ports are free when chosen, not when
    Ray binds them; or its start failed) is stopped and started again on fresh ports,
    at most HEAD_ATTEMPTS times; the last one's log is in the failure."""

    def __init__(self, tmp: Path) -> None:
        for attempt in range(HEAD_ATTEMPTS):
            port = free_port(HEAD_IP)
            self.address = f"{HEAD_IP}:{port}"
            self.log = tmp / f"head-{attempt}.log"
            self.node = RayNode([
                "--head", "--node-ip-address", HEAD_IP, "--port", str(port),
                "--ray-client-server-port", str(free_port(HEAD_IP)), "--include-dashboard",
                "false", "--num-cpus", "3", "--temp-dir", str(tmp)], self.log)
            if self._came_up():
                return
            self.stop()
        raise AssertionError(f"the Ray head did not come up in {HEAD_ATTEMPTS} starts; the "
                             f"last one's log:\n{self.log.read_text(errors='replace')[-3000:]}")

    def _came_up(self) -> bool:
        deadline = time.monotonic() + HEAD_START_S
        while HEAD_UP not in self.log.read_text(errors="replace"):
            assert self.node.proc is not None
            if self.node.proc.poll() is not None or time.monotonic() >= deadline:
                return False
            time.sleep(POLL_S)
        return True

    def stop(self) -> None:
        kill_marked(self.node.mark)
        if self.node.proc is not None and self.node.proc.poll() is None:
            self.node.proc.kill()
            self.node.proc.wait()


@pytest.fixture(scope="module")
def head() -> Iterator[Head]:
    tmp = Path(tempfile.mkdtemp(prefix="pdrr-", dir="/tmp"))  # Ray's socket paths: short
    try:
        h = Head(tmp)
        try:
            yield h
        finally:
            h.stop()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


class Router(ServeProcess):
    """One ``pdserve serve --address A --deployment D`` process."""

    def __init__(self, config: Path, log: Path, model: str) -> None:
        _, env = marked_env()
        env.update(CLUSTER_ENV)
        super().__init__(["--config", str(config)], log, env, model)


def pdserve_down(head: Head) -> str:
    env = {**marked_env()[1], **CLUSTER_ENV}
    done = subprocess.run([sys.executable, "-m", "pdserve.cli.main", "down", "--address",
                           head.address, "--deployment", DEPLOYMENT], env=env, timeout=120,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.fixture
def routers(head: Head, tiny_model: Callable[[str], Path], tmp_path: Path,
            ) -> Iterator[Callable[[], Router]]:
    config = tmp_path / "config.yaml"
    model = tiny_model("llama-gqa")
    config.write_text(yaml.safe_dump({
        "model": str(model), "address": head.address,
        "deployment": DEPLOYMENT, "http_port": 0, "grpc_port": 0, "kv_timeout_s": 10,
        "prefill": {"workers": 1, "num_cpus": 1, "engine": {"num_blocks": 128}},
        "decode": {"workers": 1, "num_cpus": 1, "engine": {"num_blocks": 256}},
        "router": {"health_timeout_s": 3, "queue_timeout_s": 5, "max_retries": 1},
    }))
    made: list[Router] = []

    def start() -> Router:
        made.append(Router(config, tmp_path / f"serve-{len(made)}.log", model.name))
        return made[-1]

    try:
        yield start
    finally:
        for r in made:
            r.stop()
        pdserve_down(head)


def all_blocks_free(r: Router) -> bool:
    return all(w["free_blocks"] == w["blocks"] for w in r.workers().values())


def test_router_killed_under_load_restarts_onto_the_live_workers(
        routers: Callable[[], Router], head: Head, tiny_model: Callable[[str], Path]) -> None:
    want = golden(tiny_model("llama-gqa"), PROMPTS, MAX_TOKENS)
    first = routers()
    assert "loading the model on 1 prefill, 1 decode worker(s)" in first.text()
    check_golden(first, PROMPTS, want, MAX_TOKENS)
    before = {wid: w["metrics"] for wid, w in first.workers().items()}

    # Load on the first router, then kill -9 it mid-load.
    outcomes: list[str] = []
    stop = threading.Event()

    def client(i: int) -> None:
        for n in range(500):  # bounded
            if stop.is_set():
                return
            try:
                status, _ = first.complete(PROMPTS[(i + n) % len(PROMPTS)], MAX_TOKENS, timeout_s=30)
                outcomes.append(str(status))
            except (OSError, http.client.HTTPException) as exc:  # the router is gone
                outcomes.append(type(exc).__name__)
                return

    threads = [threading.Thread(target=client, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    until("requests served under load", lambda: len(outcomes) >= 6, 120)
    first.kill()
    killed_at = time.monotonic()
    for t in threads:
        t.join(timeout=60)
        assert not t.is_alive(), "a client hung on the dead router"
    stop.set()
    assert outcomes.count("200") >= 6 and set(outcomes) - {"200"} <= {
        "URLError", "ConnectionResetError", "RemoteDisconnected", "ConnectionRefusedError",
        "IncompleteRead", "BadStatusLine"}, outcomes

    # A new router re-attaches: same worker processes (same /metrics), no model load.
    second = routers()
    back_s = time.monotonic() - killed_at
    text = second.text()
    assert "attaching to the 2 live worker(s) of deployment" in text
    assert "loading the model" not in text
    after = second.workers()
    assert {wid: w["metrics"] for wid, w in after.items()} == before
    assert all(w["state"] == "serving" and w["restarts"] == 0 for w in after.values())
    until("the dead router's requests to free their blocks",
          lambda: all_blocks_free(second), 60)
    check_golden(second, PROMPTS, want, MAX_TOKENS)
    print(f"router killed -9 under load: serving again {back_s:.1f} s later "
          f"(outcomes seen by its clients: {sorted(set(outcomes))})")

    # A second router on the same workers at once: both serve, both correct.
    third = routers()
    results: list[bool] = []

    def check(r: Router) -> None:
        for _ in range(2):
            for prompt, text in zip(PROMPTS, want, strict=True):
                status, body = r.complete(prompt, MAX_TOKENS)
                results.append(status == 200 and body["choices"][0]["text"] == text)  # type: ignore[index]

    pair = [threading.Thread(target=check, args=(r,)) for r in (second, third)]
    for t in pair:
        t.start()
    for t in pair:
        t.join(timeout=180)
        assert not t.is_alive()
    assert results == [True] * 2 * 2 * len(PROMPTS)
    until("every block free", lambda: all_blocks_free(second) and all_blocks_free(third), 60)

    # Stopping a router leaves the workers; pdserve down stops them.
    third.stop()
    assert "keep running (pdserve down" in third.text()
    check_golden(second, PROMPTS, want, MAX_TOKENS)
    out = pdserve_down(head)
    assert "stopped 2 worker(s)" in out and "decode-0, prefill-0" in out, out
    until("the workers to leave the second router's routing", lambda: all(
        w["state"] != "serving" for w in second.workers().values()), 60)
