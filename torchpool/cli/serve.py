"""`torchpool serve`: check the options, then run the daemon in the foreground.

What a user can get wrong is checked first, in the order the user would fix
it (flags, then the repository, then addresses), each a one-line error with
its own exit status (errors.py). Only then does the daemon start; what it
finds later (a port taken in the meantime, a model failing with
--exit-on-error) comes back as a typed exception mapped to the same
statuses here.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Any

from ..broker.options import ServerOptions
from ..logs import setup_logging
from .errors import ADDRESS, GATEWAY, MODEL_LOAD, REPOSITORY, USAGE, CliError
from .preflight import (check_listen, check_local_socket, check_ports, check_repository,
                        check_server_dependencies)
from .urls import DEFAULT_LISTEN

OPTION_FIELDS = {f.name: f for f in dataclasses.fields(ServerOptions)}


def server_options(args: argparse.Namespace, log_level: int) -> ServerOptions:
    """The daemon's options from the parsed flags (each named after its field)."""
    given: dict[str, Any] = {name: getattr(args, name) for name in OPTION_FIELDS if hasattr(args, name)}
    given.update(listen=args.listen or [DEFAULT_LISTEN], log_level=log_level,
                 load_models=args.load_model or [],
                 metrics_config=args.metrics_config or [],
                 local_allow_users=args.local_allow_users or [],
                 local_allow_groups=args.local_allow_groups or [],
                 allow_client_shm_prefixes=args.allow_client_shm_prefixes or [])
    return ServerOptions(**given)


def preflight(options: ServerOptions) -> None:
    """Everything that can be refused before the daemon starts; CliError if not."""
    from ..broker.auth import SecurityError, check_options
    from ..broker.metrics import MetricsConfigError, parse_metrics_config

    check_server_dependencies(options.http_port is not None, options.grpc_port is not None)
    check_listen(options.listen)     # the scheme first: 'Invalid argument' from ZeroMQ helps nobody
    try:
        check_options(options.listen, options.curve_secret_key, options.curve_authorized_keys,
                      options.insecure_tcp)
        parse_metrics_config(options.metrics_config)
    except (SecurityError, MetricsConfigError) as exc:
        raise CliError(USAGE, str(exc)) from None
    check_repository(options.model_repository)
    o = options
    check_local_socket(o.local_socket, o.listen)
    check_ports([("--metrics-port", "metrics", o.metrics_host, o.metrics_port),
                 ("--http-port", "HTTP", o.http_host, o.http_port),
                 ("--grpc-port", "gRPC", o.grpc_host, o.grpc_port)])


def run_serve(args: argparse.Namespace) -> int:
    level = setup_logging(args.log_level, args.log_format)
    options = server_options(args, level)
    preflight(options)
    if options.cache_dir:
        # workers inherit it through the fork server (worker/compile.py reads it)
        os.environ["TORCHPOOL_CACHE_DIR"] = os.path.abspath(options.cache_dir)
    from ..broker.auth import SecurityError
    from ..broker.connections import raise_open_files_limit
    from ..broker.frontend import AddressInUse
    from ..broker.gateways import GatewayError
    from ..broker.server import ModelLoadFailed, Server
    from ..config import ConfigError

    raise_open_files_limit()            # every client connection costs the broker an fd
    try:
        return Server(options).run()
    except AddressInUse as exc:         # taken since the preflight: the message names the address
        raise CliError(ADDRESS, str(exc)) from None
    except ConfigError as exc:           # the repository went away after the preflight
        raise CliError(REPOSITORY, f"--model-repository {options.model_repository}: {exc}") from None
    except ModelLoadFailed as exc:
        raise CliError(MODEL_LOAD, f"{exc} (--exit-on-error)") from None
    except GatewayError as exc:
        raise CliError(GATEWAY, str(exc)) from None      # its own line says what did not start
    except SecurityError as exc:
        raise CliError(USAGE, str(exc)) from None


__all__ = ["OPTION_FIELDS", "preflight", "run_serve", "server_options"]

