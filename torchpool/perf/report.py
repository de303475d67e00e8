"""What a run reports: the table on stdout, perf_analyzer's CSV, JSON, a
latency-throughput plot, and the progress line on stderr."""
from __future__ import annotations

import csv
import json
from typing import IO, TYPE_CHECKING, Optional, Sequence

from .measure import PERCENTILES, STABLE_WINDOWS, LevelResult, Window

if TYPE_CHECKING:
    from matplotlib.figure import Figure

LEVEL_HEADERS = {"concurrency": "Concurrency", "request_rate": "Request Rate"}
PLOT_PERCENTILES = (50, 99)      # the latencies --plot draws

# perf_analyzer's CSV columns (after the level's); torchpool's client does not
# time its own send and receive apart, so those two are 0 and their time is
# inside "Network+Server Send/Recv" (everything but the server's queue and compute)
CSV_COLUMNS = ("Inferences/Second", "Client Send", "Network+Server Send/Recv", "Server Queue",
               "Server Compute Input", "Server Compute Infer", "Server Compute Output", "Client Recv",
               "p50 latency", "p90 latency", "p95 latency", "p99 latency", "Avg latency")


def _level_text(result: LevelResult) -> str:
    return f"{int(result.level)}" if result.mode == "concurrency" else f"{result.level:g}"


def result_fields(result: LevelResult) -> dict:
    """One level as numbers (latencies in us): what JSON holds and the others show."""
    w = result.window
    server = w.server.per_request_us()
    server_total = sum(server.values())
    return {
        result.mode: result.level,
        "throughput_infer_per_s": round(w.throughput, 2),
        "requests": w.requests,
        "duration_s": round(w.duration_s, 3),
        "latency_us": {**{f"p{p}": w.latency_us(p) for p in PERCENTILES}, "avg": round(w.avg_latency_us, 1)},
        "server_us": {k: round(v, 1) for k, v in server.items()},
        # the rest of a request's time: client library, sockets, the daemon's broker
        "client_and_network_us": round(max(0.0, w.avg_latency_us - server_total), 1),
        "server": {"success_count": w.server.success_count, "inference_count": w.server.inference_count,
                   "execution_count": w.server.execution_count},
        "late_share": round(w.late_share, 4),
        "trials": result.trials,
        "stable": result.stable,
        "status": result.status,
    }


def table(results: Sequence[LevelResult]) -> str:
    """perf_analyzer's numbers as one aligned row per level (us = microseconds)."""
    if not results:
        return ""
    headers = [LEVEL_HEADERS[results[0].mode], "Infer/s", "p50 us", "p90 us", "p95 us", "p99 us", "Avg us",
               "Queue us", "Input us", "Infer us", "Output us", "Requests", "Status"]
    rows = []
    for r in results:
        w, server = r.window, r.window.server.per_request_us()
        rows.append([_level_text(r), f"{w.throughput:.1f}"]
                    + [f"{w.latency_us(p):.0f}" for p in PERCENTILES] + [f"{w.avg_latency_us:.0f}"]
                    + [f"{server[k]:.0f}" for k in ("queue", "compute_input", "compute_infer", "compute_output")]
                    + [str(w.requests), r.status])
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(headers)]
    lines = ["  ".join(cell.rjust(width) for cell, width in zip(line, widths)) for line in [headers] + rows]
    return "\n".join(lines) + "\n"


def write_csv(path: str, results: Sequence[LevelResult]) -> None:
    """perf_analyzer's -f file: one row per level, times in integer us."""
    with open(path, "w", newline="") as f:
        out = csv.writer(f)
        out.writerow([LEVEL_HEADERS[results[0].mode] if results else "Concurrency", *CSV_COLUMNS])
        for r in results:
            fields = result_fields(r)
            lat, server = fields["latency_us"], fields["server_us"]
            out.writerow([_level_text(r), f"{fields['throughput_infer_per_s']:g}", 0,
                          round(fields["client_and_network_us"]),
                          *(round(server[k]) for k in ("queue", "compute_input", "compute_infer", "compute_output")),
                          0, *(round(lat[f"p{p}"]) for p in PERCENTILES), round(lat["avg"])])


def write_json(path: str, settings: dict, results: Sequence[LevelResult]) -> None:
    with open(path, "w") as f:
        json.dump({"settings": settings, "results": [result_fields(r) for r in results]}, f, indent=2)
        f.write("\n")


class PlotUnavailable(Exception):
    pass


PLOT_MISSING = "--plot needs matplotlib: install torchpool[plot] (matplotlib)"


def plot_available() -> bool:
    """matplotlib is importable (checked before measuring, not after)."""
    import importlib.util

    return importlib.util.find_spec("matplotlib") is not None


def write_plot(path: str, title: str, results: Sequence[LevelResult]) -> None:
    """The latency-throughput plot as a PNG file (plot_figure)."""
    plot_figure(title, results).savefig(path, format="png", dpi=100)


def plot_figure(title: str, results: Sequence[LevelResult]) -> "Figure":
    """p50 and p99 latency against throughput, each point labelled with its
    level; a level that did not settle (unstable) or whose load was not
    delivered (behind) is ringed and its label says so, as the table's
    Status column does."""
    try:
        from matplotlib.figure import Figure   # imported here: an optional dependency
    except ImportError:
        raise PlotUnavailable(PLOT_MISSING) from None
    figure = Figure(figsize=(7, 4.5), layout="tight")
    axes = figure.add_subplot()
    x = [r.window.throughput for r in results]
    for p, style in zip(PLOT_PERCENTILES, ("o-", "s--")):
        axes.plot(x, [r.window.latency_us(p) / 1000 for r in results], style, label=f"p{p}")
    for status, color in (("unstable", "tab:red"), ("behind", "tab:purple")):
        flagged = [r for r in results if r.status == status]
        if flagged:
            axes.plot([r.window.throughput for r in flagged for _ in PLOT_PERCENTILES],
                      [r.window.latency_us(p) / 1000 for r in flagged for p in PLOT_PERCENTILES],
                      "o", markersize=13, markerfacecolor="none", markeredgecolor=color, label=status)
    for r, throughput in zip(results, x):
        flag = "" if r.status == "stable" else f" ({r.status})"
        axes.annotate(_level_text(r) + flag, (throughput, r.window.latency_us(99) / 1000),
                      textcoords="offset points", xytext=(4, 4), fontsize=8)
    axes.set_xlabel("throughput (inferences/s)")
    axes.set_ylabel("latency (ms)")
    axes.set_title(title)
    axes.grid(True, alpha=0.3)
    axes.legend()
    return figure


class ProgressLine:
    """One line on stderr, rewritten in place (carriage return) per window."""

    def __init__(self, stream: IO[str], enabled: bool) -> None:
        self.stream, self.enabled = stream, enabled
        self._width = 0

    def update(self, mode: str, level: float, trial: int, window: Window) -> None:
        if not self.enabled:
            return
        name = "concurrency" if mode == "concurrency" else "request rate"
        text = (f"{name} {level:g}: window {trial}: {window.throughput:.1f} infer/s, "
                f"p99 {window.latency_us(99):.0f} us")
        self._write("\r" + text.ljust(self._width))
        self._width = len(text)

    def clear(self) -> None:
        if self.enabled and self._width:
            self._write("\r" + " " * self._width + "\r")
            self._width = 0

    def _write(self, text: str) -> None:
        self.stream.write(text)
        self.stream.flush()


def settings_text(settings: dict) -> str:
    """perf_analyzer's "*** Measurement Settings ***" block."""
    lines = ["*** Measurement Settings ***"]
    lines += [f"  {k}: {v}" for k, v in settings.items()]
    return "\n".join(lines) + "\n\n"


def warning_lines(results: Sequence[LevelResult], stability_percentage: float) -> list[str]:
    """What the reader must know about levels that were not measured cleanly."""
    out = []
    for r in results:
        what = f"{r.mode.replace('_', ' ')} {_level_text(r)}"
        if not r.stable:
            out.append(f"warning: {what}: no {STABLE_WINDOWS} consecutive windows agreed within "
                       f"{stability_percentage:g}% in {r.trials} trials; reported "
                       "as unstable (a longer --measurement-interval helps)")
        if r.behind:
            out.append(f"warning: {what}: {r.window.late_share:.0%} of the requests were sent later than "
                       "one gap (1/rate, at least 1 ms) after their time: the load was not delivered "
                       "at that rate (every sender busy: the server or this client is saturated; "
                       "try more --max-threads or a lower rate)")
    return out


def print_results(out: IO[str], settings: dict, results: Sequence[LevelResult]) -> None:
    out.write(settings_text(settings))
    out.write(table(results))
    out.flush()


def plot_title(model: str, batch: int, extra: Optional[str] = None) -> str:
    return f"{model}, batch {batch}" + (f", {extra}" if extra else "")

