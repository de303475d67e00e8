"""Timing helpers shared by the benchmark sections."""
from __future__ import annotations

import statistics
import time
from typing import Callable


def percentiles(samples: list[float]) -> tuple[float, float]:
    """(median, p99) of the samples, in their unit."""
    s = sorted(samples)
    return statistics.median(s), s[min(len(s) - 1, int(len(s) * 0.99))]


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
