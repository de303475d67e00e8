"""The gateway process: one event loop serving HTTP and/or gRPC for a daemon.

    python -m torchpool.gateway --url ipc:///run/torchpool.sock --http-port 8000 --grpc-port 8001

`torchpool serve --http-port/--grpc-port` starts it as its child (and then
passes `--status-fd`: the gateway writes one line there once its ports are
bound, `ready {...}` or `error <why>`, so a busy port fails the daemon's start
with a one-line error instead of a log line nobody reads). Run on its own, it
is one more local client of a daemon on this host.
"""
from __future__ import annotations

import argparse
import asyncio
import ctypes
import json
import logging
import os
import signal
import sys
from typing import TYPE_CHECKING, Coroutine, Optional, Union

from ..broker.connections import raise_open_files_limit
from ..logs import FORMATS, set_process_title, setup_logging
from . import defaults

if TYPE_CHECKING:
    from .backend import Backend
    from .grpc_server import GrpcServer
    from .http_server import HttpServer
    from .offload import Offload

log = logging.getLogger("torchpool.gateway")

_PR_SET_PDEATHSIG = 1


def _die_with_parent(parent: int) -> None:
    """A gateway started by a daemon must not outlive it (SIGKILLed daemon
    included): the kernel sends us SIGTERM when the parent goes."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:          # it went before prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m torchpool.gateway",
                                description="KServe v2 / Triton HTTP and gRPC endpoints for a torchpool daemon")
    p.add_argument("--url", required=True, help="the daemon's ipc:// (or loopback tcp://) address")
    p.add_argument("--http-port", type=int, help="serve HTTP/REST on this port (0 = any free port)")
    p.add_argument("--http-host", default="127.0.0.1")
    p.add_argument("--grpc-port", type=int, help="serve gRPC on this port (0 = any free port)")
    p.add_argument("--grpc-host", default="127.0.0.1")
    p.add_argument("--http-max-input-size", type=int, default=defaults.MAX_INPUT_BYTES,
                   help="the largest HTTP request body, decompressed too (bytes)")
    p.add_argument("--grpc-max-input-size", type=int, default=defaults.MAX_INPUT_BYTES,
                   help="the largest gRPC request message (bytes)")
    # the daemon passes --allow-client-shm=true or =false (its own flag takes Triton's spellings)
    p.add_argument("--allow-client-shm", nargs="?", const="true", choices=["true", "false"],
                   default=str(defaults.ALLOW_CLIENT_SHM).lower(), metavar="true|false",
                   help="let HTTP/gRPC callers register system shared memory (Triton's; default false)")
    p.add_argument("--allow-client-shm-prefix", dest="allow_client_shm_prefixes", action="append",
                   default=[], metavar="PREFIX",
                   help="... only keys that begin with PREFIX; repeatable (none given: any key)")
    p.add_argument("--gateway-max-in-flight-per-caller", type=int,
                   default=defaults.MAX_IN_FLIGHT_PER_CALLER,
                   help="requests of one HTTP connection or gRPC peer sent to the daemon at once")
    # 0: a share of the open-files limit (defaults.max_connections)
    p.add_argument("--http-max-connections", type=int, default=0, help="HTTP connections at once")
    p.add_argument("--grpc-max-connections", type=int, default=0, help="gRPC connections at once")
    p.add_argument("--grpc-max-streams-per-peer", type=int, default=defaults.MAX_STREAMS_PER_PEER,
                   help="ModelStreamInfer streams one gRPC peer (a uid on this host, an address "
                        "elsewhere) holds open on all its connections; 0: no cap")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--log-format", default="text", choices=FORMATS)
    p.add_argument("--status-fd", type=int, help="write 'ready {...}' or 'error <why>' here, once")
    p.add_argument("--parent-pid", type=int, help="exit when this process (the daemon) goes")
    return p


class _Status:
    """The one line the daemon waits for."""

    def __init__(self, fd: Optional[int]) -> None:
        self.fd = fd

    def say(self, line: str) -> None:
        if self.fd is None:
            return
        try:
            os.write(self.fd, (line.replace("\n", " ") + "\n").encode())
            os.close(self.fd)
        except OSError:
            pass
        self.fd = None


async def _start(backend: Backend, kind: str, host: str, port: int, args: argparse.Namespace,
                 offload: Offload, max_connections: int) -> Union[HttpServer, GrpcServer]:
    if kind == "HTTP":
        from .http_server import Limits, start_http
        limits = Limits(max_body=args.http_max_input_size, max_connections=max_connections)
        return await start_http(backend, host, port, limits, offload)
    from .grpc_server import start_grpc
    return await start_grpc(backend, host, port, args.grpc_max_input_size, offload, max_connections,
                            args.grpc_max_streams_per_peer)


async def serve(args: argparse.Namespace, status: _Status, open_files: int) -> int:
    """Serve until SIGTERM/SIGINT; `open_files`: the soft fd limit, whose
    share each protocol's connections get unless given."""
    from .backend import Backend, ShmPolicy
    from .offload import Offload

    shm = ShmPolicy(args.allow_client_shm == "true", tuple(args.allow_client_shm_prefixes))
    backend = Backend(args.url, shm=shm, per_caller=args.gateway_max_in_flight_per_caller)
    offload = Offload()          # one helper process for both protocols, started on first use
    servers: list[tuple[str, Union[HttpServer, GrpcServer]]] = []
    wanted = [(kind, host, port) for kind, host, port in (("HTTP", args.http_host, args.http_port),
                                                          ("gRPC", args.grpc_host, args.grpc_port))
              if port is not None]
    share = defaults.max_connections(open_files, len(wanted))
    caps = {"HTTP": args.http_max_connections or share, "gRPC": args.grpc_max_connections or share}
    try:
        for kind, host, port in wanted:
            try:
                servers.append((kind, await _start(backend, kind, host, port, args, offload, caps[kind])))
            except OSError as exc:
                why = f"cannot serve {kind} on {host}:{port}: {exc.strerror or exc}"
                log.error("%s", why)
                status.say(f"error {why}")
                return 2
        ports = {kind.lower(): server.port for kind, server in servers}
        for (kind, server), (_k, host, _p) in zip(servers, wanted):
            log.info("%s endpoint on %s:%d for %s (at most %d connections)", kind, host, server.port,
                     args.url, caps[kind])
        status.say("ready " + json.dumps(ports))
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        return 0
    finally:
        for _kind, server in reversed(servers):
            await server.close()
        await backend.close()
        offload.close()


def _run(coro: Coroutine[object, object, int]) -> int:
    """uvloop when installed: its transports cost less per request."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    if sys.version_info >= (3, 11):
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(coro)
    # Python 3.10 has no asyncio.Runner: uvloop's policy makes asyncio.run's
    # loop (this process runs no other)
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    return asyncio.run(coro)


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.log_level, args.log_format)
    set_process_title(" ".join(["torchpool gateway"] + [f"{kind}:{port}" for kind, port in
                               (("http", args.http_port), ("grpc", args.grpc_port)) if port is not None]))
    if args.parent_pid:
        _die_with_parent(args.parent_pid)
    status = _Status(args.status_fd)
    if args.http_port is None and args.grpc_port is None:
        status.say("error neither --http-port nor --grpc-port given")
        log.error("neither --http-port nor --grpc-port given: nothing to serve")
        return 2
    open_files = raise_open_files_limit(log)    # every connection costs an fd
    try:
        return _run(serve(args, status, open_files))
    except KeyboardInterrupt:
        return 0
    finally:
        status.say("error the gateway stopped before its endpoints were ready")


if __name__ == "__main__":
    sys.exit(main())
