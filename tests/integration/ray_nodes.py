"""A Ray node of a test cluster started by hand (``ray start --block``), and the
environment every process of such a cluster runs with (test_two_node.py,
test_router_restart.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.integration.procs import kill_marked, marked_env, processes_with
from tests.waiting import until

# Every process of the test cluster: no token auth (a ~/.ray token from another local
# cluster must not switch it on), UCX on loopback over TCP, node deaths noticed in ~3 s.
CLUSTER_ENV = {
    "RAY_AUTH_MODE": "disabled", "UCX_NET_DEVICES": "lo", "UCX_TLS": "tcp",
    "RAY_health_check_period_ms": "500", "RAY_health_check_timeout_ms": "1000",
    "RAY_health_check_failure_threshold": "4", "RAY_DEDUP_LOGS": "0",
}


class RayNode:
    """One ``ray start --block`` process and everything it starts (marked)."""

    def __init__(self, args: list[str], log: Path) -> None:
        self.args, self.log_path = args, log
        self.mark, env = marked_env()
        env.update(CLUSTER_ENV)
        self.env = env
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self) -> None:
        with self.log_path.open("ab") as out:
            self.proc = subprocess.Popen(
                [str(Path(sys.executable).parent / "ray"), "start", "--block",
                 "--disable-usage-stats", *self.args],
                stdout=out, stderr=subprocess.STDOUT, env=self.env, start_new_session=True)

    def kill(self) -> None:
        """The node dies: SIGKILL to every process of it, at once."""
        kill_marked(self.mark)
        if self.proc is not None:
            self.proc.wait(timeout=30)
        until("the node's processes to end", lambda: not processes_with(self.mark), 30)
