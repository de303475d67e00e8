"""Client sessions: per-client arenas, outputs lent in place, registered regions.

A client says `hello` (over any frontend) and gets a session: an unguessable
token. A client on this host then attaches to it over the daemon's unix
side channel (local_channel.py), which tells the daemon who it is (uid, gid,
pid: SO_PEERCRED) and hands it, with SCM_RIGHTS, the fds of arena segments
the daemon made for it alone: sealed memfds it can write but not resize
(shm/segment.py). The client writes inputs there and sends descriptors;
workers read them in place. Outputs are lent to it in the workers' memory,
whose fds it gets read-only over the same channel. Triton-style registered
regions belong to the session that registered them, after a challenge: the
daemon picks a nonce, the client writes it at the region's offset, the
daemon reads it back (and the segment's owner and mode must let the peer
write it).

Safety rules (docs/security.md): local sessions are made only over the side
channel, never over tcp; every offset/size is checked for range and overflow
against the memory's real size; the daemon's own memory cannot be resized by
anyone, and client regions are read under a SIGBUS guard (shm/guard.py);
messages never echo a key; a region in use is unregistered only when its
requests finish; an idle session's lease expires and the daemon releases
what it held; each peer has limits (sessions, arena bytes, regions), and going
over one is RESOURCE_EXHAUSTED for that peer alone.
"""
from __future__ import annotations

import itertools
import logging
import os
import secrets
import socket
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence, Union, overload

from ..protocol import errors, messages
from ..protocol.errors import TorchpoolError
from ..protocol.internal import SegmentRef, lend_ref
from ..protocol.messages import Header
from ..protocol.tensors import BLOCK_HEADER_BYTES, BLOCK_MAGIC, read_block_header
from ..shm.fdpass import send_with_fds
from ..shm.segment import Segment
from .options import ServerOptions
from ..config.devices import visible_gpus
from .regions import (Challenge, CudaRegion, Peer, Region, answer_challenge, check_range, open_challenge,
                      open_cuda_region, region_key)

if TYPE_CHECKING:
    from .registry import ModelVersion

log = logging.getLogger("torchpool.broker")

AnyRegion = Union[Region, CudaRegion]


def _bad(message: str) -> TorchpoolError:
    return TorchpoolError(errors.INVALID_ARG, message)


def _no_region(what: str, name: object, detail: str = "") -> TorchpoolError:
    """Triton's NOT_FOUND text for a region name nobody registered."""
    return TorchpoolError(errors.NOT_FOUND, f"Unable to find {what}: '{name}'{detail}")


def _exhausted(message: str) -> TorchpoolError:
    return TorchpoolError(errors.RESOURCE_EXHAUSTED, message)


@dataclass(eq=False)
class Session:
    token: str
    last_seen: float
    identity: bytes = b""         # the client's ZeroMQ routing id (its connection)
    peer: Optional[Peer] = None   # set once it attached over the side channel
    channel: Optional[socket.socket] = None   # that side channel
    arena: dict[str, Segment] = field(default_factory=dict)
    handed: set[str] = field(default_factory=set)  # segments whose fds it was given
    loans: int = 0                # outputs lent to it now (the answer path owns the map of them)
    regions: dict[str, AnyRegion] = field(default_factory=dict)   # both kinds: one namespace, as Triton's
    challenges: dict[str, Challenge] = field(default_factory=dict)
    in_flight: int = 0
    # model version -> [(direct path name, worker)]: direct.py (a supervisor.WorkerHandle, not
    # named: the supervisor's modules import this one)
    direct: dict[ModelVersion, list[tuple[str, Any]]] = field(default_factory=dict)
    direct_failed: set[str] = field(default_factory=set)   # its paths whose instance's death is counted
    lend_id: int = 0              # names its lending areas in the workers (worker/lending.py)

    @property
    def local(self) -> bool:
        """Attached over the side channel: it shares memory with the daemon."""
        return self.channel is not None

    @property
    def arena_bytes(self) -> int:
        return sum(s.size for s in self.arena.values())


class SessionManager:
    def __init__(self, segment_prefix: str, options: ServerOptions,
                 end_loans: Callable[["Session"], None], forget: Callable[[Sequence[SegmentRef]], None],
                 local_socket: Optional[str] = None,
                 close_channel: Callable[[socket.socket], None] = lambda conn: conn.close(),
                 close_segment: Callable[[Segment], None] = Segment.close) -> None:
        self.prefix = segment_prefix
        self.options = options
        self.arena_size = options.client_shm_size
        self.arena_limit = options.client_shm_limit
        self.lease_s = options.client_lease
        self.local_socket = local_socket  # where clients attach (None: no local path)
        self.end_loans = end_loans        # (session) -> every output lent to it goes back
        self.forget = forget              # ([segment refs]) -> workers drop their mappings
        self.close_channel = close_channel
        # closes an ended session's arena segment: the server's reaper, off the
        # loop thread (the last close of a used 64 MiB arena takes 15-30 ms)
        self.close_segment = close_segment
        self.gpus: Callable[[], list[int]] = visible_gpus     # the device ids a CUDA region may name
        self.sessions: dict[str, Session] = {}
        self.segments: dict[str, Segment] = {}    # every client arena segment, by name
        self._counter = itertools.count()
        self._lend_ids = itertools.count(1)

    # --- lifecycle -------------------------------------------------------

    def hello(self, header: Header, identity: bytes = b"") -> Header:
        o = self.options
        if len(self.sessions) >= o.max_sessions and not self._forget_a_bare_session():
            raise _exhausted(f"this server already holds {len(self.sessions)} client sessions, its "
                             f"limit (--max-sessions); close unused clients")
        if identity:
            mine = sum(1 for s in self.sessions.values() if s.identity == identity)
            if mine >= o.max_sessions_per_peer:
                raise _exhausted(f"this connection already holds {mine} sessions, the limit per "
                                 f"connection (--max-sessions-per-peer)")
        session = Session(secrets.token_hex(16), time.monotonic(), identity, lend_id=next(self._lend_ids))
        self.sessions[session.token] = session
        return {"session": session.token, "local": False, "lease_s": self.lease_s,
                "local_socket": self.local_socket, "block_header": BLOCK_HEADER_BYTES}

    def _forget_a_bare_session(self) -> bool:
        """At --max-sessions, make room: close the longest idle session that
        holds nothing (not attached, so no memory, regions or loans; nothing in
        flight). Where libzmq cannot tell us of disconnects (no ROUTER_NOTIFY)
        a closed connection's sessions last a lease, so a client saying hello
        on connection after connection would otherwise hold every slot and
        lock every new client out; a client whose bare session went says hello
        again by itself at its next request (SESSION_LOST)."""
        bare = [s for s in self.sessions.values() if s.channel is None and s.in_flight == 0]
        if not bare:
            return False
        oldest = min(bare, key=lambda s: s.last_seen)
        log.info("client sessions at the limit (--max-sessions): forgetting session %s…, idle "
                 "for %.1f s and holding nothing", oldest.token[:8], time.monotonic() - oldest.last_seen)
        self.close(oldest)
        return True

    def attach(self, token: object, peer: Peer, channel: socket.socket, arena: bool = True
               ) -> tuple[Header, list[int]]:
        """A client on this host attaches to its session over the side channel:
        the session becomes local (and gets its first arena segment, unless
        the client only wants to register regions). Returns the answer and
        the fds to send with it."""
        session = self.sessions.get(token) if isinstance(token, str) else None
        if session is None:
            raise TorchpoolError(errors.SESSION_LOST, "unknown session (its lease expired or the daemon "
                                                      "restarted); say hello again")
        if session.channel is not None:
            raise _bad("this session is already attached")
        mine = sum(1 for s in self.sessions.values() if s.peer is not None and s.peer.uid == peer.uid)
        if mine >= self.options.max_sessions_per_peer:
            raise _exhausted(f"user {peer.uid} already holds {mine} local sessions, the limit per "
                             f"user (--max-sessions-per-peer)")
        segments = [self._new_arena_segment(session, self.arena_size)] if arena else []
        session.peer, session.channel = peer, channel
        session.last_seen = time.monotonic()
        session.handed.update(s.name for s in segments)
        return ({"ok": True, "arena": [{"segment": s.name, "size": s.size} for s in segments],
                 "block_header": BLOCK_HEADER_BYTES}, [s.fd for s in segments])

    def _new_arena_segment(self, session: Session, size: int) -> Segment:
        if session.arena_bytes + size > self.arena_limit:
            raise _exhausted(f"client arena limit reached: {session.arena_bytes} + {size} bytes "
                             f"exceeds {self.arena_limit} (--client-shm-limit)")
        total = sum(s.size for s in self.segments.values())
        if total + size > self.options.client_shm_total:
            raise _exhausted(f"the clients' arenas together would exceed {self.options.client_shm_total} "
                             f"bytes (--client-shm-total)")
        seg = Segment.create(f"{self.prefix}c{next(self._counter)}", size, prefault=False)
        session.arena[seg.name] = seg
        self.segments[seg.name] = seg
        return seg

    def grow(self, session: Session, header: Header) -> Header:
        if not session.local:
            raise _bad("arena_grow needs a local session (attach over the side channel first)")
        size = header.get("size")
        if not isinstance(size, int) or isinstance(size, bool) or not 0 < size <= self.arena_limit:
            raise _bad(f"arena_grow: size must be an integer in (0, {self.arena_limit}]")
        seg = self._new_arena_segment(session, max(size, self.arena_size))
        try:
            self.hand_over(session, [seg], writable=True)
        except TorchpoolError:
            self._drop_arena_segment(session, seg)
            raise
        return {"segment": seg.name, "size": seg.size}

    def hand_over(self, session: Session, segments: list[Segment], writable: bool) -> None:
        """Send the session's client these segments' fds over its side channel
        (before any answer names them). Read-only fds for outputs lent to it.
        Raises RESOURCE_EXHAUSTED when the client does not read its channel."""
        channel = session.channel
        assert channel is not None       # its callers hand over to local sessions only (grow, offer)
        fds = [s.fd if writable else s.readonly_fd() for s in segments]
        try:
            body = messages.pack({"segments": [{"segment": s.name, "size": s.size} for s in segments]})
            send_with_fds(channel, body, fds, socket.MSG_DONTWAIT)
        except OSError:
            raise _exhausted("the client does not read its local side channel; the daemon cannot "
                             "hand it shared memory") from None
        finally:
            if not writable:
                for fd in fds:
                    os.close(fd)
        session.handed.update(s.name for s in segments)

    def offer(self, session: Session, segment: Segment) -> bool:
        """Can an output in `segment` be lent to this session? (its fd is
        handed over first; False when the client cannot take it now)."""
        if segment.name in session.handed:
            return True
        if session.channel is None or segment.fd < 0:
            return False
        try:
            self.hand_over(session, [segment], writable=False)
        except TorchpoolError:
            return False
        return True

    def segment(self, name: str) -> Optional[Segment]:
        """A client arena segment by name (workers are handed its fd)."""
        return self.segments.get(name)

    @overload
    def get(self, token: str, identity: bytes = b"") -> Session: ...
    @overload
    def get(self, token: object, identity: bytes = b"") -> Optional[Session]: ...
    def get(self, token: object, identity: bytes = b"") -> Optional[Session]:
        """The request's session (renewing its lease); None when it names none."""
        if token is None:
            return None
        session = self.sessions.get(token) if isinstance(token, str) else None
        if session is None:
            raise TorchpoolError(errors.SESSION_LOST, "unknown session (its lease expired or the daemon "
                                                      "restarted); say hello again")
        session.last_seen = time.monotonic()
        if identity:
            session.identity = identity
        return session

    def disconnected(self, identity: bytes) -> None:
        """The client's connection closed: nobody can read its outputs any more."""
        for s in [s for s in self.sessions.values() if s.identity == identity]:
            self._gone(s)

    def channel_closed(self, session: Session) -> None:
        """The client's side channel closed: it exited (or gave up the local path)."""
        if session.token in self.sessions:
            self._gone(session)

    def _gone(self, s: Session) -> None:
        if s.in_flight:
            s.last_seen = 0.0           # closed by the lease sweep once its requests finish
        else:
            log.debug("client session %s… went away: releasing its shared memory", s.token[:8])
            self.close(s)

    def close(self, session: Session) -> None:
        """Give back everything the session held."""
        self.sessions.pop(session.token, None)
        self.end_loans(session)
        for name in list(session.regions):
            self._unregister(session, name)
        for challenge in session.challenges.values():
            os.close(challenge.fd)
        session.challenges.clear()
        forgotten = list(session.arena) + [name for paths in session.direct.values() for name, _ in paths]
        if session.local:         # the workers' lending areas of it go (worker/lending.py)
            forgotten.append(lend_ref(session.lend_id))
        session.direct.clear()
        for seg in list(session.arena.values()):
            self._drop_arena_segment(session, seg, tell_workers=False)
        if forgotten:
            self.forget(forgotten)
        if session.channel is not None:
            channel, session.channel = session.channel, None
            self.close_channel(channel)

    def _drop_arena_segment(self, session: Session, seg: Segment, tell_workers: bool = True) -> None:
        session.arena.pop(seg.name, None)
        self.segments.pop(seg.name, None)
        self.close_segment(seg)     # the memory goes when the client and the workers unmap it too
        if tell_workers:
            self.forget([seg.name])

    def expire(self) -> int:
        """Close sessions idle past their lease with nothing in flight. A
        session still holding lent outputs gets ten leases: its client may be
        reading them (a disconnect, where libzmq reports it, ends it at once)."""
        now = time.monotonic()
        for s in self.sessions.values():
            for name in [n for n, c in s.challenges.items() if c.expires < now]:
                os.close(s.challenges.pop(name).fd)
        idle = [s for s in self.sessions.values()
                if s.in_flight == 0
                and now - s.last_seen > self.lease_s * (10 if s.loans and s.last_seen else 1)]
        for s in idle:
            log.info("client session %s… idle for %.0f s: releasing its shared memory", s.token[:8],
                     now - s.last_seen)
            self.close(s)
        return len(idle)

    def close_all(self) -> None:
        for s in list(self.sessions.values()):
            self.close(s)

    # --- arena inputs ------------------------------------------------------------

    def arena_view(self, session: Optional[Session], ref: object, what: str) -> tuple[memoryview, list[object]]:
        """Check an input's `shm` descriptor; (bytes, [segment, offset, nbytes, generation])."""
        if session is None or not session.local:
            raise _bad(f"{what}: 'shm' descriptors need a local session (say hello first)")
        if not (isinstance(ref, list) and len(ref) == 4 and isinstance(ref[0], str)):
            raise _bad(f"{what}: 'shm' must be [segment, offset, nbytes, generation]")
        segment, offset, nbytes, generation = ref
        seg = session.arena.get(segment)
        if seg is None:
            raise _bad(f"{what}: the segment is not part of this session's arena")
        check_range(what, offset, nbytes, seg.size)
        if offset < BLOCK_HEADER_BYTES:
            raise _bad(f"{what}: offset {offset} leaves no room for the block header")
        magic, gen, size = read_block_header(seg.buf, offset - BLOCK_HEADER_BYTES)
        if magic != BLOCK_MAGIC or gen != generation or size != nbytes:
            raise _bad(f"{what}: stale descriptor (block header says generation {gen}, {size} bytes; "
                       f"the request says generation {generation}, {nbytes} bytes)")
        return memoryview(seg.buf)[offset:offset + nbytes], [segment, offset, nbytes, generation]

    # --- regions -----------------------------------------------------------------

    def register(self, session: Session, header: Header) -> Union[Header, bool]:
        """Triton's register, as a challenge: the first call opens the segment
        and answers {"challenge": nonce}; the client writes the nonce at the
        region's offset and calls again with "challenge": nonce; the daemon
        reads it back and maps the region (true)."""
        name = self._new_region_name(session, header, "register_system_shared_memory")
        if "challenge" in header:
            return self._answer_challenge(session, name, header.get("challenge"))
        return self._challenge(session, name, header)

    @staticmethod
    def _new_region_name(session: Session, header: Header, op: str) -> str:
        """The name a register call gives, for a local session, not taken by
        a region of either kind (one namespace, as Triton's)."""
        name = header.get("name")
        if not isinstance(name, str) or not name:
            raise _bad(f"{op}: 'name' must be a non-empty string")
        if not session.local:
            raise _bad(f"region '{name}': registered regions need a local session (a client on "
                       f"this host attached over the daemon's side channel)")
        if name in session.regions:
            # Triton's words (shared_memory_manager.cc), which its QA asserts
            raise TorchpoolError(errors.ALREADY_EXISTS, f"shared memory region '{name}' already in manager")
        return name

    def _check_room(self, session: Session, name: str) -> None:
        limit = self.options.max_regions_per_session
        if len(session.regions) + len(session.challenges) >= limit:
            raise _exhausted(f"region '{name}': this session already has {limit} regions, the "
                             f"limit (--max-regions-per-session)")

    def _challenge(self, session: Session, name: str, header: Header) -> Header:
        key = region_key(name, header.get("key"))
        self._check_room(session, name)
        assert session.peer is not None  # set with its channel (attach): register checked it is local
        challenge = open_challenge(session.peer, name, key, header.get("offset", 0), header.get("byte_size"),
                                   str(header["key"]))     # (a str: region_key checked it)
        old = session.challenges.pop(name, None)
        if old is not None:
            os.close(old.fd)
        session.challenges[name] = challenge
        return {"challenge": challenge.nonce}

    def register_cuda(self, session: Session, header: Header) -> bool:
        """Triton's CUDA register: the handle is kept (the workers open it
        when a request names the region); the GPU must be one of ours."""
        name = self._new_region_name(session, header, "register_cuda_shared_memory")
        if name in session.challenges:          # a system region of that name on its way
            raise TorchpoolError(errors.ALREADY_EXISTS, f"shared memory region '{name}' already in manager")
        self._check_room(session, name)
        session.regions[name] = open_cuda_region(name, header.get("raw_handle"), header.get("device_id"),
                                                 header.get("byte_size"), self.gpus())
        return True

    def _answer_challenge(self, session: Session, name: str, answer: object) -> bool:
        c = session.challenges.pop(name, None)
        if c is None:
            raise _bad(f"region '{name}': no challenge is pending (ask for one first)")
        session.regions[name] = answer_challenge(c, name, answer)
        return True

    def region(self, session: Optional[Session], ref: object, what: str) -> tuple[AnyRegion, int, int]:
        """Resolve `[name, byte_size, offset]` against the session's regions."""
        if session is None:
            raise _bad(f"{what}: 'region' references need a session (say hello first)")
        if not (isinstance(ref, list) and len(ref) == 3 and isinstance(ref[0], str)):
            raise _bad(f"{what}: 'region' must be [name, byte_size, offset]")
        name, nbytes, offset = ref
        region = session.regions.get(name)
        if region is None or region.unregistering:
            raise _no_region("shared memory region", name, f" ({what}; regions belong to the session "
                                                           f"that registered them)")
        offset, nbytes = region.check(f"{what} in region '{name}'", offset, nbytes)
        return region, offset, nbytes

    def unregister(self, session: Session, name: object, cuda: bool = False) -> bool:
        """Unregister one region of a kind (system, or CUDA), or all of that
        kind; a name not registered (as that kind) is no error (as in Triton)."""
        names = list(session.regions) if name is None else [name]
        for n in names:
            region = session.regions.get(n) if isinstance(n, str) else None
            if region is not None and isinstance(region, CudaRegion) == cuda:
                self._unregister(session, region.name)
        return True

    def _unregister(self, session: Session, name: str) -> None:
        region = session.regions[name]
        region.unregistering = True
        if region.in_use == 0:
            self._drop_region(session, region)

    def region_done(self, session: Session, region: AnyRegion) -> None:
        region.in_use -= 1
        if region.unregistering and region.in_use == 0:
            self._drop_region(session, region)

    def _drop_region(self, session: Session, region: AnyRegion) -> None:
        session.regions.pop(region.name, None)
        self.forget([region.segment_ref()])
        region.close()

    def status(self, session: Session, name: object) -> list[Header]:
        regions = [r for r in session.regions.values()
                   if isinstance(r, Region) and (name is None or r.name == name)]
        if name is not None and not regions:
            raise _no_region("system shared memory region", name)
        return [{"name": r.name, "key": r.given_key or r.key, "offset": r.offset, "byte_size": r.byte_size,
                 "in_use": r.in_use, "unregistering": r.unregistering} for r in regions]

    def cuda_status(self, session: Session, name: object) -> list[Header]:
        regions = [r for r in session.regions.values()
                   if isinstance(r, CudaRegion) and (name is None or r.name == name)]
        if name is not None and not regions:
            raise _no_region("cuda shared memory region", name)
        return [{"name": r.name, "device_id": r.device_id, "byte_size": r.byte_size, "in_use": r.in_use,
                 "unregistering": r.unregistering} for r in regions]
