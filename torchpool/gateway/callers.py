"""Remote callers of the gateway, and each one's turn at the daemon.

A caller is one HTTP connection or one gRPC peer (the HTTP/2 connection grpc
names by the peer's address and port). Those are the only identities the two
protocols give without authentication that another caller cannot take: every
client on this host shares one address (127.0.0.1), so an address would not
keep a local attacker apart from its neighbours. A caller ends when its
connection does (http_protocol.py; grpc_peers.py for gRPC).

The gateway talks to the daemon as one client, which the daemon lets hold
`MAX_IN_FLIGHT` requests at once. `FairShare` splits that between callers:
each holds at most `per_caller` of them (defaults.MAX_IN_FLIGHT_PER_CALLER,
--gateway-max-in-flight-per-caller); a request past either limit waits
here, in its caller's queue, and freed places go to the waiting callers in
turn (round robin), so one caller's thousand requests wait behind each
other, not in front of another caller's one.
"""
from __future__ import annotations

import asyncio
from collections import deque
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from .owners import RegionOwner

# Who a caller is beyond its connection: ("uid", 1000) for a loopback peer
# whose socket the kernel names, ("address", "10.1.2.3") for another host,
# ("caller", id) when neither is known (then it is its connection alone).
PeerKey = tuple[str, object]


class Caller:
    """One remote caller: its requests at the daemon and waiting, where it
    connects from, and the owner of the regions it may use (owners.py;
    Backend finds it at the caller's first use of regions)."""

    __slots__ = ("name", "peer", "calls", "in_flight", "waiting", "address", "local_port", "owner",
                 "gone", "read_ahead", "peer_key")

    def __init__(self, name: str, address: Optional[tuple] = None, local_port: int = 0) -> None:
        self.name = name                    # for logs: "HTTP 127.0.0.1:40312", "gRPC ipv4:..."
        self.peer = ""                      # gRPC: grpc's name of the peer
        self.calls = 0                      # gRPC: calls in progress
        self.in_flight = 0
        self.waiting: deque[asyncio.Future] = deque()
        self.address = address              # the peer's (address, port) (tcp_table.Address), if IP
        self.local_port = local_port        # the gateway's port it connected to
        self.owner: Optional[RegionOwner] = None   # once it used regions
        self.gone = False
        # gRPC: its streamed requests read ahead of their answers, all its
        # streams together (grpc_server.py makes it on its first stream)
        self.read_ahead: Optional[ReadAhead] = None
        # gRPC: who it is beyond its connection, once a stream asked (grpc_peers.py)
        self.peer_key: Optional[PeerKey] = None

    def __repr__(self) -> str:
        return f"Caller({self.name})"


class FairShare:
    """Places for requests at the daemon: `total` in all, `per_caller` for
    one caller; callers waiting for a place get one in turn."""

    def __init__(self, total: int, per_caller: int) -> None:
        self.total = total
        self.per_caller = per_caller
        self.in_flight = 0
        self._turns: deque[Caller] = deque()    # callers with requests waiting, next first

    async def enter(self, caller: Caller) -> None:
        """Wait for a place (in this caller's order); `leave` gives it back.

        Every caller still waiting while places are free is at its own
        limit (`_hand_out` runs whenever a place frees), so a caller under
        its limit takes a free place at once: a new caller never waits for
        another's request to finish (it did, when any caller was waiting;
        behind a stopped or slow model that was a lock-out)."""
        if not caller.waiting and self.in_flight < self.total and caller.in_flight < self.per_caller:
            self._take(caller)
            return
        fut = asyncio.get_running_loop().create_future()
        caller.waiting.append(fut)
        if len(caller.waiting) == 1:
            self._turns.append(caller)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.leave(caller)          # a place came as the request was cancelled
            else:
                self._forget(caller, fut)
            raise

    def leave(self, caller: Caller) -> None:
        caller.in_flight -= 1
        self.in_flight -= 1
        self._hand_out()

    def _take(self, caller: Caller) -> None:
        caller.in_flight += 1
        self.in_flight += 1

    def _forget(self, caller: Caller, fut: asyncio.Future) -> None:
        try:
            caller.waiting.remove(fut)
        except ValueError:
            return
        if not caller.waiting:
            self._turns.remove(caller)

    def _hand_out(self) -> None:
        """Free places to waiting callers, one each per round, skipping those
        at their own limit."""
        skipped = 0
        while self.in_flight < self.total and skipped < len(self._turns):
            caller = self._turns.popleft()
            if caller.in_flight >= self.per_caller:
                self._turns.append(caller)
                skipped += 1
                continue
            skipped = 0
            fut = caller.waiting.popleft()
            if not fut.done():              # not one cancelled while it waited
                self._take(caller)
                fut.set_result(None)
            if caller.waiting:
                self._turns.append(caller)

    def waiting(self) -> int:
        return sum(len(c.waiting) for c in self._turns)


class StreamAhead:
    """One stream's part of its caller's ReadAhead: its requests read and
    not answered, and its reader while it waits for room."""

    __slots__ = ("own", "waiter")

    def __init__(self) -> None:
        self.own = 0
        self.waiter: Optional[asyncio.Future] = None


class ReadAhead:
    """A caller's streamed requests read and not yet answered, all its
    streams together: a stream reads another while the caller holds fewer
    than `limit`, or when it has none of its own waiting (so a stream whose
    client reads its answers never waits for another stream's client).

    A stream that must wait is handed a place when one frees, first come
    first served, one stream per place (or woken when its own last request
    is answered), never all at once: a caller's hundreds of streams woken
    for each answer kept the event loop busy re-checking them, and every
    other caller's call waited for those rounds (issue 39, item 1)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0
        self._promised = 0              # places handed to waiting streams that have not taken them yet
        self._waiting: deque[asyncio.Future] = deque()      # streams' readers, first first

    async def take(self, stream: StreamAhead) -> None:
        """Wait for room for one more request of `stream`, and count it."""
        while stream.own and self.held + self._promised >= self.limit:
            waiter = stream.waiter = asyncio.get_running_loop().create_future()
            self._waiting.append(waiter)
            try:
                handed = await waiter       # True: a place; False: it holds none of its own now
            except asyncio.CancelledError:
                if waiter.done() and not waiter.cancelled() and waiter.result():
                    self._promised -= 1     # handed a place as it was cancelled: the next one's
                    self._hand_out()
                raise
            finally:
                stream.waiter = None
            if handed:
                self._promised -= 1
                break
        self.held += 1
        stream.own += 1

    def give(self, stream: StreamAhead, n: int = 1) -> None:
        """`n` of `stream`'s requests answered (or dropped): each place freed
        goes to the first waiting stream, and `stream` reads on once it
        holds none."""
        stream.own -= n
        self.held -= n
        if not stream.own and stream.waiter is not None and not stream.waiter.done():
            stream.waiter.set_result(False)
        self._hand_out()

    def _hand_out(self) -> None:
        while self.held + self._promised < self.limit and self._waiting:
            waiter = self._waiting.popleft()
            if not waiter.done():           # (not a cancelled stream's, nor one woken already)
                waiter.set_result(True)
                self._promised += 1
