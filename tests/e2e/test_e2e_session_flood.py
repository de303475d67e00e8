"""A client that says hello on connection after connection cannot lock others out.

Without ROUTER_NOTIFY (libzmq built without drafts, as the pyzmq wheels are)
the daemon learns that a connection closed only when its sessions' leases
end. At --max-sessions the daemon forgets the longest idle session that holds
nothing (never attached, nothing in flight); a session that holds memory is
never taken, and a client whose bare session went says hello again by itself.
"""
from __future__ import annotations

from typing import Iterator

import numpy as np
import pytest
import zmq

from torchpool.client import Client
from torchpool.protocol import errors, messages

from ..support.daemon import Daemon
from ..support.models.basic import write_plus_one

MAX_SESSIONS = 6
PER_CONNECTION = 6                 # also the attached sessions one user may hold


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    root = tmp_path_factory.mktemp("flood_repo")
    write_plus_one(root)
    d = Daemon(root, tmp_path_factory.mktemp("flood"), "--log-level", "info",
               "--max-sessions", str(MAX_SESSIONS), "--max-sessions-per-peer", str(PER_CONNECTION),
               "--client-shm-size", "4M", "--client-lease", "600").start()
    yield d
    assert d.stop() == 0, d.log()
    assert "Traceback" not in d.log(), d.log()


def hello_flood(url: str, connections: int) -> list[dict]:
    """PER_CONNECTION hellos on each of `connections` connections, each closed after."""
    ctx = zmq.Context()
    answers = []
    try:
        for _ in range(connections):
            sock = ctx.socket(zmq.DEALER)
            sock.connect(url)
            for i in range(PER_CONNECTION):
                sock.send(messages.pack({"v": 1, "op": "hello", "id": i, "local": True}))
                assert sock.poll(10000), "the daemon did not answer a hello"
                answers.append(messages.unpack(sock.recv()))
            sock.close(0)
    finally:
        ctx.term()
    return answers


def plus_one(c: Client) -> list[float]:
    return c.infer("plus_one", {"INPUT__0": np.ones(2, np.float32)})["OUTPUT__0"].tolist()


def test_a_hello_flood_does_not_lock_new_clients_out(daemon: Daemon) -> None:
    answers = hello_flood(daemon.url, connections=4 * MAX_SESSIONS // PER_CONNECTION)
    # every hello got a session: the table was full from the third connection on
    assert all(a["ok"] for a in answers), [a for a in answers if not a["ok"]][:1]
    assert "forgetting session" in daemon.log()
    with Client(daemon.url, timeout=30, local=False) as remote, Client(daemon.url, timeout=30) as local:
        assert plus_one(remote) == [2, 2] and plus_one(local) == [2, 2]


def test_a_session_holding_memory_is_never_forgotten(daemon: Daemon) -> None:
    with Client(daemon.url, timeout=30) as local, Client(daemon.url, timeout=30, local=False) as remote:
        assert plus_one(local) == [2, 2] and plus_one(remote) == [2, 2]
        session = local._state.session
        assert session is not None and local._state.arena is not None
        hello_flood(daemon.url, connections=4 * MAX_SESSIONS // PER_CONNECTION)
        assert plus_one(local) == [2, 2] and plus_one(remote) == [2, 2]
        assert local._state.session == session          # kept its session, and its arena


def test_the_limit_holds_when_every_session_holds_memory(daemon: Daemon) -> None:
    clients = [Client(daemon.url, timeout=30) for _ in range(MAX_SESSIONS)]
    try:
        for c in clients:                                # attached: each holds an arena
            assert plus_one(c) == [2, 2]
        ctx = zmq.Context()
        try:
            sock = ctx.socket(zmq.DEALER)
            sock.connect(daemon.url)
            sock.send(messages.pack({"v": 1, "op": "hello", "id": 1, "local": True}))
            assert sock.poll(10000)
            answer = messages.unpack(sock.recv())
            sock.close(0)
        finally:
            ctx.term()
        assert answer["ok"] is False and answer["error"]["code"] == errors.RESOURCE_EXHAUSTED
        assert "--max-sessions" in answer["error"]["message"]
        for c in clients:
            assert plus_one(c) == [2, 2]
    finally:
        for c in clients:
            c.close()
