"""Timing helpers shared by the benchmark sections."""
from __future__ import annotations

import statistics
import time
from typing import Callable


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
