"""pdserve as a user installs it: a wheel built from this checkout, installed into a
fresh venv and run from a folder outside the tree, serves one request through each
API (OpenAI HTTP, gRPC) on the native CPU kernels it compiled at first use, with the
gRPC code generated into the wheel at build time (a non-editable install used to fall
back to the plain-torch paths without a word and could not build its gRPC code).

The fresh venv borrows this venv's dependencies through a ``.pth`` line added after the
wheel is installed (installing torch and Ray again would take minutes and the
network); pdserve itself comes only from the wheel, which the client checks.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import sysconfig
from collections.abc import Callable
from pathlib import Path

import pytest

from pdserve.engine import kernels
from tests.integration.procs import kill_marked, marked_env, start_serve

ROOT = Path(__file__).resolve().parents[2]
# Every pool on the native kernels, named: serving fails if they cannot load.
CONFIG = """\
prefill: {num_cpus: 1, engine: {linear_backend: cpu, attention_backend: cpu}}
decode: {num_cpus: 1, engine: {linear_backend: cpu, attention_backend: cpu, num_blocks: 64}}
"""

pytestmark = pytest.mark.skipif(kernels.cpu_supported() is not None,
                                reason=f"{kernels.cpu_supported()}")


def _run(args: list[str], timeout_s: float, **kw: object) -> str:
    done = subprocess.run(args, capture_output=True, text=True, timeout=timeout_s,
                          check=False, **kw)  # type: ignore[call-overload]
    assert done.returncode == 0, f"{args}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return str(done.stdout)


def _installed(tmp: Path) -> Path:
    """A fresh venv with the wheel built from this checkout; its bin/ folder."""
    dist = tmp / "dist"
    _run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation",
          "-q", "-w", str(dist)], 600, cwd=tmp)
    (wheel,) = dist.glob("pdserve-*.whl")
    venv = tmp / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], 120)
    _run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install",
          "-q", "--no-deps", "--no-index", str(wheel)], 300)
    site = _run([str(venv / "bin" / "python"), "-c",
                 "import sysconfig; print(sysconfig.get_paths()['purelib'])"], 60).strip()
    (Path(site) / "borrowed-deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return venv / "bin"


def test_a_wheel_serves_each_api_with_its_native_kernels(
        tmp_path: Path, tiny_model: Callable[[str], Path]) -> None:
    model = tiny_model("llama-gqa")
    bin_dir = _installed(tmp_path)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "cluster.yaml").write_text(CONFIG)
    mark, env = marked_env()
    env = {k: v for k, v in env.items() if k != "PYTHONPATH"}
    env["PDSERVE_CACHE_DIR"] = str(tmp_path / "cache")  # nothing compiled there yet
    log = tmp_path / "serve.log"
    proc, text = start_serve(["--model", str(model), "--config", "cluster.yaml",
                              "--http-port", "0", "--grpc-port", "0"], log, env,
                             timeout_s=600, pdserve=[str(bin_dir / "pdserve")], cwd=outside)
    try:
        assert "compiling the CPU kernels" in text, text[-3000:]
        http = re.search(r"HTTP\s+(http://127\.0\.0\.1:\d+)/v1", text)
        grpc_addr = re.search(r"gRPC\s+(\S+:\d+)", text)
        assert http and grpc_addr, text[-3000:]
        out = json.loads(_run([str(bin_dir / "python"), str(ROOT / "tests" / "packaging" /
                                                              "wheel_client.py"),
                               http[1], grpc_addr[1], model.name], 300, cwd=outside, env=env))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        kill_marked(mark)
    venv = bin_dir.parent
    assert Path(out["pdserve"]).is_relative_to(venv), out["pdserve"]  # the wheel's, not ours
    assert Path(out["protos"]).is_relative_to(venv), out["protos"]  # generated at build time
    assert list((tmp_path / "cache" / "kernels").glob("*/pdserve_kernels.so"))
    assert out["completion"]["usage"]["completion_tokens"] == 4
    assert out["chat"]["usage"]["completion_tokens"] == 4
    assert len(out["grpc_tokens"]) == 4 and out["grpc_final"] == ["length"]
    assert out["completion"]["choices"][0]["token_ids"] == out["grpc_tokens"]  # both greedy
