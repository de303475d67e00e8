"""The request lane's two ends over a real unix socket pair: the broker's
`Lane` (sending answers, holding what the socket cannot take) and the
client's `LaneSocket` (reading them, with the segments handed over between)."""
from __future__ import annotations

import os
import socket
import threading
from types import SimpleNamespace

import msgpack
import pytest

from torchpool.broker.lane import Lane
from torchpool.broker.loop import Loop
from torchpool.client.lane import LaneSocket
from torchpool.client.local import LocalLink
from torchpool.client.types import NoAnswer
from torchpool.protocol import errors, lane, messages
from torchpool.shm.fdpass import send_with_fds


def test_a_message_survives_encoding_whole_or_in_pieces() -> None:
    small = [b"header", b"", b"x" * 100]
    (gram,) = lane.datagrams(small)
    assert gram[0] == bytes([lane.LAST])
    assert [bytes(f) for f in lane.decode(b"".join(gram)[1:])] == small
    big = [b"h", os.urandom(3 * lane.MAX_DATAGRAM)]
    grams = [b"".join(g) for g in lane.datagrams(big)]
    assert len(grams) == 4 and all(len(g) <= lane.MAX_DATAGRAM for g in grams)
    assert [g[0] for g in grams] == [lane.MORE] * 3 + [lane.LAST]
    assert [bytes(f) for f in lane.decode(b"".join(g[1:] for g in grams))] == big


@pytest.mark.parametrize("body", [b"", b"\x05\x00", b"\x05\x00\x00\x00abc", b"\xff\xff\xff\xff"])
def test_a_cut_message_is_an_error(body: bytes) -> None:
    with pytest.raises(lane.LaneError):
        lane.decode(body)


class Ends:
    """A broker Lane and a client LaneSocket joined by a socket pair."""

    def __init__(self, max_unread: int = 0) -> None:
        self.daemon_end, client_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.daemon_end.setblocking(False)
        client_end.setblocking(False)
        self.loop = Loop()
        self.loop.watch(self.daemon_end.fileno(), lambda: None)
        self.stalled: list = []
        self.gone: list = []
        session = SimpleNamespace(peer=SimpleNamespace(pid=os.getpid()))
        self.lane = Lane(self.daemon_end, session, self.loop, max_unread, self.stalled.append, self.gone.append)
        self.link = LocalLink(client_end, [], lane=True)
        self.late: list = []
        self.client = LaneSocket(self.link, "ipc:///test", self.late.append)
        self.link.lane = self.client

    def requests(self) -> list[dict]:
        """What the client sent, as the broker reads it."""
        out = []
        while True:
            try:
                data = self.daemon_end.recv(lane.MAX_DATAGRAM + 1)
            except BlockingIOError:
                return out
            assert data[0] == lane.LAST
            out.append(messages.unpack(lane.decode(memoryview(data)[1:])[0]))

    def close(self) -> None:
        self.client.close(1)
        self.link.close()
        self.daemon_end.close()


@pytest.fixture
def ends():
    e = Ends()
    yield e
    e.close()


def call_in_thread(ends: Ends, rid: int, timeout: float = 10) -> tuple[threading.Thread, dict]:
    result: dict = {}

    def run() -> None:
        try:
            result["reply"] = ends.client.request([messages.pack({"id": rid})], rid, timeout)
        except BaseException as exc:          # noqa: BLE001 - handed to the test
            result["error"] = exc
    t = threading.Thread(target=run)
    t.start()
    return t, result


def wait_sent(ends: Ends, n: int) -> list[dict]:
    got: list = []
    deadline = 200
    while len(got) < n and deadline:
        got += ends.requests()
        if len(got) < n:
            ends.loop.poll(50)
            deadline -= 1
    return got


def test_answers_large_and_small_reach_their_calls_with_segments_between(ends: Ends) -> None:
    t1, r1 = call_in_thread(ends, 1)
    t2, r2 = call_in_thread(ends, 2)
    assert sorted(h["id"] for h in wait_sent(ends, 2)) == [1, 2]
    # a segment handed over between the pieces of a large answer, as the daemon may
    payload = os.urandom(200_000)
    grams = lane.datagrams([messages.pack({"id": 2, "ok": True}), payload])
    assert len(grams) > 1
    ends.daemon_end.setblocking(True)           # the Lane's own sends never block (MSG_DONTWAIT)
    ends.daemon_end.sendmsg(grams[0])
    fd = os.memfd_create("lane-test")
    send_with_fds(ends.daemon_end, messages.pack({"segments": [{"segment": "seg1", "size": 0}]}), [fd])
    os.close(fd)
    for gram in grams[1:]:
        ends.daemon_end.sendmsg(gram)
    assert ends.lane.send({"id": 1, "ok": True})
    for _ in range(200):          # the socket may be full: what waits goes when it is writable
        if not (t1.is_alive() or t2.is_alive()):
            break
        ends.loop.poll(50)
    t1.join(10)
    t2.join(10)
    assert "reply" in r1, r1
    assert r1["reply"][0] == {"id": 1, "ok": True}
    header, frames = r2["reply"]
    assert header == {"id": 2, "ok": True} and bytes(frames[0]) == payload
    os.close(ends.link.take("seg1"))          # kept by the reader, for the answer that names it


def test_answers_the_socket_cannot_take_wait_and_go_in_order() -> None:
    ends = Ends()
    try:
        ends.daemon_end.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        sent = 0
        while not ends.lane._outbox:
            assert ends.lane.send({"id": sent, "ok": True, "pad": b"p" * 1000})
            sent += 1
        for rid in range(sent, sent + 5):
            assert ends.lane.send({"id": rid, "ok": True, "pad": b"p" * 1000})
        seen = []
        while len(seen) < sent + 5:
            ends.loop.poll(10)             # writable: the lane sends what waits
            while True:
                try:
                    data, fds = ends.link.recv()
                except BlockingIOError:
                    break
                seen.append(messages.unpack(lane.decode(memoryview(data)[1:])[0])["id"])
        assert seen == list(range(sent + 5)) and not ends.lane._outbox
    finally:
        ends.close()


def test_a_client_that_does_not_read_loses_its_lane() -> None:
    ends = Ends(max_unread=3)
    try:
        ends.daemon_end.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        while not ends.lane._outbox:
            assert ends.lane.send({"id": 0, "ok": True, "pad": b"p" * 1000})
        for _ in range(2):
            assert ends.lane.send({"id": 1, "ok": True})
        assert not ends.stalled
        assert not ends.lane.send({"id": 2, "ok": True})     # one more than it may hold
        assert ends.stalled == [ends.lane] and ends.gone == [ends.lane]
        assert ends.lane.closed and not ends.lane._outbox
        assert not ends.lane.send({"id": 3, "ok": True})
    finally:
        ends.close()


def test_calls_in_flight_fail_at_once_when_the_daemon_closes_the_lane(ends: Ends) -> None:
    t, result = call_in_thread(ends, 7, timeout=60)
    assert [h["id"] for h in wait_sent(ends, 1)] == [7]
    ends.daemon_end.close()
    t.join(10)
    assert not t.is_alive()
    err = result["error"]
    assert isinstance(err, NoAnswer) and err.code == errors.UNAVAILABLE and err.sent
    assert "closed this client's local side channel" in str(err)
    assert ends.client.lost
    with pytest.raises(NoAnswer) as later:           # not sent: safe to send elsewhere
        ends.client.request([messages.pack({"id": 8})], 8, 5)
    assert later.value.sent is False


def test_a_request_too_large_for_one_datagram_does_not_fit() -> None:
    assert lane.fits([msgpack.packb({"id": 1}), b"x" * 1000])
    assert not lane.fits([msgpack.packb({"id": 1}), b"x" * lane.MAX_DATAGRAM])


def fill_daemons_queue(ends: Ends) -> int:
    """Send raw datagrams from the client's end until the daemon's end holds no more."""
    ends.link.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    sent = 0
    while True:
        try:
            ends.link.sock.send(b"\x01" + b"".join(lane.encode([messages.pack({"id": -1})])))
        except BlockingIOError:
            return sent
        sent += 1


def test_a_request_waits_for_room_and_reads_answers_meanwhile(ends: Ends) -> None:
    assert fill_daemons_queue(ends) > 0
    t, result = call_in_thread(ends, 1, timeout=20)
    # while its request cannot be sent, an answer that comes is read (here one nobody waits for)
    assert ends.lane.send({"id": 99, "ok": True})
    for _ in range(200):
        if ends.late:
            break
        t.join(0.05)
    assert ends.late == [{"id": 99, "ok": True}] and t.is_alive()
    got: list = []
    for _ in range(200):                      # the daemon reads: the request gets through
        got += ends.requests()
        if got and got[-1] == {"id": 1}:
            break
        t.join(0.05)
    assert got[-1] == {"id": 1} and all(h == {"id": -1} for h in got[:-1])
    assert ends.lane.send({"id": 1, "ok": True})
    t.join(10)
    assert result["reply"][0] == {"id": 1, "ok": True}


def test_a_request_that_never_finds_room_fails_as_not_sent(ends: Ends) -> None:
    fill_daemons_queue(ends)
    with pytest.raises(NoAnswer) as err:
        ends.client.request([messages.pack({"id": 5})], 5, 0.5)
    assert err.value.code == errors.DEADLINE_EXCEEDED and err.value.sent is False
    assert "did not take the request in time" in str(err.value)
