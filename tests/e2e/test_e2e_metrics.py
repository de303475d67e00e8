"""/metrics in Triton's names, labels and meanings, read from a running daemon:
success and failure counts per `reason`, pending requests, the optional
latency summaries, and --metrics-config errors."""
from __future__ import annotations

import re
import shutil
import threading
import urllib.request
from pathlib import Path
from typing import Optional

import numpy as np
import pytest

from torchpool import Client, InferenceError

from ..support.daemon import Daemon, RawConnection, free_tcp_port, wait_for
from ..support.models.slow import slow_iterations

A = np.arange(16, dtype=np.float32).reshape(1, 16)
ADDSUB = {"INPUT0": A, "INPUT1": A}


@pytest.fixture(scope="module")
def metrics_repository(small_repository: Path, test_repository: Path,
                       tmp_path_factory: pytest.TempPathFactory) -> Path:
    """addsub, slow (one instance, no batching) and raise_on_negative: few
    models, so the daemons here start quickly."""
    root = tmp_path_factory.mktemp("metrics_repository")
    shutil.copytree(small_repository / "addsub", root / "addsub")
    shutil.copytree(small_repository / "slow", root / "slow")
    shutil.copytree(test_repository / "raise_on_negative", root / "raise_on_negative")
    return root


def scrape(port: int) -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()


def value(text: str, name: str, model: str, **labels: str) -> Optional[float]:
    """The sample of `name` for `model` version 1 with exactly these other labels."""
    wanted = {"model": model, "version": "1", **labels}
    for m in re.finditer(r"^(\w+)\{([^}]*)\} (\S+)$", text, re.M):
        if m.group(1) == name and dict(re.findall(r'(\w+)="([^"]*)"', m.group(2))) == wanted:
            return float(m.group(3))
    return None


def queue_count(url: str, model: str) -> int:
    """Requests of `model` handed to an instance so far (the statistics call)."""
    with RawConnection(url) as rc:
        reply = rc.call(rc.pack({"v": 1, "op": "statistics", "id": 1, "model": model}), timeout=30)[0]
    return reply["result"]["model_stats"][0]["inference_stats"]["queue"]["count"]


def test_counts_failure_reasons_and_pending(metrics_repository: Path, tmp_path: Path) -> None:
    port = free_tcp_port()
    d = Daemon(metrics_repository, tmp_path, "--metrics-port", str(port)).start()
    try:
        with Client(d.url, local=False, timeout=60) as c:
            for _ in range(3):
                c.infer("addsub", ADDSUB)
            # Refused by input validation before it is scheduled: Triton answers such a
            # request from InferAsync (the request's Normalize fails) and counts it in
            # no model statistic, failure reasons included; so does torchpool.
            with pytest.raises(InferenceError):
                c.infer("addsub", {"INPUT0": A})
            # the model raises: BACKEND
            with pytest.raises(InferenceError, match="boom"):
                c.infer("raise_on_negative", {"INPUT__0": -np.ones((1, 4), np.float32)})
            c.infer("slow", {"INPUT__0": np.array([10])})          # warm

        # one slow request holds the only instance; one behind it times out in the
        # queue (REJECTED) and one waits (pending) until the first is done
        iterations = slow_iterations(3.0)
        results: dict[str, object] = {}

        def infer(name: str, n: int) -> None:
            with Client(d.url, local=False, timeout=60) as own:
                results[name] = own.infer("slow", {"INPUT__0": np.array([n])})["OUTPUT__0"][0]

        first = threading.Thread(target=infer, args=("first", iterations))
        first.start()
        wait_for(lambda: queue_count(d.url, "slow") == 2, 30, "the long request to reach the instance")
        with Client(d.url, local=False, timeout=60) as c:
            with pytest.raises(InferenceError):
                c.infer("slow", {"INPUT__0": np.array([1])}, timeout=0.2)
        waiting = threading.Thread(target=infer, args=("waiting", 7))
        waiting.start()
        wait_for(lambda: value(scrape(port), "nv_inference_request_failure", "slow", reason="REJECTED") == 1,
                 30, "the timed-out request to count as REJECTED")
        wait_for(lambda: value(scrape(port), "nv_inference_pending_request_count", "slow") == 1, 30,
                 "one request pending behind the long one")
        first.join(60)
        waiting.join(60)
        assert results == {"first": iterations, "waiting": 7}
        wait_for(lambda: value(scrape(port), "nv_inference_pending_request_count", "slow") == 0, 30,
                 "nothing pending once both are answered")

        text = scrape(port)
        assert "# TYPE nv_inference_request_success counter" in text
        assert "# TYPE nv_inference_pending_request_count gauge" in text
        assert "_total" not in text and "torchpool_queue_depth" not in text
        assert "_summary_us" not in text           # summaries are off by default
        expected = {                               # model: success, {reason: failures}
            "addsub": (3, {}),
            "raise_on_negative": (0, {"BACKEND": 1}),
            "slow": (3, {"REJECTED": 1}),
        }
        for model, (success, failures) in expected.items():
            assert value(text, "nv_inference_request_success", model) == success, model
            for reason in ("REJECTED", "CANCELED", "BACKEND", "OTHER"):
                got = value(text, "nv_inference_request_failure", model, reason=reason)
                assert got == failures.get(reason, 0), (model, reason)
            assert value(text, "nv_inference_pending_request_count", model) == 0
        assert value(text, "nv_inference_count", "addsub") == 3
        assert value(text, "nv_inference_exec_count", "addsub") == 3
        assert value(text, "nv_inference_request_duration_us", "addsub") > 0
        assert value(text, "torchpool_worker_restarts", "addsub", model_instance="addsub_0") == 0
        # the statistics call keeps Triton's JSON: failures counted, no reasons
        with RawConnection(d.url) as rc:
            stats = rc.call(rc.pack({"v": 1, "op": "statistics", "id": 1, "model": "slow"}))[0]
        inference = stats["result"]["model_stats"][0]["inference_stats"]
        assert inference["fail"]["count"] == 1 and inference["success"]["count"] == 3
    finally:
        d.stop()


def test_summaries_only_when_enabled(metrics_repository: Path, tmp_path: Path) -> None:
    port = free_tcp_port()
    d = Daemon(metrics_repository, tmp_path, "--metrics-port", str(port),
               "--metrics-config", "summary_latencies=true",
               "--metrics-config", "summary_quantiles=0.5:0.05,0.99:0.001").start()
    try:
        with Client(d.url, local=False, timeout=60) as c:
            for _ in range(5):
                c.infer("addsub", ADDSUB)
        text = scrape(port)
        for kind in ("request", "queue", "compute_input", "compute_infer", "compute_output"):
            name = f"nv_inference_{kind}_summary_us"
            assert f"# TYPE {name} summary" in text
            quantiles = re.findall(rf'^{name}\{{model="addsub",version="1",quantile="([^"]+)"\}} (\S+)$',
                                   text, re.M)
            assert [q for q, _ in quantiles] == ["0.5", "0.99"], kind
            p50, p99 = (float(v) for _, v in quantiles)
            assert 0 <= p50 <= p99, kind
            assert value(text, f"{name}_count", "addsub") == 5, kind
            # a model that served nothing: an empty window
            assert value(text, name, "slow", quantile="0.5") != value(text, name, "slow", quantile="0.5")
        # _count and _sum are the counters of the same requests
        assert (value(text, "nv_inference_request_summary_us_sum", "addsub")
                == value(text, "nv_inference_request_duration_us", "addsub"))
        assert (value(text, "nv_inference_request_summary_us_count", "addsub")
                == value(text, "nv_inference_request_success", "addsub"))
    finally:
        d.stop()


def test_a_scrape_counts_every_direct_request_answered_before_it(metrics_repository: Path,
                                                                   tmp_path: Path) -> None:
    """A local client's plain calls go straight to the worker, which reports
    them in a ring the broker reads every 0.1 s; a scrape has the broker
    read it first, so each scrape right after an answer counts it."""
    port = free_tcp_port()
    d = Daemon(metrics_repository, tmp_path, "--metrics-port", str(port)).start()
    try:
        with Client(d.url, timeout=60) as c:
            c.infer("addsub", ADDSUB)
            wait_for(lambda: c._state.direct.open_path("addsub", "") is not None, 30, "the direct path")
            base = value(scrape(port), "nv_inference_request_success", "addsub")
            assert base is not None
            before = c.server_metadata()["transfer"].get("requests_direct", 0)
            for n in range(1, 21):
                out = c.infer("addsub", ADDSUB)
                np.testing.assert_array_equal(out["OUTPUT0"], A + A)
                assert value(scrape(port), "nv_inference_request_success", "addsub") == base + n
            # they were the worker's to report: they went on the direct path
            assert c.server_metadata()["transfer"].get("requests_direct", 0) - before == 20
    finally:
        d.stop()


def test_unknown_metrics_config_setting_stops_startup(metrics_repository: Path, tmp_path: Path) -> None:
    d = Daemon(metrics_repository, tmp_path, "--metrics-config", "summary_latency=true")
    d.start(wait_ready=False)
    assert d.proc.wait(60) == 2
    d.stop()
    log = d.log()
    assert "unknown setting 'summary_latency'" in log
    for known in ("counter_latencies", "histogram_latencies", "summary_latencies", "summary_quantiles"):
        assert known in log
    assert "Traceback" not in log
    assert "loading" not in log          # refused before any model started to load
