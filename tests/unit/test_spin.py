"""SpinWait (protocol/spin.py): a direct path's ends poll without sleeping
only while what they wait for comes sooner than the window and sooner
than it does asleep, and never longer than the window or the caller's
timeout. Real sockets and poll."""
from __future__ import annotations

import select
import socket
import time

import pytest

from torchpool.protocol.spin import MIN_SAVING_NS, PROBE_EVERY, SpinWait


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
    for _ in range(5):
        assert spin.wait(poll, 1000) == [(a.fileno(), select.POLLIN)]
    assert poll.sleeps == 0 and poll.spins == 5
    assert spin.spun_ns < spin.window_ns


def test_the_rule_spins_only_when_it_saves_a_wake_up() -> None:
    spin = SpinWait(300)
    assert spin.spinning(), "a new end spins: a sleep is taken to cost the window"
    spin.spun_ns, spin.slept_ns = 100_000, 100_000 + MIN_SAVING_NS
    assert spin.spinning()
    spin.slept_ns -= 1
    assert not spin.spinning(), "a wake-up that costs less than MIN_SAVING_NS is not worth a spin"
    spin.spun_ns, spin.slept_ns = 300_000, 900_000
    assert not spin.spinning(), "waits as long as the window: no spin"


def test_one_wait_in_so_many_goes_the_other_way(pair) -> None:
    a, b = pair
    poll, spin = CountingPoll(a), SpinWait(300)
    b.send(b"x")                                   # always there: each wait ends at once
    for _ in range(PROBE_EVERY * 2):
        assert spin.wait(poll, 1000)
    # spinning (the rule), but two waits were probes that slept
    assert (poll.spins, poll.sleeps) == (PROBE_EVERY * 2 - 2, 2)


def test_a_wake_up_that_saves_nothing_stops_the_spinning(pair) -> None:
    a, b = pair
    poll, spin = CountingPoll(a), SpinWait(300)
    b.send(b"x")           # what comes is always there: sleeping waits no longer than spinning
    for _ in range(PROBE_EVERY * 24):
        assert spin.wait(poll, 1000)
    assert not spin.spinning()
    poll.spins = poll.sleeps = 0
    for _ in range(PROBE_EVERY):
        spin.wait(poll, 1000)
    assert (poll.spins, poll.sleeps) == (1, PROBE_EVERY - 1), "it sleeps; one probe spins"
    assert spin.spun_ns < spin.window_ns


def test_waits_longer_than_the_window_stop_the_spinning(pair) -> None:
    a, _ = pair
    poll, spin = CountingPoll(a), SpinWait(200)
    for _ in range(20):                            # nothing comes: each wait spins the window, then times out
        assert spin.wait(poll, 1) == []
    assert spin.spun_ns >= spin.window_ns and not spin.spinning()
    poll.spins = poll.sleeps = 0
    assert spin.wait(poll, 1) == []
    assert (poll.spins, poll.sleeps) == (0, 1), "it slept at once"


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
