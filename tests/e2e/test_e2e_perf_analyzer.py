"""NVIDIA's own `perf_analyzer` against torchpool's HTTP and gRPC gateways
(issue 41): each of its modes runs against a real daemon, exits 0 and
reports a throughput above 0.

The binary is not a Python package torchpool can depend on, so these tests
run only where one is given:

- `TORCHPOOL_PERF_ANALYZER`: its path, or a command line prefix (split as a
  shell would), e.g. `/opt/deb13/usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2
  --library-path /opt/deb13/usr/lib/x86_64-linux-gnu
  /opt/pa/perf_analyzer/bin/perf_analyzer`;
- otherwise `perf_analyzer` on PATH.

pip's perf-analyzer wheel installs a Python wrapper under that name which
runs the real binary (its package's bin/perf_analyzer) and drops its exit
status; the binary is used in its place. The wheel's binary (2.60.0) needs
glibc 2.38: on an older system it runs only through a newer loader and libc
(docs/perf.md, "perf_analyzer against torchpool"). Without a binary that
answers `--version`, every test here is skipped, saying why.

Windows are short (-p 500, -r 3: three windows a level) and the stability
bound is wide (-s 1000: the windows' throughputs and latencies within 11x of
each other), so that a loaded machine does not fail a run perf_analyzer would
otherwise judge unstable: these tests check that perf_analyzer works against
torchpool, not how fast the machine is.
"""
from __future__ import annotations

import csv
import os
import re
import shlex
import shutil
import socket
import subprocess
from pathlib import Path
from typing import Optional

import pytest

from ..support.daemon import ROOT, Daemon, free_tcp_port, wait_for
from ..support.kserve_v2 import http_status

ENV = "TORCHPOOL_PERF_ANALYZER"
GLIBC_NOTE = ("the perf-analyzer wheel's binary (2.60.0) needs glibc 2.38; on an older system run it through "
              "Debian 13's loader and libc6/libstdc++6, which scripts/get-perf-analyzer fetches (docs/perf.md, "
              "'perf_analyzer against torchpool')")
SHORT = ["-p", "500", "-r", "3", "-s", "1000"]
# perf_analyzer's CSV header (without --verbose-csv) when the server reports statistics
CSV_COLUMNS = ["Inferences/Second", "Client Send", "Network+Server Send/Recv", "Server Queue",
               "Server Compute Input", "Server Compute Infer", "Server Compute Output", "Client Recv",
               "p50 latency", "p90 latency", "p95 latency", "p99 latency"]
SUMMARY = re.compile(r"^(Concurrency|Request Rate): ([0-9.]+), throughput: ([0-9.eE+-]+) infer/sec", re.M)


def _wrapped_binary(path: str) -> Optional[str]:
    """The real binary behind pip's `perf_analyzer` wrapper script (a Python
    console script that drops the binary's exit status), or None when `path`
    is no such script."""
    try:
        with open(path, "rb") as f:
            head = f.read(4096)
    except OSError:
        return None
    if not head.startswith(b"#!") or b"perf_analyzer.cli" not in head:
        return None
    interpreter = head[2:].split(b"\n", 1)[0].decode(errors="replace").strip()
    try:
        r = subprocess.run([*shlex.split(interpreter), "-c",
                            "import pathlib, perf_analyzer; "
                            "print(pathlib.Path(perf_analyzer.__file__).parent / 'bin' / 'perf_analyzer')"],
                           capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    binary = r.stdout.strip()
    return binary if r.returncode == 0 and os.path.isfile(binary) else None


def find_perf_analyzer() -> tuple[Optional[list[str]], str]:
    """perf_analyzer's command line and "", or None and why not."""
    given = os.environ.get(ENV, "").strip()
    if given:
        command = shlex.split(given)
        source = f"{ENV}={given!r}"
    else:
        found = shutil.which("perf_analyzer")
        if found is None:
            return None, f"perf_analyzer not found: {ENV} is not set and there is no perf_analyzer on PATH"
        command = [found]
        source = f"perf_analyzer on PATH ({found})"
    if len(command) == 1:
        program = shutil.which(command[0]) or command[0]
        binary = _wrapped_binary(program)
        if binary is not None:
            command = [binary]
        elif not (os.path.isfile(program) and os.access(program, os.X_OK)):
            return None, f"{source}: no executable there"
    try:
        r = subprocess.run([*command, "--version"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"{source}: `{shlex.join(command)} --version` failed: {e}"
    said = (r.stdout + r.stderr).strip()
    if r.returncode != 0 or "Perf Analyzer" not in said:
        first = said.splitlines()[0] if said else "no output"
        return None, f"{source}: `{shlex.join(command)} --version` exited {r.returncode}: {first}"
    return command, ""


PERF_ANALYZER, WHY_NOT = find_perf_analyzer()
pytestmark = pytest.mark.skipif(PERF_ANALYZER is None, reason=f"{WHY_NOT} ({GLIBC_NOTE})")


@pytest.fixture(scope="module")
def pa_daemon(small_repository: Path, test_repository: Path, tmp_path_factory: pytest.TempPathFactory):
    """A daemon with the example models and the sequence accumulator, HTTP and
    gRPC gateways, and system shared memory allowed to its callers."""
    repository = tmp_path_factory.mktemp("pa_repository")
    for model in ("addsub", "strings"):
        shutil.copytree(small_repository / model, repository / model)
    shutil.copytree(test_repository / "sequence_accumulate", repository / "sequence_accumulate")
    ports = {"http": free_tcp_port(), "grpc": free_tcp_port()}
    d = Daemon(repository, tmp_path_factory.mktemp("perf_analyzer"), "--http-port", str(ports["http"]),
               "--grpc-port", str(ports["grpc"]), "--allow-client-shm=true")
    d.gateway = {protocol: f"127.0.0.1:{port}" for protocol, port in ports.items()}
    d.start()
    try:
        wait_for(lambda: http_status(f"http://{d.gateway['http']}/v2/health/ready") == 200, 30,
                 "the HTTP gateway")
        wait_for(lambda: _accepts(ports["grpc"]), 30, "the gRPC gateway")
        yield d
    finally:
        assert d.stop() == 0, d.log()


def _accepts(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


def perf_analyzer(daemon: Daemon, protocol: str, model: str, *args: str) -> dict[str, float]:
    """Run perf_analyzer at the daemon's `protocol` gateway; assert it exited 0
    and return its summary, {level: throughput in infer/s}."""
    command = [*PERF_ANALYZER, "-m", model, "-i", protocol, "-u", daemon.gateway[protocol], *SHORT, *args]
    r = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=180)
    said = f"$ {shlex.join(command)}\nexit {r.returncode}\n{r.stdout}\n{r.stderr}"
    assert r.returncode == 0, said
    assert "*** Measurement Settings ***" in r.stdout, said
    summary = {level: float(throughput) for _, level, throughput in SUMMARY.findall(r.stdout)}
    assert summary and all(throughput > 0 for throughput in summary.values()), said
    return summary


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_concurrency_range(pa_daemon: Daemon, protocol: str) -> None:
    summary = perf_analyzer(pa_daemon, protocol, "addsub", "--concurrency-range", "1:2")
    assert list(summary) == ["1", "2"]


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_async(pa_daemon: Daemon, protocol: str) -> None:
    summary = perf_analyzer(pa_daemon, protocol, "addsub", "--async", "--concurrency-range", "2")
    assert list(summary) == ["2"]


def test_streaming_a_sequence_model_over_grpc(pa_daemon: Daemon) -> None:
    # two sequences at once on one bidirectional stream; perf_analyzer sets
    # each request's sequence id and start/end flags, the daemon START__1
    summary = perf_analyzer(pa_daemon, "grpc", "sequence_accumulate", "--streaming", "--concurrency-range", "2",
                            "--sequence-length", "5")
    assert list(summary) == ["2"]


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_bytes_model(pa_daemon: Daemon, protocol: str) -> None:
    summary = perf_analyzer(pa_daemon, protocol, "strings", "--shape", "INPUT__0:4", "--string-length", "8")
    assert list(summary) == ["1"]


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_request_rate(pa_daemon: Daemon, protocol: str) -> None:
    summary = perf_analyzer(pa_daemon, protocol, "addsub", "--request-rate-range", "40")
    assert list(summary) == ["40"]


def test_csv_file(pa_daemon: Daemon, tmp_path: Path) -> None:
    out = tmp_path / "out.csv"
    perf_analyzer(pa_daemon, "http", "addsub", "--concurrency-range", "1:2", "-f", str(out))
    with open(out, newline="") as f:
        table = list(csv.reader(f))
    header, rows = table[0], [row for row in table[1:] if row]
    assert header[0] == "Concurrency" and header[1:1 + len(CSV_COLUMNS)] == CSV_COLUMNS, header
    assert sorted(row[0] for row in rows) == ["1", "2"], table
    for row in rows:
        values = dict(zip(header, row))
        assert float(values["Inferences/Second"]) > 0, table
        assert float(values["p99 latency"]) > 0, table


@pytest.mark.parametrize("protocol, concurrency", [("http", "1"), ("grpc", "2")])
def test_system_shared_memory(pa_daemon: Daemon, protocol: str, concurrency: str) -> None:
    # the daemon runs with --allow-client-shm=true: perf_analyzer registers
    # its regions over the gateway and sends only their names
    summary = perf_analyzer(pa_daemon, protocol, "addsub", "--shared-memory", "system",
                            "--concurrency-range", concurrency)
    assert list(summary) == [concurrency]
