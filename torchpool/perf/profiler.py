"""Measure one load level after another: windows until three agree.

    for each level:  load.start(level)   (every client has made one request)
                     ┌─ wait one measurement interval (or until a request fails)
                     │  drain the recorder, snapshot the server's statistics
                     │  window = requests completed since the last boundary
                     └─ until the last 3 windows agree, or max trials
                     load.stop(); the level = the last 3 windows merged
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional, Protocol

from .load import OPEN, Recorder
from .measure import (MIN_LATE_NS, STABLE_WINDOWS, LevelResult, Window, is_stable, late_threshold_ns,
                      make_window, merge, server_split)


class Load(Protocol):
    def start(self, mode: str, level: float) -> None: ...

    def stop(self) -> None: ...


class RequestFailed(Exception):
    """A request of the load failed: the run stops and says why."""

    def __init__(self, mode: str, level: float, cause: BaseException) -> None:
        super().__init__(f"{cause} (at {mode.replace('_', ' ')} {level:g})")
        self.cause = cause


@dataclass
class Settings:
    interval_s: float
    stability_percentage: float
    max_trials: int
    batch_size: int


Progress = Callable[[str, float, int, Window], None]
Statistics = Callable[[], Optional[dict]]


def measure_level(load: Load, recorder: Recorder, mode: str, level: float, settings: Settings,
                  statistics: Statistics, progress: Optional[Progress] = None) -> LevelResult:
    """Run `load` at `level` until stable or out of trials; the merged result."""
    windows: list[Window] = []
    carried: list[tuple[int, int, int]] = []
    late_ns = late_threshold_ns(level) if mode == OPEN else MIN_LATE_NS
    load.start(mode, level)                 # returns with the load's clients warmed up
    try:
        recorder.drain()                    # what the previous level left is not this one's
        before = statistics()
        boundary = time.monotonic_ns()
        while True:
            # the failure event doubles as the window's timer: a failed request ends it at once
            if recorder.failed.wait(settings.interval_s):
                assert recorder.error is not None   # Recorder.fail sets it before `failed`
                raise RequestFailed(mode, level, recorder.error)
            done = carried + recorder.drain()
            end = time.monotonic_ns()
            after = statistics()
            # a request that finished after the boundary counts in the next window
            carried = [r for r in done if r[0] >= end]
            inside = [r for r in done if r[0] < end]
            window = make_window((end - boundary) / 1e9, inside, settings.batch_size,
                                 server_split(before, after), late_ns)
            windows.append(window)
            before, boundary = after, end
            if progress is not None:
                progress(mode, level, len(windows), window)
            stable = is_stable(windows, settings.stability_percentage)
            if stable or len(windows) >= settings.max_trials:
                return LevelResult(mode, level, merge(windows[-STABLE_WINDOWS:]), len(windows), stable)
    finally:
        load.stop()
