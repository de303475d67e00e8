"""deploy/grafana/torchpool-dashboard.json queries only metrics the daemon exports."""
from __future__ import annotations

import json
import re
from pathlib import Path

from torchpool.broker.metrics import MetricsConfig, render_metrics
from torchpool.broker.stats import LatencyWindows, VersionStats

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "torchpool-dashboard.json"
METRIC = re.compile(r"\b(?:nv|torchpool)_[a-z0-9_]+\b")


def exported_names() -> set[str]:
    """Every sample name of the /metrics page, summaries switched on."""
    stats = VersionStats()
    stats.windows = LatencyWindows(60.0, now=0.0)
    page = render_metrics([("m", 1, stats, 0)], {"input_mapped": 0}, MetricsConfig(summary_latencies=True),
                          now=0.0).decode()
    return {line.split("{", 1)[0].split(" ", 1)[0] for line in page.splitlines() if not line.startswith("#")}


def expressions(dashboard: dict) -> list[str]:
    exprs = []
    for panel in dashboard["panels"]:
        exprs += [t["expr"] for t in panel.get("targets", [])]
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            exprs.append(var["definition"])
    return exprs


def test_every_metric_the_dashboard_queries_is_exported() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    used = {name for expr in expressions(dashboard) for name in METRIC.findall(expr)}
    exported = exported_names()
    assert used, "no metric found in the dashboard's expressions"
    assert used <= exported, f"queried but not exported: {sorted(used - exported)}"
    # the panels the dashboard promises
    assert {"nv_inference_request_failure", "nv_inference_pending_request_count", "nv_inference_exec_count",
            "nv_inference_request_summary_us", "nv_inference_compute_infer_duration_us",
            "torchpool_worker_restarts", "torchpool_shm_bytes"} <= used


def test_grafana_10_dashboard_on_a_prometheus_datasource_variable() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["schemaVersion"] >= 36          # Grafana 9.4+ / 10
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        assert {"h", "w", "x", "y"} <= set(panel["gridPos"])
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
            assert all(t["datasource"]["uid"] == "${datasource}" for t in panel["targets"])
