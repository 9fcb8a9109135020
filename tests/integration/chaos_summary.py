"""What the chaos cases saw, printed at the end of the run (``pytest_terminal_summary``
via tests/integration/conftest.py). A hung request or a leaked block fails its case
(every wait is bounded; leaks are checked), so a printed row has none."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class Case:
    ok: int = 0  # requests that ended with all their tokens
    errors: int = 0  # ... with a clear RouterError
    cancelled: int = 0  # ... given up by their client
    recovered: int = 0  # workers back in routing after the fault
    recovery_s: float = 0.0  # fault (or SIGCONT) -> every worker in routing, every block free
    empty_kv: int = 0  # KV blocks the live workers found empty (sent or arrived so), so far


SUMMARY: dict[str, Case] = {}


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not SUMMARY:
        return
    terminalreporter.section("chaos cases")
    terminalreporter.write_line(f"{'case':44} {'ok':>3} {'error':>5} {'cancel':>6} {'hung':>4} "
                                f"{'leaked':>6} {'recovered':>9} {'in s':>6} {'empty KV':>8}")
    for name, c in SUMMARY.items():
        terminalreporter.write_line(f"{name:44} {c.ok:3d} {c.errors:5d} {c.cancelled:6d} {0:4d} "
                                    f"{0:6d} {c.recovered:9d} {c.recovery_s:6.1f} {c.empty_kv:8d}")
