"""Whose registered regions a caller may use: its region owner.

Triton keeps system shared-memory regions server-wide: any client may use,
see or unregister any region. Its own tools rely on part of that:
perf_analyzer registers its regions on one connection and infers from
another per thread, and users' code does the same with several
`InferenceServerClient`s. torchpool gives regions an owner instead:

- a caller on this host (a loopback peer) is owned by its **uid**: every
  connection of processes of one user shares that user's regions, over HTTP
  and gRPC alike. The kernel says which uid a loopback peer's socket
  belongs to (/proc/net/tcp and tcp6 list both ends of a loopback
  connection, each with its owner's uid: tcp_table.py); one user can read another
  process of the same user's memory anyway, so sharing its regions gives
  nothing away. Another user's connections cannot see, use or unregister
  them.
- any other caller (another host, or a loopback peer the kernel's table
  does not show) owns its regions alone, per connection (HTTP) or peer
  (gRPC): nothing tells two remote connections apart as one client.

An owner's regions live in a daemon session of its own (so the daemon's
region limit, --max-regions-per-session, and "unregister all" are the
owner's alone), which the gateway renews while it holds regions (the daemon
ends a session idle for its lease, --client-lease). How long they stay:

- a user's (uid) regions stay until they are unregistered, or the gateway
  stops, as Triton keeps regions: also after the user's last connection
  closes (perf_analyzer registers on a connection it closes, then infers
  on others). A later connection of that uid sees, uses and unregisters
  them; another uid's still cannot. The region limit bounds what one user
  holds, and there are as many such owners as users that registered.
- a caller's own regions go when its connection does (HTTP: when it
  closes; gRPC: when the kernel no longer shows it, grpc_peers.py):
  nothing would let a later connection prove it is the same client.
"""
from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from ..client import AsyncClient

OwnerKey = tuple[str, object]        # ("uid", 1000) or ("caller", id of the caller)


class RegionOwner:
    """The regions of one owner: its daemon session, what it registered
    there, and the callers (connections) it is shared by."""

    __slots__ = ("key", "name", "client", "renewal", "names", "cuda_names", "lock", "callers")

    def __init__(self, key: OwnerKey, name: str) -> None:
        self.key = key
        self.name = name                         # for logs: "uid 1000", or the caller's name
        self.client: Optional[AsyncClient] = None   # an AsyncClient with its own session, while it holds regions
        self.renewal: Optional[asyncio.Task[None]] = None   # what renews that session's lease meanwhile
        self.names: set[str] = set()             # the system regions registered there
        self.cuda_names: set[str] = set()        # ... and the CUDA regions (one namespace in the daemon)
        self.lock = asyncio.Lock()               # one region call of an owner at a time: they are rare
        self.callers: set[object] = set()        # the callers.Caller using them (callers.py imports this)

    def regions(self) -> int:
        """How many regions (of both kinds) its session holds."""
        return len(self.names) + len(self.cuda_names)

    def __repr__(self) -> str:
        return f"RegionOwner({self.name})"
