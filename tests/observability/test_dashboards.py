"""The Grafana dashboard and the recording rules as committed: generated from their
scripts, well-formed, and every metric every panel queries exists (in the code's
metric definitions or as a recording rule's output). The end-to-end test runs the
same queries against a real Prometheus."""

from __future__ import annotations

import re

import yaml

from tests.observability.conftest import (
    DASHBOARD,
    DEPLOY,
    REPO,
    RULES,
    dashboard,
    load_script,
    panels,
)

ROW_ORDER = ["Overview", "Disaggregation", "Faults", "Latency", "Per-stage breakdown", "Prefill pool",
             "KV transfer", "Decode pool (and colocated workers)", "Efficiency",
             "Per-worker drill-down"]
# A name right before a selector or range, or one of our prefixes anywhere.
METRIC = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*(?=\{|\[)|\b(?:pdserve_|vllm:|worker:|pool:)[\w:]+")


def metrics_in(expr: str) -> set[str]:
    return set(METRIC.findall(expr))


def test_committed_files_are_generated() -> None:
    assert DASHBOARD.read_text() == load_script("grafana/build_dashboards.py").render(), \
        "run: python deploy/grafana/build_dashboards.py"
    assert RULES.read_text() == load_script("prometheus/build_rules.py").build(), \
        "run: python deploy/prometheus/build_rules.py"


def test_dashboard_structure() -> None:
    d = dashboard()
    assert d["uid"] and d["title"] and d["schemaVersion"] >= 36
    assert [v["name"] for v in d["templating"]["list"]] == ["datasource", "model", "worker"]
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    assert [p["title"] for p in d["panels"] if p["type"] == "row"] == ROW_ORDER
    cells: set[tuple[int, int]] = set()
    for p in d["panels"]:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"])
                for y in range(g["y"], g["y"] + g["h"])}
        assert not mine & cells, f"panel {p['title']!r} overlaps another"
        cells |= mine
    for p in panels():
        assert p["description"] and p["datasource"]["uid"] == "${datasource}", p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert refs and len(refs) == len(set(refs)), p["title"]
        assert all(t["expr"].strip() for t in p["targets"]), p["title"]


def test_every_queried_metric_exists(catalog: set[str]) -> None:
    for p in panels():
        for t in p["targets"]:
            names = metrics_in(t["expr"])
            assert names, f"{p['title']}: no metric in {t['expr']}"
            missing = names - catalog
            assert not missing, f"{p['title']}: unknown metrics {missing} in {t['expr']}"


def test_variables_query_existing_metrics(catalog: set[str]) -> None:
    for v in dashboard()["templating"]["list"]:
        if v["type"] == "query":
            assert metrics_in(v["definition"]) <= catalog, v["name"]


def test_recording_rules_read_existing_metrics(catalog: set[str]) -> None:
    for group in yaml.safe_load(RULES.read_text())["groups"]:
        for rule in group["rules"]:
            assert metrics_in(rule["expr"]) - {rule["record"]} <= catalog, rule["record"]


def test_docs_explain_every_panel() -> None:
    doc = (REPO / "docs" / "observability.md").read_text()
    for p in panels():
        assert f"**{p['title']}**" in doc, f"docs/observability.md does not explain {p['title']!r}"


def test_grafana_provisioning() -> None:
    prov = DEPLOY / "grafana" / "provisioning"
    ds = yaml.safe_load((prov / "datasources" / "prometheus.yaml").read_text())
    assert ds["datasources"][0]["type"] == "prometheus"
    dash = yaml.safe_load((prov / "dashboards" / "pdserve.yaml").read_text())
    assert dash["providers"][0]["type"] == "file" and dash["providers"][0]["options"]["path"]
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    assert {"prometheus", "grafana"} <= set(compose["services"])
