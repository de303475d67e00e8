"""Prometheus metrics and health probes on one HTTP port.

    GET /metrics           Prometheus text format (Triton's nv_inference_* names
                           plus torchpool_* gauges)
    GET /v2/health/live    200 when the daemon runs
    GET /v2/health/ready   200 when every model is ready (Triton's strict readiness)

prometheus_client renders the exposition format; a custom collector reads the
broker's own counters at scrape time, so the hot path keeps plain integers and
no lock. The HTTP server runs on a daemon thread and only reads.
"""
from __future__ import annotations

import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable, Iterable

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

log = logging.getLogger("torchpool.broker")


class BrokerCollector:
    """Reads a snapshot function: [(model, version, VersionStats, queue_depth)], shm bytes."""

    def __init__(self, snapshot: Callable[[], tuple[list, dict]]) -> None:
        self.snapshot = snapshot

    def collect(self) -> Iterable:
        rows, shm = self.snapshot()
        labels = ["model", "version"]

        def counter(name: str, doc: str, value) -> CounterMetricFamily:
            fam = CounterMetricFamily(name, doc, labels=labels)
            for model, version, stats, _depth in rows:
                fam.add_metric([model, str(version)], value(stats))
            return fam

        yield counter("nv_inference_request_success", "Successful inference requests",
                      lambda s: s.success.count)
        yield counter("nv_inference_request_failure", "Failed inference requests", lambda s: s.fail.count)
        yield counter("nv_inference_count", "Inferences performed (batch items)", lambda s: s.inference_count)
        yield counter("nv_inference_exec_count", "Model executions (batches)", lambda s: s.execution_count)
        yield counter("nv_inference_request_duration_us", "Cumulative end-to-end request time (us)",
                      lambda s: (s.success.ns + s.fail.ns) // 1000)
        yield counter("nv_inference_queue_duration_us", "Cumulative queue time (us)", lambda s: s.queue.ns // 1000)
        yield counter("nv_inference_compute_input_duration_us", "Cumulative compute input time (us)",
                      lambda s: s.compute_input.ns // 1000)
        yield counter("nv_inference_compute_infer_duration_us", "Cumulative compute infer time (us)",
                      lambda s: s.compute_infer.ns // 1000)
        yield counter("nv_inference_compute_output_duration_us", "Cumulative compute output time (us)",
                      lambda s: s.compute_output.ns // 1000)
        yield counter("torchpool_worker_restarts", "Worker processes restarted after a crash",
                      lambda s: s.worker_restarts)
        depth = GaugeMetricFamily("torchpool_queue_depth", "Requests waiting for an instance", labels=labels)
        for model, version, _stats, d in rows:
            depth.add_metric([model, str(version)], d)
        yield depth
        shm_fam = GaugeMetricFamily("torchpool_shm_bytes", "Broker shared memory", labels=["state"])
        for state, value in shm.items():
            shm_fam.add_metric([state], value)
        yield shm_fam


class MetricsServer:
    def __init__(self, host: str, port: int, snapshot: Callable[[], tuple[list, dict]],
                 live: Callable[[], bool], ready: Callable[[], bool]) -> None:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(BrokerCollector(snapshot))

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    self._reply(200, generate_latest(registry), "text/plain; version=0.0.4; charset=utf-8")
                elif path == "/v2/health/live":
                    self._reply(200 if live() else 503, b"", "text/plain")
                elif path == "/v2/health/ready":
                    self._reply(200 if ready() else 503, b"", "text/plain")
                else:
                    self._reply(404, b"not found\n", "text/plain")

            def _reply(self, code: int, body: bytes, ctype: str) -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, fmt: str, *args) -> None:  # keep probes out of the log
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
