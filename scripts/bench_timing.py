"""Timing helpers shared by the benchmark sections."""
from __future__ import annotations

import statistics
import threading
import time
from typing import Callable, Optional


def percentiles(samples: list[float]) -> tuple[float, float]:
    """(median, p99) of the samples, in their unit."""
    s = sorted(samples)
    return statistics.median(s), s[min(len(s) - 1, int(len(s) * 0.99))]


def time_alternating(a: Callable[[], object], b: Callable[[], object], n: int,
                     warmup: int = 20) -> tuple[tuple[float, float], tuple[float, float]]:
    """((p50, p99) of `a`, (p50, p99) of `b`) over `n` calls of each, made in
    turn (a b, b a, ...) so that drift on a noisy machine hits both alike."""
    for _ in range(warmup):
        a()
        b()
    samples: tuple[list[float], list[float]] = ([], [])
    for i in range(n):
        for which in ((0, 1) if i % 2 == 0 else (1, 0)):
            fn = a if which == 0 else b
            t0 = time.perf_counter()
            fn()
            samples[which].append(time.perf_counter() - t0)
    return percentiles(samples[0]), percentiles(samples[1])


def time_calls(fn: Callable[[], object], n: int, warmup: int = 20) -> tuple[float, float]:
    """(p50, p99) seconds of `n` calls after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return percentiles(samples)


def throughput(make_call, threads: int, seconds: float) -> float:
    """Requests per second with `threads` closed-loop callers."""
    stop = time.monotonic() + seconds
    counts = [0] * threads
    start = threading.Barrier(threads + 1)

    def loop(i: int) -> None:
        call = make_call()
        start.wait()
        n = 0
        while time.monotonic() < stop:
            call()
            n += 1
        counts[i] = n

    workers = [threading.Thread(target=loop, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    t0 = time.monotonic()
    start.wait()
    for w in workers:
        w.join()
    return sum(counts) / (time.monotonic() - t0)


def load_test(make_call, threads: int, seconds: float) -> dict:
    """Closed-loop callers: requests per second and latency percentiles."""
    every, elapsed = closed_loop(make_call, threads, seconds)
    p50, p99 = percentiles(every)
    return {"rps": len(every) / elapsed, "p50": p50, "p99": p99, "requests": len(every)}


def closed_loop(make_call, threads: int, seconds: float, warmup: int = 3) -> tuple[list[float], float]:
    """`threads` closed-loop callers, each making `warmup` untimed calls
    first: the seconds of every timed call, and the window's length. The
    window opens once every caller is warm (a heavy model's warm-up calls
    would otherwise eat it)."""
    stop = [0.0]
    samples: list[list[float]] = [[] for _ in range(threads)]
    start = threading.Barrier(threads + 1, action=lambda: stop.__setitem__(0, time.monotonic() + seconds))

    def loop(i: int) -> None:
        call = make_call()
        for _ in range(warmup):
            call()
        start.wait()
        mine = samples[i]
        while time.monotonic() < stop[0]:
            t0 = time.perf_counter()
            call()
            mine.append(time.perf_counter() - t0)

    elapsed = run_window(loop, threads, seconds, start, stop)
    return [v for s in samples for v in s], elapsed


def run_window(loop: Callable[[int], None], threads: int, seconds: float, start: threading.Barrier,
               stop: list, at_start: Optional[Callable[[], None]] = None) -> float:
    """Run loop(0..threads-1) on threads that meet at `start` (a barrier of
    threads + 1) and call until time.monotonic() passes stop[0], `seconds`
    from now; `at_start` runs once they are started, before the window
    opens. Returns the seconds from the window's opening to the last join."""
    workers = [threading.Thread(target=loop, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    if at_start is not None:
        at_start()
    stop[0] = time.monotonic() + seconds
    start.wait()
    t0 = time.monotonic()
    for w in workers:
        w.join()
    return time.monotonic() - t0
