"""SpinWait (rules/spin.py): a direct path's ends poll without sleeping
only while what they wait for comes sooner than the window, and never
longer than the window or the caller's timeout. Real sockets and poll."""
from __future__ import annotations

import select
import socket
import time

import pytest

from torchpool.rules.spin import SpinWait


@pytest.fixture
def pair():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    yield a, b
    a.close()
    b.close()


class CountingPoll:
    """A real poll on one socket that counts the calls that do not sleep."""

    def __init__(self, sock: socket.socket) -> None:
        self.poller = select.poll()
        self.poller.register(sock.fileno(), select.POLLIN)
        self.spins = 0
        self.sleeps = 0

    def __call__(self, timeout_ms):
        if timeout_ms == 0:
            self.spins += 1
        else:
            self.sleeps += 1
        return self.poller.poll(timeout_ms)


def test_no_window_sleeps_at_once(pair) -> None:
    a, b = pair
    poll = CountingPoll(a)
    b.send(b"x")
    assert SpinWait(0).wait(poll, 1000) == [(a.fileno(), select.POLLIN)]
    assert (poll.spins, poll.sleeps) == (0, 1)


def test_what_is_there_is_found_without_sleeping(pair) -> None:
    a, b = pair
    poll, spin = CountingPoll(a), SpinWait(300)
    b.send(b"x")
    assert not spin.spinning(), "a new end spins only once its waits have shown to be short"
    assert spin.wait(poll, 1000) == [(a.fileno(), select.POLLIN)]
    assert (poll.spins, poll.sleeps) == (0, 1)
    for _ in range(5):
        assert spin.wait(poll, 1000) == [(a.fileno(), select.POLLIN)]
    assert poll.sleeps == 1 and poll.spins == 5
    assert spin.spinning()


def test_a_wider_window_waits_for_short_waits_again() -> None:
    spin = SpinWait(0)
    spin.widen(500)
    assert spin.window_ns == 500_000 and not spin.spinning()


def test_long_waits_stop_the_spinning_and_short_ones_bring_it_back(pair) -> None:
    a, b = pair
    poll, spin = CountingPoll(a), SpinWait(200)
    for _ in range(40):                  # nothing comes: each wait spins the window, then times out
        assert spin.wait(poll, 1) == []
    assert not spin.spinning(), "waits longer than the window: spinning stops"
    poll.spins = poll.sleeps = 0
    assert spin.wait(poll, 1) == []
    assert (poll.spins, poll.sleeps) == (0, 1), "it slept at once"
    b.send(b"x")                         # answers come at once again (asleep too): the average falls
    for _ in range(40):
        spin.wait(poll, 1000)
    poll.spins = poll.sleeps = 0
    assert spin.wait(poll, 1000) and (poll.spins, poll.sleeps) == (1, 0), "it spins again"


def test_a_spin_never_outlasts_the_window_or_the_timeout(pair) -> None:
    a, _ = pair
    poll = CountingPoll(a)
    spin = SpinWait(1_000_000)                   # a 1 s window
    start = time.monotonic()
    assert spin.wait(poll, 20) == []             # ... bounded by the 20 ms timeout
    assert time.monotonic() - start < 0.5
    spin = SpinWait(2000)                        # a 2 ms window, no timeout for the sleep
    start = time.monotonic()
    assert spin.wait(poll, 30) == []
    took = time.monotonic() - start
    assert 0.030 <= took < 0.5, took             # spun ≤ 2 ms, then slept the 30 ms
    assert poll.sleeps == 2


def test_a_paced_client_keeps_the_worker_asleep_but_not_the_client(pair) -> None:
    """Requests every 70% of the window: an end with the whole window (the
    client waiting for its answer) spins through them, a worker (half the
    window: it waits for what may not come) sleeps."""
    import threading

    from torchpool.rules.spin import WORKER_SPIN_SHARE

    a, b = pair
    window_us, gap_s, n = 20_000, 0.014, 25
    for share, spins in ((1.0, True), (WORKER_SPIN_SHARE, False)):
        poll, spin = CountingPoll(a), SpinWait(window_us, share=share)

        def pace() -> None:
            for _ in range(n):
                time.sleep(gap_s)          # the client's pace (load, not synchronisation)
                b.send(b"x")

        sender = threading.Thread(target=pace)
        sender.start()
        for _ in range(n):
            assert spin.wait(poll, 5000)
            a.recv(16)
        sender.join()
        assert spin.spinning() is spins, (share, spin.typical_ns)
