"""`torchpool perf` against a real daemon: the table, CSV, JSON and
plot of a concurrency sweep, an open-loop run, a BYTES model on the asyncio
driver, input files, the progress line, and one-line errors.

Windows are short (-p 300, at most 3 or 4 of them): these tests check what
is reported, not how fast the machine is.
"""
from __future__ import annotations

import csv
import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Optional

import numpy as np
import pytest

from ..support.daemon import ROOT, Daemon, wait_for

CSV_HEADER = ["Concurrency", "Inferences/Second", "Client Send", "Network+Server Send/Recv", "Server Queue",
              "Server Compute Input", "Server Compute Infer", "Server Compute Output", "Client Recv",
              "p50 latency", "p90 latency", "p95 latency", "p99 latency", "Avg latency"]
TABLE_COLUMNS = ["Infer/s", "p50 us", "p90 us", "p95 us", "p99 us", "Avg us", "Queue us", "Input us",
                 "Infer us", "Output us", "Requests", "Status"]
SHORT = ["-p", "300", "-r", "3"]


@pytest.fixture(scope="module")
def perf_daemon(small_repository: Path, tmp_path_factory: pytest.TempPathFactory):
    d = Daemon(small_repository, tmp_path_factory.mktemp("perf_daemon")).start()
    try:
        yield d
    finally:
        assert d.stop() == 0, d.log()


def perf(*args: str, timeout: float = 120, env: Optional[dict] = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "torchpool", "perf", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, env=env)


def table_rows(stdout: str, level_header: str) -> list[dict]:
    """The result table as {column: cell} per level."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:1] == [level_header.split()[0]])
    headers = [level_header] + TABLE_COLUMNS
    assert lines[start].split() == " ".join(headers).split(), lines[start]
    rows = []
    for line in lines[start + 1:]:
        cells = line.split()
        assert len(cells) == len(headers), line
        rows.append(dict(zip(headers, cells)))
    return rows


def test_concurrency_sweep_table_csv_json_plot(perf_daemon: Daemon, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    files = {k: tmp_path / f"out.{k}" for k in ("csv", "json", "png")}
    # a comma list of levels, a range among them (issue 26: `--concurrency-range 1,4,8` was refused)
    r = perf("-m", "addsub", "-u", perf_daemon.url, "--concurrency-range", "1:1,2", *SHORT,
             "--csv", str(files["csv"]), "--json", str(files["json"]), "--plot", str(files["png"]))
    assert r.returncode == 0, r.stderr
    assert "*** Measurement Settings ***" in r.stdout and "Batch size: 1" in r.stdout
    rows = table_rows(r.stdout, "Concurrency")
    assert [row["Concurrency"] for row in rows] == ["1", "2"]
    for row in rows:
        assert float(row["Infer/s"]) > 0 and int(row["Requests"]) > 0
        p50, p90, p95, p99 = (float(row[f"p{p} us"]) for p in (50, 90, 95, 99))
        assert 0 < p50 <= p90 <= p95 <= p99
        assert float(row["Infer us"]) > 0          # the server split came from statistics
        assert row["Status"] in ("stable", "unstable")
    # stderr is not a terminal and --progress was not given: no progress line
    assert "\r" not in r.stderr

    with open(files["csv"], newline="") as f:
        table = list(csv.reader(f))
    assert table[0] == CSV_HEADER
    assert [row[0] for row in table[1:]] == ["1", "2"]
    for row in table[1:]:
        values = dict(zip(CSV_HEADER, row))
        assert float(values["Inferences/Second"]) > 0
        assert int(values["p50 latency"]) <= int(values["p99 latency"])
        assert int(values["Server Compute Infer"]) > 0 and int(values["Client Send"]) == 0

    document = json.loads(files["json"].read_text())
    assert document["settings"]["model"] == "addsub" and document["settings"]["mode"] == "concurrency"
    assert document["settings"]["levels"] == [1, 2]
    results = document["results"]
    assert [x["concurrency"] for x in results] == [1, 2]
    for x in results:
        assert x["throughput_infer_per_s"] > 0 and x["requests"] > 0 and 1 <= x["trials"] <= 3
        # batch 1: the daemon served as many inferences as requests succeeded (give or
        # take the requests in flight when statistics were read), about what the client
        # counted (the windows' edges cut a few either way)
        assert abs(x["server"]["inference_count"] - x["server"]["success_count"]) <= x["concurrency"]
        assert x["server"]["success_count"] > 0
        assert abs(x["server"]["success_count"] - x["requests"]) <= 0.1 * x["requests"] + 10
        assert x["latency_us"]["p50"] <= x["latency_us"]["p99"]
        assert set(x["server_us"]) == {"queue", "compute_input", "compute_infer", "compute_output"}

    png = files["png"].read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 1000


def test_batch_size_counts_inferences_with_a_shared_client(perf_daemon: Daemon, tmp_path: Path) -> None:
    out = tmp_path / "b4.json"
    r = perf("-m", "addsub", "-u", perf_daemon.url, "-b", "4", "--input-data", "zero", *SHORT,
             "--concurrency-range", "3", "--shared-client", "--json", str(out))
    assert r.returncode == 0, r.stderr
    assert "a thread per outstanding request, one Client shared" in r.stdout
    (x,) = json.loads(out.read_text())["results"]
    # throughput is inferences (batch items) per second: 4 per request
    assert x["throughput_infer_per_s"] == pytest.approx(4 * x["requests"] / x["duration_s"], rel=0.01)
    assert abs(x["server"]["inference_count"] - 4 * x["server"]["success_count"]) <= 4 * 3


def test_request_rate(perf_daemon: Daemon, tmp_path: Path) -> None:
    out, table = tmp_path / "rate.json", tmp_path / "rate.csv"
    r = perf("-m", "addsub", "-u", perf_daemon.url, "--request-rate-range", "40:80:40", *SHORT,
             "--json", str(out), "--csv", str(table))
    assert r.returncode == 0, r.stderr
    assert [row["Request Rate"] for row in table_rows(r.stdout, "Request Rate")] == ["40", "80"]
    results = json.loads(out.read_text())["results"]
    assert [x["request_rate"] for x in results] == [40, 80]
    for x in results:
        # open loop: the rate is what was sent, whatever the server does; at these
        # rates the server keeps up, so the completions follow the rate
        assert x["throughput_infer_per_s"] == pytest.approx(x["request_rate"], rel=0.25)
    with open(table, newline="") as f:
        assert next(csv.reader(f))[0] == "Request Rate"


def test_poisson_rate_on_the_async_client(perf_daemon: Daemon, tmp_path: Path) -> None:
    out = tmp_path / "poisson.json"
    r = perf("-m", "addsub", "-u", perf_daemon.url, "--request-rate-range", "60",
             "--request-distribution", "poisson", "--async", "-p", "500", "-r", "3", "--json", str(out))
    assert r.returncode == 0, r.stderr
    (x,) = json.loads(out.read_text())["results"]
    assert json.loads(out.read_text())["settings"]["client"] == "async"
    # Poisson arrivals average the rate; 1.5 s of them at 60/s is ~90 requests
    assert x["throughput_infer_per_s"] == pytest.approx(60, rel=0.4)


def test_strings_model_bytes(perf_daemon: Daemon, tmp_path: Path) -> None:
    out = tmp_path / "strings.json"
    r = perf("-m", "strings", "-u", perf_daemon.url, "--shape", "INPUT__0:4", "--string-length", "8",
             "--concurrency-range", "2", "--async", *SHORT, "--json", str(out))
    assert r.returncode == 0, r.stderr
    (x,) = json.loads(out.read_text())["results"]
    assert x["concurrency"] == 2 and x["throughput_infer_per_s"] > 0
    assert json.loads(out.read_text())["settings"]["inputs"] == {"INPUT__0": "BYTES"}


def test_input_data_json_and_npy_directory(perf_daemon: Daemon, tmp_path: Path) -> None:
    data = tmp_path / "data.json"
    data.write_text(json.dumps({"data": [
        {"INPUT0": list(range(16)), "INPUT1": {"content": [1.5] * 16, "shape": [16]}},
        {"INPUT0": [0] * 16, "INPUT1": [2] * 16}]}))
    r = perf("-m", "addsub", "-u", perf_daemon.url, "--input-data", str(data), "-b", "2", *SHORT)
    assert r.returncode == 0, r.stderr
    assert float(table_rows(r.stdout, "Concurrency")[0]["Infer/s"]) > 0

    directory = tmp_path / "npy"
    directory.mkdir()
    np.save(directory / "INPUT__0.npy", np.array(["a", "bc", "def"]))
    r = perf("-m", "strings", "-u", perf_daemon.url, "--input-data", str(directory), *SHORT)
    assert r.returncode == 0, r.stderr
    assert float(table_rows(r.stdout, "Concurrency")[0]["Infer/s"]) > 0


def test_progress_line_when_asked(perf_daemon: Daemon) -> None:
    # bytes: text mode would turn the carriage returns into newlines
    r = subprocess.run([sys.executable, "-m", "torchpool", "perf", "-m", "addsub", "-u", perf_daemon.url,
                        "-p", "200", "-r", "2", "--progress"], cwd=ROOT, capture_output=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert b"\rconcurrency 1: window 1: " in r.stderr and b"\rconcurrency 1: window 2: " in r.stderr
    assert b"infer/s, p99 " in r.stderr and b"\n" not in r.stderr.split(b"warning")[0]


@pytest.mark.parametrize("args, status, says", [
    (["-m", "nope"], 1, "'nope'"),
    (["-m", "addsub", "--shape", "INPUT0:a,b"], 2, "--shape expects NAME:d1,d2"),
    (["-m", "addsub", "--shape", "INPUT9:16"], 2, "model 'addsub' has no input 'INPUT9'"),
    (["-m", "addsub", "--shape", "INPUT0:4"], 2, "input 'INPUT0' of model 'addsub' has dims [16]"),
    (["-m", "strings"], 2, "give its shape with --shape INPUT__0:N"),
    (["-m", "addsub", "-b", "9"], 2, "batches of at most 8"),
    (["-m", "strings", "-b", "2", "--shape", "INPUT__0:1"], 2, "does not batch"),
    (["-m", "addsub", "--concurrency-range", "4:2"], 2, "END at least START"),
    (["-m", "addsub", "--request-rate-range", "fast"], 2, "--request-rate-range expects START"),
    (["-m", "addsub", "--input-data", "/nonexistent/file.json"], 2, "no such file or directory"),
    (["-m", "addsub", "--async", "--shared-client"], 2, "--async already uses one client"),
])
def test_errors_are_one_line(perf_daemon: Daemon, args: list, status: int, says: str) -> None:
    r = perf("-u", perf_daemon.url, *args, timeout=60)
    assert r.returncode == status, (r.stdout, r.stderr)
    assert r.stderr.startswith("torchpool perf: error: ") and says in r.stderr, r.stderr
    assert r.stderr.count("\n") == 1 and r.stdout == ""


def test_json_input_missing_a_tensor(perf_daemon: Daemon, tmp_path: Path) -> None:
    data = tmp_path / "half.json"
    data.write_text(json.dumps({"data": [{"INPUT0": [0] * 16}]}))
    r = perf("-u", perf_daemon.url, "-m", "addsub", "--input-data", str(data))
    assert r.returncode == 2
    assert "entry 0: no value for input 'INPUT1' of model 'addsub'" in r.stderr


def test_no_daemon(tmp_path: Path) -> None:
    r = perf("-m", "addsub", "-u", f"ipc://{tmp_path}/absent.sock", timeout=60)
    assert r.returncode == 1
    assert r.stderr == (f"torchpool perf: error: no torchpool daemon at ipc://{tmp_path}/absent.sock: "
                        "the socket file does not exist (is `torchpool serve` running?)\n")


def test_daemon_stopping_mid_run_fails_the_run(small_repository: Path, tmp_path: Path) -> None:
    d = Daemon(small_repository, tmp_path).start()
    proc = None
    try:
        proc = subprocess.Popen([sys.executable, "-m", "torchpool", "perf", "-m", "addsub", "-u", d.url,
                                 "-p", "60000", "--timeout", "2"], cwd=ROOT, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        # the load is running once the daemon has served requests beyond the trial one
        from torchpool.client import Client
        with Client(d.url, timeout=10) as c:
            wait_for(lambda: c.statistics("addsub")["model_stats"][0]["inference_count"] > 10, 60,
                     "perf's load to reach the daemon")
        assert d.stop(signal.SIGTERM) == 0, d.log()
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 1, (out, err)
        assert err.startswith("torchpool perf: error: a request failed: ") and "concurrency 1" in err, err
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        d.stop()
