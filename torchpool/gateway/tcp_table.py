"""The kernel's table of TCP sockets (/proc/net/tcp and tcp6), as the gateway asks it.

grpc says nothing of a peer's connection but its address and port, and
neither protocol says which user a local peer runs as; the kernel's table
lists every socket of this network namespace with its addresses, state,
owner's uid and inode. `open_connections` tells whether a gRPC peer's
connection is still open (grpc_peers.py); `loopback_peer_uid` which user a
loopback peer is (owners.py).
"""
from __future__ import annotations

import ipaddress
from typing import Iterator, Optional, Union

ESTABLISHED = "01"

IPAddress = Union[ipaddress.IPv4Address, ipaddress.IPv6Address]
Address = tuple[IPAddress, int]       # (address, port)


def peer_address(peer: str) -> Optional[Address]:
    """grpc's "ipv4:1.2.3.4:5" / "ipv6:[::1]:5" as (address, port)."""
    try:
        _scheme, _, rest = peer.partition(":")
        host, _, port = rest.rpartition(":")
        address = ipaddress.ip_address(host.strip("[]"))
        return plain(address), int(port)
    except ValueError:
        return None


def socket_address(host: str, port: int) -> Optional[Address]:
    """A socket's (host, port) as Python names it (getpeername) as (address, port)."""
    try:
        return plain(ipaddress.ip_address(str(host).split("%")[0])), int(port)
    except (ValueError, TypeError):
        return None


def plain(address: IPAddress) -> IPAddress:
    """An IPv4 address seen through an IPv6 socket (::ffff:a.b.c.d) as IPv4."""
    mapped = getattr(address, "ipv4_mapped", None)
    return mapped or address


def hex_address(text: str) -> Address:
    """/proc/net/tcp's "0100007F:1F90": the address in 32-bit words of host
    (little-endian) order, the port in hex."""
    host, port = text.split(":")
    raw = bytes.fromhex(host)
    packed = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return plain(ipaddress.ip_address(packed)), int(port, 16)


def _established() -> Iterator[list[str]]:
    """The fields of each established socket's line (local, remote, ..., uid at 7, inode at 9)."""
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(path) as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) >= 10 and fields[3] == ESTABLISHED:
                yield fields


def _port(text: str) -> int:
    return int(text.rpartition(":")[2], 16)


def open_connections(local_port: int) -> dict[Address, int]:
    """Established TCP connections to `local_port`: remote (address, port) -> inode."""
    return {hex_address(f[2]): int(f[9]) for f in _established() if _port(f[1]) == local_port}


def loopback_peer_uid(peer: Address, local_port: int) -> Optional[int]:
    """The uid owning the socket of `peer` (address, port), a loopback
    connection to `local_port` of this host; None when the table has no such
    socket (not loopback, or already closed)."""
    if not peer[0].is_loopback:
        return None
    for f in _established():
        # the peer's own end: its local address is the peer, its remote our port
        if _port(f[2]) == local_port and hex_address(f[1]) == peer:
            return int(f[7])
    return None
