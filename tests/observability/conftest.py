"""Shared pieces of the observability tests: the Prometheus binaries (``make test``
installs them; ``tests/deps.py``), the metric catalog built from
the code's metric definitions plus the recording rules' outputs, and the repo's
generated artifacts (rules, dashboards) loaded as modules."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry

from pdserve.cli import top
from pdserve.messages import WorkerMetrics
from pdserve.observability.efficiency import DevicePeaks
from pdserve.observability.worker_metrics import WorkerCollector
from pdserve.router.metrics import RouterMetrics
from pdserve.router.types import ErrorKind, FinalChunk, StageTimings, Usage
from tests import deps

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
RULES = DEPLOY / "prometheus" / "rules" / "pdserve.rules.yml"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "pdserve.json"
PEAKS = DevicePeaks("test-device", 1e12, 1e11, "datasheet")


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def panels() -> list[dict[str, Any]]:
    """The dashboard's panels, less its rows."""
    return [p for p in dashboard()["panels"] if p["type"] != "row"]


def parse_top_args(*argv: str) -> argparse.Namespace:
    """``pdserve top``'s arguments, parsed."""
    p = argparse.ArgumentParser()
    top.add_arguments(p)
    return p.parse_args(list(argv))


def load_script(rel: str) -> ModuleType:
    """A script under deploy/ (not a package) imported as a module."""
    path = DEPLOY / rel
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def prometheus_bins() -> tuple[str, str]:
    """(promtool, prometheus) paths (``make test`` installs them; missing: raises)."""
    return deps.prometheus_bins()


def sample_stats() -> WorkerMetrics:
    return WorkerMetrics("decode-0", "decode", 2, 1, 90, 128)


def router_registry() -> CollectorRegistry:
    registry = CollectorRegistry()
    RouterMetrics(registry, "tiny", ttft_slo_s=1.0, tpot_slo_s=0.1)
    return registry


def router_with_traffic() -> CollectorRegistry:
    registry = CollectorRegistry()
    metrics = RouterMetrics(registry, "tiny", ttft_slo_s=1.0, tpot_slo_s=0.1)
    timings = StageTimings(router_queue=0.001, prefill_queue=0.002, prefill=0.05,
                           kv_transfer=0.004, decode_queue=0.0005, ttft=0.2, e2e=1.5,
                           inter_token=[0.01, 0.02], tokens_after_first=2)
    usage = Usage(prompt_tokens=7, completion_tokens=3, cached_tokens=0)
    metrics.observe_finished(FinalChunk("stop", usage, timings=timings))
    metrics.observe_rejected(ErrorKind.OVERLOADED)
    return registry


def worker_registry(stats: WorkerMetrics | None = None) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(WorkerCollector("tiny", lambda: stats or sample_stats(), PEAKS))
    return registry


def series_names(registry: CollectorRegistry) -> set[str]:
    """Every series name a registry can expose (counters with ``_total``, histograms
    with ``_bucket``/``_sum``/``_count``), from the metric families themselves."""
    out: set[str] = set()
    for family in registry.collect():
        if family.type == "counter":
            out.add(family.name + "_total")
        elif family.type == "histogram":
            out |= {family.name + s for s in ("_bucket", "_sum", "_count")}
        else:
            out.add(family.name)
    return out


def rule_outputs() -> set[str]:
    doc = yaml.safe_load(RULES.read_text())
    return {r["record"] for g in doc["groups"] for r in g["rules"]}


@pytest.fixture(scope="session")
def catalog() -> set[str]:
    """Every series name the code defines, plus the recording rules' outputs."""
    return series_names(router_registry()) | series_names(worker_registry()) | rule_outputs()
