"""`torchpool perf -i grpc|http` at a daemon's gateways (Triton's own
tritonclient sends, as perf_analyzer does), and what a run puts on the wire:
no per-request timeout unless `--request-timeout` asks for one.

The daemon's statistics are read beside perf over ZeroMQ (torchpool's
Client at its ipc:// address), so they count what the gateways delivered
whatever perf itself reports.
"""
from __future__ import annotations

import csv
import json
import os
from pathlib import Path

import pytest

pytest.importorskip("tritonclient.grpc")
pytest.importorskip("tritonclient.http")

from torchpool.client import Client  # noqa: E402
from torchpool.protocol import messages  # noqa: E402

from ..support.daemon import Daemon, free_tcp_port, wait_for  # noqa: E402
from ..support.kserve_v2 import http_status  # noqa: E402
from ..support.models.slow import slow_iterations  # noqa: E402
from ..support.relay import TcpRelay  # noqa: E402
from .test_e2e_perf import CSV_HEADER, SHORT, perf, table_rows  # noqa: E402


@pytest.fixture(scope="module")
def gateway_daemon(small_repository: Path, tmp_path_factory: pytest.TempPathFactory):
    ports = {"http": free_tcp_port(), "grpc": free_tcp_port()}
    d = Daemon(small_repository, tmp_path_factory.mktemp("perf_gateways"), "--http-port", str(ports["http"]),
               "--grpc-port", str(ports["grpc"]), tcp_port=free_tcp_port())
    d.gateway = {protocol: f"127.0.0.1:{port}" for protocol, port in ports.items()}
    d.tcp_port = int(d.urls[1].rsplit(":", 1)[1])
    d.start()
    try:
        wait_for(lambda: http_status(f"http://{d.gateway['http']}/v2/health/live") == 200, 30,
                 "the HTTP gateway")
        import tritonclient.grpc as grpcclient
        with grpcclient.InferenceServerClient(d.gateway["grpc"]) as c:
            wait_for(lambda: _grpc_live(c), 30, "the gRPC gateway")
        yield d
    finally:
        assert d.stop() == 0, d.log()


def _grpc_live(client) -> bool:
    from tritonclient.utils import InferenceServerException
    try:
        return client.is_server_live()
    except InferenceServerException:
        return False


def model_counts(daemon: Daemon, model: str) -> dict:
    """The daemon's counters for `model`, all versions: over ZeroMQ, not the gateway."""
    with Client(daemon.url, timeout=30) as c:
        stats = c.statistics(model)["model_stats"]
    return {"success": sum(s["inference_stats"]["success"]["count"] for s in stats),
            "fail": sum(s["inference_stats"]["fail"]["count"] for s in stats),
            "inferences": sum(s["inference_count"] for s in stats)}


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_concurrency_sweep_over_a_gateway(gateway_daemon: Daemon, protocol: str, tmp_path: Path) -> None:
    files = {k: tmp_path / f"out.{k}" for k in ("csv", "json")}
    before = model_counts(gateway_daemon, "addsub")
    r = perf("-m", "addsub", "-i", protocol, "-u", gateway_daemon.gateway[protocol], "--concurrency-range", "1:2",
             *SHORT, "-f", str(files["csv"]), "--json", str(files["json"]))
    assert r.returncode == 0, r.stderr
    after = model_counts(gateway_daemon, "addsub")
    assert f"Protocol: {protocol} (tritonclient.{protocol} at the " in r.stdout
    assert f"a thread with its own tritonclient.{protocol} client per outstanding request" in r.stdout
    assert "Timeouts: none sent with the requests" in r.stdout

    # the same table and CSV as over ZeroMQ
    rows = table_rows(r.stdout, "Concurrency")
    assert [row["Concurrency"] for row in rows] == ["1", "2"]
    for row in rows:
        assert float(row["Infer/s"]) > 0 and int(row["Requests"]) > 0
        assert float(row["Infer us"]) > 0          # the server split came from the gateway's statistics
    with open(files["csv"], newline="") as f:
        table = list(csv.reader(f))
    assert table[0] == CSV_HEADER and [row[0] for row in table[1:]] == ["1", "2"]
    for row in table[1:]:
        values = dict(zip(CSV_HEADER, row))
        assert float(values["Inferences/Second"]) > 0 and int(values["Server Compute Infer"]) > 0

    document = json.loads(files["json"].read_text())
    assert document["settings"]["protocol"] == protocol and document["settings"]["url"] == \
        gateway_daemon.gateway[protocol]
    assert document["settings"]["request_timeout_s"] is None
    reported = 0
    for x in document["results"]:
        reported += x["requests"]
        # the statistics perf read over the gateway agree with what it counted
        # (the windows' edges cut a few either way), as over ZeroMQ
        assert x["server"]["success_count"] > 0
        assert abs(x["server"]["success_count"] - x["requests"]) <= 0.1 * x["requests"] + 10
    # the daemon served every request perf reported, and more: the trial request,
    # each sender's unmeasured first request at each level (1 + 2), the windows
    # before the last three and what finished after the last
    served = after["success"] - before["success"]
    assert served >= reported + 1 + 3, (served, reported)
    assert after["inferences"] - before["inferences"] == served     # batch 1
    assert after["fail"] == before["fail"]


@pytest.mark.parametrize("protocol, load", [
    ("grpc", ["--async", "--request-rate-range", "40"]),
    ("http", ["--async", "--concurrency-range", "2"]),
    ("http", ["--request-rate-range", "40"]),
])
def test_async_and_request_rate_over_a_gateway(gateway_daemon: Daemon, protocol: str, load: list,
                                              tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    r = perf("-m", "addsub", "-i", protocol, "-u", gateway_daemon.gateway[protocol], *load, *SHORT,
             "--json", str(out))
    assert r.returncode == 0, r.stderr
    document = json.loads(out.read_text())
    (x,) = document["results"]
    assert document["settings"]["client"] == ("async" if "--async" in load else "threads")
    if "--request-rate-range" in load:
        # open loop at a rate the server keeps up with: completions follow it
        assert x["request_rate"] == 40 and x["throughput_infer_per_s"] == pytest.approx(40, rel=0.4)
    else:
        assert x["concurrency"] == 2 and x["throughput_infer_per_s"] > 0
    if "--async" in load:
        assert f"one tritonclient.{protocol}.aio client, a task per outstanding request" in r.stdout


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_bytes_inputs_over_a_gateway(gateway_daemon: Daemon, protocol: str) -> None:
    r = perf("-m", "strings", "-i", protocol, "-u", gateway_daemon.gateway[protocol], "--shape", "INPUT__0:4",
             "--string-length", "8", "-b", "1", *SHORT)
    assert r.returncode == 0, r.stderr
    assert float(table_rows(r.stdout, "Concurrency")[0]["Infer/s"]) > 0


@pytest.mark.parametrize("protocol", ["grpc", "http"])
@pytest.mark.parametrize("request_timeout", [None, 0.05])
def test_request_timeout_over_a_gateway(gateway_daemon: Daemon, protocol: str, request_timeout, tmp_path: Path) -> None:
    """Two requests at once on `slow` (one instance, 0.3 s each). A plain run
    waits for them (--timeout's 30 s) and measures. With --request-timeout
    0.05 the run fails: the gateway gives up on the trial request after
    0.05 s ("did not answer within 0.05 s": it makes Triton's `timeout`
    parameter its own wait for the answer), or, were the trial to finish,
    the daemon answers the request queued behind another "Request timeout
    expired"."""
    data = tmp_path / "slow.json"
    data.write_text(json.dumps({"data": [{"INPUT__0": [slow_iterations(0.3)]}]}))
    extra = [] if request_timeout is None else ["--request-timeout", str(request_timeout)]
    r = perf("-m", "slow", "-i", protocol, "-u", gateway_daemon.gateway[protocol], "--input-data", str(data),
             "--concurrency-range", "2", "-p", "700", "-r", "3", *extra)
    if request_timeout is None:
        assert r.returncode == 0, r.stderr
        assert float(table_rows(r.stdout, "Concurrency")[0]["Infer/s"]) > 0
        return
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert r.stderr.startswith("torchpool perf: error: ") and r.stderr.count("\n") == 1, r.stderr
    assert ("a trial request failed: " in r.stderr and "within 0.05 s" in r.stderr) or \
        ("a request failed: " in r.stderr and "Request timeout expired" in r.stderr), r.stderr


def header_of(frames: list) -> dict:
    """A torchpool message's header: its first frame, a msgpack map ({} if not)."""
    try:
        header = messages.unpack(frames[0])
    except Exception:
        return {}
    return header if isinstance(header, dict) else {}


@pytest.mark.parametrize("request_timeout", [None, 0.25])
def test_what_a_run_sends_over_zeromq(gateway_daemon: Daemon, request_timeout) -> None:
    """Every infer request perf sends, read off the wire between it and the
    daemon: a plain run's carry no timeout of their own (timeout_us 0, as a
    plain `Client.infer` sends), --request-timeout's carry it. (ZeroMQ
    without the local path, so that the requests cross the relay.)"""
    extra = [] if request_timeout is None else ["--request-timeout", str(request_timeout)]
    with TcpRelay(gateway_daemon.tcp_port, zmtp=True) as relay:
        r = perf("-m", "addsub", "-u", f"tcp://127.0.0.1:{relay.port}", "--concurrency-range", "1,2", *SHORT,
                 *extra, env={**os.environ, "TORCHPOOL_LOCAL": "0"})
        assert r.returncode == 0, r.stderr
        headers = [header_of(m) for m in relay.messages()]
    infers = [h for h in headers if h.get("op") == messages.OP_INFER]
    requests = sum(int(row["Requests"]) for row in table_rows(r.stdout, "Concurrency"))
    assert len(infers) >= requests + 1 + 3 > 4        # the trial and each sender's first request too
    if request_timeout is None:
        assert {h.get("timeout_us", 0) for h in infers} == {0}
        assert not any("sent_ns" in h for h in infers)
    else:
        assert {h["timeout_us"] for h in infers} == {int(request_timeout * 1e6)}


@pytest.mark.parametrize("request_timeout", [None, 0.25])
def test_what_a_run_sends_over_http(gateway_daemon: Daemon, request_timeout) -> None:
    """The same over the HTTP gateway: Triton's `timeout` request parameter
    only with --request-timeout (in microseconds)."""
    port = int(gateway_daemon.gateway["http"].rsplit(":", 1)[1])
    extra = [] if request_timeout is None else ["--request-timeout", str(request_timeout)]
    with TcpRelay(port) as relay:
        r = perf("-m", "addsub", "-i", "http", "-u", f"127.0.0.1:{relay.port}", *SHORT, *extra)
        assert r.returncode == 0, r.stderr
        sent = relay.sent()
    infers = [infer_json(body) for connection in sent
              for body in connection.split(b"POST /v2/models/addsub/infer")[1:]]
    assert len(infers) > 4
    assert {json.dumps(x.get("parameters", {}).get("timeout")) for x in infers} == \
        {json.dumps(None if request_timeout is None else int(request_timeout * 1e6))}


def infer_json(request: bytes) -> dict:
    """The JSON part of a binary KServe v2 infer request (after the request line)."""
    head, _, body = request.partition(b"\r\n\r\n")
    fields = dict(line.split(b": ", 1) for line in head.split(b"\r\n")[1:])
    return json.loads(body[:int(fields[b"Inference-Header-Content-Length"])])
