"""Attack: more idle connections than the daemon has file descriptors (issue 32, item 4).

With `nofile` 1024 (systemd's default soft limit), about 1,000 idle ipc://
connections made libzmq's ipc listener assert ("Too many open files
(src/ipc_listener.cpp:297)") and the broker died of SIGABRT. Now the daemon
raises its soft limit to the hard one at start, and refuses connections past
--max-connections (the limit less a reserve: broker/connections.py) instead of
dying; clients already connected are served, and once connections close new
ones are accepted again.

The daemon runs under a hard limit of 1024 (its soft limit starts lower, to
show it is raised), and a flood of ZeroMQ DEALER sockets (which reconnect at
once when refused) and side-channel connections comes at it.
"""
from __future__ import annotations

import re
import resource
import socket
import sys
from pathlib import Path

import numpy as np
import pytest
import zmq

from torchpool import Client
from torchpool.examples import IDENTITY_CONFIG, Identity, serialize, write_model

from ..support.daemon import Daemon, RawConnection, free_tcp_port, wait_for
from .test_e2e_systemd import unit_settings

SOFT, HARD = 256, 1024
FLOOD = 1100                    # ZeroMQ connections: past the hard limit
SIDE_FLOOD = 200                # side-channel connections that never attach
X = np.arange(4, dtype=np.float32)

# runs the daemon under the limits given (exec: the daemon keeps this pid)
_UNDER_LIMITS = ("import os, resource, sys; "
                 "resource.setrlimit(resource.RLIMIT_NOFILE, (int(sys.argv[1]), int(sys.argv[2]))); "
                 "os.execv(sys.argv[3], sys.argv[3:])")


@pytest.fixture
def own_fds():
    """This process holds the flood's end of every connection (two fds a ZeroMQ socket)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = 3 * FLOOD + SIDE_FLOOD + 256
    if hard != resource.RLIM_INFINITY and hard < need:
        pytest.skip(f"needs {need} open files in the test process (hard limit {hard})")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, need), hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_the_unit_gives_the_daemon_files_for_its_clients() -> None:
    assert int(unit_settings()["LimitNOFILE"][0]) >= 65536


def test_connections_past_the_fd_limit_are_refused_not_fatal(tmp_path: Path, own_fds: None) -> None:
    write_model(tmp_path / "repo", "identity", IDENTITY_CONFIG, serialize(Identity()))
    d = Daemon(tmp_path / "repo", tmp_path, tcp_port=free_tcp_port())
    d.args = [sys.executable, "-c", _UNDER_LIMITS, str(SOFT), str(HARD)] + d.args
    d.start()
    pid = d.pid()
    ctx = zmq.Context()
    ctx.MAX_SOCKETS = FLOOD + 64
    flood: list[zmq.Socket] = []
    side: list[socket.socket] = []
    try:
        assert re.search(rf"open files: soft limit raised from {SOFT} to the hard limit {HARD}", d.log())
        limits = Path(f"/proc/{pid}/limits").read_text()
        assert re.search(rf"Max open files\s+{HARD}\s+{HARD}", limits), limits
        with Client(d.url, timeout=30) as local, Client(d.urls[1], timeout=30) as remote:
            for c in (local, remote):                       # connected before the flood
                np.testing.assert_array_equal(c.infer("identity", {"INPUT__0": X})["OUTPUT__0"], X)
            for _ in range(FLOOD):
                s = ctx.socket(zmq.DEALER)
                s.setsockopt(zmq.LINGER, 0)
                # idle connections, as the issue's: a refused one tries again every 2 s
                # (ZeroMQ's 100 ms default makes a storm of 5,000+ connects a second,
                # faster than a busy broker refuses them: see docs/security.md)
                s.setsockopt(zmq.RECONNECT_IVL, 2000)
                s.connect(d.url)
                flood.append(s)
            for _ in range(SIDE_FLOOD):
                s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                s.setblocking(False)
                try:
                    s.connect(str(d.socket_path) + ".local")
                except BlockingIOError:
                    pass                                    # the backlog is full: refused by the kernel
                side.append(s)
            wait_for(lambda: "refusing new connections" in d.log() or d.proc.poll() is not None, 30,
                     "the daemon to refuse connections")
            assert d.proc.poll() is None, f"the daemon died (status {d.proc.poll()}):\n{d.log()[-3000:]}"
            # the clients connected before are served, over and over, while the flood retries
            for _ in range(20):
                for c in (local, remote):
                    np.testing.assert_array_equal(c.infer("identity", {"INPUT__0": X})["OUTPUT__0"], X)
            # once the flood goes, a new connection is served (a request sent on a
            # refused connection is lost with it: each try is a new connection).
            # Whether one is refused meanwhile is a race with the flood's own
            # retries for the places that free up (side-channel connections that
            # never attach are closed after 10 s): the log showed refusals above.
            for s in flood:
                s.close(linger=0)
            flood.clear()
            assert wait_for(lambda: _server_live(d.url, wait=0.5), 30, "a new connection to be served") is True
            assert d.pid() == pid and d.proc.poll() is None
            assert "Too many open files" not in d.log()
    finally:
        for s in flood:
            s.close(linger=0)
        for s in side:
            s.close()
        ctx.term()
        assert d.stop() == 0, d.log()[-3000:]


def _server_live(url: str, wait: float):
    """server_live's answer on a new connection, or None when none comes within `wait` s."""
    with RawConnection(url) as conn:
        conn.send(RawConnection.pack({"v": 1, "op": "server_live", "id": 1}))
        if not conn.pending(wait):
            return None
        header, _ = conn.recv()
        return header["result"] if header["ok"] else header
