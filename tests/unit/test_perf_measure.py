"""torchpool perf's arithmetic: percentiles, windows, stability, merging,
the server split from two statistics answers, ranges, schedules, the table
and the CSV."""
from __future__ import annotations

import csv
import io
import statistics
from pathlib import Path

import pytest

from torchpool.perf.cli import DEFAULT_URL, UsageError, parse_range
from torchpool.perf.load import Schedule
from torchpool.perf.measure import (LevelResult, ServerSplit, Window, is_stable, late_threshold_ns,
                                    make_window, merge, percentile, server_split)
from torchpool.perf.report import CSV_COLUMNS, plot_figure, table, write_csv


def test_percentile_is_nearest_rank() -> None:
    values = list(range(1, 101))                     # 1..100
    assert [percentile(values, p) for p in (50, 90, 95, 99, 100)] == [50, 90, 95, 99, 100]
    assert percentile([7], 99) == 7
    assert percentile([], 50) == 0
    assert percentile([1, 2, 3, 4], 50) == 2 and percentile([1, 2, 3, 4], 51) == 3
    assert percentile([10, 20], 0) == 10


def window(throughput: float, p99_us: float, requests: int = 100) -> Window:
    """A window of `requests` latencies whose p99 (the 99th of 100) is p99_us."""
    latencies = sorted([int(p99_us * 500)] * (requests - 2) + [int(p99_us * 1000)] * 2)
    w = Window(requests / throughput, latencies, 1)
    assert w.throughput == pytest.approx(throughput) and w.latency_us(99) == pytest.approx(p99_us)
    return w


def test_window_numbers() -> None:
    records = [(10, 1000, 0), (20, 3000, 5_000_000), (30, 2000, 0), (40, 4000, 0)]
    w = make_window(0.5, records, batch_size=4)
    assert w.requests == 4 and w.throughput == 32.0     # 4 requests x batch 4 in 0.5 s
    assert w.latencies_ns == [1000, 2000, 3000, 4000]
    assert w.avg_latency_us == 2.5 and w.latency_us(50) == 2.0 and w.latency_us(99) == 4.0
    assert w.late == 1 and w.late_share == 0.25


def test_late_threshold_is_a_gap_and_at_least_a_millisecond() -> None:
    assert late_threshold_ns(100) == 10_000_000
    assert late_threshold_ns(10_000) == 1_000_000
    records = [(1, 1, 5_000_000), (2, 1, 20_000_000)]
    assert make_window(1, records, 1, late_ns=late_threshold_ns(100)).late == 1


def test_stability_needs_three_agreeing_windows() -> None:
    assert not is_stable([window(1000, 500)] * 2, 10)
    assert is_stable([window(1000, 500), window(1050, 520), window(980, 490)], 10)
    # the largest over the smallest is what must stay within the percentage
    assert not is_stable([window(1000, 500), window(1111, 500), window(1000, 500)], 10)
    assert is_stable([window(1000, 500), window(1099, 500), window(1000, 500)], 10)
    # p99 latency counts as much as throughput
    assert not is_stable([window(1000, 500), window(1000, 600), window(1000, 500)], 10)
    # only the last three count
    assert is_stable([window(10, 9000), window(1000, 500), window(1000, 500), window(1000, 500)], 10)
    # a window with no request never agrees
    assert not is_stable([Window(1.0, [], 1)] * 3, 10)


def test_merge_pools_requests_and_adds_durations() -> None:
    a = Window(1.0, [1, 3], 2, late=1, server=ServerSplit(2, 4, 1, {"queue": 10, "compute_input": 0,
                                                                  "compute_infer": 20, "compute_output": 0},
                                                         {"queue": 2, "compute_input": 0,
                                                          "compute_infer": 2, "compute_output": 0}))
    b = Window(0.5, [2], 2, late=0)
    m = merge([a, b])
    assert m.latencies_ns == [1, 2, 3] and m.duration_s == 1.5 and m.late == 1
    assert m.throughput == pytest.approx(3 * 2 / 1.5)
    assert m.server.success_count == 2 and m.server.per_request_us()["compute_infer"] == 0.01


def stats(success: int, queue_ns: int, infer_ns: int, count: int, version: str = "1") -> dict:
    def d(n: int, ns: int) -> dict:
        return {"count": n, "ns": ns}
    return {"name": "m", "version": version, "inference_count": count, "execution_count": count // 2,
            "inference_stats": {"success": d(success, 0), "fail": d(0, 0), "queue": d(success, queue_ns),
                                "compute_input": d(success, 0), "compute_infer": d(success, infer_ns),
                                "compute_output": d(success, 0)}}


def test_server_split_is_the_difference_per_request() -> None:
    before = {"model_stats": [stats(10, 1_000_000, 5_000_000, 10)]}
    after = {"model_stats": [stats(110, 3_000_000, 25_000_000, 110), stats(5, 1, 1, 5, version="2")]}
    split = server_split(before, after)
    assert split.success_count == 100 and split.inference_count == 100 and split.execution_count == 50
    us = split.per_request_us()
    assert us["queue"] == 20.0 and us["compute_infer"] == 200.0 and us["compute_input"] == 0.0
    # a version that appeared in between has no "before": not counted
    assert server_split(None, after).success_count == 0


def test_ranges_as_perf_analyzer_reads_them() -> None:
    assert parse_range("1", "--concurrency-range", True) == [1]
    assert parse_range("1:4", "--concurrency-range", True) == [1, 2, 3, 4]
    assert parse_range("1:8:3", "--concurrency-range", True) == [1, 4, 7]
    assert parse_range("100:300:100", "--request-rate-range", False) == [100.0, 200.0, 300.0]
    assert parse_range("0.5:1.5:0.5", "--request-rate-range", False) == [0.5, 1.0, 1.5]
    # a comma list of levels, each may be a range (issue 26: `--concurrency-range 1,4,8` was refused)
    assert parse_range("1,4,8", "--concurrency-range", True) == [1, 4, 8]
    assert parse_range("1, 2,4:12:4", "--concurrency-range", True) == [1, 2, 4, 8, 12]
    assert parse_range("100,250.5", "--request-rate-range", False) == [100.0, 250.5]
    for bad in ("0", "4:2", "1:2:0", "a", "1:2:3:4", "1.5", "", "-1:2", "1,,4", "1,0", "4,"):
        with pytest.raises(UsageError):
            parse_range(bad, "--concurrency-range", True)
    with pytest.raises(UsageError):
        parse_range("nan", "--request-rate-range", False)


def test_schedules() -> None:
    constant = Schedule(100.0, poisson=False, start_ns=1_000)
    assert [constant.next() for _ in range(4)] == [1_000, 10_001_000, 20_001_000, 30_001_000]
    poisson = Schedule(1000.0, poisson=True, start_ns=0, seed=3)
    times = [poisson.next() for _ in range(20001)]
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert all(g >= 0 for g in gaps) and len(set(gaps)) > 1000
    assert statistics.mean(gaps) == pytest.approx(1_000_000, rel=0.05)     # the rate on average
    assert statistics.stdev(gaps) == pytest.approx(1_000_000, rel=0.1)     # exponential: sd = mean
    again = Schedule(1000.0, poisson=True, start_ns=0, seed=3)
    assert [again.next() for _ in range(5)] == times[:5]                   # seeded: repeatable


def level(mode: str, value: float, stable: bool = True) -> LevelResult:
    w = Window(1.0, [400_000, 500_000, 900_000], 1,
               server=ServerSplit(3, 3, 3, {"queue": 30_000, "compute_input": 3_000, "compute_infer": 60_000,
                                            "compute_output": 6_000},
                                  {"queue": 3, "compute_input": 3, "compute_infer": 3, "compute_output": 3}))
    return LevelResult(mode, value, w, trials=3, stable=stable)


def test_table_and_csv(tmp_path: Path) -> None:
    results = [level("concurrency", 1), level("concurrency", 2, stable=False)]
    lines = table(results).splitlines()
    assert lines[0].split() == ["Concurrency", "Infer/s", "p50", "us", "p90", "us", "p95", "us", "p99", "us",
                                "Avg", "us", "Queue", "us", "Input", "us", "Infer", "us", "Output", "us",
                                "Requests", "Status"]
    assert lines[1].split() == ["1", "3.0", "500", "900", "900", "900", "600", "10", "1", "20", "2", "3",
                                "stable"]
    assert lines[2].split()[0] == "2" and lines[2].split()[-1] == "unstable"

    path = tmp_path / "r.csv"
    write_csv(str(path), results)
    rows = list(csv.reader(io.StringIO(path.read_text())))
    assert rows[0] == ["Concurrency", *CSV_COLUMNS]
    # client and network = the average (600) less the server's queue and compute (33)
    assert rows[1] == ["1", "3", "0", "567", "10", "1", "20", "2", "0", "500", "900", "900", "900", "600"]

    write_csv(str(path), [level("request_rate", 250.0)])
    assert path.read_text().splitlines()[1].startswith("250,")
    assert path.read_text().startswith("Request Rate,Inferences/Second,")


def test_behind_only_in_open_loop() -> None:
    r = level("request_rate", 100.0)
    r.window.late = 1                                  # 1 of 3 late: over 10%
    assert r.behind and r.status == "behind"
    c = level("concurrency", 1)
    c.window.late = 3
    assert not c.behind and c.status == "stable"


def test_plot_rings_unstable_and_behind_levels() -> None:
    pytest.importorskip("matplotlib")
    stable, unstable = level("concurrency", 1), level("concurrency", 2, stable=False)
    axes = plot_figure("addsub", [stable, unstable]).axes[0]
    lines = {line.get_label(): line for line in axes.get_lines()}
    assert set(lines) == {"p50", "p99", "unstable"}
    ring = lines["unstable"]          # around the unstable level's p50 and p99 (ms), not the stable one's
    assert list(ring.get_xdata()) == [3.0, 3.0] and list(ring.get_ydata()) == [0.5, 0.9]
    assert [t.get_text() for t in axes.texts] == ["1", "2 (unstable)"]

    behind = level("request_rate", 100.0)
    behind.window.late = 3
    axes = plot_figure("addsub", [behind]).axes[0]
    assert {line.get_label() for line in axes.get_lines()} == {"p50", "p99", "behind"}
    assert [t.get_text() for t in axes.texts] == ["100 (behind)"]


def test_default_url_is_the_daemons() -> None:
    from torchpool.cli import DEFAULT_LISTEN

    assert DEFAULT_URL == DEFAULT_LISTEN
