"""The broker's loop waits for a worker's answer as a direct path's ends do
(broker/loop.py `Loop.wait`, rules/spin.py): while it expects an answer and
answers have come sooner than the window, it polls without sleeping; when
it expects none (an idle daemon, clients' requests only) every wait may
sleep. Real sockets and a real ZeroMQ poller, which counts its waits that
may sleep; a thread answers each message at once."""
from __future__ import annotations

import socket
import threading
from typing import Optional

import zmq

from torchpool.broker.loop import Loop

ROUND_TRIPS = 50
WINDOW_US = 5_000_000        # longer than any answer takes on a loaded machine: every answer is "soon"


class CountingPoller(zmq.Poller):
    """A real poller; counts its polls that may sleep (a timeout other than 0)."""

    sleeps = 0

    def poll(self, timeout: Optional[float] = None) -> list:  # type: ignore[override]
        if timeout is None or timeout > 0:
            self.sleeps += 1
        return super().poll(timeout)


def echo(sock: socket.socket) -> None:
    """The worker: answers each message at once, until its socket closes."""
    while True:
        data = sock.recv(64)
        if not data:
            return
        sock.send(data)


def round_trips(expecting: bool) -> int:
    """ROUND_TRIPS messages answered through the loop; how many of its waits could sleep."""
    loop = Loop(WINDOW_US)
    poller = loop.poller = CountingPoller()
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    worker = threading.Thread(target=echo, args=(theirs,), daemon=True)
    worker.start()
    answers: list[bytes] = []
    loop.watch(ours.fileno(), lambda: answers.append(ours.recv(64)))
    try:
        for i in range(ROUND_TRIPS):
            ours.send(b"%d" % i)
            while len(answers) <= i:
                loop.wait(10_000, expecting)
        assert answers == [b"%d" % i for i in range(ROUND_TRIPS)]
        return poller.sleeps
    finally:
        ours.shutdown(socket.SHUT_RDWR)
        worker.join(10)
        ours.close()
        theirs.close()


def test_an_expected_answer_is_polled_for_without_sleeping() -> None:
    # the first wait sleeps (a new wait has not shown its answers to be quick); then none
    assert round_trips(expecting=True) <= 1


def test_no_answer_expected_means_every_wait_may_sleep() -> None:
    assert round_trips(expecting=False) >= ROUND_TRIPS


def test_a_spin_window_of_zero_never_spins() -> None:
    loop = Loop(0)
    poller = loop.poller = CountingPoller()
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        loop.watch(a.fileno(), lambda: a.recv(64))
        b.send(b"x")
        assert loop.wait(10_000, expecting=True)
        assert poller.sleeps == 1
    finally:
        a.close()
        b.close()
