"""Measurement windows: what one window saw, when windows agree, and the
server's side of a window from two statistics snapshots.

perf_analyzer's rules, kept: a load level is measured in windows of
`--measurement-interval`; it is reported once the last three windows agree
within `--stability-percentage` (the largest over the smallest, on throughput
and on p99 latency), or after `--max-trials` windows, flagged unstable. What
is reported is the three last windows merged: their requests pooled, their
durations added.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Sequence

STABLE_WINDOWS = 3            # perf_analyzer's stability window
PERCENTILES = (50, 90, 95, 99)
# Open loop: a request sent more than a whole gap (1/rate), and at least 1 ms,
# after its time was late; over 10% late and the client could not keep up.
# (perf_analyzer counts any delay; a Python sender's wake-ups jitter by about
# a millisecond on a busy machine, and Poisson bursts are bunched on purpose.)
MIN_LATE_NS = 1_000_000
LATE_SHARE = 0.1

# Triton's per-request server durations, in the order of perf_analyzer's columns
SERVER_PARTS = ("queue", "compute_input", "compute_infer", "compute_output")


def percentile(ordered: Sequence[int], p: float) -> int:
    """The nearest-rank `p`-th percentile of ascending `ordered` (0 if empty):
    the smallest value with at least p% of the values at or below it."""
    if not ordered:
        return 0
    rank = max(1, math.ceil(p / 100.0 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


@dataclass
class ServerSplit:
    """Server-side counters over a window: Triton statistics differences."""
    success_count: int = 0
    inference_count: int = 0
    execution_count: int = 0
    ns: dict = field(default_factory=lambda: dict.fromkeys(SERVER_PARTS, 0))
    counts: dict = field(default_factory=lambda: dict.fromkeys(SERVER_PARTS, 0))

    def __add__(self, other: "ServerSplit") -> "ServerSplit":
        return ServerSplit(self.success_count + other.success_count,
                           self.inference_count + other.inference_count,
                           self.execution_count + other.execution_count,
                           {k: self.ns[k] + other.ns[k] for k in SERVER_PARTS},
                           {k: self.counts[k] + other.counts[k] for k in SERVER_PARTS})

    def per_request_us(self) -> dict:
        """Average microseconds per request of each part (0 where none ran)."""
        return {k: (self.ns[k] / self.counts[k] / 1000.0 if self.counts[k] else 0.0) for k in SERVER_PARTS}


def server_split(before: Optional[dict], after: Optional[dict]) -> ServerSplit:
    """The difference of two `Client.statistics(model, version)` answers
    (Triton's model statistics: one entry per version, cumulative ns). The
    versions present in both are summed; None (statistics unavailable) is zero."""
    split = ServerSplit()
    if not before or not after:
        return split
    old = {(s["name"], s["version"]): s for s in before.get("model_stats", [])}
    for new in after.get("model_stats", []):
        prev = old.get((new["name"], new["version"]))
        if prev is None:
            continue
        new_stats, prev_stats = new["inference_stats"], prev["inference_stats"]
        split.success_count += new_stats["success"]["count"] - prev_stats["success"]["count"]
        split.inference_count += new["inference_count"] - prev["inference_count"]
        split.execution_count += new["execution_count"] - prev["execution_count"]
        for part in SERVER_PARTS:
            split.ns[part] += new_stats[part]["ns"] - prev_stats[part]["ns"]
            split.counts[part] += new_stats[part]["count"] - prev_stats[part]["count"]
    return split


@dataclass
class Window:
    """The requests completed in one measurement window (or several merged)."""
    duration_s: float
    latencies_ns: list             # ascending
    batch_size: int
    late: int = 0                  # open loop: requests sent late (late_threshold_ns)
    server: ServerSplit = field(default_factory=ServerSplit)

    @property
    def requests(self) -> int:
        return len(self.latencies_ns)

    @property
    def throughput(self) -> float:
        """Inferences per second: requests times the batch size, as perf_analyzer counts."""
        return self.requests * self.batch_size / self.duration_s if self.duration_s > 0 else 0.0

    def latency_us(self, p: float) -> float:
        return percentile(self.latencies_ns, p) / 1000.0

    @property
    def avg_latency_us(self) -> float:
        return sum(self.latencies_ns) / len(self.latencies_ns) / 1000.0 if self.latencies_ns else 0.0

    @property
    def late_share(self) -> float:
        return self.late / self.requests if self.requests else 0.0


def late_threshold_ns(rate: float) -> int:
    """How late an open-loop request at `rate` per second may be sent and still count as on time."""
    return max(MIN_LATE_NS, int(1e9 / rate))


def make_window(duration_s: float, records: Sequence[tuple], batch_size: int,
                server: Optional[ServerSplit] = None, late_ns: int = MIN_LATE_NS) -> Window:
    """A window from (end_ns, latency_ns, sent_late_ns) records; a request sent
    more than `late_ns` after its time counts as late."""
    latencies = sorted(r[1] for r in records)
    late = sum(1 for r in records if r[2] > late_ns)
    return Window(duration_s, latencies, batch_size, late, server or ServerSplit())


def merge(windows: Sequence[Window]) -> Window:
    """Windows pooled into one: requests together, durations and server counters added."""
    server = ServerSplit()
    for w in windows:
        server = server + w.server
    return Window(sum(w.duration_s for w in windows),
                  sorted(x for w in windows for x in w.latencies_ns),
                  windows[0].batch_size, sum(w.late for w in windows), server)


def _agree(values: Sequence[float], percentage: float) -> bool:
    low, high = min(values), max(values)
    return low > 0 and high / low <= 1.0 + percentage / 100.0


def is_stable(windows: Sequence[Window], percentage: float) -> bool:
    """True when the last STABLE_WINDOWS windows agree within `percentage` on
    throughput and on p99 latency (a window with no request never agrees)."""
    if len(windows) < STABLE_WINDOWS:
        return False
    last = windows[-STABLE_WINDOWS:]
    return (_agree([w.throughput for w in last], percentage)
            and _agree([w.latency_us(99) for w in last], percentage))


@dataclass
class LevelResult:
    """One load level as reported: the merged stable (or last) windows."""
    mode: str                     # "concurrency" or "request_rate"
    level: float                  # concurrent requests, or requests per second
    window: Window
    trials: int
    stable: bool

    @property
    def behind(self) -> bool:
        """Open loop only: the client sent too many requests late (could not keep up)."""
        return self.mode == "request_rate" and self.window.late_share > LATE_SHARE

    @property
    def status(self) -> str:
        if self.behind:
            return "behind"
        return "stable" if self.stable else "unstable"
