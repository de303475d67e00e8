"""Waiting on a direct path: poll without sleeping while the other end
answers sooner than a window.

A process asleep in poll() is woken by the kernel when its peer sends; on a
VM whose CPUs are idle that wake-up (an interrupt to a halted virtual CPU
that the host must schedule again, a context switch, cold caches) is the
largest cost of a tiny request. Measured on the development VM (2 vCPUs),
two processes answering each other over a unix socket pair: 124 µs p50
and ~71 µs of CPU per side per round trip when both sleep, 12 µs and
~14 µs when both poll without sleeping. On a direct path the client waits
for the worker's answer (the model's run) and the worker for the client's
next request, each wait a few hundred µs at most for a small model:
polling through them halves a tiny request's latency for about the CPU the
wake-ups cost, and keeps both virtual CPUs from halting (on this VM, tiny
requests with both ends asleep showed 16-75% "steal" time, the host's delay
in running a halted CPU again; with both ends polling, 0-12%).

So each end spins (polls without a timeout, yielding the CPU to anything
runnable between polls) for at most `window`, and only while its recent
waits, spinning or asleep, were shorter than the window: a slow model, a
client that sends now and then, or a crowd of clients sharing two CPUs
makes them longer, and the end sleeps at once again. Both ends decide
alike, so both spin or both sleep. (A rule that also weighed waits spent
spinning against waits spent asleep was tried: each end's measure of the
other depends on whether the other spins, and the ends settled asleep in
the minutes when a wake-up was slowest.) The broker decides the window
(`--direct-spin-us`) and tells both ends with the path; 0 turns spinning
off.

The broker waits the same way, with the same window, for a worker running
one of its batches (broker/loop.py `Loop.wait`: remote clients, sequences,
everything the broker schedules): measured on the 2-core VM, a tiny remote
request's p50 went from ~535 to ~470 µs and 8 callers' throughput up ~10%,
for ~90 µs more of the broker's CPU per request at c=1 (its spin through the
worker's run, in place of a wake-up).

The two ends do not gain alike. The client waits for an answer it asked
for: every microsecond of a wake-up is its caller's latency. The worker
waits for a request that may not come: spinning through a client's steady
pace (one request every 400 µs: a wait of ~330 µs) cost the worker 83% of a
core against 26% asleep, to save one wake-up per request. So the worker
spins only while its waits average under half the window (`share`): a
client calling back to back (its turnaround, ~100-200 µs) keeps it
spinning, a paced one does not.
"""
from __future__ import annotations

import os
import time
from typing import Callable, Optional, TypeVar

_now = time.perf_counter_ns
_yield = os.sched_yield

Ready = TypeVar("Ready")         # what a poll found (only its truth counts here)

WORKER_SPIN_SHARE = 0.5      # a worker spins while its waits average under half the window


class SpinWait:
    """One end's wait on its direct path(s): spin, then sleep."""

    __slots__ = ("window_ns", "typical_ns", "share")

    def __init__(self, window_us: int = 0, share: float = 1.0) -> None:
        self.window_ns = max(0, int(window_us)) * 1000
        self.share = share           # spin while recent waits average under share × window
        # recent waits, averaged; a new end starts as if they were long: it spins
        # once they have shown to be short (a crowd of new clients does not spin at once)
        self.typical_ns = self.window_ns

    def widen(self, window_us: int) -> None:
        """A longer window (a worker's first direct path): as for a new end,
        the waits must show to be short before it spins."""
        self.window_ns = max(0, int(window_us)) * 1000
        self.typical_ns = max(self.typical_ns, self.window_ns)

    def spinning(self) -> bool:
        return self.typical_ns < self.window_ns * self.share

    def wait(self, poll: Callable[[Optional[int]], Ready], timeout_ms: Optional[int]) -> Ready:
        """`poll(timeout_ms)` (None: no timeout), after spinning on `poll(0)`
        while that pays; what it found ready."""
        window = self.window_ns
        if not window:
            return poll(timeout_ms)
        start = _now()
        ready: Optional[Ready] = None
        if self.typical_ns < window * self.share:
            end = start + (window if timeout_ms is None else min(window, timeout_ms * 1_000_000))
            while True:
                ready = poll(0)
                if ready or _now() >= end:
                    break
                _yield()
        if not ready:
            ready = poll(timeout_ms)
        assert ready is not None
        # a wait that ends in a timeout counts as long: nothing came
        self.waited(_now() - start)
        return ready

    def waited(self, ns: int) -> None:
        """One wait took `ns` (spinning or asleep): the recent waits' average
        follows it (a wait counts as at most four windows)."""
        self.typical_ns += (min(ns, 4 * self.window_ns) - self.typical_ns) >> 3
