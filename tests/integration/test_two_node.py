"""A real two-node Ray cluster on this machine: a head started with ``ray start
--head`` on 127.0.0.3 offering ``prefill_node``, a second raylet on 127.0.0.4 offering
``decode_node`` and the label ``pdserve/pool=decode``. ``pdserve serve --address``
joins it with the prefill pool pinned by resource and the decode pool by label, so KV
crosses nodes (UCX over TCP for nixl, gloo for torch). Greedy output equals the
engine's. Then the second node dies under load (every process of it killed):
in-flight requests end, the decode worker leaves routing, ``/health`` and the file-SD
targets drop it; when the node comes back the worker returns and serves again."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import threading
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
from tests.waiting import until

HEAD_IP, NODE_IP = "127.0.0.3", "127.0.0.4"
PROMPTS = [[5 + (i * 13 + j) % 400 for j in range(4 + 11 * i)] for i in range(4)]
MAX_TOKENS = 12

class TwoNodes:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.port = free_port(HEAD_IP)
        self.address = f"{HEAD_IP}:{self.port}"
        self.head = RayNode([
            "--head", "--node-ip-address", HEAD_IP, "--port", str(self.port),
            "--ray-client-server-port", str(free_port(HEAD_IP)), "--include-dashboard", "false",
            "--num-cpus", "2", "--resources", json.dumps({"prefill_node": 2}),
            "--labels", "pdserve/pool=prefill", "--temp-dir", str(tmp)],
            tmp / "head.log")
        self.node = RayNode([
            "--address", self.address, "--node-ip-address", NODE_IP, "--num-cpus", "2",
            "--resources", json.dumps({"decode_node": 2}), "--labels", "pdserve/pool=decode"],
            tmp / "node.log")
        try:
            self.wait_nodes(2)
        except BaseException:
            self.stop()
            raise

    def wait_nodes(self, n: int) -> None:
        """Until the cluster has ``n`` live nodes (asked from a driver of its own)."""
        script = ("import ray, sys, time\n"
                  f"ray.init(address={self.address!r}, logging_level='ERROR')\n"
                  "deadline = time.monotonic() + 90\n"
                  f"while sum(n['Alive'] for n in ray.nodes()) != {n}:\n"
                  "    if time.monotonic() > deadline: sys.exit(1)\n"
                  "    time.sleep(0.2)\n")
        env = {**marked_env()[1], **CLUSTER_ENV}
        assert subprocess.run([sys.executable, "-c", script], env=env, timeout=150,
                              capture_output=True).returncode == 0, f"not {n} nodes"

    def stop(self) -> None:
        for node in (self.node, self.head):
            kill_marked(node.mark)
            if node.proc is not None and node.proc.poll() is None:
                node.proc.kill()
                node.proc.wait()


@pytest.fixture(scope="module")
def cluster() -> Iterator[TwoNodes]:
    # Ray's socket paths must stay under 107 bytes: a short folder, not pytest's.
    tmp = Path(tempfile.mkdtemp(prefix="pd2n-", dir="/tmp"))
    try:
        nodes = TwoNodes(tmp)
        try:
            yield nodes
        finally:
            nodes.stop()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


class Served(ServeProcess):
    """``pdserve serve --address`` on the two-node cluster."""

    def __init__(self, cluster: TwoNodes, model: Path, transfer: str, tmp: Path) -> None:
        self.targets = tmp / "targets.json"
        config = {
            "model": str(model), "transfer": transfer, "address": cluster.address,
            "http_port": 0, "grpc_port": 0, "file_sd_path": str(self.targets),
            "kv_timeout_s": 10, "restart_backoff_s": 0.2,
            "prefill": {"workers": 1, "num_cpus": 1, "resources": {"prefill_node": 1},
                        "engine": {"num_blocks": 128}},
            "decode": {"workers": 1, "num_cpus": 1, "labels": {"pdserve/pool": "decode"},
                       "engine": {"num_blocks": 256}},
            "router": {"health_timeout_s": 3, "queue_timeout_s": 5, "max_retries": 1,
                       "placement": "static"},  # KV crosses the nodes
        }
        (tmp / "config.yaml").write_text(yaml.safe_dump(config))
        _, env = marked_env()
        env.update(CLUSTER_ENV)
        super().__init__(["--config", str(tmp / "config.yaml")], tmp / "serve.log", env,
                         model.name)


@pytest.fixture
def serve(cluster: TwoNodes, tiny_model: Callable[[str], Path], tmp_path: Path,
          ) -> Iterator[Callable[[str], Served]]:
    made: list[Served] = []

    def start(transfer: str) -> Served:
        made.append(Served(cluster, tiny_model("llama-gqa"), transfer, tmp_path))
        return made[-1]

    yield start
    for s in made:
        s.stop()


def test_pools_on_two_nodes_match_the_engine_over_gloo(
        serve: Callable[[str], Served], tiny_model: Callable[[str], Path]) -> None:
    s = serve("torch")
    workers = s.workers()
    # Placement: each pool on its own node (the workers' /metrics bind the node's IP).
    assert str(workers["prefill-0"]["metrics"]).startswith(HEAD_IP + ":")
    assert str(workers["decode-0"]["metrics"]).startswith(NODE_IP + ":")
    check_golden(s, PROMPTS, golden(tiny_model("llama-gqa"), PROMPTS, MAX_TOKENS), MAX_TOKENS)


def test_node_loss_and_return_over_nixl(serve: Callable[[str], Served], cluster: TwoNodes,
                                        tiny_model: Callable[[str], Path]) -> None:
    s = serve("nixl")
    want = golden(tiny_model("llama-gqa"), PROMPTS, MAX_TOKENS)
    check_golden(s, PROMPTS, want, MAX_TOKENS)
    assert str(s.workers()["decode-0"]["metrics"]).startswith(NODE_IP + ":")

    # Load while the decode node dies: every request ends (tokens or a clear error).
    outcomes: list[int] = []
    stop = threading.Event()

    def client(i: int) -> None:
        for n in range(200):  # bounded
            if stop.is_set():
                return
            status, body = s.complete(PROMPTS[(i + n) % len(PROMPTS)], MAX_TOKENS)
            if status != 200:
                assert "error" in body and body["error"]["message"], body  # type: ignore[index]
            outcomes.append(status)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    until("requests served before the loss", lambda: len(outcomes) >= 3, 120)
    cluster.node.kill()
    until("the decode worker to leave routing",
          lambda: s.workers()["decode-0"]["state"] == "down", 60)
    assert s.get("/health")[0] == 503
    until("file-SD to drop the decode worker", lambda: "decode-0" not in json.dumps(
        json.loads(s.targets.read_text())), 30)
    stop.set()
    for t in threads:
        t.join(timeout=120)
        assert not t.is_alive(), "a request hung after the node died"
    assert outcomes.count(200) >= 3 and set(outcomes) <= {200, 429, 500, 503}, outcomes

    # The node comes back: Ray restarts the decode actor there and it rejoins.
    cluster.node.start()
    cluster.wait_nodes(2)
    until("the decode worker to rejoin", lambda: s.get("/health")[0] == 200
          and s.workers()["decode-0"]["state"] == "serving", 180)
    assert int(s.workers()["decode-0"]["restarts"]) >= 1  # type: ignore[call-overload]
    until("file-SD to list it again", lambda: "decode-0" in s.targets.read_text(), 30)
    check_golden(s, PROMPTS, want, MAX_TOKENS)
