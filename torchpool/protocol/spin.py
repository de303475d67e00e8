"""Waiting on a direct path: poll without sleeping while that saves more
than it costs.

A process asleep in poll() is woken by the kernel when its peer sends; on a
VM whose CPUs are idle that wake-up (an interrupt to a halted virtual CPU,
a context switch, cold caches) is the largest cost of a tiny request.
Measured on the development VM (2 vCPUs), two processes answering each
other over a unix socket pair: 124 µs p50 and ~71 µs of CPU per side per
round trip when both sleep, 12 µs and ~14 µs when both poll without
sleeping. On a direct path the client waits for the worker's answer (the
model's run) and the worker for the client's next request, each wait a
few hundred µs at most for a small model: polling through them halves a
tiny request's latency for about the CPU the wake-ups cost. On a busy host
wake-ups are cheap (no CPU is halted) and spinning only burns CPU; on a
host that runs the VM's two CPUs on one physical CPU at times (its "steal"
time), a spin even slows the other end down.

So each end spins (polls without a timeout, yielding the CPU to anything
runnable between polls) for at most `window`, and only while both of these
hold, each an average of its recent waits:
- waits are shorter than the window: a slow model, a client that sends now
  and then, or a crowd of clients sharing two CPUs makes them longer;
- waits spent spinning are shorter than waits spent asleep by at least
  MIN_SAVING_NS: what a spin saves is the wake-up, and a wake-up that costs
  little is not worth a spin's CPU (measured on the development VM: at
  30-60% steal, waits spent spinning were the longer ones).
One wait in PROBE_EVERY goes the other way, to keep both averages current.
The broker decides the window (`--direct-spin-us`) and tells both ends
with the path; 0 turns spinning off.
"""
from __future__ import annotations

import os
import time
from typing import Callable, Optional

_now = time.perf_counter_ns
_yield = os.sched_yield

PROBE_EVERY = 32            # one wait in so many spins when the rule says sleep, or sleeps when it says spin
MIN_SAVING_NS = 25_000      # what spinning must save against sleeping, per wait


class SpinWait:
    """One end's wait on its direct path(s): spin, then sleep."""

    __slots__ = ("window_ns", "spun_ns", "slept_ns", "waits")

    def __init__(self, window_us: int = 0) -> None:
        self.window_ns = max(0, int(window_us)) * 1000
        # recent waits, averaged: spinning, and asleep (at first taken to be
        # as long as the window, so that an end starts spinning)
        self.spun_ns = 0
        self.slept_ns = self.window_ns
        self.waits = 0

    def spinning(self) -> bool:
        """Does the rule say spin (probes aside)?"""
        return self.spun_ns < self.window_ns and self.slept_ns - self.spun_ns >= MIN_SAVING_NS

    def wait(self, poll: Callable[[Optional[int]], list], timeout_ms: Optional[int]) -> list:
        """`poll(timeout_ms)` (None: no timeout), after spinning on `poll(0)`
        when that pays; what it found ready."""
        window = self.window_ns
        if not window:
            return poll(timeout_ms)
        self.waits += 1
        spin = self.spinning()
        if self.waits % PROBE_EVERY == 0:
            spin = not spin
        start = _now()
        ready = None
        if spin:
            end = start + (window if timeout_ms is None else min(window, timeout_ms * 1_000_000))
            while True:
                ready = poll(0)
                if ready or _now() >= end:
                    break
                _yield()
        if not ready:
            ready = poll(timeout_ms)
        # a wait that ends in a timeout counts as long: nothing came
        waited = min(_now() - start, 4 * window)
        if spin:
            self.spun_ns += (waited - self.spun_ns) >> 3
        else:
            self.slept_ns += (waited - self.slept_ns) >> 3
        return ready
