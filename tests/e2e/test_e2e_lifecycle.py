"""End to end: the daemon's life: start, signals, crashes, restarts, conflicts.

Each test starts its own small daemon (only good models) in tmp_path.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest

from torchpool.client import Client
from torchpool.protocol import errors
from torchpool.protocol.errors import InferenceError

from ..support.daemon import (ROOT, Daemon, RawConnection, alive, cpu_ticks, daemon_segments, descendants,
                              memfds, torchpool_processes, wait_for, worker_pids)
from ..support.models.slow import slow_iterations

ADDSUB_IN = {"INPUT0": np.arange(16, dtype=np.float32).reshape(1, 16),
             "INPUT1": np.full((1, 16), 2.0, np.float32)}


def check_addsub(client: Client) -> None:
    result = client.infer("addsub", ADDSUB_IN)
    assert np.array_equal(result["OUTPUT0"], ADDSUB_IN["INPUT0"] + 2)
    assert np.array_equal(result["OUTPUT1"], ADDSUB_IN["INPUT0"] - 2)


def start(repository: Path, workdir: Path, *extra: str) -> Daemon:
    return Daemon(repository, workdir, "--log-level", "debug", *extra).start()


@contextmanager
def serving(repository: Path, workdir: Path) -> Iterator[Daemon]:
    """A daemon for the block; then it must stop cleanly (exit 0) and leave nothing behind."""
    d = start(repository, workdir)
    try:
        yield d
        pids = [d.pid()] + descendants(d.pid())
        assert d.stop() == 0, d.log()
    finally:
        if d.proc.poll() is None:
            d.stop(signal.SIGKILL)
    assert_nothing_left(d, pids)


def assert_nothing_left(d: Daemon, pids: list[int]) -> None:
    wait_for(lambda: not any(alive(p) for p in pids), 30, "the daemon's processes to exit")
    ours = {p for p, _ in torchpool_processes()} & set(pids)
    assert not ours, ours
    assert not daemon_segments(d.urls), daemon_segments(d.urls)
    assert not d.socket_path.exists(), "socket file left behind"


def start_in_flight(client_url: str, n: int, worker: int,
                    through_broker: bool = False) -> tuple[threading.Thread, dict]:
    """Send `slow` with n iterations from a thread; return once the worker
    computes it. `through_broker`: from a client without a local session
    (local=False), so that it does not go on a direct path to the worker
    (the broker then knows it runs)."""
    outcome: dict = {}
    before = cpu_ticks(worker)

    def run() -> None:
        with Client(client_url, timeout=60, local=False if through_broker else None) as c:
            try:
                outcome["result"] = c.infer("slow", {"INPUT__0": np.array([n])})
            except InferenceError as exc:
                outcome["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    # an idle worker blocks in recv and uses no CPU: growing CPU time means it runs our request
    wait_for(lambda: cpu_ticks(worker) >= before + 3 or not thread.is_alive(), 30,
             "the slow worker to start computing")
    assert thread.is_alive(), outcome
    return thread, outcome


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_stops_cleanly(small_repository: Path, tmp_path: Path, sig: int) -> None:
    d = start(small_repository, tmp_path)
    try:
        assert "torchpool ready" in d.log()
        assert d.socket_path.exists()
        # the broker's input arena and one output arena per worker: sealed memfds, no names
        held = memfds(d.pid())
        assert any(n.endswith(".in0") for n in held) and any(".w" in n for n in held), held
        assert not daemon_segments(d.urls)
        pids = [d.pid()] + descendants(d.pid())
        # fork server, resource tracker and one worker per model
        assert len(pids) >= 1 + 1 + 6, pids
        with Client(d.url, timeout=30) as c:
            check_addsub(c)
            worker = worker_pids(d.log(), "slow")[0]
            assert worker in pids
            # a request running when the signal comes still gets its answer (grace period)
            n = slow_iterations(0.3)
            thread, outcome = start_in_flight(d.url, n, worker)
            d.proc.send_signal(sig)
            # while it drains, the daemon says it is going and refuses new work
            wait_for(lambda: not c.server_live(), 10, "server_live to turn False")
            assert c.server_ready() is False
            with pytest.raises(InferenceError) as exc:
                c.infer("addsub", ADDSUB_IN)
            assert exc.value.code == errors.UNAVAILABLE and "shutting down" in exc.value.message
            thread.join(60)
            assert int(outcome["result"]["OUTPUT__0"][0]) == n, outcome
        assert d.stop(timeout=60) == 0, d.log()
    finally:
        if d.proc.poll() is None:
            d.stop(signal.SIGKILL)
    assert_nothing_left(d, pids)
    assert "torchpool stopped" in d.log()


def test_worker_killed_mid_request(small_repository: Path, tmp_path: Path) -> None:
    with serving(small_repository, tmp_path) as d:
        worker = worker_pids(d.log(), "slow")[0]
        assert worker in descendants(d.pid())
        with Client(d.url, timeout=30) as c:
            assert int(c.infer("slow", {"INPUT__0": np.array([10])})["OUTPUT__0"][0]) == 10
            thread, outcome = start_in_flight(d.url, 10 ** 9, worker)   # would run for minutes
            os.kill(worker, signal.SIGKILL)
            thread.join(30)
            err = outcome.get("error")
            assert err is not None, outcome
            assert err.code == errors.INTERNAL
            assert "'slow'" in err.message and "SIGKILL" in err.message, err.message
            # the daemon stays up, the other models are untouched
            assert c.server_live() is True
            check_addsub(c)
            # a new worker replaces the dead one and the model answers again
            new = wait_for(lambda: [p for p in worker_pids(d.log(), "slow") if p != worker], 30,
                           "a respawned slow worker")[0]
            wait_for(lambda: c.model_ready("slow"), 30, "slow to be ready again")
            assert int(c.infer("slow", {"INPUT__0": np.array([1234])})["OUTPUT__0"][0]) == 1234
            assert alive(new) and new in descendants(d.pid()) and not alive(worker)
            assert "restarting it" in d.log()


def test_a_request_sent_ahead_to_a_worker_that_dies_runs_on_its_replacement(
        small_repository: Path, tmp_path: Path) -> None:
    """A busy worker is sent the next request ahead; when it dies running
    the one before, the request it never started is queued again and the
    restarted instance answers it: only the running one fails."""
    with serving(small_repository, tmp_path) as d:
        worker = worker_pids(d.log(), "slow")[0]
        thread, outcome = start_in_flight(d.url, 10 ** 9, worker, through_broker=True)   # runs for minutes
        with RawConnection(d.url) as conn:
            conn.send(RawConnection.pack({"v": 1, "op": "infer", "id": 7, "model": "slow", "version": "",
                                          "inputs": [{"name": "INPUT__0", "datatype": "INT64", "shape": [1],
                                                      "data": np.array([7]).tobytes()}]}))
            # answered after the daemon read (and sent ahead) the request before it: one pipe keeps their order
            header, _ = conn.call(RawConnection.pack({"v": 1, "op": "statistics", "id": "s", "model": "slow",
                                                      "version": ""}))
            assert header["id"] == "s", header
            os.kill(worker, signal.SIGKILL)
            thread.join(30)
            assert "SIGKILL" in outcome["error"].message, outcome
            header, frames = conn.recv(timeout=60)
            assert header["id"] == 7 and header.get("ok"), header
            out = header["outputs"][0]
            data = out["data"] if isinstance(out["data"], bytes) else frames[out["data"] - 1]
            assert np.frombuffer(data, np.int64).tolist() == [7]
            assert not conn.pending(0.2)      # one answer
        assert not alive(worker)


def test_daemon_killed_then_restarted_cleans_up(small_repository: Path, tmp_path: Path) -> None:
    first = start(small_repository, tmp_path)
    pids = [first.pid()] + descendants(first.pid())
    with Client(first.url, timeout=30) as c:
        check_addsub(c)
    # a worker in the middle of a request that would run for minutes
    thread, _ = start_in_flight(first.url, 10 ** 9, worker_pids(first.log(), "slow")[0])
    first.proc.send_signal(signal.SIGKILL)
    assert first.stop() == -signal.SIGKILL
    # the fork server and the workers follow the daemon (no orphans), the busy one too
    wait_for(lambda: not any(alive(p) for p in pids), 30, "orphaned processes to exit")
    thread.join(30)
    assert not thread.is_alive()
    # its memory had no names: a daemon killed outright leaves none behind in /dev/shm
    assert not daemon_segments(first.urls)
    assert first.socket_path.exists()          # nobody removed it

    with serving(small_repository, tmp_path) as second:
        log = second.log()
        assert "stale socket file" in log
        assert "left by a dead daemon" in log
        assert not daemon_segments(second.urls)
        assert all(f".{second.pid()}." in n for n in memfds(second.pid()))
        with Client(second.url, timeout=30) as c:
            check_addsub(c)


def test_second_daemon_on_a_busy_socket_fails(small_repository: Path, tmp_path: Path) -> None:
    first = start(small_repository, tmp_path)
    try:
        second = Daemon(small_repository, tmp_path)
        second.log_path = tmp_path / "second.log"
        second.start(wait_ready=False)
        assert second.proc.wait(60) == 4, second.log()   # an address in use
        second.stop()
        log = second.log()
        assert "in use by a running process" in log and str(first.socket_path) in log, log
        assert "Traceback" not in log
        assert not [n for n in daemon_segments(first.urls) if f".{second.pid()}." in n]
        # the first daemon is untouched and still owns its socket
        assert first.socket_path.exists()
        with Client(first.url, timeout=30) as c:
            check_addsub(c)
            assert c.server_ready() is True
        pids = [first.pid()] + descendants(first.pid())
        assert first.stop() == 0, first.log()
    finally:
        if first.proc.poll() is None:
            first.stop(signal.SIGKILL)
    assert_nothing_left(first, pids)


def test_cli_infer_prints_json(daemon: Daemon) -> None:
    a = list(range(16))
    out = subprocess.run(
        [sys.executable, "-m", "torchpool", "infer", "libtorch_float32_float32_float32",
         "--url", daemon.url, "--input", f"INPUT__0={json.dumps([a])}:FP32",
         "--input", f"INPUT__1={json.dumps([[1] * 16])}:FP32"],
        capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    assert lines == [
        {"name": "OUTPUT__0", "datatype": "FP32", "shape": [1, 16], "data": [float(x + 1) for x in a]},
        {"name": "OUTPUT__1", "datatype": "FP32", "shape": [1, 16], "data": [float(x - 1) for x in a]},
    ]


def test_cli_infer_strings_and_errors(daemon: Daemon) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "torchpool", "infer", "string_io", "--url", daemon.url,
         "--input", 'INPUT__0=["abc", "hello"]', "--output", "OUTPUT__0"],
        capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    assert [json.loads(line) for line in out.stdout.splitlines()] == [
        {"name": "OUTPUT__0", "datatype": "BYTES", "shape": [2], "data": ["cba", "olleh"]}]
    bad = subprocess.run(
        [sys.executable, "-m", "torchpool", "infer", "no_such_model", "--url", daemon.url,
         "--input", "INPUT__0=[1]"], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert bad.returncode == 1
    assert "NOT_FOUND" in bad.stderr and "'no_such_model'" in bad.stderr
