"""The embedded cluster is always a cluster of its own: with Ray's bootstrap file
(``<temp dir>/ray/ray_current_cluster``, which ``ray start`` writes and a plain
``ray.init()`` follows) naming a GCS that is gone, ``init_local_ray`` still starts
its own cluster at once instead of retrying the dead one. Its autoscaler monitor
opens no metrics port (Ray's fixed 44217 on every interface).

Run in a subprocess under a temp dir of its own (``RAY_TMPDIR``), so the stale file
never touches the machine's ``/tmp/ray`` and the test session's Ray is left alone."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from pdserve.cluster.cluster import EMBEDDED_NODE_IP

START_TIMEOUT_S = 90  # a Ray start on a busy 2-core machine; a dead GCS is retried longer

# As `pdserve serve` calls it by default (no num_cpus: Ray would refuse that for a
# cluster it joins, before trying to reach it).
SCRIPT = """
import os
from pathlib import Path
import ray
from pdserve.cluster.cluster import init_local_ray
from tests.waiting import until
init_local_ray()
assert ray.get(ray.put(1)) == 1
print("gcs", ray.get_runtime_context().gcs_address, ray.util.get_node_ip_address())
# Ray's autoscaler monitor either serves 44217 on every interface or, embedded, gives
# up on its metrics server (and says so in its log): wait for one or the other.
log = Path(os.environ["RAY_TMPDIR"]) / "ray" / "session_latest" / "logs" / "monitor.log"
mark = ("RAY_TMPDIR=" + os.environ["RAY_TMPDIR"]).encode()
def ours() -> set[int]:  # socket inodes of this cluster's processes (they inherit the env)
    inodes = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if mark not in Path(f"/proc/{pid}/environ").read_bytes():
                continue
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(int(target[8:-1]))
        except OSError:
            continue
    return inodes
def port_44217() -> bool:
    mine = ours()
    return any(f[1].endswith(":ACB9") and f[3] == "0A" and int(f[9]) in mine
               for table in ("/proc/net/tcp", "/proc/net/tcp6")
               for f in (line.split() for line in Path(table).read_text().splitlines()[1:]))
until("the monitor's metrics server", lambda: port_44217() or (
    log.exists() and "starting the metrics server" in log.read_text()), 60, poll_s=0.05)
print("monitor port", port_44217())
ray.shutdown()
"""


def dead_address() -> str:
    """host:port where nothing listens (a port just freed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def test_embedded_ray_ignores_a_stale_bootstrap_file() -> None:
    # Short: Ray's unix sockets live under it (a path of at most 107 bytes).
    tmp = Path(tempfile.mkdtemp(prefix="pdray-", dir="/tmp"))
    try:
        stale = dead_address()
        (tmp / "ray").mkdir()
        (tmp / "ray" / "ray_current_cluster").write_text(stale)
        env = {**os.environ, "RAY_TMPDIR": str(tmp)}
        env.pop("RAY_ADDRESS", None)
        proc = subprocess.Popen([sys.executable, "-c", SCRIPT], env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=START_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
            raise AssertionError(f"no cluster within {START_TIMEOUT_S}s:\n{out[-3000:]}") from None
        assert proc.returncode == 0, out[-3000:]
        (line,) = [x for x in out.splitlines() if x.startswith("gcs ")]
        _, gcs, node_ip = line.split()
        assert gcs != stale and node_ip == EMBEDDED_NODE_IP, line  # its own, on loopback
        assert "monitor port False" in out, out[-3000:]  # no metrics port on every interface
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
