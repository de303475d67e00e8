"""The /metrics page in Triton's names and labels, --metrics-config, latency windows."""
from __future__ import annotations

import math
import time

import pytest

from torchpool.broker import stats as stats_module
from torchpool.broker.metrics import (DEFAULT_QUANTILES, HISTOGRAM_BUCKETS_MS, MetricsConfig, MetricsConfigError,
                                      MetricsSnapshot, configure_metrics, parse_metrics_config, quantile,
                                      render_metrics)
from torchpool.broker.stats import BACKEND, REJECTED, LatencyWindow, LatencyWindows, VersionStats


def lines(text: bytes) -> list[str]:
    return text.decode().splitlines()


def page(stats: VersionStats, config: MetricsConfig = MetricsConfig(), pending: int = 0,
         now: float = 0.0) -> list[str]:
    return lines(render_metrics(MetricsSnapshot([("addsub", 1, stats, pending)], {"input_mapped": 64}), config,
                                now))


# --- --metrics-config ---------------------------------------------------------------

def test_config_defaults_are_tritons() -> None:
    config = parse_metrics_config([])
    assert config.counter_latencies and not config.summary_latencies
    assert config.summary_quantiles == DEFAULT_QUANTILES


def test_config_settings() -> None:
    config = parse_metrics_config(["summary_latencies=true", "counter_latencies=false",
                                   "summary_quantiles=0.9:0.01, 0.5:0.05", "histogram_latencies=true"])
    assert config.summary_latencies and not config.counter_latencies
    assert config.summary_quantiles == ((0.5, 0.05), (0.9, 0.01))


@pytest.mark.parametrize("item, words", [
    ("summary_latency=true", ["unknown setting 'summary_latency'", "summary_latencies", "summary_quantiles",
                              "counter_latencies"]),
    ("summary_latencies", ["unknown setting"]),
    ("summary_latencies=yes", ["expected true or false"]),
    ("summary_quantiles=0.5", ["'0.5' is not <quantile>:<error>"]),
    ("summary_quantiles=1.5:0.1", ["between 0 and 1"]),
])
def test_config_errors_name_the_setting(item: str, words: list[str]) -> None:
    with pytest.raises(MetricsConfigError) as info:
        parse_metrics_config([item])
    for word in words:
        assert word in str(info.value)


# --- names and labels ---------------------------------------------------------------

def test_tritons_names_without_total_suffix_and_failure_reasons() -> None:
    s = VersionStats()
    s.success.add(5_000_000, 5)
    s.queue.add(1_000_000, 5)
    s.record_failure(2_000_000, BACKEND)
    s.record_failure(1_000, REJECTED)
    s.record_failure(1_000, REJECTED)
    text = page(s, pending=3)
    assert "# TYPE nv_inference_request_success counter" in text
    assert 'nv_inference_request_success{model="addsub",version="1"} 5' in text
    assert 'nv_inference_request_failure{model="addsub",reason="REJECTED",version="1"} 2' in text
    assert 'nv_inference_request_failure{model="addsub",reason="BACKEND",version="1"} 1' in text
    assert 'nv_inference_request_failure{model="addsub",reason="CANCELED",version="1"} 0' in text
    assert 'nv_inference_request_failure{model="addsub",reason="OTHER",version="1"} 0' in text
    assert "# TYPE nv_inference_pending_request_count gauge" in text
    assert 'nv_inference_pending_request_count{model="addsub",version="1"} 3' in text
    # Triton's request duration sums successful requests only
    assert 'nv_inference_request_duration_us{model="addsub",version="1"} 5000' in text
    assert 'nv_inference_queue_duration_us{model="addsub",version="1"} 1000' in text
    assert 'torchpool_shm_bytes{state="input_mapped"} 64' in text
    assert not [line for line in text if "_total" in line or "torchpool_queue_depth" in line]
    assert not [line for line in text if "_summary_us" in line]


def test_counter_latencies_off() -> None:
    text = "\n".join(page(VersionStats(), MetricsConfig(counter_latencies=False)))
    assert "_duration_us" not in text and "nv_inference_request_success" in text


def test_label_values_are_escaped() -> None:
    text = lines(render_metrics(MetricsSnapshot([('a"b\\c', 2, VersionStats(), 0)], {}), MetricsConfig(), 0.0))
    assert 'nv_inference_count{model="a\\"b\\\\c",version="2"} 0' in text


# --- summaries ----------------------------------------------------------------------

def test_quantile_nearest_rank() -> None:
    values = list(range(1, 101))
    assert quantile(values, 0.5) == 50 and quantile(values, 0.99) == 99 and quantile(values, 1.0) == 100
    assert quantile(values, 0.0) == 1 and quantile([7], 0.999) == 7
    assert math.isnan(quantile([], 0.5))


def test_summaries_from_windows() -> None:
    s = VersionStats()
    s.windows = LatencyWindows(60.0, now=0.0)
    for us in range(1, 101):
        s.success.add(us * 1000)
        s.windows.request.observe(us, now=1.0)
    text = page(s, MetricsConfig(summary_latencies=True), now=2.0)
    assert "# TYPE nv_inference_request_summary_us summary" in text
    assert 'nv_inference_request_summary_us{model="addsub",version="1",quantile="0.5"} 50' in text
    assert 'nv_inference_request_summary_us{model="addsub",version="1",quantile="0.999"} 100' in text
    assert 'nv_inference_request_summary_us_count{model="addsub",version="1"} 100' in text
    assert 'nv_inference_request_summary_us_sum{model="addsub",version="1"} 5050' in text
    # nothing queued yet: an empty window, as a Prometheus summary reports it
    assert 'nv_inference_queue_summary_us{model="addsub",version="1",quantile="0.5"} NaN' in text
    for kind in ("queue", "compute_input", "compute_infer", "compute_output"):
        assert f'nv_inference_{kind}_summary_us_count{{model="addsub",version="1"}} 0' in text


def test_window_forgets_after_max_age_and_stays_bounded() -> None:
    w = LatencyWindow(max_age=10.0, now=0.0, buckets=5, cap=4)
    w.observe(1, now=0.5)
    w.observe(2, now=3.0)
    assert sorted(w.samples(now=3.0)) == [1, 2]
    assert w.samples(now=10.5) == [2]          # the 0-2 s bucket is older than 10 s
    assert w.samples(now=30.0) == []           # all of it, though nothing rotated it out
    w.observe(3, now=30.0)
    assert w.samples(now=30.0) == [3]
    w.observe(9, now=30.1, times=100)          # a batch of 100 requests: at most `cap` samples kept
    assert w.samples(now=30.1) == [9, 9, 9, 9]


def test_execution_observed_per_request_only_with_windows(monkeypatch: pytest.MonkeyPatch) -> None:
    plain = VersionStats()
    assert plain.windows is None
    plain.record_execution(4, 2, 1000, 2000, 3000)    # no windows: nothing but the counters
    monkeypatch.setattr(stats_module, "_window_age", 60.0)
    s = VersionStats()
    assert s.windows is not None
    s.record_execution(4, 2, 1000, 2000, 3000)
    assert s.windows.compute_infer.samples(now=s.windows.compute_infer.rotate_at - 1e-3) == [2, 2]


def test_page_parses_as_prometheus_text() -> None:
    """Prometheus' own text parser (prometheus_client's) reads every family
    with Triton's name and type."""
    from prometheus_client.parser import text_string_to_metric_families

    s = VersionStats()
    s.windows = LatencyWindows(60.0, now=0.0)
    s.success.add(3000)
    s.windows.request.observe(3, now=1.0)
    text = render_metrics(MetricsSnapshot([("addsub", 1, s, 0)], {"input_mapped": 64}),
                          MetricsConfig(summary_latencies=True),
                          now=1.0).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert families["nv_inference_request_success"].type == "counter"
    assert families["nv_inference_pending_request_count"].type == "gauge"
    summary = families["nv_inference_request_summary_us"]
    assert summary.type == "summary"
    got = {(x.name, x.labels.get("quantile")): x.value for x in summary.samples}
    assert got[("nv_inference_request_summary_us", "0.5")] == 3
    assert got[("nv_inference_request_summary_us_count", None)] == 1


# --- histograms (--metrics-config histogram_latencies=true) -------------------------

def test_histograms_count_into_buckets_that_add_up() -> None:
    bounds = tuple(round(ms * 1000) for ms in HISTOGRAM_BUCKETS_MS)
    s = VersionStats()
    s.windows = LatencyWindows(None, now=0.0, histogram_bounds=bounds)      # histograms, no summaries
    for us in (80, 100, 300, 7000):
        s.windows.request.observe(us, now=1.0)
    s.windows.queue.observe(30, now=1.0, times=3)      # a batch of 3 requests waited 30 us each
    text = page(s, MetricsConfig(histogram_latencies=True))
    name = "nv_inference_first_response_histogram_ms"       # Triton's family: a request to its response
    assert f"# TYPE {name} histogram" in text
    labels = 'model="addsub",version="1"'
    assert f'{name}_bucket{{{labels},le="0.05"}} 0' in text
    assert f'{name}_bucket{{{labels},le="0.1"}} 2' in text          # 80 and 100 us: le is "at most"
    assert f'{name}_bucket{{{labels},le="0.5"}} 3' in text
    assert f'{name}_bucket{{{labels},le="10"}} 4' in text
    assert f'{name}_bucket{{{labels},le="+Inf"}} 4' in text
    assert f'{name}_count{{{labels}}} 4' in text and f'{name}_sum{{{labels}}} 7.48' in text
    assert f'torchpool_inference_queue_histogram_ms_bucket{{{labels},le="0.05"}} 3' in text
    assert f'torchpool_inference_compute_infer_histogram_ms_count{{{labels}}} 0' in text
    assert not [line for line in text if "_summary_us" in line]
    # off (the default): no histogram family at all
    assert not [line for line in page(s) if "histogram" in line]


def test_histograms_and_summaries_together_parse_as_prometheus_text(monkeypatch: pytest.MonkeyPatch) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    monkeypatch.setattr(stats_module, "_window_age", None)
    monkeypatch.setattr(stats_module, "_histogram_bounds", None)
    assert VersionStats().windows is None
    configure_metrics(["histogram_latencies=true", "summary_latencies=true"])
    s = VersionStats()                       # made after the setting, as every version at startup
    s.record_execution(2, 2, 1000, 2_000_000, 3000)
    s.success.add(3_000_000)
    s.windows.request.observe(3000, now=time.monotonic())
    text = render_metrics(MetricsSnapshot([("addsub", 1, s, 0)], {}),
                          MetricsConfig(histogram_latencies=True, summary_latencies=True)).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    histogram = families["torchpool_inference_compute_infer_histogram_ms"]
    assert histogram.type == "histogram"
    buckets = {x.labels["le"]: x.value for x in histogram.samples if x.name.endswith("_bucket")}
    assert buckets["1"] == 0 and buckets["2.5"] == 2 and buckets["+Inf"] == 2    # two requests of 2 ms
    assert families["nv_inference_request_summary_us"].type == "summary"
    got = {x.labels.get("quantile"): x.value for x in families["nv_inference_request_summary_us"].samples}
    assert got["0.5"] == 3000


# --- model states, load times, workers ----------------------------------------------

def test_model_state_gauge_load_time_and_workers() -> None:
    loaded = VersionStats()
    loaded.load_seconds = 1.25
    loaded.count_restart("addsub_1")
    row = {"name": "addsub_0", "pid": 4242, "cpu_s": 1.5, "rss_bytes": 300 << 20, "pss_bytes": 120 << 20,
           "gpu_memory_bytes": None}
    snap = MetricsSnapshot([("addsub", 1, loaded, 0), ("mlp", 2, VersionStats(), 0)], {},
                           states=[("addsub", "1", "READY"), ("mlp", "2", "LOADING"), ("broken", "", "UNAVAILABLE")],
                           instances=[("addsub", 1, row), ("addsub", 1, {**row, "name": "addsub_1",
                                                                          "pss_bytes": None})],
                           restarts=[("addsub", 1, {"addsub_0": 0, "addsub_1": 1})])
    text = lines(render_metrics(snap, MetricsConfig()))
    assert "# TYPE nv_model_load_duration_secs gauge" in text       # Triton's name
    assert 'nv_model_load_duration_secs{model="addsub",version="1"} 1.25' in text
    assert not [line for line in text if line.startswith('nv_model_load_duration_secs{model="mlp"')]
    # one sample per state: 1 for the one it is in, so `== 1` alerts on UNAVAILABLE
    assert 'torchpool_model_state{model="addsub",state="READY",version="1"} 1' in text
    assert 'torchpool_model_state{model="addsub",state="UNAVAILABLE",version="1"} 0' in text
    assert 'torchpool_model_state{model="mlp",state="LOADING",version="2"} 1' in text
    assert 'torchpool_model_state{model="broken",state="UNAVAILABLE",version=""} 1' in text
    assert len([line for line in text if line.startswith("torchpool_model_state{")]) == 3 * 4
    one = 'model="addsub",model_instance="addsub_0",version="1"'
    assert f'torchpool_worker_restarts{{{one}}} 0' in text
    assert 'torchpool_worker_restarts{model="addsub",model_instance="addsub_1",version="1"} 1' in text
    assert f"torchpool_worker_cpu_seconds{{{one}}} 1.5" in text
    assert f"torchpool_worker_rss_bytes{{{one}}} {300 << 20}" in text
    assert f"torchpool_worker_pss_bytes{{{one}}} {120 << 20}" in text
    # a PSS not read yet is no sample, not a 0; nor is the GPU memory of a worker on the CPU
    assert not [line for line in text if line.startswith("torchpool_worker_pss_bytes") and "addsub_1" in line]
    assert not [line for line in text if line.startswith("torchpool_worker_gpu_memory_bytes{")]
