"""Every socket an embedded ``pdserve serve`` listens on is a row of the port table in
docs/operations.md ("Ports and what must stay inside the cluster network"), read
from /proc for every process the server started: the router's HTTP and gRPC on
``--host`` (loopback), every worker listener (``/metrics``, token stream, KV channel)
on loopback, and beyond loopback only Ray's own -- the GCS, the raylet, and one gRPC
server per Ray core worker process (the router's driver and each actor). Nothing on
Ray's fixed autoscaler-metrics port 44217."""

from __future__ import annotations

import json
import re
import signal
import urllib.request
from collections.abc import Callable
from pathlib import Path

import yaml

from tests.integration.procs import (
    kill_marked,
    listening_sockets,
    marked_env,
    processes_with,
    sockets_of,
    start_serve,
)

RAY_MONITOR_PORT = 44217


def loopback(ip: str) -> bool:
    return ip.startswith("127.") or ip == "::1"


def kind_of(pid: int) -> str:
    cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    if "pdserve.cli.main serve" in cmd:
        return "router"
    if "gcs_server" in cmd:
        return "gcs"
    if "/raylet " in cmd or cmd.endswith("/raylet"):
        return "raylet"
    if cmd.startswith(("ray::PrefillActor", "ray::DecodeActor", "ray::ColocatedActor")):
        return "worker"
    return "ray"  # Ray's agents and idle core workers, its log monitor, ...


def test_every_listener_is_in_the_port_table(tiny_model: Callable[[str], Path],
                                             tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({
        "model": str(tiny_model("llama-gqa")), "http_port": 0, "grpc_port": 0,
        "prefill": {"engine": {"num_blocks": 64}}, "decode": {"engine": {"num_blocks": 64}},
    }))
    mark, env = marked_env()
    proc, text = start_serve(["--config", str(config)], tmp_path / "serve.log", env)
    try:
        http = re.search(r"HTTP\s+http://127\.0\.0\.1:(\d+)/v1", text)
        grpc = re.search(r"gRPC\s+127\.0\.0\.1:(\d+)", text)
        assert http and grpc, text[-3000:]
        with urllib.request.urlopen(f"http://127.0.0.1:{http[1]}/admin/workers",
                                    timeout=30) as r:
            metrics = {int(w["metrics"].rsplit(":", 1)[1]) for w in json.loads(r.read())["workers"]}

        table = listening_sockets()
        seen: dict[str, list[tuple[str, int]]] = {}
        for pid in processes_with(mark):
            try:
                kind = kind_of(pid)
            except OSError:
                continue
            socks = [table[i] for i in sockets_of(pid) if i in table]
            if not socks:
                continue
            seen.setdefault(kind, []).extend(socks)
            wide = [s for s in socks if not loopback(s[0])]
            if kind in ("router", "worker", "ray"):
                # beyond loopback: at most the process's Ray core-worker gRPC server
                assert len(wide) <= 1, f"{kind} {pid} listens beyond loopback on {wide}"
        everything = [s for socks in seen.values() for s in socks]
        assert all(port != RAY_MONITOR_PORT for _, port in everything), everything

        router = {port for ip, port in seen["router"] if loopback(ip)}
        assert router == {int(http[1]), int(grpc[1])}, seen["router"]  # and nothing else
        workers = {port for ip, port in seen["worker"] if loopback(ip)}
        # each worker's /metrics; the decode worker's token stream and KV listeners too
        assert metrics < workers and len(workers) >= len(metrics) + 2, seen["worker"]
        assert {"gcs", "raylet"} <= seen.keys()
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        finally:
            kill_marked(mark)
