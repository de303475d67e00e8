"""Command line: `torchpool serve | infer | make-example-repo`."""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Optional, Sequence

DEFAULT_LISTEN = "ipc:///tmp/torchpool.sock"
MiB = 1 << 20


def _size(text: str) -> int:
    """A byte size: plain bytes or with a K/M/G suffix."""
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    text = text.strip().lower().rstrip("ib")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


class JsonFormatter(logging.Formatter):
    """One JSON object per line, for log shippers (`--log-format json`)."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {"ts": round(record.created, 6), "level": record.levelname, "logger": record.name,
                 "pid": record.process, "message": record.getMessage()}
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def setup_logging(level: str, fmt: str = "text") -> int:
    """Logs go to stderr: journald captures them under systemd. The text
    format has no timestamp when journald adds its own (JOURNAL_STREAM set)."""
    numeric = getattr(logging, level.upper())
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        stamp = "" if os.environ.get("JOURNAL_STREAM") else "%(asctime)s "
        handler.setFormatter(logging.Formatter(stamp + "%(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(numeric)
    return numeric


def _serve(args: argparse.Namespace) -> int:
    from .broker.frontend import AddressInUse
    from .broker.server import Server, ServerOptions

    level = setup_logging(args.log_level, args.log_format)
    options = ServerOptions(model_repository=args.model_repository,
                            listen=args.listen or [DEFAULT_LISTEN], log_level=level,
                            shm_chunk=args.shm_chunk, shm_limit=args.shm_limit,
                            worker_shm_chunk=args.worker_shm_chunk,
                            grace_period=args.grace_period, busy_poll_us=args.busy_poll_us,
                            worker_busy_poll_us=args.worker_busy_poll_us,
                            client_shm_size=args.client_shm_size, client_lease=args.client_lease,
                            execution_timeout=args.execution_timeout, metrics_port=args.metrics_port,
                            metrics_host=args.metrics_host, log_format=args.log_format,
                            model_control_mode=args.model_control_mode, load_models=args.load_model or [],
                            repository_poll_secs=args.repository_poll_secs)
    try:
        return Server(options).run()
    except AddressInUse as exc:
        logging.getLogger("torchpool").error("%s", exc)
        return 2


def _parse_input(text: str) -> tuple[str, object]:
    import numpy as np

    name, sep, value = text.partition("=")
    if not sep:
        raise SystemExit(f"--input expects NAME=JSON or NAME=JSON:DTYPE, got {text!r}")
    dtype = None
    if ":" in value and value.rsplit(":", 1)[1].isalnum():
        value, dtype = value.rsplit(":", 1)
    data = json.loads(value)
    if dtype is None and isinstance(data, list) and data and all(isinstance(x, str) for x in data):
        return name, data
    from .protocol.datatypes import numpy_dtype
    return name, np.asarray(data, dtype=numpy_dtype(dtype.upper()) if dtype else np.float32)


def _infer(args: argparse.Namespace) -> int:
    from .client import Client
    from .protocol.errors import InferenceError

    inputs = dict(_parse_input(i) for i in args.input)
    with Client(args.url, timeout=args.timeout) as client:
        try:
            result = client.infer(args.model, inputs, outputs=args.output or None, version=args.version)
        except InferenceError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
    for name, value in result.items():
        shown = [v.decode("utf-8", "replace") if isinstance(v, bytes) else v for v in value.reshape(-1).tolist()]
        print(json.dumps({"name": name, "datatype": str(value.dtype), "shape": list(value.shape),
                          "data": shown}))
    return 0


def _make_example_repo(args: argparse.Namespace) -> int:
    from pathlib import Path

    from .examples import build_example_repository

    names = build_example_repository(Path(args.directory))
    print(f"built {len(names)} models in {args.directory}: {', '.join(names)}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="torchpool", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="serve a Triton PyTorch model repository (foreground)")
    serve.add_argument("--model-repository", required=True, help="the repository directory")
    serve.add_argument("--listen", action="append", metavar="URL",
                       help=f"ipc:// or tcp:// address; repeat for several (default {DEFAULT_LISTEN})")
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    serve.add_argument("--log-format", default="text", choices=["text", "json"],
                       help="text (journald-friendly) or json lines for log shippers")
    serve.add_argument("--metrics-port", type=int, default=None,
                       help="serve Prometheus /metrics and /v2/health/{live,ready} on this port")
    serve.add_argument("--metrics-host", default="127.0.0.1")
    serve.add_argument("--model-control-mode", default="none", choices=["none", "poll", "explicit"],
                       help="Triton's: none = load all at start; poll = rescan the repository "
                            "(and on SIGHUP); explicit = load/unload calls from clients")
    serve.add_argument("--load-model", action="append", metavar="NAME",
                       help="explicit mode: load this model at start ('*' = all); repeatable")
    serve.add_argument("--repository-poll-secs", type=float, default=15.0,
                       help="poll mode: seconds between repository scans (default 15)")
    serve.add_argument("--execution-timeout", type=float, default=0.0,
                       help="kill and restart a worker whose batch runs longer (seconds; 0 = never)")
    serve.add_argument("--shm-chunk", type=_size, default=64 * MiB,
                       help="size of each input shared-memory segment (default 64M)")
    serve.add_argument("--shm-limit", type=_size, default=2048 * MiB,
                       help="cap on input shared memory in all (default 2G)")
    serve.add_argument("--worker-shm-chunk", type=_size, default=4 * MiB,
                       help="first output segment of each worker; grows as outputs need (default 4M)")
    serve.add_argument("--grace-period", type=float, default=30.0,
                       help="seconds SIGTERM waits for accepted requests (default 30)")
    serve.add_argument("--busy-poll-us", type=int, default=500,
                       help="after activity, poll without sleeping this long (lower latency on "
                            "VMs where waking a process is slow); 0 disables (default 500)")
    serve.add_argument("--worker-busy-poll-us", type=int, default=0,
                       help="the same for each worker after a batch; trades CPU for latency (default 0)")
    serve.add_argument("--client-shm-size", type=_size, default=64 * MiB,
                       help="arena segment given to each local client (default 64M)")
    serve.add_argument("--client-lease", type=float, default=60.0,
                       help="seconds after which an idle client's session and shared memory are "
                            "released (default 60)")
    serve.set_defaults(func=_serve)

    infer = sub.add_parser("infer", help="send one request and print the outputs as JSON lines")
    infer.add_argument("model")
    infer.add_argument("--url", default=DEFAULT_LISTEN)
    infer.add_argument("--input", action="append", default=[], metavar="NAME=JSON[:DTYPE]",
                       help='e.g. INPUT0="[[1,2,3]]":FP32 or TEXT=\'["a","b"]\'')
    infer.add_argument("--output", action="append", metavar="NAME")
    infer.add_argument("--version")
    infer.add_argument("--timeout", type=float, default=60.0)
    infer.set_defaults(func=_infer)

    example = sub.add_parser("make-example-repo", help="write the example model repository")
    example.add_argument("directory")
    example.set_defaults(func=_make_example_repo)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)
