"""Command line: `torchpool serve | infer | models | metadata | stats | ps | keygen | make-example-repo | perf`.

This module is the parser and `main`; each command runs in its own module
(serve.py, client_commands.py, setup_commands.py), imported only when that
command runs, so `torchpool --help` and the client commands never import the
broker. A failure the user can fix is one line, `torchpool: error: ...`, with
the exit status errors.py gives it (`torchpool serve --help` lists them).
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import logging
from typing import TYPE_CHECKING, Callable, Optional, Sequence, cast

from ..broker.options import ServerOptions
from ..logs import FORMATS
from .errors import EXIT_STATUS_HELP, CliError, report, until_the_reader_goes
from .urls import DEFAULT_LISTEN

if TYPE_CHECKING:
    Subparsers = argparse._SubParsersAction[argparse.ArgumentParser]

_OPTION_FIELDS = {f.name: f for f in dataclasses.fields(ServerOptions)}


def _default(name: str) -> object:
    """The default of a `ServerOptions` field: the daemon's options own them."""
    f = _OPTION_FIELDS[name]
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    raise KeyError(f"ServerOptions.{name} has no default")


def _shown(value: object) -> str:
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


def _whole(text: str) -> int:
    """A whole number, 0 or more."""
    value = int(text)
    if value < 0:
        raise ValueError(text)
    return value


def _boolean(text: str) -> bool:
    """Triton's boolean flag values."""
    value = text.strip().lower()
    if value in ("true", "1", "yes", "on"):
        return True
    if value in ("false", "0", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _run(module: str, function: str) -> Callable[[argparse.Namespace], int]:
    """A command's runner, imported when the command runs (not when the parser is built)."""
    def run(args: argparse.Namespace) -> int:
        return getattr(importlib.import_module(f"{__name__}.{module}"), function)(args)
    return run


def version_text() -> str:
    """`torchpool X.Y.Z (torch A.B.C)`: torch's version from its installed
    metadata, so a client-only install (no torch) still answers at once."""
    from importlib import metadata

    from .. import __version__

    try:
        torch = f"torch {metadata.version('torch')}"
    except metadata.PackageNotFoundError:
        torch = "torch not installed"
    return f"torchpool {__version__} ({torch})"


class _VersionAction(argparse.Action):
    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS,
                 default: object = argparse.SUPPRESS, help: Optional[str] = None) -> None:
        super().__init__(option_strings, dest, nargs=0, default=default, help=help)

    def __call__(self, parser: argparse.ArgumentParser, *_: object) -> None:
        print(version_text())
        parser.exit()


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
    sec.add_argument("--no-direct-paths", dest="direct_paths", action="store_false",
                     default=_default("direct_paths"),
                     help="local clients send every request through the daemon's queue (and its "
                          "--max-in-flight-per-client), none straight to a model's worker")
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
             "unanswered requests of one client process on this host (ipc://) or one tcp "
             "connection; more are refused at once"),
            ("--max-unread-replies", "max_unread_replies", int,
             "replies queued for a connection that does not read them; then its requests "
             "fail and its memory is freed"),
            ("--max-connections", "max_connections", int,
             "client connections in all (ipc://, tcp://, local side channel); more are closed "
             "as they come; 0: the open-files limit less a quarter"),
            ("--max-header-bytes", "max_header_bytes", _size,
             "bytes of one request's header frame (small fields and tensors inline up to 64 KiB "
             "each); a larger one is refused before it is decoded"),
            ("--max-bytes-elements", "max_bytes_elements", int, "elements of one BYTES tensor"),
            ("--max-bytes-tensor-bytes", "max_bytes_tensor_bytes", _size, "bytes of one BYTES tensor")):
        sec.add_argument(flag, dest=name, type=kind, default=_default(name),
                         help=f"limit: {what} (default {_shown(_default(name))})")


def _add_client_flags(command: argparse.ArgumentParser) -> None:
    """How a client command reaches the daemon."""
    command.add_argument("--url", default=DEFAULT_LISTEN,
                         help=f"the daemon's ipc:// or tcp:// address (default {DEFAULT_LISTEN})")
    command.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for the answer")
    command.add_argument("--server-key", metavar="FILE",
                         help="tcp:// with CURVE: the daemon's public key file (NAME.key)")
    command.add_argument("--client-key", metavar="FILE",
                         help="tcp:// with CURVE: this client's secret key file (NAME.key_secret)")


def _add_client_commands(sub: Subparsers) -> None:
    infer = sub.add_parser(
        "infer", help="send one request and print the outputs as JSON lines",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Send one request; print each output as a JSON line: "
                    '{"name", "datatype" (Triton\'s: FP32, BYTES, ...), "shape", "data"}.',
        epilog="inputs:\n"
               "  NAME=JSON               the model's declared datatype, e.g. INPUT0='[[1,2,3]]'\n"
               "  NAME=JSON:DATATYPE      Triton's datatype names, e.g. INPUT0='[[1,2,3]]':INT64\n"
               "  NAME=@FILE.npy          a numpy file, its own dtype and shape\n"
               "  NAME=@FILE.npy:DATATYPE ... converted, e.g. INPUT0=@x.npy:FP16\n"
               "JSON strings make BYTES: TEXT='[\"a\",\"b\"]'\n"
               "exit statuses: 0 done, 1 the server answered with an error or could not be reached, "
               "2 bad arguments, 141 stdout's reader went away (| head)")
    infer.add_argument("model")
    infer.add_argument("--input", action="append", default=[], metavar="NAME=VALUE",
                       help="an input tensor (forms below); repeat for each")
    infer.add_argument("--output", action="append", metavar="NAME",
                       help="only these outputs (default all); repeatable")
    infer.add_argument("--version", help="the model version (default the highest ready one)")
    infer.add_argument("--json", action="store_true",
                       help="one JSON document instead of lines: KServe v2's inference response, "
                            '{"model_name", "outputs": [...]} ("model_version" with --version)')
    _add_client_flags(infer)
    infer.set_defaults(func=_run("client_commands", "run_infer"))

    models = sub.add_parser("models", help="the repository index: every model version, its state "
                                           "and why it is not ready")
    models.add_argument("--json", action="store_true", help="the index as JSON")
    _add_client_flags(models)
    models.set_defaults(func=_run("client_commands", "run_models"))

    metadata = sub.add_parser("metadata", help="a model's inputs and outputs: Triton datatypes and shapes")
    metadata.add_argument("model")
    metadata.add_argument("--version", help="the model version (default the highest ready one)")
    metadata.add_argument("--json", action="store_true", help="the metadata as JSON")
    _add_client_flags(metadata)
    metadata.set_defaults(func=_run("client_commands", "run_metadata"))

    stats = sub.add_parser("stats", help="inference statistics: counts and average queue and "
                                         "compute times, per model version")
    stats.add_argument("model", nargs="?", help="only this model (default all)")
    stats.add_argument("--version", help="only this version of the model")
    stats.add_argument("--json", action="store_true", help="Triton's statistics JSON")
    _add_client_flags(stats)
    stats.set_defaults(func=_run("client_commands", "run_stats"))

    ps = sub.add_parser("ps", help="the worker processes: which model, version and instance each serves, "
                                   "its state, restarts, uptime, CPU time and memory (PSS)")
    ps.add_argument("model", nargs="?", help="only this model's workers (default all)")
    ps.add_argument("--version", help="only this version's")
    ps.add_argument("--json", action="store_true", help="the rows as JSON, with RSS and the start time too")
    _add_client_flags(ps)
    ps.set_defaults(func=_run("client_commands", "run_ps"))


def _add_perf(sub: Subparsers) -> None:
    """`torchpool perf` (torchpool/perf: a load generator like perf_analyzer)."""
    from ..perf.cli import add_parser as add_perf_parser

    add_perf_parser(sub)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="torchpool", description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", action=_VersionAction, help="print the version and exit")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="serve a Triton PyTorch model repository (foreground)",
                           description="Serve a Triton PyTorch model repository in the foreground.",
                           epilog=EXIT_STATUS_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    serve.add_argument("--model-repository", required=True, help="the repository directory")
    serve.add_argument("--exit-on-error", nargs="?", const=True, type=_boolean,
                       default=_default("exit_on_error"), metavar="BOOL",
                       help="Triton's: stop the daemon (exit status 5) when a model fails to load at "
                            "startup; --exit-on-error or --exit-on-error=true (default false: the "
                            "model is UNAVAILABLE and the others serve)")
    serve.add_argument("--listen", action="append", metavar="URL",
                       help=f"ipc:// or tcp:// address; repeat for several (default {DEFAULT_LISTEN})")
    serve.add_argument("--log-level", default=logging.getLevelName(cast(int, _default("log_level"))).lower(),
                       choices=["debug", "info", "warning", "error"])
    serve.add_argument("--log-format", default=_default("log_format"), choices=FORMATS,
                       help="text (journald-friendly) or json lines for log shippers; workers "
                            "log the same way into the same stream")
    serve.add_argument("--metrics-port", type=int, default=_default("metrics_port"),
                       help="serve Prometheus /metrics and /v2/health/{live,ready} on this port")
    serve.add_argument("--metrics-host", default=_default("metrics_host"))
    serve.add_argument("--metrics-config", action="append", metavar="KEY=VALUE",
                       help="Triton's metrics options, e.g. summary_latencies=true, "
                            "histogram_latencies=true, summary_quantiles=0.5:0.05,0.99:0.001 "
                            "(docs/metrics.md); repeatable")
    serve.add_argument("--http-port", type=int, default=_default("http_port"),
                       help="serve KServe v2 / Triton HTTP/REST on this port (Triton's 8000); "
                            "a gateway process that is a local client of this daemon")
    serve.add_argument("--http-host", default=_default("http_host"),
                       help=f"address of the HTTP endpoint (default {_default('http_host')})")
    serve.add_argument("--grpc-port", type=int, default=_default("grpc_port"),
                       help="serve KServe v2 / Triton gRPC on this port (Triton's 8001)")
    serve.add_argument("--grpc-host", default=_default("grpc_host"),
                       help=f"address of the gRPC endpoint (default {_default('grpc_host')})")
    serve.add_argument("--http-max-input-size", type=_size, default=_default("http_max_input_size"),
                       help="Triton's: the largest HTTP request body, also once decompressed "
                            f"(default {_shown(_default('http_max_input_size'))})")
    serve.add_argument("--grpc-max-input-size", type=_size, default=_default("grpc_max_input_size"),
                       help=f"the largest gRPC request (default {_shown(_default('grpc_max_input_size'))})")
    serve.add_argument("--allow-client-shm", nargs="?", const=True, type=_boolean,
                       default=_default("allow_client_shm"), metavar="BOOL",
                       help="Triton's: let HTTP/gRPC callers register system shared memory, which "
                            "the daemon opens with its own rights (default false)")
    serve.add_argument("--allow-client-shm-prefix", dest="allow_client_shm_prefixes", action="append",
                       metavar="PREFIX", help="... only segments whose key begins with PREFIX; repeatable")
    serve.add_argument("--gateway-max-in-flight-per-caller", type=int,
                       default=_default("gateway_max_in_flight_per_caller"),
                       help="requests of one HTTP connection or gRPC peer sent to the daemon at once; "
                            "more wait in the gateway, callers in turn "
                            f"(default {_shown(_default('gateway_max_in_flight_per_caller'))})")
    serve.add_argument("--http-max-connections", type=int, default=_default("http_max_connections"),
                       help="HTTP connections at once: at the cap a new one replaces the oldest idle "
                            "one, or is refused; 0: a share of the gateway's open-files limit")
    serve.add_argument("--grpc-max-connections", type=int, default=_default("grpc_max_connections"),
                       help="gRPC connections at once, more are refused; 0: a share of the "
                            "gateway's open-files limit")
    serve.add_argument("--grpc-max-streams-per-peer", type=int, default=_default("grpc_max_streams_per_peer"),
                       help="ModelStreamInfer streams one gRPC peer (a uid on this host, an address "
                            "elsewhere) holds open on all its connections; one more is refused "
                            "RESOURCE_EXHAUSTED; 0: no cap "
                            f"(default {_shown(_default('grpc_max_streams_per_peer'))})")
    serve.add_argument("--model-control-mode", default=_default("model_control_mode"),
                       choices=["none", "poll", "explicit"],
                       help="Triton's: none = load all at start; poll = rescan the repository "
                            "(and on SIGHUP); explicit = load/unload calls from clients")
    serve.add_argument("--load-model", action="append", metavar="NAME",
                       help="explicit mode: load this model at start ('*' = all); repeatable")
    serve.add_argument("--repository-poll-secs", type=float, default=_default("repository_poll_secs"),
                       help="poll mode: seconds between repository scans; 0 = only on SIGHUP "
                            f"(systemctl reload) (default {_shown(_default('repository_poll_secs'))})")
    serve.add_argument("--execution-timeout", type=float, default=_default("execution_timeout"),
                       help="kill and restart a worker whose batch runs longer (seconds; 0 = never; "
                            f"default {_shown(_default('execution_timeout'))})")
    serve.add_argument("--cache-dir", default=_default("cache_dir"),
                       help="directory for compiled-model caches (TORCH_COMPILE), shared by "
                            "restarted workers and other instances; default $TORCHPOOL_CACHE_DIR, "
                            "else ~/.cache/torchpool")
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
    serve.add_argument("--output-capture-mib", type=_whole, default=_default("output_capture_mib"),
                       help="each worker's output capture region: large tensors the model makes are "
                            "answered from it, uncopied; 0 turns capture off (default "
                            "$TORCHPOOL_OUTPUT_CAPTURE_MIB, else 256)")
    serve.add_argument("--stream-copy-bytes", type=_size, default=_default("stream_copy_bytes"),
                       help="copies into shared memory this large and larger store around the CPU "
                            "caches (pays on some machines only); 0: never (default "
                            "$TORCHPOOL_STREAM_COPY_BYTES, else 0)")
    serve.add_argument("--grace-period", type=float, default=_default("grace_period"),
                       help="seconds SIGTERM waits for accepted requests "
                            f"(default {_shown(_default('grace_period'))})")
    serve.add_argument("--stop-timeout", type=float, default=_default("stop_timeout"),
                       help="at shutdown, after the grace period, seconds a worker gets to exit; "
                            "one still running is sent SIGABRT (its Python stack goes to the log), "
                            f"then SIGKILL (default {_shown(_default('stop_timeout'))})")
    serve.add_argument("--busy-poll-us", type=int, default=_default("busy_poll_us"),
                       help="after activity, poll without sleeping this long: trades the broker's "
                            "CPU for latency where waking a process is slow; 0 disables "
                            f"(default {_shown(_default('busy_poll_us'))})")
    serve.add_argument("--worker-busy-poll-us", type=int, default=_default("worker_busy_poll_us"),
                       help="the same for each worker after a batch; trades CPU for latency "
                            f"(default {_shown(_default('worker_busy_poll_us'))})")
    serve.add_argument("--direct-spin-us", type=int, default=_default("direct_spin_us"),
                       help="a direct path's client and worker, and the broker waiting for a "
                            "worker's answer, poll at most this long without "
                            "sleeping, while the other answers sooner: lower latency for small "
                            f"models, CPU for wake-ups; 0 disables (default {_shown(_default('direct_spin_us'))})")
    serve.add_argument("--client-shm-size", type=_size, default=_default("client_shm_size"),
                       help="arena segment given to each local client "
                            f"(default {_shown(_default('client_shm_size'))})")
    serve.add_argument("--client-lease", type=float, default=_default("client_lease"),
                       help="seconds after which an idle client's session and shared memory are "
                            f"released (default {_shown(_default('client_lease'))})")
    _add_security_flags(serve)
    serve.set_defaults(func=_run("serve", "run_serve"))

    _add_client_commands(sub)

    keys = sub.add_parser("keygen", help="write a CURVE key pair for tcp:// (NAME.key public, "
                                         "NAME.key_secret secret)")
    keys.add_argument("directory", help="where to write the two files (created if missing)")
    keys.add_argument("--name", default="torchpool",
                      help="file name of the pair, e.g. server or the client's name (default torchpool)")
    keys.set_defaults(func=_run("setup_commands", "run_keygen"))

    example = sub.add_parser("make-example-repo", help="write the example model repository")
    example.add_argument("directory")
    example.set_defaults(func=_run("setup_commands", "run_make_example_repo"))
    _add_perf(sub)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The `torchpool` command; returns its exit status."""
    return until_the_reader_goes(lambda: _command(argv))


def _command(argv: Optional[Sequence[str]]) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except CliError as exc:
        serving = getattr(args, "command", "") == "serve"
        report(exc.message, getattr(args, "log_format", "text") if serving else "text")
        return exc.status
    except KeyboardInterrupt:
        return 130        # Ctrl-C in a client command (serve handles its own signals)


__all__ = ["DEFAULT_LISTEN", "build_parser", "main", "version_text"]
