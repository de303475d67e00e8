"""What an operator sees of a running daemon (issue 26, items 7 to 9), from one
daemon whose model `gated` loads until the test lets it:

* `torchpool ps`: every worker process, its model, version, instance, state,
  restarts, CPU and PSS; the same rows in the statistics' `instances`, and so
  in HTTP's /v2/models/<m>/stats;
* /metrics: Triton's histograms behind histogram_latencies=true and its
  nv_model_load_duration_secs, a model-state gauge, per-worker CPU and memory,
  restarts per instance;
* the log: a line when a version starts loading, "still loading" while it
  does, READY with the time it took, "restarted, READY in N s"; JSON lines
  say which model, version and instance they are about.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Optional

import numpy as np
import pytest

from torchpool import Client

from ..support.daemon import ROOT, Daemon, alive, descendants, free_tcp_port, wait_for
from ..support.models.basic import PlusOne
from ..support.models.core import config, parameters, serialize, tensor

httpclient = pytest.importorskip("tritonclient.http")

WARMUP = ('model_warmup [ { name: "zeros" batch_size: 1 inputs { key: "INPUT__0" value: '
          '{ data_type: TYPE_FP32 dims: [ 2 ] zero_data: true } } } ]\n')
# loaded in the worker before the model (TORCHPOOL_PYTHON_MODULES): waits for the test's gate
GATE = "import os, time\nwhile not os.path.exists({path!r}):\n    time.sleep(0.02)\n"
X = {"INPUT__0": np.array([1, 2], np.float32)}


def _model(repo: Path, name: str, extra: str = "") -> Path:
    """`name`: INPUT__0 FP32 [2] -> OUTPUT__0 = x + 1, no batching."""
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "config.pbtxt").write_text(config(name, inputs=[tensor("INPUT__0", "FP32", [2])],
                                                     outputs=[tensor("OUTPUT__0", "FP32", [2])],
                                                     max_batch_size=0, extra=extra))
    (repo / name / "1" / "model.pt").write_bytes(serialize(PlusOne()))
    return repo / name


def torchpool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "torchpool", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=60)


def ps(url: str, *args: str) -> list[dict]:
    done = torchpool("ps", "--json", "--url", url, *args)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def scrape(port: int) -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()


def sample(text: str, name: str, **labels: str) -> Optional[float]:
    """The value of `name` with exactly these labels, or None."""
    for m in re.finditer(r"^(\w+)\{([^}]*)\} (\S+)$", text, re.M):
        if m.group(1) == name and dict(re.findall(r'(\w+)="([^"]*)"', m.group(2))) == labels:
            return float(m.group(3))
    return None


def records(d: Daemon) -> list[dict]:
    return [json.loads(line) for line in d.log().splitlines() if line.startswith("{")]


def logged(d: Daemon, text: str) -> list[dict]:
    return [r for r in records(d) if text in r["message"]]


@pytest.fixture
def observed(tmp_path: Path):
    repo = tmp_path / "repo"
    _model(repo, "good", WARMUP)
    gate = tmp_path / "gate"
    gated = _model(repo, "gated", parameters(TORCHPOOL_PYTHON_MODULES="gate.py"))
    (gated / "gate.py").write_text(GATE.format(path=str(gate)))
    (repo / "broken").mkdir()
    (repo / "broken" / "config.pbtxt").write_text("max_batch_sz: 4\n")
    metrics, http = free_tcp_port(), free_tcp_port()
    d = Daemon(repo, tmp_path, "--metrics-port", str(metrics), "--http-port", str(http), "--log-format", "json",
               "--metrics-config", "histogram_latencies=true", env={"TORCHPOOL_LOADING_NOTICE_S": "0.3"})
    d.start(wait_ready=False)
    try:
        yield d, gate, metrics, http
    finally:
        gate.touch()
        d.stop()


def test_ps_metrics_and_logs_while_loading_serving_and_restarting(observed) -> None:
    d, gate, metrics, http = observed
    # --- while `gated` loads: it says so, and ps and /metrics show it LOADING
    still = wait_for(lambda: logged(d, "still loading model 'gated' version 1"), 60, "a 'still loading' line")
    assert re.fullmatch(r"still loading model 'gated' version 1 \(\d+ s; 0 of 1 instances ready\)",
                        still[0]["message"]), still[0]
    assert (still[0]["model"], still[0]["version"]) == ("gated", "1")
    [starting] = logged(d, "model 'gated' version 1 loading")
    assert (starting["model"], starting["version"]) == ("gated", "1")
    loading = [r for r in ps(d.url, "gated") if r["name"] == "gated_0"]
    assert [r["state"] for r in loading] == ["LOADING"] and loading[0]["pid"] in descendants(d.pid())
    text = scrape(metrics)
    assert sample(text, "torchpool_model_state", model="gated", version="1", state="LOADING") == 1
    assert sample(text, "torchpool_model_state", model="gated", version="1", state="READY") == 0
    assert sample(text, "torchpool_model_state", model="broken", version="", state="UNAVAILABLE") == 1
    assert sample(text, "nv_model_load_duration_secs", model="gated", version="1") is None

    gate.touch()
    wait_for(lambda: "torchpool ready" in d.log(), 60, "the daemon's ready line")
    [ready] = logged(d, "model 'gated' version 1 READY (1 instance) in ")
    took = float(re.search(r" in (\d+\.\d+) s$", ready["message"]).group(1))
    assert took >= 0.3 and (ready["model"], ready["version"]) == ("gated", "1")
    # a worker's own records carry its instance (its warm-up's line)
    [warmup] = logged(d, "model 'good' instance 'good_0': 1 warm-up batch")
    assert (warmup["model"], warmup["version"], warmup["instance"]) == ("good", "1", "good_0")

    with Client(d.url, timeout=30) as c:
        for _ in range(3):
            assert c.infer("good", X)["OUTPUT__0"].tolist() == [2, 3]

    # --- serving: ps, the statistics' extension over HTTP, /metrics agree
    rows = {r["model"]: r for r in ps(d.url)}
    assert set(rows) == {"good", "gated"}
    workers = descendants(d.pid())
    for model, row in rows.items():
        assert (row["version"], row["name"], row["device"], row["state"]) == ("1", f"{model}_0", "cpu", "READY")
        assert row["pid"] in workers and row["restarts"] == 0
        assert row["uptime_s"] > 0 and row["cpu_s"] > 0
        assert 0 < row["pss_bytes"] <= row["rss_bytes"]     # the torch pages it shares counted in part
    table = torchpool("ps", "--url", d.url, "good")
    header, line = table.stdout.splitlines()
    assert header.split() == ["MODEL", "VERSION", "INSTANCE", "PID", "DEVICE", "THREADS", "STATE", "RESTARTS",
                              "UPTIME", "CPU", "PSS"]
    assert line.split()[:8] == ["good", "1", "good_0", str(rows["good"]["pid"]), "cpu",
                                str(rows["good"]["threads"]), "READY", "0"]
    assert rows["good"]["threads"] >= 1
    assert line.endswith(" MiB")
    with httpclient.InferenceServerClient(f"127.0.0.1:{http}") as h:
        [entry] = h.get_inference_statistics("good")["model_stats"]
    assert [(i["name"], i["pid"], i["state"]) for i in entry["instances"]] == \
        [("good_0", rows["good"]["pid"], "READY")]

    def scraped_pss() -> Optional[str]:
        page = scrape(metrics)
        return page if sample(page, "torchpool_worker_pss_bytes", model="good", model_instance="good_0",
                              version="1") else None
    text = wait_for(scraped_pss, 30, "the PSS of good's worker on /metrics")
    one = {"model": "good", "model_instance": "good_0", "version": "1"}
    assert sample(text, "torchpool_worker_cpu_seconds", **one) > 0
    assert sample(text, "torchpool_worker_rss_bytes", **one) > 0
    assert sample(text, "torchpool_worker_restarts", **one) == 0
    assert sample(text, "torchpool_model_state", model="gated", version="1", state="READY") == 1
    assert sample(text, "nv_model_load_duration_secs", model="gated", version="1") >= 0.3
    histogram = "nv_inference_first_response_histogram_ms"
    assert sample(text, f"{histogram}_count", model="good", version="1") == 3
    assert sample(text, f"{histogram}_bucket", model="good", version="1", le="+Inf") == 3
    assert sample(text, f"{histogram}_bucket", model="good", version="1", le="0.025") == 0
    assert sample(text, "torchpool_inference_compute_infer_histogram_ms_count", model="good", version="1") == 3

    # --- a worker dies: restarted, and every view counts it against its instance
    old = rows["good"]["pid"]
    os.kill(old, signal.SIGKILL)
    back = wait_for(lambda: logged(d, "model 'good' version 1 instance 'good_0' restarted, READY in "), 60,
                    "the restarted line")
    assert (back[0]["model"], back[0]["version"], back[0]["instance"]) == ("good", "1", "good_0")
    [died] = logged(d, "instance 'good_0' was killed by signal SIGKILL (9); restarting it")
    assert died["instance"] == "good_0" and died["level"] == "ERROR"
    [row] = [r for r in ps(d.url, "good")]
    assert row["restarts"] == 1 and row["pid"] != old and row["state"] == "READY" and not alive(old)
    assert sample(scrape(metrics), "torchpool_worker_restarts", **one) == 1
    with Client(d.url, timeout=30) as c:
        assert c.infer("good", X)["OUTPUT__0"].tolist() == [2, 3]
