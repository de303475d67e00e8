"""The request lane (protocol/lane.py) against a real daemon: a local sync
client's inference travels on its side channel, and a client that abuses
the lane gets a clear error, or loses its session, without harming the
daemon or anyone else.

Attacks, each on a session attached by hand with `"lane": true`: datagrams
that are not lane requests, cut-short frames, a header that is not msgpack,
a datagram over the size limit, a request naming another session, an
operation the lane does not take, a flood past the in-flight limit, file
descriptors sent along (the daemon must not keep them), and a client that
sends and never reads.
"""
from __future__ import annotations

import os
import signal
import socket
import threading
from pathlib import Path

import numpy as np
import pytest
import zmq

from torchpool import Client
from torchpool.client.local import LocalLink
from torchpool.client.types import NoAnswer
from torchpool.protocol import errors, lane, messages

from ..support.daemon import Daemon, daemon_segments, wait_for
from ..support.models.slow import slow_iterations

A = np.arange(16, dtype=np.float32).reshape(1, 16)
UNREAD = 4
IN_FLIGHT = 8


@pytest.fixture(scope="module")
def lane_daemon(small_repository: Path, tmp_path_factory: pytest.TempPathFactory):
    d = Daemon(small_repository, tmp_path_factory.mktemp("lane"), "--max-unread-replies", str(UNREAD),
               "--max-in-flight-per-client", str(IN_FLIGHT), "--client-shm-size", "4M",
               "--log-level", "debug", "--no-direct-paths").start()   # its plain requests stay on the lane
    yield d
    assert d.stop() == 0, d.log()
    assert "Traceback" not in d.log(), d.log()
    assert not daemon_segments(d.urls), "the daemon left shared memory behind"


class RawLane:
    """A session said hello to over ZeroMQ, attached with a lane, spoken by hand."""

    def __init__(self, url: str) -> None:
        self.ctx = zmq.Context()
        self.dealer = self.ctx.socket(zmq.DEALER)
        self.dealer.connect(url)
        self.dealer.send(messages.pack({"v": 1, "op": "hello", "id": 0, "local": True}))
        assert self.dealer.poll(10000)
        hello = messages.unpack(self.dealer.recv())["result"]
        self.token = hello["session"]
        self.link = LocalLink.attach(hello["local_socket"], self.token, 10, lane=True)
        assert self.link.lane_ok
        self.sock = self.link.sock
        self.sock.settimeout(10)

    def send_raw(self, data: bytes, fds: tuple = (), sock: socket.socket | None = None) -> None:
        """One datagram on the lane (or `sock`), with `fds` if any."""
        sock = sock or self.sock
        if fds:
            socket.send_fds(sock, [data], list(fds))
        else:
            sock.send(data)

    def send(self, header: dict, *payload: bytes, sock: socket.socket | None = None) -> None:
        self.send_raw(b"".join([bytes([lane.LAST]), *lane.encode([messages.pack(header), *payload])]),
                      sock=sock)

    def answer(self, timeout: float = 10) -> dict:
        """The next answer (segments handed over on the way are closed)."""
        self.sock.settimeout(timeout)
        try:
            while True:
                data, fds, _, _ = socket.recv_fds(self.sock, lane.MAX_DATAGRAM + 1, 8)
                for fd in fds:
                    os.close(fd)
                assert data, "the daemon closed the lane"
                if data[0] == lane.LAST:
                    return messages.unpack(lane.decode(memoryview(data)[1:])[0])
        finally:
            self.sock.settimeout(10)

    def infer(self, rid: int, model: str = "addsub", session: str = "") -> dict:
        return {"v": 1, "op": "infer", "id": rid, "model": model, "version": "", "outputs": None,
                "session": session or self.token,
                "inputs": [{"name": n, "datatype": "FP32", "shape": [1, 16], "data": A.tobytes()}
                           for n in ("INPUT0", "INPUT1")]}

    def close(self) -> None:
        self.link.close()
        self.dealer.close(0)
        self.ctx.term()


def served(d: Daemon) -> None:
    """The daemon is up and answers another client correctly."""
    assert d.proc.poll() is None, d.log()
    with Client(d.url, timeout=30) as c:
        out = c.infer("addsub", {"INPUT0": A, "INPUT1": A})
        np.testing.assert_array_equal(out["OUTPUT0"], A + A)


def lane_requests(c: Client) -> int:
    return c.server_metadata()["transfer"].get("requests_on_lane", 0)


def test_a_local_client_sends_its_inference_on_the_lane(lane_daemon: Daemon) -> None:
    with Client(lane_daemon.url, timeout=30) as c:
        before = lane_requests(c)
        for i in range(20):
            x = A + i
            out = c.infer("addsub", {"INPUT0": x, "INPUT1": A})
            np.testing.assert_array_equal(out["OUTPUT0"], x + A)
            np.testing.assert_array_equal(out["OUTPUT1"], x - A)
        big = np.arange(1 << 18, dtype=np.float32)                   # 1 MiB: in the arena, lent back
        out = c.infer("identity", {"INPUT__0": big})["OUTPUT__0"]
        np.testing.assert_array_equal(out, big)
        assert c.is_local and c._state.link.lane is not None
        # each counted on the lane: with direct paths off, the client is offered none
        assert lane_requests(c) - before == 21
        assert not c._state.link.direct_ok
        assert "requests_direct" not in c.server_metadata()["transfer"]


def test_a_request_too_large_for_the_lane_goes_over_zeromq(lane_daemon: Daemon) -> None:
    """An input that finds no room in the arena (4 MiB, held by an `empty()`
    array; the client may not grow it) travels inline: 400 KiB do not fit
    one lane datagram, so the request goes over ZeroMQ, its output inline."""
    x = np.arange(100_000, dtype=np.float32)
    with Client(lane_daemon.url, timeout=30, arena_cap=4 << 20) as c:
        hold = c.empty([1_000_000], "FP32")
        before = lane_requests(c)
        out = c.infer("identity", {"INPUT__0": x})["OUTPUT__0"]
        np.testing.assert_array_equal(out, x)
        assert lane_requests(c) == before
        np.testing.assert_array_equal(c.infer("addsub", {"INPUT0": A, "INPUT1": A})["OUTPUT0"], A + A)
        assert lane_requests(c) == before + 1
        del hold


@pytest.mark.parametrize("data, message", [
    (b"\x07not a lane request", "a lane request is one datagram of at most"),
    (bytes([lane.MORE]) + b"\x00" * 8, "a lane request is one datagram of at most"),
    (bytes([lane.LAST]) + b"\x40\x00\x00\x00abc", "malformed lane request"),
    (bytes([lane.LAST]), "malformed lane request"),
    (bytes([lane.LAST]) + b"".join(lane.encode([b"\xc1\xc1 not msgpack"])), "header"),
    (bytes([lane.LAST]) + b"x" * (lane.MAX_DATAGRAM + 10), "a lane request is one datagram of at most"),
])
def test_what_is_not_a_lane_request_gets_a_clear_error(lane_daemon: Daemon, data: bytes, message: str) -> None:
    raw = RawLane(lane_daemon.url)
    try:
        raw.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 * lane.MAX_DATAGRAM)
        raw.send_raw(data)
        header = raw.answer()
        assert header["ok"] is False and header["error"]["code"] == errors.INVALID_ARG, header
        assert message in header["error"]["message"], header
        raw.send(raw.infer(5))                                  # the lane still serves it
        header = raw.answer()
        assert header["id"] == 5 and header["ok"] is True, header
    finally:
        raw.close()
    served(lane_daemon)


def test_a_lane_runs_only_its_own_sessions_inference(lane_daemon: Daemon) -> None:
    raw, other = RawLane(lane_daemon.url), RawLane(lane_daemon.url)
    try:
        raw.send(raw.infer(1, session=other.token))             # another session's token
        header = raw.answer()
        assert header["error"]["code"] == errors.INVALID_ARG, header
        assert "must name that session" in header["error"]["message"]
        raw.send({"v": 1, "op": "unload", "id": 2, "model": "addsub", "session": raw.token})
        header = raw.answer()
        assert header["id"] == 2 and header["error"]["code"] == errors.UNSUPPORTED, header
        assert "only infer, arena_grow and direct" in header["error"]["message"]
        raw.send({"v": 1, "op": "hello", "id": 3})
        assert raw.answer()["error"]["code"] == errors.UNSUPPORTED
    finally:
        raw.close()
        other.close()
    with Client(lane_daemon.url, timeout=30) as c:
        assert c.model_ready("addsub")                          # nothing was unloaded
    served(lane_daemon)


def test_a_flood_on_the_lane_is_held_to_the_in_flight_limit(lane_daemon: Daemon) -> None:
    """Requests past --max-in-flight-per-client are refused at once, as over ZeroMQ
    (the lane counts against the client's process); the lane serves it again after."""
    raw = RawLane(lane_daemon.url)
    slow = np.array([slow_iterations(0.3)], np.int64)
    try:
        for rid in range(IN_FLIGHT + 4):
            raw.send({"v": 1, "op": "infer", "id": rid, "model": "slow", "version": "", "outputs": None,
                      "session": raw.token, "inputs": [{"name": "INPUT__0", "datatype": "INT64",
                                                        "shape": [1], "data": slow.tobytes()}]})
        answers = [raw.answer(timeout=60) for _ in range(IN_FLIGHT + 4)]
        refused = [a for a in answers if not a["ok"]]
        assert sorted(a["id"] for a in answers) == list(range(IN_FLIGHT + 4))
        assert len(refused) == 4, answers
        for a in refused:
            assert a["error"]["code"] == errors.RESOURCE_EXHAUSTED
            assert "--max-in-flight-per-client" in a["error"]["message"]
        raw.send(raw.infer(100))
        assert raw.answer()["ok"] is True
    finally:
        raw.close()
    served(lane_daemon)


def test_file_descriptors_sent_on_the_lane_are_not_kept(lane_daemon: Daemon) -> None:
    raw = RawLane(lane_daemon.url)
    daemon_fds = f"/proc/{lane_daemon.pid()}/fd"
    try:
        raw.send(raw.infer(1))
        assert raw.answer()["ok"] is True
        before = len(os.listdir(daemon_fds))
        r, w = os.pipe()
        try:
            for rid in range(2, 12):
                raw.send_raw(b"".join([bytes([lane.LAST]), *lane.encode([messages.pack(raw.infer(rid))])]),
                             fds=(r, w))
                assert raw.answer()["id"] == rid
        finally:
            os.close(r)
            os.close(w)
        assert len(os.listdir(daemon_fds)) <= before
    finally:
        raw.close()
    served(lane_daemon)


def test_a_client_that_never_reads_its_lane_loses_its_session(lane_daemon: Daemon) -> None:
    """Large answers it does not read fill its socket; past --max-unread-replies
    more the daemon ends its session (its memory goes back) and closes the lane."""
    raw = RawLane(lane_daemon.url)
    big = {"name": "INPUT__0", "datatype": "FP32", "shape": [12000], "data": np.zeros(12000, np.float32).tobytes()}
    try:
        raw.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sent = 0
        with Client(lane_daemon.url, timeout=30) as other:
            while "does not read its replies" not in lane_daemon.log() and sent < 400:
                try:
                    raw.send({"v": 1, "op": "infer", "id": sent, "model": "identity", "version": "",
                              "outputs": None, "session": raw.token, "inputs": [big]})
                except (BrokenPipeError, ConnectionResetError):
                    break                                       # the daemon closed the lane already
                sent += 1
                if sent % 20 == 0:                               # the others are served meanwhile
                    np.testing.assert_array_equal(
                        other.infer("addsub", {"INPUT0": A, "INPUT1": A})["OUTPUT0"], A + A)
            wait_for(lambda: "ending its session" in lane_daemon.log(), 20, "the daemon to end the session")
        # what was sent before it may be there; then the lane is closed (a reset when
        # the daemon closed it with requests of ours still unread)
        raw.sock.settimeout(20)
        while True:
            try:
                data = raw.sock.recv(lane.MAX_DATAGRAM + 1)
            except ConnectionResetError:
                break
            if not data:
                break
        # and its session goes: at once, or at the next lease sweep (15 s) when it still
        # had requests running (a request naming it meanwhile would keep it)
        wait_for(lambda: f"client session {raw.token[:8]}" in lane_daemon.log(), 40,
                 "the session to be released")
        raw.dealer.send(messages.pack({"v": 1, "op": "get_system_shared_memory_status", "id": "s",
                                       "session": raw.token}))
        assert raw.dealer.poll(10000)
        assert messages.unpack(raw.dealer.recv())["error"]["code"] == errors.SESSION_LOST
    finally:
        raw.close()
    served(lane_daemon)


def test_calls_on_the_lane_fail_at_once_when_the_daemon_dies(small_repository: Path, tmp_path: Path) -> None:
    d = Daemon(small_repository, tmp_path).start()
    try:
        with Client(d.url, timeout=120) as c, Client(d.url, timeout=30, local=False) as observer:
            c.infer("addsub", {"INPUT0": A, "INPUT1": A})
            assert c._state.link.lane is not None
            sent = lane_requests(observer)
            result: dict = {}

            def call() -> None:
                try:
                    c.infer("slow", {"INPUT__0": np.array([slow_iterations(60)], np.int64)})
                except BaseException as exc:         # noqa: BLE001 - handed to the test
                    result["error"] = exc
            t = threading.Thread(target=call)
            t.start()
            wait_for(lambda: lane_requests(observer) == sent + 1, 10, "the request to reach the daemon")
            os.kill(d.pid(), signal.SIGKILL)
            t.join(20)
            assert not t.is_alive(), "the call waited for its timeout"
            err = result["error"]
            assert isinstance(err, NoAnswer) and err.code == errors.UNAVAILABLE, err
    finally:
        d.stop(timeout=10)
