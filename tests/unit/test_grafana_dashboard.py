"""deploy/grafana/torchpool-dashboard.json queries only metrics the daemon exports."""
from __future__ import annotations

import json
import re
from pathlib import Path

from torchpool.broker.metrics import HISTOGRAM_BUCKETS_MS, MetricsConfig, MetricsSnapshot, render_metrics
from torchpool.broker.nvml import GpuReading
from torchpool.broker.stats import LatencyWindows, VersionStats

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "torchpool-dashboard.json"
METRIC = re.compile(r"\b(?:nv|torchpool)_[a-z0-9_]+\b")


def exported_names() -> set[str]:
    """Every sample name of the /metrics page, summaries and histograms switched on."""
    stats = VersionStats()
    stats.windows = LatencyWindows(60.0, now=0.0, histogram_bounds=tuple(round(ms * 1000)
                                                                         for ms in HISTOGRAM_BUCKETS_MS))
    stats.load_seconds = 1.0
    worker = {"name": "m_0", "pid": 1, "cpu_s": 1.0, "rss_bytes": 1, "pss_bytes": 1, "gpu_memory_bytes": 1}
    snap = MetricsSnapshot([("m", 1, stats, 0)], {"input_mapped": 0}, states=[("m", "1", "READY")],
                           instances=[("m", 1, worker)], restarts=[("m", 1, {"m_0": 0})],
                           gpus=(GpuReading(0, "GPU-0", 1 << 30, 1 << 20, 0.5),))
    page = render_metrics(snap, MetricsConfig(summary_latencies=True, histogram_latencies=True),
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
    # ... and what issue 26 found missing: histograms that add up across hosts, the model state to
    # alert on, Triton's load time, each worker's CPU and memory
    assert {"nv_inference_first_response_histogram_ms_bucket", "torchpool_inference_queue_histogram_ms_bucket",
            "torchpool_model_state", "nv_model_load_duration_secs", "torchpool_worker_cpu_seconds",
            "torchpool_worker_pss_bytes"} <= used
    # ... and issue 30's: each worker's GPU memory, each GPU's memory and utilization
    assert {"torchpool_worker_gpu_memory_bytes", "nv_gpu_memory_used_bytes", "nv_gpu_memory_total_bytes",
            "nv_gpu_utilization"} <= used


def test_histogram_quantiles_add_buckets_up_and_workers_are_told_apart_by_model_instance() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = expressions(dashboard)
    quantiles = [e for e in exprs if "histogram_quantile(" in e]
    assert quantiles and all("sum by (le, model)" in e and "_bucket{" in e for e in quantiles)
    worker = [e for e in exprs if "torchpool_worker_" in e]
    assert worker and all("model_instance" in e for e in worker)
    # `instance` stays Prometheus' scrape target: the dashboard's Instance variable filters daemons
    assert all('instance=~"$instance"' in e for e in exprs if "label_values" not in e)


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
