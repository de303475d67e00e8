"""One `torchpool perf` run: connect, learn the model, make the inputs, try
one request, then measure each load level and report.

The control client (metadata, the trial request, statistics) lives on the
main thread; the load has clients of its own (torchpool/perf/load.py).
"""
from __future__ import annotations

import argparse
from typing import IO, Any, Optional

from ..client import Client
from ..protocol.errors import InferenceError
from .inputs import build_requests, model_inputs, parse_shape
from .load import Recorder, Target, make_load
from .measure import LevelResult
from .profiler import RequestFailed, Settings, measure_level
from .report import (PlotUnavailable, ProgressLine, plot_title, print_results, warning_lines, write_csv,
                     write_json, write_plot)


class ServerError(Exception):
    """The daemon is not there, does not know the model, or failed a request."""


class PerfSession:
    def __init__(self, args: argparse.Namespace, mode: str, connect_timeout: float) -> None:
        self.args, self.mode = args, mode
        self.client_options = {"timeout": args.timeout, "server_key": args.server_key,
                               "client_key": args.client_key}
        self.control = Client(args.url, **self.client_options)
        try:
            self._connect(connect_timeout)
        except BaseException:
            self.control.close()
            raise

    def _connect(self, connect_timeout: float) -> None:
        args = self.args
        shapes = dict(parse_shape(text) for text in args.shape)
        try:
            if not self.control.server_live(timeout=connect_timeout):
                raise ServerError(f"the daemon at {args.url} is not live")
            metadata = self.control.model_metadata(args.model, args.version)
            config = self.control.model_config(args.model, args.version)
        except InferenceError as exc:
            raise ServerError(str(exc)) from None
        self.inputs = model_inputs(args.model, metadata, config)
        self.requests = build_requests(self.inputs, args.batch_size, args.input_data, shapes,
                                       args.string_length)
        try:    # what the daemon refuses is said once, before any load
            self.control.infer(args.model, self.requests[0], version=args.version)
        except InferenceError as exc:
            raise ServerError(f"a trial request failed: {exc}") from None

    def settings(self, levels: list) -> dict:
        a = self.args
        return {
            "model": a.model, "version": a.version or "latest", "batch_size": a.batch_size,
            "url": a.url, "input_data": a.input_data,
            "inputs": {s.name: s.datatype for s in self.inputs.specs},
            "mode": self.mode, "levels": levels,
            "request_distribution": a.request_distribution if self.mode == "request_rate" else None,
            "client": self._client_kind(),
            "measurement_interval_ms": a.measurement_interval,
            "stability_percentage": a.stability_percentage, "max_trials": a.max_trials,
        }

    def _client_kind(self) -> str:
        a = self.args
        return "async" if a.use_async else "threads, shared client" if a.shared_client else "threads"

    def _settings_shown(self, levels: list) -> dict:
        a = self.args
        if self.mode == "concurrency":
            load = f"concurrency {', '.join(f'{x:g}' for x in levels)} (closed loop)"
        else:
            load = (f"request rate {', '.join(f'{x:g}' for x in levels)}/s (open loop, "
                    f"{a.request_distribution}, at most {a.max_threads} outstanding)")
        client = {"async": "one AsyncClient, a task per outstanding request",
                  "threads": "a thread with its own Client per outstanding request",
                  "threads, shared client": "a thread per outstanding request, one Client shared"}
        return {"Model": f"{a.model} (version {a.version or 'latest'}) at {a.url}",
                "Batch size": a.batch_size, "Input data": a.input_data, "Load": load, "Clients": client[self._client_kind()],
                "Measurement window": f"{a.measurement_interval} ms",
                "Stabilizing": f"3 windows within {a.stability_percentage:g}% on throughput and p99 "
                               f"latency, at most {a.max_trials} windows"}

    def run(self, levels: list, out: IO[str], err: IO[str]) -> int:
        a = self.args
        recorder = Recorder()
        target = Target(a.model, a.version, self.requests, a.timeout)
        load = make_load(a.use_async, target, recorder, a.url, self.client_options, a.max_threads,
                         a.request_distribution == "poisson", a.shared_client)
        progress = ProgressLine(err, a.progress or err.isatty())
        settings = Settings(a.measurement_interval / 1000.0, a.stability_percentage, a.max_trials,
                            a.batch_size)
        results: list[LevelResult] = []
        status = 0
        try:
            for level in levels:
                results.append(measure_level(load, recorder, self.mode, level, settings, self._statistics,
                                             progress.update))
        except RequestFailed as exc:
            progress.clear()
            raise ServerError(f"a request failed: {exc}") from None
        except KeyboardInterrupt:
            status = 130                     # report what was measured before the interrupt
        finally:
            progress.clear()
            load.close()
        print_results(out, self._settings_shown(levels), results)
        for line in warning_lines(results, a.stability_percentage):
            print(line, file=err)
        return self._write_files(levels, results, err) or status

    def _write_files(self, levels: list, results: list, err: IO[str]) -> int:
        a = self.args
        try:
            if a.csv:
                write_csv(a.csv, results)
            if a.json:
                write_json(a.json, self.settings(levels), results)
            if a.plot:
                write_plot(a.plot, plot_title(a.model, a.batch_size, self.mode.replace("_", " ")), results)
        except PlotUnavailable as exc:
            print(f"torchpool perf: error: {exc}", file=err)
            return 2
        except OSError as exc:
            print(f"torchpool perf: error: cannot write {exc.filename}: {exc.strerror}", file=err)
            return 1
        return 0

    def _statistics(self) -> Optional[dict]:
        try:
            return self.control.statistics(self.args.model, self.args.version)
        except InferenceError:
            return None                      # no server split, the client's numbers stand

    def close(self) -> None:
        self.control.close()

    def __enter__(self) -> "PerfSession":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
