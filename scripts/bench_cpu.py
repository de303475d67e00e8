"""Where one tiny request's CPU goes: client, broker, worker, beside a raw echo.

    .venv/bin/python scripts/bench_cpu.py [--requests 5000]      (or scripts/bench --only cpu)

Sends `--requests` add/sub requests (2x[1,16] FP32) one at a time and reads
each process's CPU time from /proc/<pid>/task/*/schedstat (nanoseconds on a
CPU, every thread) before and after, so a change shows which process it
moved cost in. The raw ZeroMQ REQ/REP-style echo of the same bytes (a
DEALER/ROUTER pair, no framework) is measured the same way, in the same run.
Figures are per request, in microseconds; this machine is shared and noisy:
compare within one run.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import numpy as np
import zmq

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.support.daemon import descendants  # noqa: E402
from torchpool.client import Client  # noqa: E402
from torchpool.examples import build_example_repository  # noqa: E402


def echo_server(url: str) -> None:
    # bench.py's echo (imported here, not at the top: bench.py imports this module)
    from bench import echo_server as serve

    serve(url)


def cpu_ns(pid: int) -> dict[str, int]:
    """CPU nanoseconds of each thread of `pid`, by thread name (summed per name)."""
    found: dict[str, int] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            ns = int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0])
            name = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
        except (OSError, ValueError):
            continue                        # a thread that ended meanwhile
        key = "main" if tid == str(pid) else name
        found[key] = found.get(key, 0) + ns
    return found


def title(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()


def measure(call, n: int, pids: dict[str, int], latencies: Optional[list] = None) -> dict[str, dict[str, float]]:
    """Run `call` n times; CPU µs per request of each named process, by
    thread. Each call's latency (µs) is appended to `latencies` when given."""
    for _ in range(min(200, n // 10)):
        call()
    clock = time.perf_counter_ns
    took = []
    before = {name: cpu_ns(pid) for name, pid in pids.items()}
    for _ in range(n):
        t0 = clock()
        call()
        took.append(clock() - t0)
    after = {name: cpu_ns(pid) for name, pid in pids.items()}
    if latencies is not None:
        latencies.extend(t / 1000 for t in took)
    out = {}
    for name in pids:
        out[name] = {t: (after[name].get(t, 0) - before[name].get(t, 0)) / n / 1000
                     for t in after[name]}
    return out


WAYS = (("local", True, {}), ("local_timeout", True, {"timeout": 30.0}), ("inline", False, {}))
WAY_TITLES = {"local": "local shared-memory path", "local_timeout": "local, timeout=30 on each call",
              "inline": "inline frames (local=False)", "async": "AsyncClient, one call at a time"}


def measure_async(url: str, inputs: dict, n: int, pids: dict[str, int], latencies: list) -> dict:
    """`measure` for AsyncClient.infer, awaited one at a time in one event loop."""
    import asyncio

    from torchpool.client import AsyncClient

    async def run() -> dict:
        async with AsyncClient(url) as c:
            for _ in range(min(200, n // 10)):
                await c.infer("addsub", inputs, copy=True)
            clock = time.perf_counter_ns
            took = []
            before = {name: cpu_ns(pid) for name, pid in pids.items()}
            for _ in range(n):
                t0 = clock()
                await c.infer("addsub", inputs, copy=True)
                took.append(clock() - t0)
            after = {name: cpu_ns(pid) for name, pid in pids.items()}
        latencies.extend(t / 1000 for t in took)
        return {name: {t: (after[name].get(t, 0) - before[name].get(t, 0)) / n / 1000 for t in after[name]}
                for name in pids}

    return asyncio.run(run())


def bench_echo(work: Path, n: int) -> dict:
    url = f"ipc://{work}/echo.sock"
    proc = mp.get_context("spawn").Process(target=echo_server, args=(url,))
    proc.start()
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(url)
    payload = b"h" * 64 + np.ones(32, np.float32).tobytes()

    def call() -> None:
        sock.send(payload)
        sock.recv(copy=False)

    call()
    took: list[float] = []
    res = measure(call, n, {"client": os.getpid(), "echo": proc.pid}, took)
    res["p50_us"] = statistics.median(took)
    sock.send_multipart([b"quit"])
    sock.close(0)
    proc.join(10)
    return res


def bench_torchpool(work: Path, n: int, options: list[str]) -> dict:
    repo = work / "repo"
    build_example_repository(repo)
    url = f"ipc://{work}/tp.sock"
    args = [sys.executable, "-m", "torchpool", "serve", "--model-repository", str(repo), "--listen", url,
            *options]
    log = open(work / "daemon.log", "wb")
    daemon = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while "torchpool ready" not in (work / "daemon.log").read_text(errors="replace"):
            if daemon.poll() is not None or time.monotonic() > deadline:
                raise SystemExit((work / "daemon.log").read_text())
            time.sleep(0.05)
        worker = next(p for p in descendants(daemon.pid) if "addsub" in title(p))
        a = np.ones((1, 16), np.float32)
        inputs = {"INPUT0": a, "INPUT1": a}
        pids = {"client": os.getpid(), "broker": daemon.pid, "worker": worker}
        out = {}
        # the ways of calling (issue 40): plain, with a per-call timeout, as a
        # client on another host gets it (no shared memory), and asyncio
        for way, local, options in WAYS:
            with Client(url, local=local) as c:
                took: list[float] = []
                res = out[way] = measure(lambda: c.infer("addsub", inputs, copy=True, **options), n, pids, took)
                res["p50_us"] = statistics.median(took)
        took = []
        res = out["async"] = measure_async(url, inputs, n, pids, took)
        res["p50_us"] = statistics.median(took)
        return out
    finally:
        daemon.terminate()
        daemon.wait(60)
        log.close()


# torchpool's configurations: the defaults (a direct path's ends poll for
# up to --direct-spin-us), both ends of a direct path asleep in poll, and the
# broker and workers busy-polling after activity
CONFIGS = (("default", "daemon defaults", []),
           ("no_spin", "--direct-spin-us 0", ["--direct-spin-us", "0"]),
           ("busy_poll_500", "--busy-poll-us 500", ["--busy-poll-us", "500"]))


def bench_cpu(requests: int) -> dict:
    """The echo, and torchpool in each of CONFIGS."""
    with tempfile.TemporaryDirectory(prefix="torchpool-bench-cpu.") as tmp:
        work = Path(tmp)
        out = {"requests": requests, "echo": bench_echo(work, requests)}
        for label, _, options in CONFIGS:
            sub = work / label
            sub.mkdir()
            out[label] = bench_torchpool(sub, requests, options)
    return out


def _block(name: str, res: dict) -> list[str]:
    lines, total = [f"{name}, p50 {res['p50_us']:.0f} µs"], 0.0
    for proc, threads in _procs(res).items():
        s = sum(threads.values())
        total += s
        detail = ", ".join(f"{t} {v:.0f}" for t, v in sorted(threads.items(), key=lambda kv: -kv[1]) if v >= 1)
        lines.append(f"  {proc:<8} {s:7.0f} µs   ({detail})")
    lines.append(f"  {'total':<8} {total:7.0f} µs")
    return lines


def _procs(res: dict) -> dict[str, dict[str, float]]:
    """The per-process entries of a result (not its p50_us)."""
    return {k: v for k, v in res.items() if isinstance(v, dict)}


def _total(res: dict) -> float:
    return sum(sum(t.values()) for t in _procs(res).values())


def render_cpu(r: dict) -> list[str]:
    lines = ["", f"CPU per tiny request, by process and thread (add/sub 2x[1,16] FP32, c=1, ipc, "
                 f"{r['requests']} requests; schedstat)"]
    lines += _block("raw ZeroMQ echo", r["echo"])
    echo = _total(r["echo"])
    for label, title_, _ in CONFIGS:
        if label not in r:               # (a result file from before the configuration existed)
            continue
        for path, res in r[label].items():
            lines += _block(f"torchpool, {title_}, {WAY_TITLES.get(path, path)}"
                            f" ({_total(res) / echo:.1f}x the echo)", res)
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=5000)
    args = parser.parse_args()
    print("\n".join(render_cpu(bench_cpu(args.requests))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
