"""End to end: the HTTP/gRPC gateway as the daemon's child process.

It starts with the daemon, a busy port fails the daemon's start with one
line, it is restarted when it dies, it dies with a SIGKILLed daemon, and it
imports no torch (a gateway needs only the client side of torchpool).
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ..support.daemon import ROOT, Daemon, alive, descendants, free_tcp_port, wait_for

httpclient = pytest.importorskip("tritonclient.http")


def gateway_pid(d: Daemon) -> int:
    for pid in descendants(d.pid()):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"torchpool.gateway" in cmd or b"torchpool gateway" in cmd:   # before / after its title is set
            return pid
    raise AssertionError("no gateway process under the daemon")


def http_live(port: int) -> bool:
    client = httpclient.InferenceServerClient(f"127.0.0.1:{port}", connection_timeout=2, network_timeout=5)
    try:
        return client.is_server_live()
    except Exception:       # refused while it restarts
        return False
    finally:
        client.close()


def addsub_over_http(port: int) -> np.ndarray:
    client = httpclient.InferenceServerClient(f"127.0.0.1:{port}")
    try:
        a = np.arange(16, dtype=np.float32).reshape(1, 16)
        inputs = [httpclient.InferInput("INPUT0", [1, 16], "FP32"), httpclient.InferInput("INPUT1", [1, 16], "FP32")]
        inputs[0].set_data_from_numpy(a)
        inputs[1].set_data_from_numpy(a)
        return client.infer("addsub", inputs).as_numpy("OUTPUT0")
    finally:
        client.close()


def test_busy_http_port_fails_the_start_with_one_line(small_repository: Path, tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        d = Daemon(small_repository, tmp_path, "--http-port", str(port))
        d.start(wait_ready=False)
        assert d.proc.wait(60) == 4, d.log()   # a port in use, found before any model loads
    log = d.log()
    assert f"cannot serve HTTP on 127.0.0.1:{port}" in log, log
    assert "Traceback" not in log, log
    assert not d.socket_path.exists()


def test_gateway_restarts_and_serves_the_same_port(small_repository: Path, tmp_path: Path) -> None:
    port = free_tcp_port()
    d = Daemon(small_repository, tmp_path, "--http-port", str(port)).start()
    try:
        assert np.array_equal(addsub_over_http(port), np.arange(16, dtype=np.float32).reshape(1, 16) * 2)
        first = gateway_pid(d)
        os.kill(first, signal.SIGKILL)
        wait_for(lambda: not alive(first), 10, "the killed gateway to go")
        wait_for(lambda: http_live(port), 30, "the restarted gateway to answer")
        assert gateway_pid(d) != first
        assert "gateway exited (signal 9); restarting it" in d.log()
        assert np.array_equal(addsub_over_http(port), np.arange(16, dtype=np.float32).reshape(1, 16) * 2)
        pids = [d.pid(), *descendants(d.pid())]
    finally:
        assert d.stop() == 0, d.log()
    wait_for(lambda: not any(alive(p) for p in pids), 30, "every process of the daemon to exit")


def test_gateway_dies_with_a_killed_daemon(small_repository: Path, tmp_path: Path) -> None:
    port = free_tcp_port()
    d = Daemon(small_repository, tmp_path, "--http-port", str(port)).start()
    try:
        gateway = gateway_pid(d)
        pids = [d.pid(), *descendants(d.pid())]
    finally:        # a failed lookup must not leave the daemon running
        d.proc.send_signal(signal.SIGKILL)
        d.proc.wait(30)
    wait_for(lambda: not alive(gateway), 30, "the gateway to exit after its daemon was killed")
    for p in pids:        # workers follow their broker the same way
        wait_for(lambda p=p: not alive(p), 30, f"process {p} to exit")
    d.socket_path.unlink(missing_ok=True)
    Path(f"{d.socket_path}.local").unlink(missing_ok=True)


def test_the_gateway_imports_no_torch() -> None:
    code = ("import sys; import torchpool.gateway.process, torchpool.gateway.backend, "
            "torchpool.gateway.http_server, torchpool.gateway.grpc_server; "
            "sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0
