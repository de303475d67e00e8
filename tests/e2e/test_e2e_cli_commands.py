"""The client commands against the session daemon: `torchpool infer | models | metadata | stats | ps`,
`torchpool --version`, and the process titles of a running daemon.

Each command runs as a user runs it (`python -m torchpool ...`); its output
is compared with what the client library gets from the same daemon, and
every bad argument is one line with exit status 2, every refusal by the
server one line with its text and exit status 1.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import numpy as np
import pytest

import torchpool
from torchpool.client import Client

from ..support.daemon import ROOT, Daemon, descendants

ADDSUB = "libtorch_float32_float32_float32"      # INPUT__0, INPUT__1 FP32 [16], mbs 8


def torchpool_command(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "torchpool", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=60)


def failed(status: int, *args: str) -> str:
    """The command fails with `status` and one line; that line, without its prefix."""
    done = torchpool_command(*args)
    assert done.returncode == status, (done.returncode, done.stdout, done.stderr)
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("torchpool: error: "), done.stderr
    assert done.stdout == ""
    return lines[0][len("torchpool: error: "):]


def json_lines(done: subprocess.CompletedProcess) -> list[dict]:
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in done.stdout.splitlines()]


def test_version() -> None:
    done = torchpool_command("--version")
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"torchpool {torchpool.__version__} (torch {metadata.version('torch')})\n"


# --- infer ---------------------------------------------------------------------------------

def test_infer_takes_the_models_datatypes_and_prints_tritons_names(daemon: Daemon, tmp_path: Path) -> None:
    a = np.arange(16, dtype=np.float32).reshape(1, 16)
    np.save(tmp_path / "b.npy", np.ones((1, 16), dtype=np.float64))
    rows = json_lines(torchpool_command("infer", ADDSUB, "--url", daemon.url,
                                        "--input", f"INPUT__0={json.dumps(a.tolist())}",
                                        "--input", f"INPUT__1=@{tmp_path / 'b.npy'}:FP32"))
    assert rows == [
        {"name": "OUTPUT__0", "datatype": "FP32", "shape": [1, 16], "data": (a + 1).reshape(-1).tolist()},
        {"name": "OUTPUT__1", "datatype": "FP32", "shape": [1, 16], "data": (a - 1).reshape(-1).tolist()},
    ]
    ints = json_lines(torchpool_command("infer", "libtorch_int32_int32_int32", "--url", daemon.url,
                                        "--input", f"INPUT0={json.dumps([list(range(16))])}",
                                        "--input", f"INPUT1={json.dumps([[2] * 16])}", "--output", "OUTPUT1"))
    assert ints == [{"name": "OUTPUT1", "datatype": "INT32", "shape": [1, 16], "data": [i - 2 for i in range(16)]}]


def test_infer_bytes_and_bf16(daemon: Daemon) -> None:
    rows = json_lines(torchpool_command("infer", "string_io", "--url", daemon.url,
                                        "--input", 'INPUT__0=["abc", "hello"]', "--output", "OUTPUT__0"))
    assert rows == [{"name": "OUTPUT__0", "datatype": "BYTES", "shape": [2], "data": ["cba", "olleh"]}]
    rows = json_lines(torchpool_command("infer", "identity_bf16", "--url", daemon.url,
                                        "--input", "INPUT__0=[1.5, -2.0, 0.25]"))
    assert rows == [{"name": "OUTPUT__0", "datatype": "BF16", "shape": [3], "data": [1.5, -2.0, 0.25]}]


def test_infer_refuses_bad_arguments_in_one_line(daemon: Daemon, tmp_path: Path) -> None:
    url = ["--url", daemon.url]
    assert failed(2, "infer", ADDSUB, *url, "--input", "INPUT__0=[[1,2") == \
        "--input INPUT__0=[[1,2: not valid JSON (Expecting ',' delimiter at column 6); quote it for the " \
        "shell, e.g. --input 'INPUT__0=[[1,2,3]]'"
    assert failed(2, "infer", ADDSUB, *url, "--input", "INPUT__0=[[1]]:FLOAT32") == \
        "--input INPUT__0=[[1]]:FLOAT32: unknown datatype 'FLOAT32' (Triton's names: BOOL, UINT8, UINT16, " \
        "UINT32, UINT64, INT8, INT16, INT32, INT64, FP16, BF16, FP32, FP64, BYTES)"
    missing = tmp_path / "missing.npy"
    assert failed(2, "infer", ADDSUB, *url, "--input", f"INPUT__0=@{missing}") == \
        f"--input INPUT__0=@{missing}: cannot read {missing}: No such file or directory"
    assert failed(2, "infer", ADDSUB, *url, "--input", "INPUT__0") == \
        "--input INPUT__0: expected NAME=JSON[:DATATYPE] or NAME=@FILE.npy[:DATATYPE]"
    assert failed(2, "infer", ADDSUB, "--url", "/tmp/torchpool.sock") == \
        "--url /tmp/torchpool.sock: expected a URL such as ipc:///tmp/torchpool.sock or tcp://127.0.0.1:8555"


def test_infer_shows_the_servers_refusal(daemon: Daemon) -> None:
    url = ["--url", daemon.url]
    assert failed(1, "infer", "no_such_model", *url, "--input", "INPUT__0=[1]") == \
        "[NOT_FOUND] Request for unknown model: 'no_such_model' is not found"
    line = failed(1, "infer", ADDSUB, *url, "--input", "INPUT__0=[[1]]:FP32", "--input", "NOPE=[[1]]:FP32")
    assert line == f"[INVALID_ARG] unexpected inference input 'NOPE' for model '{ADDSUB}'"


def test_a_daemon_that_is_not_running(tmp_path: Path) -> None:
    socket_path = tmp_path / "none.sock"
    for command in (["infer", ADDSUB, "--input", "INPUT__0=[1]"], ["models"], ["metadata", ADDSUB], ["stats"]):
        assert failed(1, *command, "--url", f"ipc://{socket_path}") == \
            f"no torchpool daemon at ipc://{socket_path}: {socket_path} does not exist " \
            f"(is `torchpool serve` running there?)"
    from ..support.daemon import free_tcp_port

    port = free_tcp_port()
    assert failed(1, "models", "--url", f"tcp://127.0.0.1:{port}") == \
        f"no torchpool daemon at tcp://127.0.0.1:{port}: connection refused (is `torchpool serve` running there?)"


# --- models, metadata, stats -----------------------------------------------------------------

def test_models_lists_the_repository_index(daemon: Daemon) -> None:
    with Client(daemon.url, timeout=30) as c:
        index = c.repository_index()
    done = torchpool_command("models", "--url", daemon.url, "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == index
    table = torchpool_command("models", "--url", daemon.url)
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert lines[0].split() == ["MODEL", "VERSION", "STATE", "REASON"]
    rows = lines[1:]
    assert len(rows) == len(index)
    for line, entry in zip(rows, index):
        name, version, state = line.split()[:3]
        assert (name, version, state) == (entry["name"], entry["version"] or "-", entry["state"])
        assert line.endswith(entry["reason"])
    assert f"{ADDSUB}  " in rows[[e["name"] for e in index].index(ADDSUB)]


def test_metadata_shows_tritons_datatypes_and_shapes(daemon: Daemon) -> None:
    done = torchpool_command("metadata", ADDSUB, "--url", daemon.url)
    assert done.returncode == 0, done.stderr
    lines = [line.split(None, 3) for line in done.stdout.splitlines()]
    assert done.stdout.splitlines()[0] == f"model {ADDSUB} (pytorch_libtorch), versions: 1"
    assert lines[1] == ["NAME", "DATATYPE", "SHAPE"]
    assert lines[2:] == [["input", "INPUT__0", "FP32", "[-1, 16]"], ["input", "INPUT__1", "FP32", "[-1, 16]"],
                         ["output", "OUTPUT__0", "FP32", "[-1, 16]"], ["output", "OUTPUT__1", "FP32", "[-1, 16]"]]
    with Client(daemon.url, timeout=30) as c:
        assert json.loads(torchpool_command("metadata", ADDSUB, "--url", daemon.url, "--json").stdout) == \
            c.model_metadata(ADDSUB)
    assert failed(1, "metadata", "no_such_model", "--url", daemon.url) == \
        "[NOT_FOUND] Request for unknown model: 'no_such_model' is not found"


def test_stats_counts_and_averages(daemon: Daemon) -> None:
    model = "libtorch_nobatch_float32_float32_float32"
    with Client(daemon.url, timeout=30) as c:
        for _ in range(3):
            c.infer(model, {"INPUT__0": np.ones(16, np.float32), "INPUT__1": np.ones(16, np.float32)})
        stats = c.statistics(model)["model_stats"][0]
    raw = json.loads(torchpool_command("stats", model, "--url", daemon.url, "--json").stdout)
    assert raw["model_stats"][0]["inference_stats"]["success"]["count"] == \
        stats["inference_stats"]["success"]["count"] >= 3
    done = torchpool_command("stats", model, "--url", daemon.url)
    assert done.returncode == 0, done.stderr
    header, row = done.stdout.splitlines()
    assert header.split("  ")[0] == "MODEL" and "AVG QUEUE" in header and "AVG COMPUTE" in header
    cells = row.split()
    s = stats["inference_stats"]
    assert cells[:6] == [model, "1", str(s["success"]["count"]), str(s["fail"]["count"]),
                         str(stats["inference_count"]), str(stats["execution_count"])]
    assert cells[7] == "us" or cells[7] == "ms"      # e.g. "85 us"
    all_models = torchpool_command("stats", "--url", daemon.url)
    assert all_models.returncode == 0 and model in all_models.stdout


def test_infer_json_is_kserves_inference_response(daemon: Daemon) -> None:
    a = [list(range(16))]
    args = ("infer", ADDSUB, "--url", daemon.url, "--input", f"INPUT__0={json.dumps(a)}",
            "--input", f"INPUT__1={json.dumps(a)}", "--output", "OUTPUT__0")
    done = torchpool_command(*args, "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"model_name": ADDSUB, "outputs": [
        {"name": "OUTPUT__0", "datatype": "FP32", "shape": [1, 16], "data": [2.0 * i for i in range(16)]}]}
    versioned = json.loads(torchpool_command(*args, "--json", "--version", "1").stdout)
    assert versioned["model_version"] == "1"
    assert json_lines(torchpool_command(*args)) == json.loads(done.stdout)["outputs"]   # lines: the same rows


def test_stats_into_a_reader_that_went_away(daemon: Daemon) -> None:
    """`torchpool stats | head`: no BrokenPipeError traceback, the shell's SIGPIPE status."""
    read, write = os.pipe()
    os.close(read)
    try:
        done = subprocess.run([sys.executable, "-m", "torchpool", "stats", "--url", daemon.url], stdout=write,
                              stderr=subprocess.PIPE, text=True, cwd=ROOT, timeout=60)
    finally:
        os.close(write)
    assert (done.returncode, done.stderr) == (141, "")


def test_ps_lists_each_instance_of_a_model(daemon: Daemon) -> None:
    done = torchpool_command("ps", "multi_instance", "--json", "--url", daemon.url)
    assert done.returncode == 0, done.stderr
    rows = json.loads(done.stdout)
    assert [(r["model"], r["version"], r["name"], r["state"]) for r in rows] == \
        [("multi_instance", "1", "multi_instance_0_0", "READY"), ("multi_instance", "1", "multi_instance_0_1", "READY")]
    assert {r["pid"] for r in rows} <= set(descendants(daemon.pid())) and rows[0]["pid"] != rows[1]["pid"]
    assert all(r["pss_bytes"] > 0 and r["rss_bytes"] >= r["pss_bytes"] for r in rows)
    assert all(r["threads"] >= 1 for r in rows)          # its share of the daemon's CPUs
    every = json.loads(torchpool_command("ps", "--json", "--url", daemon.url).stdout)
    assert {r["pid"] for r in every} <= set(descendants(daemon.pid())) and len(every) > len(rows)
    table = torchpool_command("ps", "--url", daemon.url).stdout.splitlines()
    assert table[0].split()[:3] == ["MODEL", "VERSION", "INSTANCE"] and len(table) == len(every) + 1
    assert failed(1, "ps", "no_such_model", "--url", daemon.url) == \
        "[NOT_FOUND] Request for unknown model: 'no_such_model' is not found"


# --- process titles --------------------------------------------------------------------------

def test_processes_are_titled_by_what_they_serve(daemon: Daemon) -> None:
    pytest.importorskip("setproctitle")
    titles = {}
    for pid in [daemon.pid()] + descendants(daemon.pid()):
        try:
            titles[pid] = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
        except OSError:
            continue
    assert titles[daemon.pid()] == f"torchpool broker {daemon.url}"
    workers = sorted(t for t in titles.values() if t.startswith("torchpool worker "))
    assert f"torchpool worker {ADDSUB} v1 #0" in workers, titles
    # Triton's instance names: group 0 (unnamed, so named after the model), instances 0 and 1
    assert "torchpool worker multi_instance v1 #0_0" in workers and \
        "torchpool worker multi_instance v1 #0_1" in workers, workers
