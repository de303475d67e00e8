"""Attack: more idle connections than the gateway has file descriptors (issue 32, item 4).

With `nofile` 1024, ~1,100 idle HTTP connections took every fd of the
HTTP/gRPC gateway process: new HTTP connections were accepted and closed at
once (libuv's answer to EMFILE) and gRPC ones never accepted ("File
descriptor limit reached. Retrying."), until idle connections timed out
(300 s). Now the gateway raises its soft limit to the hard one at start and
caps each protocol's connections below it (defaults.max_connections: at
1024, 384 each with both served). At the HTTP cap a new connection takes
the place of the oldest one with no request in hand (idle, or still sending
its headers), or is refused (503) when every one has a request in hand;
past half the cap those go after `pressure_timeout` (5 s), oldest first.
gRPC's cap is grpcio's (grpc.max_allowed_incoming_connections): one past it
is refused at once, and the connections it has are served on.

The daemon runs under a hard limit of 1024 (test_e2e_fd_limit's way); the
flood's sockets are raw ones: a third silent, a third idle after one
request, a third stalled in a request's headers (slowloris). The rules
themselves are also shown on a gateway in this process with a cap of a few
connections.
"""
from __future__ import annotations

import re
import select
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest

from torchpool.examples import IDENTITY_CONFIG, Identity, serialize, write_model

from ..support.daemon import ROOT, Daemon, free_tcp_port, wait_for
from ..support.http_gateway import InProcessGateway, ResponseReader, closed_by_server, connect, error_of, gateway_pid
from .test_e2e_fd_limit import _UNDER_LIMITS, own_fds  # noqa: F401 (a fixture)

httpclient = pytest.importorskip("tritonclient.http")
grpcclient = pytest.importorskip("tritonclient.grpc")

SOFT, HARD = 256, 1024
FLOOD = 1100                        # idle connections: past the gateway's fd limit
X = np.arange(4, dtype=np.float32)
LIVE = b"GET /v2/health/live HTTP/1.1\r\nHost: t\r\n\r\n"


class Gateway:
    """The daemon under the lowered limit and its gateway's ports and pid."""

    def __init__(self, daemon: Daemon, http_port: int, grpc_port: int) -> None:
        self.daemon, self.http_port, self.grpc_port = daemon, http_port, grpc_port
        self.pid = gateway_pid(daemon)

    def cap(self, kind: str) -> int:
        return int(re.search(rf"{kind} endpoint on .* \(at most (\d+) connections\)", self.daemon.log())[1])

    def http_infer(self, client: Any = None) -> np.ndarray:
        own = client is None
        client = client or httpclient.InferenceServerClient(f"127.0.0.1:{self.http_port}",
                                                            connection_timeout=5, network_timeout=5)
        try:
            i = httpclient.InferInput("INPUT__0", [4], "FP32")
            i.set_data_from_numpy(X)
            return client.infer("identity", [i]).as_numpy("OUTPUT__0")
        finally:
            if own:
                client.close()

    def grpc_infer(self, client: Any = None) -> np.ndarray:
        own = client is None
        # a channel of its own: grpc would share another client's connection to the same address
        client = client or grpcclient.InferenceServerClient(
            f"127.0.0.1:{self.grpc_port}", channel_args=[("grpc.use_local_subchannel_pool", 1)])
        try:
            i = grpcclient.InferInput("INPUT__0", [4], "FP32")
            i.set_data_from_numpy(X)
            return client.infer("identity", [i], client_timeout=5).as_numpy("OUTPUT__0")
        finally:
            if own:
                client.close()

    def assert_alive(self) -> None:
        d = self.daemon
        assert d.proc.poll() is None, d.log()[-3000:]
        assert gateway_pid(d) == self.pid, f"the gateway was restarted:\n{d.log()[-3000:]}"


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    root = tmp_path_factory.mktemp("gateway_fd_limit")
    write_model(root / "repo", "identity", IDENTITY_CONFIG, serialize(Identity()))
    http_port, grpc_port = free_tcp_port(), free_tcp_port()
    d = Daemon(root / "repo", root, "--http-port", str(http_port), "--grpc-port", str(grpc_port))
    d.args = [sys.executable, "-c", _UNDER_LIMITS, str(SOFT), str(HARD)] + d.args
    d.start()
    try:
        gw = Gateway(d, http_port, grpc_port)
        yield gw
        gw.assert_alive()
        log = d.log()
        assert "Too many open files" not in log and "File descriptor limit" not in log, log[-3000:]
        assert "Traceback" not in log, log[-3000:]
    finally:
        assert d.stop() == 0, d.log()[-3000:]


def flood(port: int, n: int, *, http: bool) -> list[socket.socket]:
    """`n` connections that send nothing or, with `http`, a third nothing, a
    third one request (whose answer they read), a third the first line of one."""
    socks = []
    for k in range(n):
        s = connect(port, timeout=10)
        socks.append(s)
        if http and k % 3 == 1:
            s.sendall(LIVE)
            assert ResponseReader(s).read()[0] == 200
        elif http and k % 3 == 2:
            s.sendall(LIVE[:30])
    return socks


def still_open(socks: list[socket.socket]) -> int:
    """Connections the server has not closed (a FIN or a reset; what it sent
    before, such as grpc's SETTINGS, does not count)."""
    poll = select.poll()
    for s in socks:
        poll.register(s, select.POLLRDHUP)      # POLLHUP and POLLERR come unasked
    return len(socks) - len(poll.poll(0))


def close_all(socks: list[socket.socket]) -> None:
    for s in socks:
        s.close()
    socks.clear()


def test_the_gateway_raises_its_fd_limit_and_caps_its_connections(gateway: Gateway) -> None:
    limits = Path(f"/proc/{gateway.pid}/limits").read_text()
    assert re.search(rf"Max open files\s+{HARD}\s+{HARD}", limits), limits
    assert re.search(rf"torchpool.gateway: open files: soft limit {HARD}", gateway.daemon.log())
    assert gateway.cap("HTTP") == gateway.cap("gRPC") == 384      # (1024 - 256) / 2


def test_a_gateway_of_its_own_raises_its_fd_limit(gateway: Gateway, tmp_path: Path) -> None:
    log_path = tmp_path / "gateway.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-c", _UNDER_LIMITS, str(SOFT), str(HARD), sys.executable,
                                 "-m", "torchpool.gateway", "--url", gateway.daemon.url, "--http-port", "0"],
                                stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        wait_for(lambda: "HTTP endpoint on" in log_path.read_text() or proc.poll() is not None, 30,
                 "the gateway's endpoint")
        text = log_path.read_text()
        assert f"open files: soft limit raised from {SOFT} to the hard limit {HARD}" in text, text
        # HTTP alone: all that is not kept for the rest
        assert f"(at most {HARD - 256} connections)" in text, text
        assert re.search(rf"Max open files\s+{HARD}\s+{HARD}", Path(f"/proc/{proc.pid}/limits").read_text())
    finally:
        proc.terminate()
        assert proc.wait(30) == 0, log_path.read_text()


def test_idle_http_connections_past_the_fd_limit_lock_nobody_out(gateway: Gateway, own_fds: None) -> None:
    busy = httpclient.InferenceServerClient(f"127.0.0.1:{gateway.http_port}", network_timeout=10)
    grpc_before = grpcclient.InferenceServerClient(f"127.0.0.1:{gateway.grpc_port}")
    stop = threading.Event()
    failures: list[BaseException] = []
    served = [0]

    def keep_calling() -> None:     # a caller busy all along keeps its connection
        while not stop.is_set():
            try:
                np.testing.assert_array_equal(gateway.http_infer(busy), X)
                served[0] += 1
            except BaseException as exc:    # noqa: BLE001 (reported below)
                failures.append(exc)
                return

    caller = threading.Thread(target=keep_calling)
    socks: list[socket.socket] = []
    try:
        np.testing.assert_array_equal(gateway.grpc_infer(grpc_before), X)
        caller.start()
        socks = flood(gateway.http_port, FLOOD, http=True)
        # a new HTTP client and a new gRPC one are served at once, beside the flood
        np.testing.assert_array_equal(gateway.http_infer(), X)
        np.testing.assert_array_equal(gateway.grpc_infer(), X)
        np.testing.assert_array_equal(gateway.grpc_infer(grpc_before), X)
        cap = gateway.cap("HTTP")
        assert still_open(socks) <= cap
        # under pressure they go sooner than the idle and header timeouts (300 s, 30 s): down to half the cap
        wait_for(lambda: still_open(socks) <= cap // 2, 20, "the flood to be closed down to half the cap")
        stop.set()
        caller.join()
        assert not failures, failures
        assert served[0] > 0
        gateway.assert_alive()
        # once the flood goes, new connections are served
        close_all(socks)
        for _ in range(3):
            np.testing.assert_array_equal(gateway.http_infer(), X)
            np.testing.assert_array_equal(gateway.grpc_infer(), X)
        gateway.assert_alive()
    finally:
        stop.set()
        if caller.is_alive():
            caller.join()
        close_all(socks)
        busy.close()
        grpc_before.close()


def test_idle_grpc_connections_past_the_cap_are_refused_not_fatal(gateway: Gateway, own_fds: None) -> None:
    before = grpcclient.InferenceServerClient(f"127.0.0.1:{gateway.grpc_port}")
    socks: list[socket.socket] = []
    try:
        np.testing.assert_array_equal(gateway.grpc_infer(before), X)
        socks = flood(gateway.grpc_port, FLOOD, http=False)
        # its connections go on being served, HTTP is untouched, a new gRPC connection is refused
        np.testing.assert_array_equal(gateway.grpc_infer(before), X)
        np.testing.assert_array_equal(gateway.http_infer(), X)
        with pytest.raises(Exception, match="UNAVAILABLE"):
            gateway.grpc_infer()
        gateway.assert_alive()
        # connections that never speak HTTP/2 are closed after grpc's handshake
        # timeout (10 s; grpc's default is 120 s), and then new ones are served
        wait_for(lambda: still_open(socks) == 0, 30, "the gateway to close the silent gRPC connections")
        wait_for(lambda: _grpc_serves(gateway), 10, "a new gRPC connection to be served")
        np.testing.assert_array_equal(gateway.grpc_infer(before), X)
    finally:
        close_all(socks)
        before.close()


def _grpc_serves(gateway: Gateway) -> bool:
    try:
        return bool(np.array_equal(gateway.grpc_infer(), X))
    except Exception:       # refused while the flood's connections are being closed
        return False


# --- the rules, on a gateway in this process with a small cap ---------------------------------

def test_at_the_cap_a_new_connection_takes_the_oldest_idle_ones_place(gateway: Gateway) -> None:
    with InProcessGateway(gateway.daemon.url, max_connections=4, pressure_timeout=60) as gw:
        socks = [connect(gw.port) for _ in range(4)]
        try:
            wait_for(lambda: gw.connections() == 4, 10, "four connections")
            socks[0].sendall(LIVE)                      # no longer idle: now the newest idle one
            assert ResponseReader(socks[0]).read()[0] == 200
            socks[1].sendall(LIVE[:30])                 # its headers begun: now newer than socks[0]
            late = connect(gw.port)
            socks.append(late)
            late.sendall(LIVE)
            assert ResponseReader(late).read()[0] == 200
            assert closed_by_server(socks[2], 10)       # the oldest idle one made room
            late2 = connect(gw.port)
            socks.append(late2)
            late2.sendall(LIVE)
            assert ResponseReader(late2).read()[0] == 200
            assert closed_by_server(socks[3], 10)       # then the next oldest
            assert still_open([socks[0], socks[1], late, late2]) == 4
            assert gw.connections() == 4
            socks[1].sendall(LIVE[30:])                 # the one sending headers was not closed
            assert ResponseReader(socks[1]).read()[0] == 200
        finally:
            close_all(socks)


def test_at_the_cap_with_every_one_holding_a_request_a_new_one_is_refused(gateway: Gateway) -> None:
    with InProcessGateway(gateway.daemon.url, max_connections=2) as gw:
        socks = [connect(gw.port) for _ in range(2)]
        try:
            for s in socks:                             # each with a request in hand, its body to come
                s.sendall(b"POST /v2/repository/index HTTP/1.1\r\nHost: t\r\nContent-Length: 2\r\n\r\n")
            wait_for(lambda: gw.connections() == 2, 10, "two connections")
            with connect(gw.port) as late:
                status, headers, body = ResponseReader(late).read()
                assert status == 503 and headers["connection"] == "close"
                assert error_of(body) == ("the HTTP gateway holds 2 connections, as many as it accepts "
                                          "(--http-max-connections), each with a request in hand: try "
                                          "again later")
                assert closed_by_server(late, 10)
            for s in socks:                             # those it has are served
                s.sendall(b"{}")
                assert ResponseReader(s).read()[0] == 200
        finally:
            close_all(socks)


def test_past_half_the_cap_idle_and_stalled_connections_go_sooner(gateway: Gateway) -> None:
    with InProcessGateway(gateway.daemon.url, max_connections=8, pressure_timeout=0.5) as gw:
        socks = [connect(gw.port) for _ in range(6)]
        try:
            wait_for(lambda: gw.connections() == 6, 10, "six connections")
            socks[0].sendall(b"POST /v2/repository/index HTTP/1.1\r\nHost: t\r\nContent-Length: 2\r\n\r\n")
            socks[1].sendall(LIVE)                      # idle since its answer: newer than the rest
            assert ResponseReader(socks[1]).read()[0] == 200
            socks[2].sendall(LIVE[:30])                 # stalled in its headers
            # down to half the cap (4): the two oldest with no request in hand go
            assert closed_by_server(socks[3], 10) and closed_by_server(socks[4], 10)
            assert still_open([socks[0], socks[1], socks[2], socks[5]]) == 4
            assert gw.connections() == 4
            socks[0].sendall(b"{}")                     # its request in hand all along
            assert ResponseReader(socks[0]).read()[0] == 200
        finally:
            close_all(socks)
