"""The client runs where torch and Ray are not installed: it must never import them."""

from __future__ import annotations

import subprocess
import sys


def test_client_imports_no_torch_or_ray() -> None:
    code = ("import sys, pdserve.client, pdserve.client.bench_cli, pdserve.client.plots; "
            "bad = [m for m in ('torch', 'ray') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
