"""The client commands: `torchpool infer | models | metadata | stats | ps`.

Each is a client of a running daemon (`--url`). Before the first call the
address is tried with a plain connect, so a daemon that is not running is
one line saying so at once, not a ZeroMQ call that waits out its timeout.
An error the server answers is printed as the server wrote it (its code
and message, naming the model and tensor). Exit status: 0 done, 1 the
server answered with an error or could not be reached, 2 bad arguments.
"""
from __future__ import annotations

import argparse
import errno
import json
import os
import socket
import time
from contextlib import contextmanager
from typing import TYPE_CHECKING, Callable, Iterator, Optional, Sequence, Union

from ..broker.usage import PSS_EVERY_S
from .errors import FAILURE, CliError
from .inputs import input_value, output_row, parse_specs
from .preflight import reason
from .urls import check_url, tcp_host_port

from ..client.types import RegionOutput

if TYPE_CHECKING:
    from ..client import Client

CONNECT_TIMEOUT = 5.0
# `ps` asks again this long for the PSS of workers the daemon had not read yet
# (it reads PSS on a thread of its own, at once for a worker asked about first)
PSS_WAIT_S = 3.0


def check_reachable(url: str) -> None:
    """CliError(FAILURE) when nothing listens at `url` (checked as --url first)."""
    check_url("--url", url)
    hint = "is `torchpool serve` running there?"
    address: Union[str, tuple[str, int]]            # a unix socket's path, or (host, port)
    if url.startswith("ipc://"):
        path = url[len("ipc://"):]
        if not os.path.exists(path):
            raise CliError(FAILURE, f"no torchpool daemon at {url}: {path} does not exist ({hint})")
        family, address = socket.AF_UNIX, path
    else:
        host, port = tcp_host_port(url)
        if port is None:
            raise CliError(FAILURE, f"--url {url}: a client needs the port number")
        family, address = socket.AF_INET6 if ":" in host else socket.AF_INET, (host, port)
    try:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.settimeout(CONNECT_TIMEOUT)
            probe.connect(address)
    except socket.timeout:
        raise CliError(FAILURE, f"no torchpool daemon at {url}: no answer to a connect within "
                                f"{CONNECT_TIMEOUT:g} s ({hint})") from None
    except OSError as exc:
        if exc.errno in (errno.ECONNREFUSED, errno.ENOENT):
            raise CliError(FAILURE, f"no torchpool daemon at {url}: {reason(exc)} ({hint})") from None
        raise CliError(FAILURE, f"cannot reach {url}: {reason(exc)}") from None


@contextmanager
def connected(args: argparse.Namespace) -> Iterator[Client]:
    """A Client on --url; the server's errors (and ours) as CliError(FAILURE)."""
    from ..client import Client
    from ..protocol.errors import TorchpoolError

    check_reachable(args.url)
    try:
        client = Client(args.url, timeout=args.timeout, server_key=args.server_key,
                        client_key=args.client_key)
    except (ValueError, OSError) as exc:
        raise CliError(FAILURE, f"--url {args.url}: {exc}") from None
    try:
        with client:
            yield client
    except TorchpoolError as exc:
        raise CliError(FAILURE, str(exc)) from None


def run_infer(args: argparse.Namespace) -> int:
    specs = parse_specs(args.input)           # the syntax, before anything is sent
    with connected(args) as client:
        declared: dict[str, str] = {}
        if any(spec.needs_metadata for spec in specs):
            meta = client.model_metadata(args.model, args.version)
            declared = {t["name"]: t["datatype"] for t in meta.get("inputs", [])}
        inputs = {spec.name: input_value(spec, declared) for spec in specs}
        result = client.infer(args.model, inputs, outputs=args.output or None, version=args.version,
                              copy=True)
        # (the CLI asks for no output into a region, so every value is a tensor)
        rows = [output_row(name, value) for name, value in result.items() if not isinstance(value, RegionOutput)]
    if args.json:       # KServe v2's inference response (model_version only when asked for one)
        response = {"model_name": args.model, **({"model_version": args.version} if args.version else {}),
                    "outputs": rows}
        print(json.dumps(response, indent=2))
        return 0
    for row in rows:
        print(json.dumps(row))
    return 0


def run_models(args: argparse.Namespace) -> int:
    with connected(args) as client:
        index = client.repository_index()
    if args.json:
        print(json.dumps(index, indent=2))
        return 0
    print(table(("MODEL", "VERSION", "STATE", "REASON"),
                [(m["name"], m["version"] or "-", m["state"], m.get("reason", "")) for m in index]))
    return 0


def run_metadata(args: argparse.Namespace) -> int:
    with connected(args) as client:
        meta = client.model_metadata(args.model, args.version)
    if args.json:
        print(json.dumps(meta, indent=2))
        return 0
    versions = ", ".join(meta.get("versions", [])) or "none ready"
    print(f"model {meta['name']} ({meta.get('platform', '')}), versions: {versions}")
    rows = [(kind, t["name"], t["datatype"], json.dumps(t["shape"]))
            for kind, key in (("input", "inputs"), ("output", "outputs")) for t in meta.get(key, [])]
    print(table(("", "NAME", "DATATYPE", "SHAPE"), rows))
    return 0


def run_stats(args: argparse.Namespace) -> int:
    with connected(args) as client:
        stats = client.statistics(args.model, args.version)
    if args.json:
        print(json.dumps(stats, indent=2))
        return 0
    rows = []
    for s in stats.get("model_stats", []):
        inference = s["inference_stats"]
        computed = inference["compute_infer"]["count"]
        compute_ns = sum(inference[k]["ns"] for k in ("compute_input", "compute_infer", "compute_output"))
        rows.append((s["name"], s["version"], inference["success"]["count"], inference["fail"]["count"],
                     s["inference_count"], s["execution_count"],
                     average_us(inference["queue"]["ns"], inference["queue"]["count"]),
                     average_us(compute_ns, computed)))
    print(table(("MODEL", "VERSION", "SUCCESS", "FAIL", "INFERENCES", "EXECUTIONS", "AVG QUEUE",
                 "AVG COMPUTE"), rows))
    return 0


def run_ps(args: argparse.Namespace) -> int:
    with connected(args) as client:
        rows = current_rows(lambda: instance_rows(client.statistics(args.model, args.version)))
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    # GPU memory (NVML's figure per process) only where a worker has one
    gpu = any(r.get("gpu_memory_bytes") is not None for r in rows)
    print(table(("MODEL", "VERSION", "INSTANCE", "PID", "DEVICE", "THREADS", "STATE", "RESTARTS", "UPTIME", "CPU",
                 "PSS") + (("GPU MEM",) if gpu else ()),
                [(r["model"], r["version"], r["name"], r["pid"], r["device"], r.get("threads") or "-", r["state"],
                  r["restarts"],
                  duration(r["uptime_s"]), "-" if r["cpu_s"] is None else f"{r['cpu_s']:.2f} s",
                  size(r["pss_bytes"])) + ((size(r.get("gpu_memory_bytes")),) if gpu else ())
                 for r in rows]))
    return 0


def current_rows(fetch: Callable[[], list[dict]], every: float = PSS_EVERY_S,
                 wait: float = PSS_WAIT_S) -> list[dict]:
    """`fetch()`'s rows once each has a PSS reading at most `every` seconds
    old (from a daemon that gives no age: any reading), or after `wait`.
    The daemon answers a worker's last reading at once and reads it again
    when it is older than `every`: without asking again, `ps` showed the
    reading the previous `ps` had caused, however long ago."""
    deadline = time.monotonic() + wait
    rows = fetch()
    while not all(row["pss_bytes"] is not None and (row.get("pss_age_s") or 0) <= every for row in rows) \
            and time.monotonic() < deadline:
        time.sleep(0.05)
        rows = fetch()
    return rows


def instance_rows(stats: dict) -> list[dict]:
    """Every worker of a statistics answer (its `instances` extension), with
    its model and version, in the answer's order."""
    return [{"model": s["name"], "version": s["version"], **row}
            for s in stats.get("model_stats", []) for row in s.get("instances", [])]


def duration(seconds: float) -> str:
    """An uptime for people: 42s, 12m05s, 3h07m, 2d04h."""
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def size(n: Optional[int]) -> str:
    """Bytes for people, in MiB or GiB; '-' when unknown."""
    if n is None:
        return "-"
    return f"{n / (1 << 30):.2f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.1f} MiB"


def average_us(total_ns: int, count: int) -> str:
    """An average duration for people: '-' when nothing was counted."""
    if not count:
        return "-"
    us = total_ns / count / 1000
    return f"{us / 1000:.2f} ms" if us >= 10_000 else f"{us:.0f} us"


def table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """Left-aligned columns, two spaces apart; no trailing blanks."""
    cells = [[str(c) for c in header]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells)


__all__ = ["average_us", "check_reachable", "duration", "instance_rows", "run_infer", "run_metadata", "run_models",
           "run_ps", "run_stats", "size", "table"]
