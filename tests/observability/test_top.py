"""``pdserve top``: discovery from the file-SD file, window arithmetic, one frame
over real ``/metrics`` servers on loopback."""

from __future__ import annotations

import http.server
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, start_http_server

from pdserve.cli import top
from pdserve.engine.results import StepInfo
from pdserve.messages import WorkerMetrics
from pdserve.observability.file_sd import FileSD, cluster_targets
from pdserve.observability.worker_metrics import WorkerCollector
from tests.observability.conftest import PEAKS, parse_top_args, router_with_traffic


def test_quantile_interpolates_like_prometheus() -> None:
    cum = {0.1: 0.0, 0.2: 10.0, 0.4: 20.0, float("inf"): 20.0}
    assert top.quantile(0.5, cum) == pytest.approx(0.2)
    assert top.quantile(0.25, cum) == pytest.approx(0.15)
    assert top.quantile(0.75, cum) == pytest.approx(0.3)
    assert top.quantile(0.5, {1.0: 0.0, float("inf"): 0.0}) is None
    assert top.quantile(0.99, {1.0: 0.0, float("inf"): 4.0}) == 1.0  # beyond the last bound


def test_discovery(tmp_path: Path) -> None:
    sd = tmp_path / "t.json"
    FileSD(sd).update(cluster_targets("m", ("127.0.0.1", 8000), {"decode-0": ("127.0.0.1", 9)}))
    got = top.discover(parse_top_args("--file-sd", str(sd)))
    assert [(s.role, s.url) for s in got] == [("router", "http://127.0.0.1:8000/metrics"),
                                             ("decode", "http://127.0.0.1:9/metrics")]
    got = top.discover(parse_top_args("--router", "h:1", "--worker", "http://h:2/metrics"))
    assert [s.url for s in got] == ["http://h:1/metrics", "http://h:2/metrics"]
    assert got[1].name == "h:2"  # not the URL (it ran into the role column)


def test_discovery_asks_the_router(tmp_path: Path) -> None:
    """Given only the router, the workers are the ones its /metrics/targets lists."""
    groups = FileSD(tmp_path / "t.json")
    groups.update(cluster_targets("m", ("127.0.0.1", 8000), {"prefill-0": ("127.0.0.1", 9),
                                                            "decode-0": ("127.0.0.1", 10)}))
    body = (tmp_path / "t.json").read_bytes()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            ok = self.path == "/metrics/targets"
            self.send_response(200 if ok else 404)
            self.end_headers()
            self.wfile.write(body if ok else b"")

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        got = top.discover(parse_top_args("--router", f"127.0.0.1:{server.server_port}"))
    finally:
        server.shutdown()
        server.server_close()
    assert [(s.role, s.name, s.url) for s in got] == [
        ("router", "router", "http://127.0.0.1:8000/metrics"),
        ("prefill", "prefill-0", "http://127.0.0.1:9/metrics"),
        ("decode", "decode-0", "http://127.0.0.1:10/metrics")]


def test_sigterm_shows_the_cursor_again() -> None:
    proc = subprocess.Popen([sys.executable, "-m", "pdserve.cli.main", "top", "--router",
                             "127.0.0.1:1", "--interval", "0.1", "--timeout", "0.1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None
    seen = b""
    deadline = time.monotonic() + 60
    while b"DOWN" not in seen and time.monotonic() < deadline:  # a frame is on screen
        seen += os.read(proc.stdout.fileno(), 4096)
    assert b"\x1b[?25l" in seen
    proc.send_signal(signal.SIGTERM)
    rest, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0 and (seen + rest).endswith(b"\x1b[?25h")


@pytest.fixture
def servers() -> Iterator[dict[str, tuple[str, int]]]:
    """A router and two workers on loopback; each worker runs one step per scrape."""

    def busy(s: WorkerMetrics) -> WorkerMetrics:
        s.observe_step(StepInfo(2, 64, 0, 64, 0.05), 1e10, 1e9)  # 20% of PEAKS, both ways
        s.kv_transfer_bytes += 1 << 20
        return s

    regs = {"router": router_with_traffic()}
    for role in ("prefill", "decode"):
        stats = WorkerMetrics(f"{role}-0", role, 1, 2, 48, 64)
        regs[f"{role}-0"] = CollectorRegistry()
        regs[f"{role}-0"].register(
            WorkerCollector("tiny", lambda s=stats: busy(s), PEAKS))  # type: ignore[misc]
    made, addrs = [], {}
    for name, reg in regs.items():
        server, _ = start_http_server(0, addr="127.0.0.1", registry=reg)
        made.append(server)
        addrs[name] = ("127.0.0.1", int(server.server_port))
    yield addrs
    for server in made:
        server.shutdown()
        server.server_close()


def test_once_prints_one_frame(servers: dict[str, tuple[str, int]], tmp_path: Path,
                               capsys: pytest.CaptureFixture[str]) -> None:
    sd = tmp_path / "targets.json"
    router = servers.pop("router")
    FileSD(sd).update(cluster_targets("tiny", router, servers))
    servers["decode-9"] = ("127.0.0.1", 1)  # listed but down
    FileSD(sd).update(cluster_targets("tiny", router, servers))
    assert top.run(parse_top_args("--file-sd", str(sd), "--once", "--interval", "0.2",
                         "--timeout", "1")) == 0
    out = capsys.readouterr().out
    assert "\x1b[" not in out  # --once prints plain text
    lines = {line.split()[0]: line for line in out.splitlines()[::-1] if line.strip()}
    assert "DOWN" in lines["decode-9"]
    assert lines["decode"].split()[1] == "1/2"  # the pool line: one of two workers up
    prefill = lines["prefill-0"].split()
    assert prefill[1] == "prefill" and prefill[4] == "25.0%"  # KV use: 1 - 48/64
    assert float(prefill[5]) > 0  # tokens/s from the step between the two scrapes
    assert prefill[8:10] == ["20.0%", "20.0%"]  # MFU, MBU
    ttft = next(line for line in out.splitlines() if line.startswith("TTFT"))
    assert ttft.split()[1] == "1"  # the one request, since the router started


def test_unreachable_router_exits_nonzero(capsys: pytest.CaptureFixture[str]) -> None:
    assert top.run(parse_top_args("--router", "127.0.0.1:1", "--once", "--interval", "0")) == 1
    assert "DOWN" in capsys.readouterr().out
