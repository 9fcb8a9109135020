"""The suite's hard dependencies, checked in one place: a dependency the project
installs (pyproject, ``make test``) that is missing is a broken set-up, and the tests
that need it fail loudly instead of skipping."""

from __future__ import annotations

import importlib.util
import platform
import shutil

NIXL_MODULES = ("nixl", "nixl_cu12", "nixl_cu13")


def has_nixl() -> bool:
    """Whether nixl imports here. Where pyproject installs it (Linux x86-64) its absence
    raises: the set-up is broken. Elsewhere (no wheel) the nixl tests do not apply."""
    found = any(importlib.util.find_spec(m) is not None for m in NIXL_MODULES)
    if not found and platform.system() == "Linux" and platform.machine() == "x86_64":
        raise RuntimeError("nixl is a dependency on Linux x86-64 (pyproject: nixl-cu12) but "
                           "does not import: reinstall with `make test`")
    return found


def prometheus_bins() -> tuple[str, str]:
    """(promtool, prometheus) paths; ``make test`` installs them (its ``prometheus``
    target, Debian's package). Missing: a broken set-up, raised, never skipped."""
    promtool, prometheus = shutil.which("promtool"), shutil.which("prometheus")
    if promtool is None or prometheus is None:
        raise RuntimeError("promtool and prometheus are test dependencies: `make prometheus` "
                           "installs them (Debian's prometheus package, as root)")
    return promtool, prometheus
