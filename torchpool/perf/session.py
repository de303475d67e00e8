"""One `torchpool perf` run: connect, learn the model, make the inputs, try
one request, then measure each load level and report.

The control requests (metadata, the trial request, statistics: control.py)
are made on the main thread; the load has senders of its own (load.py,
senders.py). Both go over the protocol asked for (`-i`).
"""
from __future__ import annotations

import argparse
from typing import IO, Optional

from .control import ServerError, open_control
from .inputs import build_arrays, model_inputs, parse_shape
from .load import Recorder, make_load
from .measure import LevelResult
from .profiler import RequestFailed, Settings, measure_level
from .report import (PlotUnavailable, ProgressLine, plot_title, print_results, warning_lines, write_csv,
                     write_json, write_plot)
from .senders import GRPC, HTTP, ZMQ, Plan, sender_factory

__all__ = ["PerfSession", "ServerError"]

CLIENTS = {   # (protocol, kind): how the settings block names the load's clients
    (ZMQ, "threads"): "a thread with its own Client per outstanding request",
    (ZMQ, "threads, shared client"): "a thread per outstanding request, one Client shared",
    (ZMQ, "async"): "one AsyncClient, a task per outstanding request",
}
PROTOCOL_TEXT = {ZMQ: "zmq (torchpool's client)", GRPC: "grpc (tritonclient.grpc at the gRPC gateway)",
                 HTTP: "http (tritonclient.http at the HTTP gateway, binary tensors)"}


class PerfSession:
    def __init__(self, args: argparse.Namespace, mode: str, connect_timeout: float) -> None:
        self.args, self.mode = args, mode
        self.protocol = args.protocol
        self.control = open_control(args.protocol, args.url, args.timeout, connect_timeout, args.server_key,
                                    args.client_key)
        try:
            self._connect(connect_timeout)
        except BaseException:
            self.control.close()
            raise

    def _connect(self, connect_timeout: float) -> None:
        args = self.args
        shapes = dict(parse_shape(text) for text in args.shape)
        self.control.check_live(connect_timeout)
        metadata = self.control.metadata(args.model, args.version)
        config = self.control.config(args.model, args.version)
        self.inputs = model_inputs(args.model, metadata, config)
        sets = build_arrays(self.inputs, args.batch_size, args.input_data, shapes, args.string_length)
        self.plan = Plan(args.model, args.version, self.inputs, sets, args.request_timeout)
        self.control.trial(self.plan)        # what the server refuses is said once, before any load

    def settings(self, levels: list) -> dict:
        a = self.args
        return {
            "model": a.model, "version": a.version or "latest", "batch_size": a.batch_size,
            "url": a.url, "input_data": a.input_data,
            "inputs": {s.name: s.datatype for s in self.inputs.specs},
            "protocol": self.protocol,
            "mode": self.mode, "levels": levels,
            "request_distribution": a.request_distribution if self.mode == "request_rate" else None,
            "client": self._client_kind(),
            "timeout_s": a.timeout, "request_timeout_s": a.request_timeout,
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
        return {"Model": f"{a.model} (version {a.version or 'latest'}) at {a.url}",
                "Protocol": PROTOCOL_TEXT[self.protocol],
                "Batch size": a.batch_size, "Input data": a.input_data, "Load": load,
                "Clients": self._clients_text(),
                "Timeouts": self._timeouts_text(),
                "Measurement window": f"{a.measurement_interval} ms",
                "Stabilizing": f"3 windows within {a.stability_percentage:g}% on throughput and p99 "
                               f"latency, at most {a.max_trials} windows"}

    def _clients_text(self) -> str:
        kind = self._client_kind()
        if self.protocol == ZMQ:
            return CLIENTS[(ZMQ, kind)]
        module = f"tritonclient.{self.protocol}"
        if kind == "async":
            return f"one {module}.aio client, a task per outstanding request"
        return f"a thread with its own {module} client per outstanding request"

    def _timeouts_text(self) -> str:
        a = self.args
        wait = f"a request may wait {a.timeout:g} s for its answer"
        if a.request_timeout is None:
            return f"none sent with the requests; {wait}"
        sent = f"each request sent with a timeout of {a.request_timeout:g} s"
        if self.protocol == ZMQ:
            return f"{sent}, which is also how long it waits for its answer"
        return f"{sent}; {wait}"

    def run(self, levels: list, out: IO[str], err: IO[str]) -> int:
        a = self.args
        recorder = Recorder()
        make_sender = sender_factory(self.protocol, a.url, a.timeout, self.plan, a.use_async, a.shared_client,
                                     a.server_key, a.client_key)
        # a per-request timeout over ZeroMQ is also that call's wait
        wait_s = max(a.timeout, a.request_timeout or 0.0) if self.protocol == ZMQ else a.timeout
        load = make_load(a.use_async, make_sender, recorder, wait_s, a.max_threads,
                         a.request_distribution == "poisson")
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
        # None: no server split, the client's numbers stand
        return self.control.statistics(self.args.model, self.args.version)

    def close(self) -> None:
        self.control.close()

    def __enter__(self) -> "PerfSession":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
