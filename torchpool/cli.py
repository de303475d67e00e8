"""Command line: `torchpool serve | infer | keygen | make-example-repo`."""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from typing import Any, Optional, Sequence

from .broker.options import ServerOptions
from .logs import FORMATS, setup_logging

DEFAULT_LISTEN = "ipc:///tmp/torchpool.sock"
_OPTION_FIELDS = {f.name: f for f in dataclasses.fields(ServerOptions)}


def _default(name: str) -> Any:
    """The default of a `ServerOptions` field: the daemon's options own them."""
    f = _OPTION_FIELDS[name]
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    raise KeyError(f"ServerOptions.{name} has no default")


def _shown(value: float) -> str:
    """A default for --help: sizes as 64M / 2G, numbers as they are."""
    if isinstance(value, int) and value >= 1 << 20 and value % (1 << 20) == 0:
        mib = value >> 20
        return f"{mib >> 10}G" if mib % 1024 == 0 else f"{mib}M"
    return f"{value:g}" if isinstance(value, float) else str(value)


def _size(text: str) -> int:
    """A byte size: plain bytes or with a K/M/G suffix."""
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    text = text.strip().lower().rstrip("ib")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def _serve(args: argparse.Namespace) -> int:
    from .broker.auth import SecurityError, check_options

    level = setup_logging(args.log_level, args.log_format)
    # every serve flag is named after its ServerOptions field
    given = {name: getattr(args, name) for name in _OPTION_FIELDS if hasattr(args, name)}
    given.update(listen=args.listen or [DEFAULT_LISTEN], log_level=level,
                 load_models=args.load_model or [],
                 metrics_config=args.metrics_config or [],
                 local_allow_users=args.local_allow_users or [],
                 local_allow_groups=args.local_allow_groups or [])
    options = ServerOptions(**given)
    try:
        # key files and addresses are checked before anything starts (or torch is
        # imported): a one-line error, exit status 2
        check_options(options.listen, options.curve_secret_key, options.curve_authorized_keys,
                      options.insecure_tcp)
    except SecurityError as exc:
        logging.getLogger("torchpool").error("%s", exc)
        return 2
    from .broker.metrics import MetricsConfigError, parse_metrics_config

    try:    # a metrics setting torchpool does not know stops it before anything starts
        parse_metrics_config(options.metrics_config)
    except MetricsConfigError as exc:
        logging.getLogger("torchpool").error("%s", exc)
        return 2
    from .broker.frontend import AddressInUse
    from .broker.gateways import GatewayError
    from .broker.server import Server

    try:
        return Server(options).run()
    except (AddressInUse, SecurityError, GatewayError) as exc:
        logging.getLogger("torchpool").error("%s", exc)
        return 2


def _keygen(args: argparse.Namespace) -> int:
    from .broker.auth import SecurityError, keygen, read_certificate

    try:
        public_file, secret_file = keygen(args.directory, args.name)
        public, _ = read_certificate(public_file, secret=False)
    except (SecurityError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"public key {public.decode()}\n"
          f"  {public_file}  (public: copy it into the daemon's --curve-authorized-keys directory,\n"
          f"  or give it to clients as server_key)\n"
          f"  {secret_file}  (secret, mode 600: --curve-secret-key, or a client's client_key)")
    return 0


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


def _add_security_flags(serve: argparse.ArgumentParser) -> None:
    """Who may connect and how much each client may take (docs/security.md)."""
    sec = serve.add_argument_group("clients: access and limits (docs/security.md)")
    sec.add_argument("--local-socket", default=_default("local_socket"), metavar="PATH",
                     help="unix socket where local clients get their shared-memory sessions "
                          "(default: the first ipc:// path + '.local'; '' turns the local path off)")
    sec.add_argument("--local-allow-user", dest="local_allow_users", action="append", metavar="USER",
                     help="only these users (names or uids) may open local sessions; repeatable")
    sec.add_argument("--local-allow-group", dest="local_allow_groups", action="append", metavar="GROUP",
                     help="... or members of these groups; repeatable")
    sec.add_argument("--curve-secret-key", default=_default("curve_secret_key"), metavar="FILE",
                     help="encrypt and authenticate tcp:// with ZeroMQ CURVE: this daemon's "
                          "secret key file (torchpool keygen)")
    sec.add_argument("--curve-authorized-keys", default=_default("curve_authorized_keys"),
                     metavar="DIR", help="directory of the client public keys allowed over tcp://")
    sec.add_argument("--insecure-tcp", action="store_true", default=_default("insecure_tcp"),
                     help="allow a non-loopback tcp:// address without CURVE")
    sec.add_argument("--remote-model-control", action="store_true",
                     default=_default("remote_model_control"),
                     help="accept load/unload from tcp:// clients too (default: ipc:// only)")
    for flag, name, kind, what in (
            ("--max-sessions", "max_sessions", int, "client sessions in all"),
            ("--max-sessions-per-peer", "max_sessions_per_peer", int,
             "sessions per local user or per connection"),
            ("--client-shm-limit", "client_shm_limit", _size, "arena bytes of one local client"),
            ("--client-shm-total", "client_shm_total", _size, "arena bytes of all local clients"),
            ("--max-regions-per-session", "max_regions_per_session", int,
             "registered regions of one session"),
            ("--max-in-flight-per-client", "max_in_flight_per_client", int,
             "unanswered requests of one connection; more are refused at once"),
            ("--max-unread-replies", "max_unread_replies", int,
             "replies queued for a connection that does not read them; then its requests "
             "fail and its memory is freed"),
            ("--max-bytes-elements", "max_bytes_elements", int, "elements of one BYTES tensor"),
            ("--max-bytes-tensor-bytes", "max_bytes_tensor_bytes", _size, "bytes of one BYTES tensor")):
        sec.add_argument(flag, dest=name, type=kind, default=_default(name),
                         help=f"limit: {what} (default {_shown(_default(name))})")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="torchpool", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="serve a Triton PyTorch model repository (foreground)")
    serve.add_argument("--model-repository", required=True, help="the repository directory")
    serve.add_argument("--listen", action="append", metavar="URL",
                       help=f"ipc:// or tcp:// address; repeat for several (default {DEFAULT_LISTEN})")
    serve.add_argument("--log-level", default=logging.getLevelName(_default("log_level")).lower(),
                       choices=["debug", "info", "warning", "error"])
    serve.add_argument("--log-format", default=_default("log_format"), choices=FORMATS,
                       help="text (journald-friendly) or json lines for log shippers; workers "
                            "log the same way into the same stream")
    serve.add_argument("--metrics-port", type=int, default=_default("metrics_port"),
                       help="serve Prometheus /metrics and /v2/health/{live,ready} on this port")
    serve.add_argument("--metrics-host", default=_default("metrics_host"))
    serve.add_argument("--metrics-config", action="append", metavar="KEY=VALUE",
                       help="Triton's metrics options, e.g. summary_latencies=true, "
                            "summary_quantiles=0.5:0.05,0.99:0.001; repeatable")
    serve.add_argument("--http-port", type=int, default=_default("http_port"),
                       help="serve KServe v2 / Triton HTTP/REST on this port (Triton's 8000); "
                            "a gateway process that is a local client of this daemon")
    serve.add_argument("--http-host", default=_default("http_host"),
                       help=f"address of the HTTP endpoint (default {_default('http_host')})")
    serve.add_argument("--grpc-port", type=int, default=_default("grpc_port"),
                       help="serve KServe v2 / Triton gRPC on this port (Triton's 8001)")
    serve.add_argument("--grpc-host", default=_default("grpc_host"),
                       help=f"address of the gRPC endpoint (default {_default('grpc_host')})")
    serve.add_argument("--model-control-mode", default=_default("model_control_mode"),
                       choices=["none", "poll", "explicit"],
                       help="Triton's: none = load all at start; poll = rescan the repository "
                            "(and on SIGHUP); explicit = load/unload calls from clients")
    serve.add_argument("--load-model", action="append", metavar="NAME",
                       help="explicit mode: load this model at start ('*' = all); repeatable")
    serve.add_argument("--repository-poll-secs", type=float, default=_default("repository_poll_secs"),
                       help="poll mode: seconds between repository scans "
                            f"(default {_shown(_default('repository_poll_secs'))})")
    serve.add_argument("--execution-timeout", type=float, default=_default("execution_timeout"),
                       help="kill and restart a worker whose batch runs longer (seconds; 0 = never; "
                            f"default {_shown(_default('execution_timeout'))})")
    serve.add_argument("--load-timeout", type=float, default=_default("load_timeout"),
                       help="a worker that has not loaded its model by then is killed and its "
                            "version fails (seconds; 0 = never; "
                            f"default {_shown(_default('load_timeout'))})")
    serve.add_argument("--shm-chunk", type=_size, default=_default("shm_chunk"),
                       help=f"size of each input shared-memory segment (default {_shown(_default('shm_chunk'))})")
    serve.add_argument("--shm-limit", type=_size, default=_default("shm_limit"),
                       help=f"cap on input shared memory in all (default {_shown(_default('shm_limit'))})")
    serve.add_argument("--worker-shm-chunk", type=_size, default=_default("worker_shm_chunk"),
                       help="first output segment of each worker; grows as outputs need "
                            f"(default {_shown(_default('worker_shm_chunk'))})")
    serve.add_argument("--grace-period", type=float, default=_default("grace_period"),
                       help="seconds SIGTERM waits for accepted requests "
                            f"(default {_shown(_default('grace_period'))})")
    serve.add_argument("--busy-poll-us", type=int, default=_default("busy_poll_us"),
                       help="after activity, poll without sleeping this long (lower latency on "
                            "VMs where waking a process is slow); 0 disables "
                            f"(default {_shown(_default('busy_poll_us'))})")
    serve.add_argument("--worker-busy-poll-us", type=int, default=_default("worker_busy_poll_us"),
                       help="the same for each worker after a batch; trades CPU for latency "
                            f"(default {_shown(_default('worker_busy_poll_us'))})")
    serve.add_argument("--client-shm-size", type=_size, default=_default("client_shm_size"),
                       help="arena segment given to each local client "
                            f"(default {_shown(_default('client_shm_size'))})")
    serve.add_argument("--client-lease", type=float, default=_default("client_lease"),
                       help="seconds after which an idle client's session and shared memory are "
                            f"released (default {_shown(_default('client_lease'))})")
    _add_security_flags(serve)
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

    keys = sub.add_parser("keygen", help="write a CURVE key pair for tcp:// (NAME.key public, "
                                         "NAME.key_secret secret)")
    keys.add_argument("directory", help="where to write the two files (created if missing)")
    keys.add_argument("--name", default="torchpool",
                      help="file name of the pair, e.g. server or the client's name (default torchpool)")
    keys.set_defaults(func=_keygen)

    example = sub.add_parser("make-example-repo", help="write the example model repository")
    example.add_argument("directory")
    example.set_defaults(func=_make_example_repo)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)
