"""Per model-version statistics, in Triton's shape.

The broker updates plain integers on its own thread; the statistics call and
the Prometheus collector read them. Durations are cumulative nanoseconds, as
Triton reports them.

With Triton's latency summaries switched on (--metrics-config
summary_latencies=true) each version also keeps the latencies of its recent
requests in bounded windows, read at scrape time for quantiles; with
histogram_latencies=true it counts them into histogram buckets. Both off (the
default), that costs the hot path one `is None` test.
"""
from __future__ import annotations

import time
from bisect import bisect_left
from collections import Counter, deque
from dataclasses import dataclass, field
from itertools import repeat
from typing import Iterable, Optional, Protocol

from .usage import Instance, instance_rows

# Triton's failure reasons, the `reason` label of nv_inference_request_failure:
# refused after it was queued (its timeout passed), cancelled, failed by the
# model or its instance, anything else
REJECTED, CANCELED, BACKEND, OTHER = "REJECTED", "CANCELED", "BACKEND", "OTHER"
FAILURE_REASONS = (REJECTED, CANCELED, BACKEND, OTHER)


@dataclass
class Duration:
    count: int = 0
    ns: int = 0

    def add(self, ns: int, count: int = 1) -> None:
        self.count += count
        self.ns += ns

    def to_json(self) -> dict[str, int]:
        return {"count": self.count, "ns": self.ns}


@dataclass
class BatchStats:
    compute_input: Duration = field(default_factory=Duration)
    compute_infer: Duration = field(default_factory=Duration)
    compute_output: Duration = field(default_factory=Duration)


class LatencyWindow:
    """Latencies (us) observed in about the last `max_age` seconds, for
    quantiles at scrape time: what a prometheus-cpp Summary (Triton's) keeps.
    Like it, the window is `buckets` age buckets, the oldest dropped every
    max_age / buckets seconds; each keeps its newest `cap` samples, so memory
    stays bounded under any load (beyond `cap` samples per bucket the
    quantiles are those of the most recent ones).

    Only the broker thread writes. The scrape thread copies with C-level
    calls (list(), extend), which the GIL does not interleave with appends."""

    __slots__ = ("step", "cap", "buckets", "current", "rotate_at")
    histogram = None                   # (a WindowAndHistogram has one too)

    def __init__(self, max_age: float, now: float, buckets: int = 5, cap: int = 1024) -> None:
        self.step = max_age / buckets
        self.cap = cap
        self.buckets: deque[deque[int]] = deque((deque(maxlen=cap) for _ in range(buckets)), maxlen=buckets)
        self.current: deque[int] = self.buckets[-1]
        self.rotate_at = now + self.step

    def observe(self, us: int, now: float, times: int = 1) -> None:
        """`times` requests took `us` each (a batch's compute time is each of its requests')."""
        if now >= self.rotate_at:
            self._rotate(now)
        if times == 1:
            self.current.append(us)
        else:
            self.current.extend(repeat(us, min(times, self.cap)))

    @property
    def window(self) -> "LatencyWindow":
        return self

    def _rotate(self, now: float) -> None:
        steps = int((now - self.rotate_at) / self.step) + 1
        for _ in range(min(steps, len(self.buckets))):      # (always full: len is its maxlen)
            self.buckets.append(deque(maxlen=self.cap))     # the oldest falls out
        self.current = self.buckets[-1]
        self.rotate_at += steps * self.step

    def samples(self, now: float) -> list[int]:
        """The samples still in the window at `now`: buckets older than
        max_age that no request has rotated out yet are left out."""
        rotate_at = self.rotate_at
        expired = 0 if now < rotate_at else int((now - rotate_at) / self.step) + 1
        buckets = list(self.buckets)
        out: list[int] = []
        for bucket in buckets[min(expired, len(buckets)):]:
            out.extend(bucket)
        return out


class LatencyHistogram:
    """Latencies (us) counted into buckets of fixed upper bounds (a Prometheus
    histogram): unlike a summary's quantiles, buckets add up across versions,
    daemons and hosts. Only the broker thread writes; a scrape copies."""

    __slots__ = ("bounds", "counts", "total_us")
    window = None                      # (a WindowAndHistogram has one too)

    def __init__(self, bounds_us: tuple[int, ...]) -> None:
        self.bounds = bounds_us                  # ascending; the last bucket is +Inf
        self.counts = [0] * (len(bounds_us) + 1)
        self.total_us = 0

    @property
    def histogram(self) -> "LatencyHistogram":
        return self

    def observe(self, us: int, now: float, times: int = 1) -> None:
        self.counts[bisect_left(self.bounds, us)] += times      # the first bound >= us
        self.total_us += us * times


class WindowAndHistogram:
    """A window and a histogram of the same latency."""

    __slots__ = ("window", "histogram")

    def __init__(self, window: LatencyWindow, histogram: LatencyHistogram) -> None:
        self.window, self.histogram = window, histogram

    def observe(self, us: int, now: float, times: int = 1) -> None:
        self.window.observe(us, now, times)
        self.histogram.observe(us, now, times)


class Latency(Protocol):
    """What is kept of one latency: LatencyWindow, LatencyHistogram or WindowAndHistogram."""

    @property
    def window(self) -> Optional[LatencyWindow]: ...
    @property
    def histogram(self) -> Optional[LatencyHistogram]: ...
    def observe(self, us: int, now: float, times: int = 1) -> None: ...


class LatencyWindows:
    """What one version records of each latency Triton summarises beyond its
    counter: a window (summaries), a histogram, or both; each has
    `observe(us, now, times)`, `.window` and `.histogram` (None if not kept)."""

    __slots__ = ("request", "queue", "compute_input", "compute_infer", "compute_output")
    request: Latency
    queue: Latency
    compute_input: Latency
    compute_infer: Latency
    compute_output: Latency

    def __init__(self, max_age: Optional[float], now: float,
                 histogram_bounds: Optional[tuple[int, ...]] = None) -> None:
        for name in self.__slots__:     # (one of the two at least: _new_windows)
            window = LatencyWindow(max_age, now) if max_age is not None else None
            histogram = LatencyHistogram(histogram_bounds) if histogram_bounds is not None else None
            setattr(self, name, WindowAndHistogram(window, histogram) if window and histogram
                    else window or histogram)


# Summaries and histograms are process-wide settings, as in Triton: chosen at
# startup (metrics.configure_metrics), before any model version exists
_window_age: Optional[float] = None
_histogram_bounds: Optional[tuple[int, ...]] = None


def keep_latency_windows(max_age: Optional[float]) -> None:
    """From now on, new VersionStats keep latency windows of `max_age`
    seconds (None: none)."""
    global _window_age
    _window_age = max_age


def keep_latency_histograms(bounds_us: Optional[tuple[int, ...]]) -> None:
    """From now on, new VersionStats count latencies into buckets of these
    upper bounds in us (None: no histograms)."""
    global _histogram_bounds
    _histogram_bounds = bounds_us


def _new_windows() -> Optional[LatencyWindows]:
    if _window_age is None and _histogram_bounds is None:
        return None
    return LatencyWindows(_window_age, time.monotonic(), _histogram_bounds)


@dataclass
class VersionStats:
    success: Duration = field(default_factory=Duration)      # whole request, accept to answer
    fail: Duration = field(default_factory=Duration)
    queue: Duration = field(default_factory=Duration)
    compute_input: Duration = field(default_factory=Duration)
    compute_infer: Duration = field(default_factory=Duration)
    compute_output: Duration = field(default_factory=Duration)
    inference_count: int = 0          # requests' batch items served
    execution_count: int = 0          # model executions (batches)
    last_inference_ms: int = 0
    worker_restarts: int = 0          # of all its instances
    restarts: Counter[str] = field(default_factory=Counter)        # instance name -> its restarts
    loading_since: float = 0.0        # monotonic: when its instances started loading
    load_seconds: Optional[float] = None    # from then until the version was READY
    batches: dict[int, BatchStats] = field(default_factory=dict)
    batch_sizes: Counter[int] = field(default_factory=Counter)
    # failed requests per Triton reason (fail.count is their sum)
    failures: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FAILURE_REASONS, 0))
    windows: Optional[LatencyWindows] = field(default_factory=_new_windows, repr=False, compare=False)

    def count_restart(self, instance: str) -> None:
        """Instance `instance`'s worker died and is being restarted."""
        self.worker_restarts += 1
        self.restarts[instance] += 1

    def record_failure(self, ns: int, reason: str) -> None:
        """A request failed after `ns`, for `reason` (one of FAILURE_REASONS)."""
        self.fail.add(ns)
        self.failures[reason] += 1

    def record_execution(self, batch_size: int, requests: int, input_ns: int, infer_ns: int,
                         output_ns: int, padding: int = 0) -> None:
        """One model execution serving `requests` requests of `batch_size` items
        in all, plus `padding` rows of no request (a sequence batch's empty slots,
        which count in the batch statistics' size as in Triton)."""
        self.execution_count += 1
        self.inference_count += batch_size
        batch_size += padding
        self.last_inference_ms = int(time.time() * 1000)
        # Triton counts compute durations per request; each request of the batch shares them
        self.compute_input.add(input_ns * requests, requests)
        self.compute_infer.add(infer_ns * requests, requests)
        self.compute_output.add(output_ns * requests, requests)
        b = self.batches.get(batch_size)
        if b is None:        # (not setdefault: that would build a BatchStats on every execution)
            b = self.batches[batch_size] = BatchStats()
        b.compute_input.add(input_ns)
        b.compute_infer.add(infer_ns)
        b.compute_output.add(output_ns)
        self.batch_sizes[batch_size] += 1
        windows = self.windows
        if windows is not None:
            now = time.monotonic()
            windows.compute_input.observe(input_ns // 1000, now, requests)
            windows.compute_infer.observe(infer_ns // 1000, now, requests)
            windows.compute_output.observe(output_ns // 1000, now, requests)

    def to_triton(self, name: str, version: int, workers: Iterable[Instance] = ()) -> dict[str, object]:
        """Triton's model_stats entry, and torchpool's extensions: the restarts
        and the version's live `workers` (supervisor.WorkerHandles) as
        `instances` (usage.instance_row)."""
        return {
            "name": name,
            "version": str(version),
            "last_inference": self.last_inference_ms,
            "inference_count": self.inference_count,
            "execution_count": self.execution_count,
            "inference_stats": {
                "success": self.success.to_json(),
                "fail": self.fail.to_json(),
                "queue": self.queue.to_json(),
                "compute_input": self.compute_input.to_json(),
                "compute_infer": self.compute_infer.to_json(),
                "compute_output": self.compute_output.to_json(),
            },
            "batch_stats": [
                {"batch_size": size, "compute_input": b.compute_input.to_json(),
                 "compute_infer": b.compute_infer.to_json(), "compute_output": b.compute_output.to_json()}
                for size, b in sorted(self.batches.items())
            ],
            "worker_restarts": self.worker_restarts,
            "instances": instance_rows(workers, self.restarts),
        }
