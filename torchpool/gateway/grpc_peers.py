"""gRPC callers: one per peer, and when a peer's connection is gone.

grpc names the peer of a call by its address and port ("ipv4:127.0.0.1:
40312"): one HTTP/2 connection, what callers.py takes as a caller. grpc
says nothing when a connection closes, so the kernel is asked:
`open_connections` reads /proc/net/tcp and tcp6 for the established
connections to the gateway's port, each with its socket's inode (never the
same for two sockets open at once). A caller that holds regions is tied to
the inode its connection had when it registered; once no connection from
its address and port is open, or one with another inode is (the port was
reused), it is forgotten and its regions go. That is checked every
`SWEEP_S` seconds, and only while some caller holds regions.
"""
from __future__ import annotations

import asyncio
import ipaddress
import logging
from typing import Any, Optional

from .callers import Caller

log = logging.getLogger("torchpool.gateway.grpc")

SWEEP_S = 1.0
_ESTABLISHED = "01"

Address = tuple[Any, int]       # (ipaddress.IPv4Address or IPv6Address, port)


def peer_address(peer: str) -> Optional[Address]:
    """grpc's "ipv4:1.2.3.4:5" / "ipv6:[::1]:5" as (address, port)."""
    try:
        _scheme, _, rest = peer.partition(":")
        host, _, port = rest.rpartition(":")
        address = ipaddress.ip_address(host.strip("[]"))
        return _plain(address), int(port)
    except ValueError:
        return None


def _plain(address: Any) -> Any:
    """An IPv4 address seen through an IPv6 socket (::ffff:a.b.c.d) as IPv4."""
    mapped = getattr(address, "ipv4_mapped", None)
    return mapped or address


def _hex_address(text: str) -> Address:
    """/proc/net/tcp's "0100007F:1F90": the address in 32-bit words of host
    (little-endian) order, the port in hex."""
    host, port = text.split(":")
    raw = bytes.fromhex(host)
    packed = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return _plain(ipaddress.ip_address(packed)), int(port, 16)


def open_connections(local_port: int) -> dict[Address, int]:
    """Established TCP connections to `local_port`: remote (address, port) -> inode."""
    found: dict[Address, int] = {}
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(path) as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 10 or fields[3] != _ESTABLISHED:
                continue
            if int(fields[1].rpartition(":")[2], 16) != local_port:
                continue
            found[_hex_address(fields[2])] = int(fields[9])
    return found


class GrpcCallers:
    """The callers of a gRPC server on `port`, by peer; `forget` is
    Backend.forget. A caller with nothing in progress and no regions is
    not kept."""

    def __init__(self, port: int, forget: Any) -> None:
        self.port = port
        self.forget = forget
        self.by_peer: dict[str, Caller] = {}
        self._connection: dict[Caller, int] = {}    # caller with regions -> its socket's inode
        self._sweeper: Optional[asyncio.Task] = None

    def enter(self, peer: str) -> Caller:
        caller = self.by_peer.get(peer)
        if caller is None:
            caller = self.by_peer[peer] = Caller(f"gRPC {peer}")
            caller.peer = peer
        caller.calls += 1
        return caller

    def leave(self, caller: Caller) -> None:
        caller.calls -= 1
        if caller.calls == 0 and caller.regions is None and self.by_peer.get(caller.peer) is caller:
            del self.by_peer[caller.peer]
            self._connection.pop(caller, None)

    async def regions_registered(self, caller: Caller) -> None:
        """`caller` holds regions now: tie them to its connection."""
        if caller in self._connection or caller.regions is None:
            return
        address = peer_address(caller.peer)
        connections = await asyncio.get_running_loop().run_in_executor(None, open_connections, self.port)
        inode = connections.get(address) if address is not None else None
        self._connection[caller] = inode if inode is not None else -1
        if self._sweeper is None or self._sweeper.done():
            self._sweeper = asyncio.ensure_future(self._sweep())

    async def _sweep(self) -> None:
        loop = asyncio.get_running_loop()
        while self._connection:
            await asyncio.sleep(SWEEP_S)
            connections = await loop.run_in_executor(None, open_connections, self.port)
            for caller, inode in list(self._connection.items()):
                if caller.regions is None:
                    self._connection.pop(caller, None)
                    continue
                address = peer_address(caller.peer)
                if address is not None and connections.get(address, -2) == inode:
                    continue
                log.info("%s is gone: its regions are unregistered", caller.name)
                self._connection.pop(caller, None)
                if self.by_peer.get(caller.peer) is caller:
                    del self.by_peer[caller.peer]
                await self.forget(caller)

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            await asyncio.gather(self._sweeper, return_exceptions=True)
        for caller in list(self._connection):
            await self.forget(caller)
        self._connection.clear()
