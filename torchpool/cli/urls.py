"""What a torchpool address looks like: `ipc://PATH` or `tcp://HOST:PORT`.

Checked before anything uses one (serve's --listen, the client commands'
--url), so a path given without its scheme is a one-line usage error that
shows the URL meant, instead of ZeroMQ's "Invalid argument".
"""
from __future__ import annotations

from typing import Optional

from .errors import USAGE, CliError

DEFAULT_LISTEN = "ipc:///tmp/torchpool.sock"   # serve's --listen and the client commands' --url
EXAMPLE_TCP = "tcp://127.0.0.1:8555"


def url_problem(url: str) -> Optional[str]:
    """Why `url` is not a torchpool address, or None when it is one."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        example = f"ipc://{url}" if url.startswith("/") else DEFAULT_LISTEN
        return f"expected a URL such as {example} or {EXAMPLE_TCP}"
    if scheme == "ipc":
        return None if rest else f"expected a socket path after ipc://, e.g. {DEFAULT_LISTEN}"
    if scheme == "tcp":
        host, colon, port = rest.rpartition(":")
        if not colon or not host or not (port == "*" or (port.isdigit() and int(port) < 65536)):
            return f"expected tcp://HOST:PORT with a port number, e.g. {EXAMPLE_TCP}"
        return None
    return f"only ipc:// and tcp:// addresses are served, e.g. {DEFAULT_LISTEN} or {EXAMPLE_TCP}"


def check_url(flag: str, url: str) -> None:
    """CliError (bad usage) naming `flag` and `url` unless it is an address."""
    problem = url_problem(url)
    if problem is not None:
        raise CliError(USAGE, f"{flag} {url}: {problem}")


def tcp_host_port(url: str) -> tuple[str, Optional[int]]:
    """(host, port) of a checked tcp:// URL; port None for '*' (any)."""
    host, _, port = url[len("tcp://"):].rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]          # an IPv6 literal
    return host, None if port == "*" else int(port)


__all__ = ["DEFAULT_LISTEN", "check_url", "tcp_host_port", "url_problem"]
