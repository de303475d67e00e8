"""Prometheus metrics, in Triton's names and labels, and health probes on one HTTP port.

    GET /metrics           Prometheus text format: Triton's nv_inference_* and
                           nv_model_* metrics (docs/metrics.md) plus torchpool_*
                           extras: model states, each worker's restarts, CPU
                           and memory
    GET /v2/health/live    200 when the daemon runs
    GET /v2/health/ready   200 when every model is ready (Triton's strict readiness)

The text is rendered here at scrape time from the broker's own counters, so
the hot path keeps plain integers and no lock; the HTTP server runs on a
daemon thread and only reads. Rendered by hand, not by prometheus_client:
it names every counter `<name>_total`, and Triton's dashboards and alerts
query `nv_inference_request_success`, not `nv_inference_request_success_total`.

--metrics-config takes Triton's settings (parse_metrics_config); an unknown
one stops the daemon at startup with the known ones named.
"""
from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Callable, Iterable, Literal, Optional, Sequence

from .frontend import AddressInUse
from .options import ServerOptions
from .registry import LOADING, READY, UNAVAILABLE, UNLOADING
from .stats import (FAILURE_REASONS, Duration, LatencyHistogram, LatencyWindow, VersionStats,
                    keep_latency_histograms, keep_latency_windows)
from .nvml import NVML, GpuReading, NvmlSampler
from .usage import InstanceRow, instance_rows

if TYPE_CHECKING:
    from .registry import ModelVersion, Registry

log = logging.getLogger("torchpool.broker")

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Triton's defaults (core's metric_model_reporter.h): {quantile, allowed error}
DEFAULT_QUANTILES: tuple[tuple[float, float], ...] = (
    (0.5, 0.05), (0.9, 0.01), (0.95, 0.001), (0.99, 0.001), (0.999, 0.001))
# prometheus-cpp's Summary default, which Triton keeps: quantiles of the last 60 s
SUMMARY_MAX_AGE_S = 60.0
# histogram_latencies=true: upper bounds of the buckets, in ms (Triton's unit
# for histograms). Triton's own (100, 500, 2000, 5000 ms) are for generative
# models; these reach down to a small TorchScript model's tens of us.
HISTOGRAM_BUCKETS_MS = (0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 50, 100, 250, 500, 1000, 2500,
                        5000, 10000)
MODEL_STATES = (LOADING, READY, UNAVAILABLE, UNLOADING)     # torchpool_model_state's `state` values


# ------------------------------------------------------------ --metrics-config

class MetricsConfigError(ValueError):
    """A --metrics-config setting torchpool does not know or cannot read."""


@dataclass(frozen=True)
class MetricsConfig:
    counter_latencies: bool = True       # the nv_inference_*_duration_us counters
    summary_latencies: bool = False      # the nv_inference_*_summary_us summaries
    summary_quantiles: tuple[tuple[float, float], ...] = DEFAULT_QUANTILES
    histogram_latencies: bool = False    # the *_histogram_ms histograms (_HISTOGRAMS)


KNOWN_SETTINGS = ("counter_latencies", "histogram_latencies", "summary_latencies", "summary_quantiles")


def _flag(key: str, value: str) -> bool:
    if value.lower() in ("true", "false"):
        return value.lower() == "true"
    raise MetricsConfigError(f"--metrics-config {key}={value}: expected true or false")


def _quantiles(value: str) -> tuple[tuple[float, float], ...]:
    """Triton's "<quantile>:<error>,...", e.g. 0.5:0.05,0.9:0.01."""
    pairs = []
    for item in value.split(","):
        quantile, sep, error = item.strip().partition(":")
        try:
            q, e = float(quantile), float(error)
        except ValueError:
            q = e = math.nan
        if not sep or not (0.0 <= q <= 1.0 and 0.0 <= e <= 1.0):
            raise MetricsConfigError(f"--metrics-config summary_quantiles={value}: {item.strip()!r} is not "
                                     f"<quantile>:<error> with both between 0 and 1 "
                                     f"(e.g. summary_quantiles=0.5:0.05,0.9:0.01,0.99:0.001)")
        pairs.append((q, e))
    return tuple(sorted(pairs))


def parse_metrics_config(items: Iterable[str]) -> MetricsConfig:
    """Triton's --metrics-config <setting>=<value> list. Raises
    MetricsConfigError on anything else, naming the settings known."""
    flags: dict[str, bool] = {}
    quantiles = MetricsConfig.summary_quantiles
    for item in items:
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or key not in KNOWN_SETTINGS:
            raise MetricsConfigError(f"--metrics-config {item!r}: unknown setting {key!r}; known: "
                                     f"{', '.join(f'{k}=...' for k in KNOWN_SETTINGS)}")
        if key == "summary_quantiles":
            quantiles = _quantiles(value)
        else:
            flags[key] = _flag(key, value)
    return MetricsConfig(
        counter_latencies=flags.get("counter_latencies", MetricsConfig.counter_latencies),
        summary_latencies=flags.get("summary_latencies", MetricsConfig.summary_latencies),
        summary_quantiles=quantiles,
        histogram_latencies=flags.get("histogram_latencies", MetricsConfig.histogram_latencies))


def configure_metrics(items: Iterable[str]) -> MetricsConfig:
    """Parse --metrics-config and start what it asks the hot path to record
    (latency windows for the summaries). Call once at startup, before any
    model version exists."""
    config = parse_metrics_config(items)
    keep_latency_windows(SUMMARY_MAX_AGE_S if config.summary_latencies else None)
    keep_latency_histograms(tuple(round(ms * 1000) for ms in HISTOGRAM_BUCKETS_MS)
                            if config.histogram_latencies else None)
    return config


# ---------------------------------------------------------- text exposition

Labels = tuple[tuple[str, str], ...]


def _escape(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r'\"')


def _escape_help(text: str) -> str:
    return text.replace("\\", r"\\").replace("\n", r"\n")


def _number(value: float) -> str:
    if isinstance(value, int):
        return str(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


class Exposition:
    """Prometheus text format 0.0.4, family by family."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def family(self, name: str, kind: str, doc: str) -> None:
        self.lines.append(f"# HELP {name} {_escape_help(doc)}")
        self.lines.append(f"# TYPE {name} {kind}")

    def sample(self, name: str, labels: Labels, value: float) -> None:
        text = ",".join(f'{k}="{_escape(v)}"' for k, v in labels)
        self.lines.append(f"{name}{{{text}}} {_number(value)}" if text else f"{name} {_number(value)}")

    def render(self) -> bytes:
        return ("\n".join(self.lines) + "\n").encode()


def quantile(ordered: Sequence[float], q: float) -> float:
    """The q-quantile of sorted samples (nearest rank); NaN without samples,
    as a Prometheus summary reports an empty window."""
    if not ordered:
        return math.nan
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


# (latency: the family's name part and the LatencyWindows field, help text,
# the VersionStats counter of the same requests), in Triton's order and words
_LATENCIES: tuple[tuple[str, str, str], ...] = (
    ("request", "inference request duration in microseconds (includes cached requests)", "success"),
    ("queue", "inference queuing duration in microseconds (includes cached requests)", "queue"),
    ("compute_input", "compute input duration in microseconds (does not include cached requests)",
     "compute_input"),
    ("compute_infer", "compute inference duration in microseconds (does not include cached requests)",
     "compute_infer"),
    ("compute_output", "inference compute output duration in microseconds (does not include cached "
                       "requests)", "compute_output"),
)

# Triton's one histogram is a request's time to its first response: for the
# models torchpool serves, which answer each request once, its duration.
# Triton has no histogram of the other latencies; these are torchpool's.
_HISTOGRAMS = {
    "request": ("nv_inference_first_response_histogram_ms",
                "Histogram of end-to-end inference request to the first response time in milliseconds"),
    **{kind: (f"torchpool_inference_{kind}_histogram_ms",
              "Histogram of " + doc.replace("microseconds", "milliseconds"))
       for kind, doc, _ in _LATENCIES[1:]},
}

VersionRow = tuple[str, int, VersionStats, int]   # model, version, its statistics, pending requests
Keyed = tuple[Labels, VersionStats, int]           # a version's labels, its statistics, pending requests


@dataclass
class MetricsSnapshot:
    """What a scrape reads from the broker, taken on the scrape's thread."""
    versions: list[VersionRow]
    shm: dict[str, int]                            # {state: bytes}
    states: list[tuple[str, str, str]] = field(default_factory=list)   # model, version ("" if none), state
    # model, version, usage.instance_row, and the version's restarts per instance
    instances: list[tuple[str, int, InstanceRow]] = field(default_factory=list)
    restarts: list[tuple[str, int, dict[str, int]]] = field(default_factory=list)
    gpus: tuple[GpuReading, ...] = ()              # NVML's latest reading (none on a CPU host)


def take_snapshot(registry: Optional["Registry"], pending: Callable[[ModelVersion], int],
                  shm: dict[str, int], gpus: NvmlSampler = NVML) -> MetricsSnapshot:
    """The broker's state for a scrape. The loop runs meanwhile: every list is
    copied before it is walked. A version loading or retiring beside the
    serving one of the same number is left out (its series would repeat the
    serving one's labels)."""
    snap = MetricsSnapshot([], shm, gpus=gpus.reading().gpus)
    if registry is None:
        return snap
    seen = set()
    for mv in list(registry.all_versions()):      # the serving generation first
        key = (mv.name, mv.version)
        if key in seen:
            continue
        seen.add(key)
        workers = list(mv.workers)
        snap.versions.append((mv.name, mv.version, mv.stats, pending(mv)))
        snap.instances += [(mv.name, mv.version, row) for row in instance_rows(workers, mv.stats.restarts)]
        names = {h.spec.instance for h in workers} | set(mv.stats.restarts)
        snap.restarts.append((mv.name, mv.version, {n: mv.stats.restarts.get(n, 0) for n in sorted(names)}))
    for model in list(registry.models.values()):
        if model.unloaded:
            continue          # unloaded on purpose: nothing to alert on
        versions = list(model.versions.items())
        if model.error or not versions:
            snap.states.append((model.name, "", UNAVAILABLE))
        snap.states += [(model.name, str(v), mv.state) for v, mv in sorted(versions)]
    return snap


def render_metrics(snap: MetricsSnapshot, config: MetricsConfig, now: Optional[float] = None) -> bytes:
    """The /metrics page: Triton's per-model families, then torchpool's."""
    now = time.monotonic() if now is None else now
    out = Exposition()
    keyed = [((("model", model), ("version", str(version))), stats, pending)
             for model, version, stats, pending in snap.versions]

    def per_version(name: str, kind: str, doc: str, value: Callable[[VersionStats, int], float]) -> None:
        out.family(name, kind, doc)
        for labels, stats, pending in keyed:
            out.sample(name, labels, value(stats, pending))

    per_version("nv_inference_request_success", "counter",
                "Number of successful inference requests, all batch sizes", lambda s, _: s.success.count)
    out.family("nv_inference_request_failure", "counter", "Number of failed inference requests, all batch sizes")
    for (model, version), stats, _ in keyed:
        for reason in FAILURE_REASONS:       # labels sorted by name, as Triton (prometheus-cpp) writes them
            out.sample("nv_inference_request_failure", (model, ("reason", reason), version),
                       stats.failures[reason])
    per_version("nv_inference_count", "counter",
                "Number of inferences performed (does not include cached requests)",
                lambda s, _: s.inference_count)
    per_version("nv_inference_exec_count", "counter",
                "Number of model executions performed (does not include cached requests)",
                lambda s, _: s.execution_count)
    per_version("nv_inference_pending_request_count", "gauge",
                "Instantaneous number of pending requests awaiting execution per-model.", lambda _, p: p)
    if config.counter_latencies:
        for kind, doc, counter in _LATENCIES:
            # Triton sums successful requests only: rate(duration) / rate(success) is their mean
            per_version(f"nv_inference_{kind}_duration_us", "counter", f"Cumulative {doc}",
                        _duration_us(counter))
    if config.summary_latencies:
        for kind, doc, counter in _LATENCIES:
            _summary(out, f"nv_inference_{kind}_summary_us", f"Summary of {doc}", keyed, kind, counter,
                     config.summary_quantiles, now)
    if config.histogram_latencies:
        for kind, (name, doc) in _HISTOGRAMS.items():
            _histogram(out, name, doc, keyed, kind)
    out.family("nv_model_load_duration_secs", "gauge", "Model load time in seconds")
    for labels, stats, _ in keyed:
        if stats.load_seconds is not None:
            out.sample("nv_model_load_duration_secs", labels, round(stats.load_seconds, 6))
    _gpu_families(out, snap.gpus)
    _torchpool_families(out, snap)
    return out.render()


def _duration_us(counter: str) -> Callable[[VersionStats, int], float]:
    """The value of a duration counter of VersionStats (its name), in us."""
    return lambda s, _: getattr(s, counter).ns // 1000


def _gpu_families(out: Exposition, gpus: Sequence[GpuReading]) -> None:
    """Triton's per-GPU families (label gpu_uuid), for every GPU NVML sees;
    none where it sees none, as Triton's CPU-only build exports none."""
    if not gpus:
        return
    out.family("nv_gpu_utilization", "gauge", "GPU utilization rate [0.0 - 1.0)")
    for gpu in gpus:
        if gpu.utilization is not None:
            out.sample("nv_gpu_utilization", (("gpu_uuid", gpu.uuid),), gpu.utilization)
    out.family("nv_gpu_memory_total_bytes", "gauge", "GPU total memory, in bytes")
    for gpu in gpus:
        out.sample("nv_gpu_memory_total_bytes", (("gpu_uuid", gpu.uuid),), gpu.total_bytes)
    out.family("nv_gpu_memory_used_bytes", "gauge", "GPU used memory, in bytes")
    for gpu in gpus:
        out.sample("nv_gpu_memory_used_bytes", (("gpu_uuid", gpu.uuid),), gpu.used_bytes)


def _torchpool_families(out: Exposition, snap: MetricsSnapshot) -> None:
    out.family("torchpool_model_state", "gauge",
               "1 for the state each model version is in (LOADING, READY, UNAVAILABLE, UNLOADING), 0 for the "
               "others; version \"\" for a model with none (its configuration did not load)")
    for model, shown, state in snap.states:
        for each in MODEL_STATES:
            out.sample("torchpool_model_state", (("model", model), ("state", each), ("version", shown)),
                       int(each == state))
    out.family("torchpool_worker_restarts", "counter",
               "Worker processes of a model instance restarted after a crash or an execution timeout")
    for model, version, counts in snap.restarts:
        for instance, count in counts.items():
            out.sample("torchpool_worker_restarts", _instance_labels(model, version, instance), count)
    rows = [(_instance_labels(model, version, row["name"]), row) for model, version, row in snap.instances]
    for name, kind, doc, key in _USAGE_FAMILIES:
        out.family(name, kind, doc)
        for labels, row in rows:
            value = row[key]
            if value is not None:
                out.sample(name, labels, value)
    out.family("torchpool_shm_bytes", "gauge", "Broker shared memory")
    for state, value in snap.shm.items():
        out.sample("torchpool_shm_bytes", (("state", state),), value)


# the families of a worker's usage: (name, kind, help, its InstanceRow field)
_USAGE_FAMILIES: tuple[tuple[str, str, str, Literal["cpu_s", "rss_bytes", "pss_bytes", "gpu_memory_bytes"]],
                       ...] = (
    ("torchpool_worker_cpu_seconds", "counter", "CPU time (user and system) of the worker process", "cpu_s"),
    ("torchpool_worker_rss_bytes", "gauge", "Resident memory of the worker process (pages it shares "
                                             "with other workers counted whole)", "rss_bytes"),
    ("torchpool_worker_pss_bytes", "gauge", "Proportional set size of the worker process (its share "
                                             "of each page it maps): what adds up across workers", "pss_bytes"),
    ("torchpool_worker_gpu_memory_bytes", "gauge", "GPU memory the worker process holds, as NVML reports it "
                                                   "(its CUDA context, modules and allocator; workers on a "
                                                   "GPU only)", "gpu_memory_bytes"),
)


def _instance_labels(model: str, version: int, instance: str) -> Labels:
    # not `instance`: Prometheus gives every sample the `instance` of its scrape
    # target, and would rename ours `exported_instance`
    return (("model", model), ("model_instance", instance), ("version", str(version)))


def _histogram(out: Exposition, name: str, doc: str, keyed: Sequence[Keyed], kind: str) -> None:
    """One histogram family: cumulative buckets (`le` in ms), _sum (ms) and
    _count, from one copy of each version's counts."""
    out.family(name, "histogram", doc)
    for labels, stats, _ in keyed:
        windows = stats.windows
        h: Optional[LatencyHistogram] = getattr(windows, kind).histogram if windows is not None else None
        if h is None:
            continue
        counts, total_us = list(h.counts), h.total_us
        cumulative = 0
        for bound_us, count in zip(h.bounds + (None,), counts):
            cumulative += count
            le = "+Inf" if bound_us is None else f"{bound_us / 1000:g}"
            out.sample(f"{name}_bucket", labels + (("le", le),), cumulative)
        out.sample(f"{name}_sum", labels, total_us / 1000)
        out.sample(f"{name}_count", labels, cumulative)


def _summary(out: Exposition, name: str, doc: str, keyed: Sequence[Keyed], window: str, counter: str,
             quantiles: tuple[tuple[float, float], ...], now: float) -> None:
    """One summary family: quantiles over the version's recent window; _count
    and _sum are the all-time counter they match (as Triton's docs say they do)."""
    out.family(name, "summary", doc)
    for labels, stats, _ in keyed:
        windows = stats.windows
        lw: Optional[LatencyWindow] = getattr(windows, window).window if windows is not None else None
        ordered = sorted(lw.samples(now)) if lw is not None else []
        for q, _error in quantiles:
            out.sample(name, labels + (("quantile", _number(q)),), quantile(ordered, q))
        total: Duration = getattr(stats, counter)
        out.sample(f"{name}_count", labels, total.count)
        out.sample(f"{name}_sum", labels, total.ns // 1000)


# ------------------------------------------------------------------ server

class MetricsServer:
    """/metrics, and Triton's health endpoints: live until the daemon stops
    (`stopping()`), ready while it is not stopping and `ready()` says so."""

    def __init__(self, host: str, port: int, snapshot: Callable[[], MetricsSnapshot],
                 stopping: Callable[[], bool], ready: Callable[[], bool],
                 config: MetricsConfig = MetricsConfig()) -> None:
        def metrics() -> bytes:
            return render_metrics(snapshot(), config)

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    self._reply(200, metrics(), CONTENT_TYPE)
                elif path == "/v2/health/live":
                    self._reply(503 if stopping() else 200, b"", "text/plain")
                elif path == "/v2/health/ready":
                    self._reply(200 if not stopping() and ready() else 503, b"", "text/plain")
                else:
                    self._reply(404, b"not found\n", "text/plain")

            def _reply(self, code: int, body: bytes, ctype: str) -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, fmt: str, *args: object) -> None:  # keep probes out of the log
                log.debug("metrics: " + fmt, *args)

        self.httpd = ThreadingHTTPServer((host, port), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="torchpool-metrics", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def serve_metrics(options: ServerOptions, snapshot: Callable[[], MetricsSnapshot], stopping: Callable[[], bool],
                  ready: Callable[[], bool], config: MetricsConfig) -> Optional[MetricsServer]:
    """The daemon's metrics and health server, started (None without --metrics-port);
    `stopping` and `ready` as MetricsServer's."""
    o = options
    if o.metrics_port is None:
        return None
    try:
        server = MetricsServer(o.metrics_host, o.metrics_port, snapshot, stopping, ready, config)
    except OSError as exc:      # the CLI probed it: another process took it since
        raise AddressInUse(f"--metrics-port {o.metrics_port}: cannot serve metrics on "
                           f"{o.metrics_host}:{o.metrics_port}: {exc.strerror or exc}") from None
    server.start()
    log.info("metrics and health on http://%s:%d/metrics", o.metrics_host, server.port)
    return server
