"""gRPC callers: one per peer, and when a peer's connection is gone.

grpc names the peer of a call by its address and port ("ipv4:127.0.0.1:
40312"): one HTTP/2 connection, what callers.py takes as a caller. grpc
says nothing when a connection closes, so the kernel is asked:
`open_connections` (tcp_table.py) reads /proc/net/tcp and tcp6 for the established
connections to the gateway's port, each with its socket's inode (never the
same for two sockets open at once). A caller that holds regions is tied to
the inode its connection had when it registered; once no connection from
its address and port is open, or one with another inode is (the port was
reused), it is forgotten (Backend.forget: its own regions go, its user's
stay). That is checked every `SWEEP_S` seconds, and only while some caller
holds regions.

Streams are also counted by peer beyond the connection (callers.PeerKey: a
loopback peer's uid, another host's address): grpc bounds the streams of
one connection, and a client that opens connection after connection would
otherwise hold that many again on each (issue 39, item 1: 4 connections x
100 streams never read). The key is looked up once per connection, at its
first stream.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable, Optional

from ..protocol import errors
from ..protocol.errors import TorchpoolError
from .callers import Caller, PeerKey
from .tcp_table import loopback_peer_uid, open_connections, peer_address

log = logging.getLogger("torchpool.gateway.grpc")

SWEEP_S = 1.0

class GrpcCallers:
    """The callers of a gRPC server on `port`, by peer; `forget` is
    Backend.forget. A caller with nothing in progress and no regions is
    not kept."""

    def __init__(self, port: int, forget: Callable[[Caller], Awaitable[None]],
                 max_streams_per_peer: int = 0) -> None:
        self.port = port
        self.forget = forget
        self.max_streams_per_peer = max_streams_per_peer     # 0: no cap
        self._streams: dict[PeerKey, int] = {}          # open ModelStreamInfer streams by peer
        self.by_peer: dict[str, Caller] = {}
        self._connection: dict[Caller, int] = {}    # caller with regions -> its socket's inode
        self._sweeper: Optional[asyncio.Task] = None
        self._tracking: set[Caller] = set()      # callers whose uses_regions is under way

    def enter(self, peer: str) -> Caller:
        caller = self.by_peer.get(peer)
        if caller is None:
            caller = self.by_peer[peer] = Caller(f"gRPC {peer}", peer_address(peer), self.port)
            caller.peer = peer
        caller.calls += 1
        return caller

    def leave(self, caller: Caller) -> None:
        caller.calls -= 1
        if caller.owner is not None and caller not in self._connection and caller not in self._tracking:
            # it used regions (a region call, or an infer naming them): its
            # owner keeps them while it is connected
            self._tracking.add(caller)
            asyncio.ensure_future(self.uses_regions(caller))
        elif caller.calls == 0 and caller.owner is None and self.by_peer.get(caller.peer) is caller:
            del self.by_peer[caller.peer]
            self._connection.pop(caller, None)

    async def open_stream(self, caller: Caller) -> None:
        """Count a new stream of `caller`'s peer; RESOURCE_EXHAUSTED when
        the peer holds `max_streams_per_peer` open already (then nothing is
        counted). `close_stream` when it ends. Without a cap nothing is
        counted (nor looked up)."""
        if not self.max_streams_per_peer:
            return
        key = caller.peer_key
        if key is None:
            key = caller.peer_key = await self._peer_key(caller)
        open_now = self._streams.get(key, 0)
        if open_now >= self.max_streams_per_peer:
            raise TorchpoolError(errors.RESOURCE_EXHAUSTED,
                                 f"{_describe(key, caller)} has {open_now} ModelStreamInfer streams open, the most "
                                 f"one peer may (--grpc-max-streams-per-peer); end one before opening another")
        self._streams[key] = open_now + 1

    def close_stream(self, caller: Caller) -> None:
        key = caller.peer_key
        if key is None:
            return
        left = self._streams.get(key, 0) - 1
        if left > 0:
            self._streams[key] = left
        else:
            self._streams.pop(key, None)

    def open_streams(self) -> dict[PeerKey, int]:
        return dict(self._streams)

    async def _peer_key(self, caller: Caller) -> PeerKey:
        address = caller.address
        if address is None:
            return ("caller", id(caller))
        if not address[0].is_loopback:
            return ("address", str(address[0]))
        uid = await asyncio.get_running_loop().run_in_executor(None, loopback_peer_uid, address, self.port)
        return ("uid", uid) if uid is not None else ("caller", id(caller))

    async def uses_regions(self, caller: Caller) -> None:
        """`caller` shares an owner's regions now: it counts while its
        connection is open."""
        if caller in self._connection or caller.owner is None:
            self._tracking.discard(caller)
            return
        try:
            address = peer_address(caller.peer)
            connections = await asyncio.get_running_loop().run_in_executor(None, open_connections, self.port)
        finally:
            self._tracking.discard(caller)
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
                if caller.owner is None:
                    self._connection.pop(caller, None)
                    continue
                address = peer_address(caller.peer)
                if address is not None and connections.get(address, -2) == inode:
                    continue
                log.info("%s is gone", caller.name)
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


def _describe(key: PeerKey, caller: Caller) -> str:
    kind, value = key
    if kind == "uid":
        return f"gRPC user uid {value}"
    if kind == "address":
        return f"gRPC peer {value}"
    return caller.name
