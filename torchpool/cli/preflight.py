"""What `torchpool serve` checks before it starts anything.

Every check here is cheap and runs before a worker starts or a model loads,
so a wrong path or a busy port fails in a second with one line naming the
flag and its value, not after minutes of loading (or as a traceback).

Ports are probed by binding them with the options the real servers use
(SO_REUSEADDR) and closing again; the window in which another process
could take one afterwards is milliseconds, and the real bind reports that
case with the same exit status. The ipc:// socket files are claimed as the
frontend would claim them: a file a live daemon answers on is refused, a
dead daemon's is removed.
"""
from __future__ import annotations

import errno
import os
import socket
from pathlib import Path
from typing import Optional, Sequence

from .errors import ADDRESS, REPOSITORY, USAGE, CliError
from .urls import check_url, tcp_host_port


def reason(exc: OSError) -> str:
    """'address already in use': the OS's words, lower-cased as in the rest of the line."""
    text = exc.strerror or str(exc)
    return text[:1].lower() + text[1:]


def check_server_dependencies(http: bool, grpc: bool) -> None:
    """A client-only install (pip install torchpool) has no torch: say so
    before anything starts, not as workers dying one by one."""
    import importlib.util

    wanted = ["torch"] + (["httptools"] if http else []) + (["grpc"] if grpc else [])
    missing = [m for m in wanted if importlib.util.find_spec(m) is None]
    if missing:
        raise CliError(USAGE, f"{', '.join(missing)} not installed: the daemon needs "
                              "pip install 'torchpool[server]'")


def check_repository(path: str) -> None:
    """The repository is a directory this process can list."""
    root = Path(path)
    flag = f"--model-repository {path}"
    scheme = path.split("://", 1)[0].lower() if "://" in path else ""
    if scheme:
        # Triton reads s3://, gs:// and as:// itself; torchpool serves a local
        # directory only (its workers load and re-check files on disk)
        raise CliError(REPOSITORY, f"{flag}: cloud and remote repositories ({scheme}://) are not "
                                   f"supported; copy the repository to a local directory (e.g. "
                                   f"'aws s3 sync', 'gsutil rsync', 'azcopy sync') or mount it "
                                   f"(s3fs, gcsfuse, blobfuse) and give that path")
    if not root.exists():
        raise CliError(REPOSITORY, f"{flag}: no such directory")
    if not root.is_dir():
        raise CliError(REPOSITORY, f"{flag}: not a directory")
    try:
        next(iter(os.scandir(root)), None)
    except OSError as exc:
        raise CliError(REPOSITORY, f"{flag}: cannot be read: {reason(exc)}") from None


def check_listen(urls: Sequence[str]) -> None:
    """Every --listen URL is well formed, given once, and free."""
    for url in urls:
        check_url("--listen", url)
    seen = set()
    for url in urls:
        if url in seen:
            raise CliError(USAGE, f"--listen {url}: given twice")
        seen.add(url)
    for url in urls:
        if url.startswith("ipc://"):
            _claim_ipc(url)
        else:
            host, port = tcp_host_port(url)
            if port:                # 0 and '*' pick a free port: nothing to probe
                _probe(f"--listen {url}", host, port, what="listen", resolve_only_literal=True)


def _claim_ipc(url: str) -> None:
    from ..broker.frontend import ipc_path

    path = ipc_path(url)
    assert path is not None         # called for ipc:// URLs only
    _claim(f"--listen {url}", path, socket.SOCK_STREAM)


def check_local_socket(option: Optional[str], listen: Sequence[str]) -> None:
    """The local clients' side channel (--local-socket, by default beside the first ipc:// socket)."""
    from ..broker.local_channel import resolve_path
    from ..shm import daemon_id

    path = resolve_path(option, list(listen), daemon_id(list(listen)))
    if path is not None:
        _claim(f"--local-socket {path}", path, socket.SOCK_SEQPACKET)


def _claim(label: str, path: str, kind: int) -> None:
    """A socket file as the daemon claims it: a live one refused, a dead one's removed."""
    from ..broker.frontend import AddressInUse, claim_socket_path

    try:
        claim_socket_path(path, kind)
    except AddressInUse as exc:
        raise CliError(ADDRESS, f"{label}: {exc}") from None
    except OSError as exc:
        raise CliError(ADDRESS, f"{label}: cannot use {path}: {reason(exc)}") from None


def check_ports(endpoints: Sequence[tuple[str, str, str, Optional[int]]]) -> None:
    """`endpoints`: (flag, what it serves, host, port or None when off).
    Each port that is on is free on its host, and no two share one."""
    used: dict[tuple[str, int], str] = {}
    for flag, what, host, port in endpoints:
        if port is None:
            continue
        if not 0 <= port < 65536:
            raise CliError(USAGE, f"{flag} {port}: not a port number (0-65535)")
        if port == 0:
            continue
        other = used.get((host, port))
        if other is not None:
            raise CliError(USAGE, f"{flag} {port}: already given to {other}")
        used[(host, port)] = flag
        _probe(f"{flag} {port}", host, port, what=what)


def _probe(label: str, host: str, port: int, what: str, resolve_only_literal: bool = False) -> None:
    """Bind host:port as a server would and close it again; CliError(ADDRESS) if that fails.
    `resolve_only_literal`: a ZeroMQ address may name an interface ('eth0'),
    which is not a host name: one that does not resolve is left to ZeroMQ."""
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        if resolve_only_literal:
            return
        raise CliError(ADDRESS, f"{label}: cannot resolve host '{host}': {exc.strerror}") from None
    for family, kind, proto, _name, address in infos:
        try:
            with socket.socket(family, kind, proto) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                probe.bind(address)
        except OSError as exc:
            if exc.errno == errno.EAFNOSUPPORT:     # no IPv6 on this host: the IPv4 bind decides
                continue
            where = f"{host}:{port}" if ":" not in host else f"[{host}]:{port}"
            serve = "" if what == "listen" else f"cannot serve {what} on {where}: "
            raise CliError(ADDRESS, f"{label}: {serve}{reason(exc)}") from None


__all__ = ["check_listen", "check_local_socket", "check_ports", "check_repository", "reason"]
