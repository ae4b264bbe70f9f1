"""The Grafana dashboard and docs/metrics.md agree with the metric catalogue in pdserve.cluster.runtime.metrics."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from pdserve.cluster.runtime.metrics import METRICS, MetricKind, MetricSpec

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "k8s" / "grafana" / "pdserve-dashboard.json"
DOCS = ROOT / "docs" / "metrics.md"
BY_SCRAPED = {m.scraped_name: m for m in METRICS}
# Labels Ray's exporter adds to every series, the PodMonitor's relabelling, and histogram buckets.
OUTSIDE_LABELS = {"ray_io_cluster", "SessionName", "NodeAddress", "WorkerId", "Component", "Version", "le"}
_SERIES = re.compile(r"\b(ray_pdserve_[a-z0-9_]+)")
_SELECTOR = re.compile(r"\b(ray_pdserve_[a-z0-9_]+)\{([^}]*)\}")
_MATCHER = re.compile(r"\s*([A-Za-z_]\w*)\s*(=~|!~|!=|=)\s*\"[^\"]*\"\s*")


def _dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def _graph_panels() -> list[dict]:
    return [p for p in _dashboard()["panels"] if p["type"] != "row"]


def _exprs() -> list[str]:
    return [t["expr"] for p in _graph_panels() for t in p["targets"]]


def _spec_of(series: str) -> MetricSpec:
    """The catalogue entry a scraped series belongs to (histograms add _bucket, _sum, _count)."""
    if series in BY_SCRAPED:
        return BY_SCRAPED[series]
    base, _, suffix = series.rpartition("_")
    spec = BY_SCRAPED.get(base)
    if spec is None or spec.kind is not MetricKind.HISTOGRAM or suffix not in ("bucket", "sum", "count"):
        raise AssertionError(f"{series} is not a metric pdserve.cluster.runtime.metrics defines")
    return spec


def test_dashboard_is_a_grafana_dashboard_with_a_prometheus_datasource_variable() -> None:
    board = _dashboard()
    assert board["schemaVersion"] >= 36 and board["uid"] and board["title"]
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in _graph_panels():
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["targets"], f"panel {panel['title']!r} has no query"
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}", panel["title"]
        assert {"h", "w", "x", "y"} <= set(panel["gridPos"]) and panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24


def test_every_query_uses_only_defined_metrics_labels_and_variables() -> None:
    variables = {v["name"] for v in _dashboard()["templating"]["list"]} | {"__rate_interval", "__range"}
    for expr in _exprs():
        assert expr.count("(") == expr.count(")") and expr.count("{") == expr.count("}"), expr
        series = _SERIES.findall(expr)
        assert series, f"query references no pdserve metric: {expr}"
        for name in series:
            spec = _spec_of(name)
            if name.endswith("_bucket"):
                assert "histogram_quantile" in expr, expr
            if spec.kind is MetricKind.COUNTER or spec.kind is MetricKind.HISTOGRAM:
                assert re.search(r"\b(rate|increase)\(" + re.escape(name), expr), f"{name} needs rate(): {expr}"
        for name, selector in _SELECTOR.findall(expr):
            allowed = set(_spec_of(name).tag_keys) | OUTSIDE_LABELS
            for part in filter(None, selector.split(",")):
                m = _MATCHER.fullmatch(part)
                assert m, f"cannot read matcher {part!r} in {expr}"
                assert m.group(1) in allowed, f"{name} has no label {m.group(1)!r}"
        for var in re.findall(r"\$(\w+)", expr):
            assert var in variables, f"undefined variable ${var} in {expr}"


@pytest.mark.parametrize("metric", [
    "pdserve_time_to_first_token_seconds", "pdserve_inter_token_latency_seconds",
    "pdserve_e2e_request_latency_seconds", "pdserve_request_queue_time_seconds",
    "pdserve_request_prefill_time_seconds", "pdserve_request_decode_time_seconds",
    "pdserve_kv_cache_usage_perc", "pdserve_prefix_cache_hits_total", "pdserve_prefix_cache_queries_total",
    "pdserve_kv_transfer_bytes_total", "pdserve_num_requests_running", "pdserve_num_requests_waiting",
    "pdserve_pool_replicas", "pdserve_planner_decisions_total",
])
def test_dashboard_shows(metric: str) -> None:
    assert any("ray_" + metric in expr for expr in _exprs())


def test_docs_table_lists_every_metric_with_its_type_and_labels() -> None:
    rows = {}
    for line in DOCS.read_text().splitlines():
        cells = [c.strip().strip("`") for c in line.strip().strip("|").split("|")]
        if len(cells) >= 4 and cells[0].startswith("ray_pdserve_"):
            rows[cells[0]] = cells
    assert set(rows) == set(BY_SCRAPED), "docs/metrics.md and METRICS disagree"
    for name, (_, kind, labels, *_rest) in rows.items():
        spec = BY_SCRAPED[name]
        assert kind == spec.kind.value, name
        assert {label.strip(" `") for label in labels.split(",")} == set(spec.tag_keys), name


def test_engine_metrics_read_fields_the_engine_stats_have() -> None:
    """``update_engine`` reads ``EngineStats`` by field name: a renamed field must fail here, not
    leave its gauge or counter silently unset."""
    from dataclasses import fields

    from pdserve.cluster.runtime.metrics import _ENGINE_COUNTERS, _ENGINE_GAUGES
    from pdserve.engine.llm_engine import EngineStats

    names = {f.name for f in fields(EngineStats)}
    assert set(_ENGINE_COUNTERS) | set(_ENGINE_GAUGES) <= names
