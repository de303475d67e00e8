"""The autoscaler's metric, computed as prometheus-adapter computes it, from a
live daemon's /metrics.

deploy/autoscaling/prometheus-adapter.yaml holds Triton's Helm chart rule

    avg(delta(nv_inference_queue_duration_us{..}[30s])
        / (1 + delta(nv_inference_request_success{..}[30s]))) by (pod)

and hpa.yaml scales on it with a target. Here the rule's query is read from
the manifest, checked to be that expression, and evaluated with PromQL's
semantics (delta per series, division matching series by their labels, avg
over the Pod's series) between two scrapes of a daemon under two loads: one
that queues (more clients than the model has instances) and one that does
not (one client at a time). The first must come out above the HPA's target
and the second below it. The window is the time between the two scrapes
(about 2 s, not 30 s): the ratio of two deltas over the same window does
not depend on its length.
"""
from __future__ import annotations

import re
import shutil
import sys
import threading
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import yaml

from torchpool.client import Client

from ..support.daemon import ROOT, Daemon, free_tcp_port, wait_for
from ..support.models.slow import slow_iterations

AUTOSCALING = ROOT / "deploy" / "autoscaling"
COMPUTE = 0.05        # seconds one `slow` request computes
WINDOW = 40           # requests answered between the two scrapes (~2 s: the model has one instance)
QUEUEING_CLIENTS = 4  # on the model's one instance: each request waits for up to 3 others
QUERY = re.compile(r"avg\(delta\((\w+)\{<<\.LabelMatchers>>\}\[(\d+)s\]\)"
                   r"/\(1\+delta\((\w+)\{<<\.LabelMatchers>>\}\[\2s\]\)\)\) by \(<<\.GroupBy>>\)")


def load_yaml(name: str) -> dict:
    return yaml.safe_load((AUTOSCALING / name).read_text())


def hpa_metric() -> tuple[str, float]:
    """The HPA's one Pods metric: its name and AverageValue target."""
    (metric,) = load_yaml("hpa.yaml")["spec"]["metrics"]
    assert metric["type"] == "Pods" and metric["pods"]["target"]["type"] == "AverageValue"
    return metric["pods"]["metric"]["name"], float(metric["pods"]["target"]["averageValue"])


def adapter_rule(metric: str) -> dict:
    config = yaml.safe_load(load_yaml("prometheus-adapter.yaml")["data"]["config.yaml"])
    (rule,) = [r for r in config["rules"] if r["name"]["as"] == metric]
    return rule


Series = dict[tuple[tuple[str, str], ...], float]


def scrape(port: int) -> dict[str, Series]:
    """Every sample of the page: name -> {sorted labels: value}."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out: dict[str, Series] = {}
    for m in re.finditer(r"^(\w+)(?:\{([^}]*)\})? (\S+)$", text, re.M):
        labels = tuple(sorted(re.findall(r'(\w+)="([^"]*)"', m.group(2) or "")))
        out.setdefault(m.group(1), {})[labels] = float(m.group(3))
    return out


def evaluate(query: str, before: dict[str, Series], after: dict[str, Series]) -> float:
    """The rule's query for one Pod: avg over its series of
    delta(numerator) / (1 + delta(denominator)), series matched by labels."""
    m = QUERY.fullmatch(query)
    assert m, f"not the queue-time expression of Triton's chart: {query}"
    numerator, _, denominator = m.groups()
    ratios = []
    for labels, value in after[numerator].items():
        waited = value - before[numerator][labels]
        answered = after[denominator][labels] - before[denominator][labels]
        ratios.append(waited / (1 + answered))
    assert ratios, f"no {numerator} series on the page"
    return sum(ratios) / len(ratios)


@pytest.fixture(scope="module")
def metrics_daemon(small_repository: Path, tmp_path_factory: pytest.TempPathFactory):
    """addsub and slow (one instance, no batching): two series per family."""
    root = tmp_path_factory.mktemp("hpa_repository")
    for name in ("addsub", "slow"):
        shutil.copytree(small_repository / name, root / name)
    port = free_tcp_port()
    d = Daemon(root, tmp_path_factory.mktemp("hpa_daemon"), "--metrics-port", str(port)).start()
    d.metrics_port = port
    yield d
    assert d.stop() == 0, d.log()


def under_load(daemon: Daemon, clients: int) -> tuple[dict[str, Series], dict[str, Series]]:
    """Two scrapes WINDOW answers apart while `clients` threads call `slow` back to back."""
    stop = threading.Event()
    answered = [0] * clients
    iterations = np.array([slow_iterations(COMPUTE)], np.int64)

    def run(i: int) -> None:
        # local=False: the way a client on another host is served, through the
        # daemon's queue (a local client may get a direct path to the worker)
        with Client(daemon.url, timeout=60, local=False) as c:
            while not stop.is_set():
                assert c.infer("slow", {"INPUT__0": iterations})["OUTPUT__0"].tolist() == iterations.tolist()
                answered[i] += 1

    threads = [threading.Thread(target=run, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    try:
        wait_for(lambda: all(answered), 60, "every client's first answer")
        before, start = scrape(daemon.metrics_port), sum(answered)
        wait_for(lambda: sum(answered) >= start + WINDOW, 60, f"{WINDOW} more answers")
        after = scrape(daemon.metrics_port)
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert not any(t.is_alive() for t in threads)
    return before, after


def test_the_hpa_metric_tells_a_queueing_load_from_one_that_does_not(metrics_daemon: Daemon) -> None:
    metric, target = hpa_metric()
    rule = adapter_rule(metric)
    assert rule["name"]["matches"] == "nv_inference_queue_duration_us"
    assert rule["seriesQuery"].startswith("nv_inference_queue_duration_us{")
    query = rule["metricsQuery"]
    assert QUERY.fullmatch(query).group(2) == "30"

    calm = evaluate(query, *under_load(metrics_daemon, 1))
    queued = evaluate(query, *under_load(metrics_daemon, QUEUEING_CLIENTS))
    print(f"\n{metric}: one client {calm:.0f} us, {QUEUEING_CLIENTS} clients {queued:.0f} us, "
          f"target {target:.0f} us", file=sys.stderr)
    # each queued request waits for about (clients - 1) computations; half of
    # that over the two series (addsub idle)
    assert calm < target < queued, (calm, target, queued)
    assert queued > 0.25 * (QUEUEING_CLIENTS - 1) * COMPUTE * 1e6 / 2, queued
