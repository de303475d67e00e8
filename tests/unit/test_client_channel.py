"""The sync client shared by threads, and why a call got no answer, against
a real ZeroMQ peer that the test drives by hand (a ROUTER that answers when
told, or never): deadlines fire in every thread, replies reach their own
caller, a lost connection or a missing socket fails calls at once."""
from __future__ import annotations

import asyncio
import socket
import threading
import time
from pathlib import Path
from typing import Any, Callable

import msgpack
import pytest
import zmq

from torchpool.client import AsyncClient, Client, NoAnswer
from torchpool.client.watch import ConnectionWatch
from torchpool.gateway.backend import grpc_status_name, http_status
from torchpool.protocol import errors
from torchpool.protocol.errors import InferenceError

from ..support.threads import in_threads

THREADS = 8
SLACK = 1.5      # seconds a deadline may fire late on a loaded 2-core machine


class Peer:
    """A ROUTER bound where a daemon would be: it reads requests and answers
    only what the test tells it to."""

    def __init__(self, url: str) -> None:
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(url)
        self.requests: list[tuple[bytes, dict]] = []

    def take(self, count: int, timeout: float = 10.0) -> list[tuple[bytes, dict]]:
        """Read until `count` requests have arrived in all."""
        deadline = time.monotonic() + timeout
        while len(self.requests) < count:
            remaining = deadline - time.monotonic()
            assert remaining > 0, f"only {len(self.requests)} of {count} requests arrived"
            if self.sock.poll(int(remaining * 1000)):
                frames = self.sock.recv_multipart()
                self.requests.append((frames[0], msgpack.unpackb(frames[1], raw=False)))
        return self.requests

    def answer(self, ident: bytes, header: dict, result: Any) -> None:
        reply = {"v": header.get("v", 1), "id": header["id"], "ok": True, "result": result}
        self.sock.send_multipart([ident, msgpack.packb(reply, use_bin_type=True)])

    def close(self) -> None:
        self.sock.close(linger=0)


@pytest.fixture
def peer_url(tmp_path: Path) -> str:
    return f"ipc://{tmp_path / 'peer.sock'}"


@pytest.fixture
def peer(peer_url: str):
    p = Peer(peer_url)
    yield p
    p.close()


def timed(call: Callable[[], Any]) -> tuple[Any, float]:
    started = time.monotonic()
    try:
        result = call()
    except InferenceError as exc:
        result = exc
    return result, time.monotonic() - started


def test_every_threads_deadline_fires_and_says_deadline_exceeded(peer: Peer, peer_url: str) -> None:
    limits = [0.2 + 0.1 * i for i in range(THREADS)]
    with Client(peer_url, timeout=30, local=False) as c:
        outcomes = in_threads(THREADS, lambda i: timed(lambda: c.server_live(timeout=limits[i])))
        # every request was sent while the others waited: the peer holds all of them
        assert len({h["id"] for _, h in peer.take(THREADS)}) == THREADS
    for limit, (exc, took) in zip(limits, outcomes):
        assert isinstance(exc, NoAnswer), exc
        assert exc.code == errors.DEADLINE_EXCEEDED
        assert exc.message == (f"torchpool at {peer_url} did not answer within {limit:g} s "
                               f"(it is reachable: the request may still run)")
        assert limit <= took < limit + SLACK, (limit, took)


def test_each_reply_reaches_the_thread_that_asked(peer: Peer, peer_url: str) -> None:
    with Client(peer_url, timeout=30, local=False) as c:
        answered = threading.Thread(target=lambda: answer_in_reverse(peer, THREADS))
        answered.start()
        results = in_threads(THREADS, lambda i: c.model_metadata(f"model{i}"))
        answered.join(30)
    assert results == [{"name": f"model{i}"} for i in range(THREADS)]


def answer_in_reverse(peer: Peer, count: int) -> None:
    """Wait for `count` requests, then answer the last one first."""
    for ident, header in reversed(peer.take(count)):
        peer.answer(ident, header, {"name": header["model"]})


def test_a_late_answer_does_not_disturb_the_next_call(peer: Peer, peer_url: str) -> None:
    with Client(peer_url, timeout=1.0, local=False) as c:
        with pytest.raises(NoAnswer) as exc:
            c.model_metadata("late")
        assert exc.value.code == errors.DEADLINE_EXCEEDED
        (ident, late), = peer.take(1)
        peer.answer(ident, late, {"name": "late"})
        answering = threading.Thread(target=lambda: answer_in_reverse(peer, 2))
        answering.start()
        assert c.model_metadata("now") == {"name": "now"}
        answering.join(30)


def test_a_lost_connection_fails_every_waiting_call_at_once(peer: Peer, peer_url: str) -> None:
    with Client(peer_url, timeout=30, local=False) as c:
        closer = threading.Thread(target=lambda: (peer.take(THREADS), peer.close()))
        closer.start()
        outcomes = in_threads(THREADS, lambda i: timed(c.server_live))
        closer.join(30)
    for exc, took in outcomes:
        assert isinstance(exc, NoAnswer) and exc.code == errors.UNAVAILABLE, exc
        assert exc.message == (f"lost the connection to torchpool at {peer_url} before the answer came "
                               f"(did the daemon stop? the request may or may not have run)")
        assert took < 10, took


def test_async_client_lost_connection_and_deadline(peer: Peer, peer_url: str) -> None:
    async def main() -> None:
        async with AsyncClient(peer_url, timeout=30, local=False) as c:
            exc, took = await timed_async(c.server_live(timeout=0.3))
            assert isinstance(exc, NoAnswer) and exc.code == errors.DEADLINE_EXCEEDED, exc
            assert 0.3 <= took < 0.3 + SLACK
            waiting = asyncio.ensure_future(timed_async(c.server_live()))
            await asyncio.get_running_loop().run_in_executor(None, peer.take, 2)
            peer.close()
            exc, took = await waiting
            assert isinstance(exc, NoAnswer) and exc.code == errors.UNAVAILABLE, exc
            assert "lost the connection" in exc.message and took < 10
    asyncio.run(main())


async def timed_async(call: Any) -> tuple[Any, float]:
    started = time.monotonic()
    try:
        result = await call
    except InferenceError as exc:
        result = exc
    return result, time.monotonic() - started


def test_close_cancels_the_calls_other_threads_wait_for(peer: Peer, peer_url: str) -> None:
    c = Client(peer_url, timeout=30, local=False)
    closer = threading.Thread(target=lambda: (peer.take(THREADS), c.close()))
    closer.start()
    outcomes = in_threads(THREADS, lambda i: timed(c.server_live))
    closer.join(30)
    for exc, took in outcomes:
        assert isinstance(exc, InferenceError) and exc.code == errors.CANCELLED, exc
        assert exc.message == "client closed" and took < 10
    with pytest.raises(InferenceError) as again:
        c.server_live()
    assert again.value.code == errors.CANCELLED


def test_a_missing_socket_file_fails_at_once(tmp_path: Path) -> None:
    url = f"ipc://{tmp_path / 'nobody.sock'}"
    expected = (f"no torchpool daemon at {url}: the socket file does not exist "
                f"(is the daemon running? check --listen)")
    with Client(url, timeout=30) as c:
        for call in (c.server_live, lambda: c.infer("addsub", {"X": [b"x"]})):
            exc, took = timed(call)
            assert isinstance(exc, NoAnswer) and exc.code == errors.UNAVAILABLE, exc
            assert exc.message == expected and not exc.sent
            assert took < 1.0, took

    async def main() -> None:
        async with AsyncClient(url, timeout=30) as c:
            exc, took = await timed_async(c.server_live())
            assert isinstance(exc, NoAnswer) and exc.code == errors.UNAVAILABLE, exc
            assert exc.message == expected and took < 1.0
    asyncio.run(main())


def test_a_socket_file_nobody_accepts_on_fails_at_once(tmp_path: Path) -> None:
    """What a daemon killed outright leaves: the file is there, nothing listens."""
    path = tmp_path / "stale.sock"
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(path))           # bound, never listening: connections are refused
    try:
        url = f"ipc://{path}"
        with Client(url, timeout=30) as c:
            exc, took = timed(c.server_live)
        assert isinstance(exc, NoAnswer) and exc.code == errors.UNAVAILABLE, exc
        assert exc.message == (f"no torchpool daemon at {url}: nothing accepts connections on the "
                               f"socket file (a daemon that was killed leaves it behind; is the "
                               f"daemon running? check --listen)")
        assert took < 2.0, took
    finally:
        stale.close()


def assert_answered_once(c: Client, peer: Peer) -> None:
    """One call of `c` answered by `peer` (from another thread)."""
    answering = threading.Thread(target=lambda: answer_in_reverse(peer, 1))
    answering.start()
    assert c.model_metadata("m") == {"name": "m"}
    answering.join(30)


def test_a_daemon_that_starts_later_is_reached(tmp_path: Path) -> None:
    """The check is made at each call, not once: the daemon may come later."""
    url = f"ipc://{tmp_path / 'later.sock'}"
    with Client(url, timeout=30, local=False) as c:
        with pytest.raises(NoAnswer):
            c.server_live()
        peer = Peer(url)
        try:
            assert_answered_once(c, peer)
        finally:
            peer.close()


def test_an_unread_monitor_never_freezes_the_context(tmp_path: Path) -> None:
    """libzmq blocks its I/O thread on a full monitor queue: a client that
    keeps failing to connect, and is not called, must not stop every other
    socket of the context. (Retries every 1 ms here: thousands of events.)"""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.RECONNECT_IVL, 1)
    watch = ConnectionWatch(ctx, sock, f"ipc://{tmp_path / 'nobody.sock'}", False)
    sock.connect(f"ipc://{tmp_path / 'nobody.sock'}")
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    try:
        router.bind(f"ipc://{tmp_path / 'other.sock'}")
        dealer.connect(f"ipc://{tmp_path / 'other.sock'}")
        # Rounds of a growing length until one has piled up over 2,000 failed
        # attempts unread (3 s is ~3,000 on a quiet machine; a loaded one makes
        # fewer): the other sockets must work at the end of each round.
        piled = 0
        for seconds in (3, 6, 12, 24):
            time.sleep(seconds)      # not a synchronisation: time for attempts to pile up
            dealer.send(b"still alive")
            assert router.poll(5000), "the context's I/O thread is blocked"
            router.recv_multipart()
            before = watch.retries
            watch.drain()
            piled = watch.retries - before
            if piled > 2000:
                break
        assert piled > 2000 and not watch.connected, piled
    finally:
        watch.close(sock)
        for s in (router, dealer, sock):
            s.close(linger=0)
        ctx.term()


def test_clients_closed_while_they_retry_do_not_freeze_the_context(tmp_path: Path) -> None:
    """A client closed while its socket keeps retrying a missing daemon: its
    monitor must stop before the monitor's reader closes, or the next event
    blocks libzmq's I/O thread and every later client hangs."""
    for _ in range(50):
        c = Client(f"ipc://{tmp_path / 'nobody.sock'}", local=False)
        with pytest.raises(NoAnswer):
            c.server_live()
        c.close()
    peer = Peer(f"ipc://{tmp_path / 'peer.sock'}")
    try:
        with Client(f"ipc://{tmp_path / 'peer.sock'}", timeout=5, local=False) as c:
            assert_answered_once(c, peer)
    finally:
        peer.close()


def test_gateway_statuses_for_deadline_exceeded() -> None:
    assert http_status(errors.DEADLINE_EXCEEDED) == 504
    assert grpc_status_name(errors.DEADLINE_EXCEEDED) == "DEADLINE_EXCEEDED"
    assert errors.DEADLINE_EXCEEDED in errors.CODES
