"""`torchpool perf`: a load generator and latency/throughput profiler, as
Triton's perf_analyzer is for Triton (docs/perf.md).

    cli.py       the options, `add_parser` for the torchpool command, `run`
    session.py   one run: connect, learn the model, try a request, measure, report
    control.py   the run's own requests: live?, metadata, config, a trial, statistics
    inputs.py    the requests' inputs, from the model's metadata or from files
    senders.py   the way requests are sent (-i): torchpool's client over ZeroMQ,
                 or tritonclient over the daemon's gRPC or HTTP gateway
    load.py      closed-loop and open-loop load on threads or on an event loop
    profiler.py  one load level: windows until three agree
    measure.py   percentiles, windows, stability, the server's split of a window
    report.py    the table, perf_analyzer's CSV, JSON, the plot, the progress line

    load threads ──infer──► daemon          main thread: every measurement
        │ (end, latency, late)                interval, drain the recorder and
        ▼                                     diff the daemon's statistics
    Recorder ───────────────────────────────► Window ─► stable? ─► LevelResult
"""
