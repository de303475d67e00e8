"""Benchmark section: a new gRPC caller beside an offender whose streams are
never read (issue 39, item 1), imported by bench.py (`--only offender`).

The offender is tests/support/grpc_unread_streams.py in a process of its
own: 4 HTTP/2 connections × 100 `ModelStreamInfer` streams × 20 requests of
16 FP32 to `identity`, written without reading an answer. The new caller is
tritonclient.grpc on a connection of its own, a new one for each call
(connect included), one call at a time: first alone, then from the moment
the offender starts until its requests stop being run (the gateway runs
every request of the streams it opened: their small answers fit grpc's
windows). Figures: the caller's p50/p99/max alone and beside the offender,
the ratio of the p99s (the issue's goal: within 3×), the calls made in the
offender's first second apart (its 400 streams open then), and how many
of the offender's requests ran meanwhile.
"""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from bench_timing import percentiles

ROOT = Path(__file__).resolve().parent.parent
X = np.arange(16, dtype=np.float32)
CONNECTIONS, STREAMS, REQUESTS = 4, 100, 20


def _new_caller(port: int) -> Callable[[], Optional[float]]:
    import tritonclient.grpc as grpcclient

    def call() -> Optional[float]:
        t = grpcclient.InferInput("INPUT__0", [16], "FP32")
        t.set_data_from_numpy(X)
        started = time.perf_counter()
        with grpcclient.InferenceServerClient(f"127.0.0.1:{port}",
                                              channel_args=[("grpc.use_local_subchannel_pool", 1)]) as c:
            try:
                out = c.infer("identity", [t], client_timeout=30)
            except grpcclient.InferenceServerException:
                return None
        took = time.perf_counter() - started
        assert out.as_numpy("OUTPUT__0").tolist() == X.tolist()
        return took
    return call


def _ran(http_port: int) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/v2/models/identity/stats", timeout=30) as r:
        return int(json.load(r)["model_stats"][0]["inference_count"])


def bench_offender(daemon_class: type, free_port: Callable[[], int], quick: bool) -> dict:
    from torchpool.examples import build_example_repository

    alone_n = 100 if quick else 300
    with tempfile.TemporaryDirectory(prefix="torchpool-bench-") as tmp:
        work = Path(tmp)
        build_example_repository(work / "repo")
        http_port, grpc_port = free_port(), free_port()
        daemon = daemon_class(work / "repo", [f"ipc://{work}/tp.sock"], work / "daemon.log", http_port, grpc_port)
        try:
            daemon.wait_ready()
            call = _new_caller(grpc_port)
            deadline = time.monotonic() + 30
            while call() is None and time.monotonic() < deadline:
                time.sleep(0.05)        # the gateway binds its ports as the daemon says ready
            alone = [t for t in (call() for _ in range(alone_n)) if t is not None]
            print(f"a new gRPC caller beside {CONNECTIONS} x {STREAMS} unread streams ...", flush=True)
            base = _ran(http_port)
            offender = subprocess.Popen(
                [sys.executable, "-m", "tests.support.grpc_unread_streams", str(grpc_port), str(CONNECTIONS),
                 str(STREAMS), str(REQUESTS), "16"], cwd=ROOT, stdin=subprocess.PIPE)
            started = time.monotonic()
            calls: list[tuple[float, Optional[float], int]] = []     # (when, seconds, offender's run after)
            try:
                last, still = 0, time.monotonic()
                while time.monotonic() - still < 1.0 and time.monotonic() - started < 120:
                    at = time.monotonic() - started
                    took = call()
                    offender_ran = _ran(http_port) - base - len(calls) - 1      # less the new caller's
                    calls.append((at, took, offender_ran))
                    if offender_ran != last:
                        last, still = offender_ran, time.monotonic()
            finally:
                assert offender.stdin is not None
                offender.stdin.close()
                offender.wait(60)
        finally:
            daemon.stop()
    # beside it: the calls made before the last of its requests that ran had run
    beside = [(at, t) for at, t, ran in calls if ran < last or at == 0.0]
    failed = sum(t is None for _, t in beside)
    later = [t for at, t in beside if at >= 1.0 and t is not None]
    return {"alone": percentiles(alone), "beside": percentiles(later) if later else None,
            "beside_max": max(later) if later else None, "beside_n": len(later),
            "first_second": [round(t, 4) for at, t in beside if at < 1.0 and t is not None], "failed": failed,
            "offender_ran": last, "offender_sent": CONNECTIONS * STREAMS * REQUESTS,
            "offender_seconds": max((at for at, _ in beside), default=0.0)}


def render_offender(r: dict, us: Callable[[float], str]) -> list[str]:
    alone, beside = r["alone"], r["beside"]
    lines = ["", f"A new gRPC caller (a connection per call) beside {CONNECTIONS} connections x {STREAMS} "
                 f"streams x {REQUESTS} requests never read ({r['offender_ran']:,} of the offender's "
                 f"{r['offender_sent']:,} run, in {r['offender_seconds']:.1f} s):",
             "| new caller | p50 | p99 | max | calls |", "|---|---|---|---|---|",
             f"| alone | {us(alone[0])} | {us(alone[1])} | | |"]
    if beside is not None:
        lines.append(f"| beside the offender (its 2nd second on) | {us(beside[0])} | {us(beside[1])} "
                     f"| {us(r['beside_max'])} | {r['beside_n']} |")
        lines.append(f"| p99 beside / alone | {beside[1] / alone[1]:.2f}x | | | |")
    first = r["first_second"]
    lines.append(f"calls in the offender's first second (its streams open): "
                 f"{', '.join(us(t) for t in first) or 'none'}; failed calls: {r['failed']}")
    return lines
