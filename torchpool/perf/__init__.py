"""`torchpool perf`: a load generator and latency/throughput profiler, as
Triton's perf_analyzer is for Triton (docs/perf.md).

    cli.py       the options, `add_parser` for the torchpool command, `run`
    session.py   one run: connect, learn the model, try a request, measure, report
    inputs.py    the requests' inputs, from the model's metadata or from files
    load.py      closed-loop and open-loop load on threads or on an AsyncClient
    profiler.py  one load level: windows until three agree
    measure.py   percentiles, windows, stability, the server's split of a window
    report.py    the table, perf_analyzer's CSV, JSON, the plot, the progress line

    load threads ──infer──► daemon          main thread: every measurement
        │ (end, latency, late)                interval, drain the recorder and
        ▼                                     diff the daemon's statistics
    Recorder ───────────────────────────────► Window ─► stable? ─► LevelResult
"""
