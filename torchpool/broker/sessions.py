"""Client sessions: per-client arenas, outputs lent in place, registered regions.

A local client says `hello` and gets a session: an unguessable token, and
arena segments the daemon creates for that client alone. The client writes
inputs there and sends descriptors; workers read them in place. Outputs are
lent to the client in the worker's shared memory until it releases them.
Triton-style registered regions belong to the session that registered them,
after the client proved it can read the segment.

Safety rules (docs/protocol.md): every offset/size is checked for range and
overflow against the segment's real size (fstat) at registration and on every
request; the daemon's own names cannot be registered; messages never echo a
key; a region in use is unregistered only when its requests finish; an idle
session's lease expires and the daemon releases what it held — unlinking only
the arena segments it created itself, never a client's region.
"""
from __future__ import annotations

import itertools
import logging
import mmap
import os
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import posix_ipc

from ..protocol import errors
from ..protocol.errors import TorchpoolError
from ..protocol.messages import REGION_TOKEN_BYTES
from ..shm.naming import PREFIX, boot_id
from ..protocol.tensors import BLOCK_HEADER_BYTES, BLOCK_MAGIC, read_block_header
from ..shm.segment import Segment

log = logging.getLogger("torchpool.broker")

MAX_INT = (1 << 63) - 1


def _bad(message: str) -> TorchpoolError:
    return TorchpoolError(errors.INVALID_ARG, message)


def _check_range(what: str, offset: Any, nbytes: Any, size: int) -> None:
    """offset and nbytes are ints, >= 0, and offset + nbytes fits in size."""
    for label, v in (("offset", offset), ("byte size", nbytes)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 0 or v > MAX_INT:
            raise _bad(f"{what}: {label} {v!r} is not an integer in [0, 2^63)")
    if offset + nbytes > size:
        raise _bad(f"{what}: offset {offset} + byte size {nbytes} = {offset + nbytes} exceeds "
                   f"the {size} bytes available")


@dataclass(eq=False)
class Region:
    """A client-owned segment registered under a name (Triton's system shm)."""

    name: str
    key: str                      # shm_open name without the leading '/'
    offset: int
    byte_size: int
    fd: int
    ino: int
    buf: mmap.mmap
    in_use: int = 0
    unregistering: bool = False

    def real_size(self) -> int:
        return os.fstat(self.fd).st_size

    def check(self, what: str, offset: Any, nbytes: Any) -> None:
        """A request's (offset, nbytes) within the region and the segment now."""
        _check_range(what, offset, nbytes, self.byte_size)
        end = self.offset + offset + nbytes
        if end > self.real_size() or end > len(self.buf):
            raise _bad(f"{what}: region '{self.name}' is smaller than registered "
                       f"(the segment shrank); unregister and register it again")

    def view(self, offset: int, nbytes: int) -> memoryview:
        start = self.offset + offset
        return memoryview(self.buf)[start:start + nbytes]

    def worker_ref(self) -> list:
        """How a worker names it: the key plus the inode, so a re-created
        segment under the same name is never mistaken for this one."""
        return [self.key, self.ino]

    def close(self) -> None:
        try:
            self.buf.close()
        except BufferError:
            pass
        os.close(self.fd)


@dataclass(eq=False)
class Session:
    token: str
    local: bool
    last_seen: float
    identity: bytes = b""         # the client's ZeroMQ routing id (its connection)
    arena: dict[str, Segment] = field(default_factory=dict)
    loans: int = 0                # outputs lent to it now (the answer path owns the map of them)
    regions: dict[str, Region] = field(default_factory=dict)
    in_flight: int = 0

    @property
    def arena_bytes(self) -> int:
        return sum(s.size for s in self.arena.values())


class SessionManager:
    def __init__(self, segment_prefix: str, arena_size: int, arena_limit: int, lease_s: float,
                 end_loans: Callable[["Session"], None], forget: Callable[[list], None]) -> None:
        self.prefix = segment_prefix
        self.arena_size = arena_size
        self.arena_limit = arena_limit
        self.lease_s = lease_s
        self.end_loans = end_loans        # (session) -> every output lent to it goes back
        self.forget = forget              # ([segment refs]) -> workers drop their mappings
        self.sessions: dict[str, Session] = {}
        self._counter = itertools.count()
        self._generations = itertools.count(1)
        self.boot_id = boot_id()

    # --- lifecycle -------------------------------------------------------

    def hello(self, header: dict, identity: bytes = b"") -> dict:
        local = bool(header.get("local")) and header.get("boot_id") == self.boot_id and bool(self.boot_id)
        session = Session(secrets.token_hex(16), local, time.monotonic(), identity)
        if local:
            self._add_segment(session, self.arena_size)
        self.sessions[session.token] = session
        return {"session": session.token, "local": local, "boot_id": self.boot_id,
                "arena": [{"segment": s.name, "size": s.size} for s in session.arena.values()],
                "lease_s": self.lease_s, "block_header": BLOCK_HEADER_BYTES}

    def _add_segment(self, session: Session, size: int) -> Segment:
        if session.arena_bytes + size > self.arena_limit:
            raise TorchpoolError(errors.UNAVAILABLE,
                                 f"client arena limit reached: {session.arena_bytes} + {size} bytes "
                                 f"exceeds {self.arena_limit}")
        seg = Segment.create(f"{self.prefix}c{next(self._counter)}", size, prefault=False)
        session.arena[seg.name] = seg
        return seg

    def grow(self, session: Session, header: dict) -> dict:
        if not session.local:
            raise _bad("arena_grow needs a local session")
        size = header.get("size")
        if not isinstance(size, int) or isinstance(size, bool) or not 0 < size <= self.arena_limit:
            raise _bad(f"arena_grow: size must be an integer in (0, {self.arena_limit}]")
        seg = self._add_segment(session, max(size, self.arena_size))
        return {"segment": seg.name, "size": seg.size}

    def get(self, token: Any, identity: bytes = b"") -> Optional[Session]:
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
            if s.in_flight:
                s.last_seen = 0.0           # closed by the lease sweep once its requests finish
            else:
                log.debug("client session %s… disconnected: releasing its shared memory", s.token[:8])
                self.close(s)

    def close(self, session: Session) -> None:
        """Give back everything the session held."""
        self.sessions.pop(session.token, None)
        self.end_loans(session)
        for name in list(session.regions):
            self._unregister(session, name)
        forgotten = list(session.arena)
        for seg in session.arena.values():
            seg.unlink()       # the daemon created these: it unlinks them
            seg.close()
        session.arena.clear()
        if forgotten:
            self.forget(forgotten)

    def expire(self) -> int:
        """Close sessions idle past their lease with nothing in flight. A
        session still holding lent outputs gets ten leases: its client may be
        reading them (a disconnect, where libzmq reports it, ends it at once)."""
        now = time.monotonic()
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

    def arena_view(self, session: Optional[Session], ref: Any, what: str) -> tuple[memoryview, list]:
        """Check an input's `shm` descriptor; (bytes, [segment, offset, nbytes, generation])."""
        if session is None or not session.local:
            raise _bad(f"{what}: 'shm' descriptors need a local session (say hello first)")
        if not (isinstance(ref, list) and len(ref) == 4 and isinstance(ref[0], str)):
            raise _bad(f"{what}: 'shm' must be [segment, offset, nbytes, generation]")
        segment, offset, nbytes, generation = ref
        seg = session.arena.get(segment)
        if seg is None:
            raise _bad(f"{what}: the segment is not part of this session's arena")
        _check_range(what, offset, nbytes, seg.size)
        if offset < BLOCK_HEADER_BYTES:
            raise _bad(f"{what}: offset {offset} leaves no room for the block header")
        magic, gen, size = read_block_header(seg.buf, offset - BLOCK_HEADER_BYTES)
        if magic != BLOCK_MAGIC or gen != generation or size != nbytes:
            raise _bad(f"{what}: stale descriptor (block header says generation {gen}, {size} bytes; "
                       f"the request says generation {generation}, {nbytes} bytes)")
        return memoryview(seg.buf)[offset:offset + nbytes], [segment, offset, nbytes, generation]

    # --- regions -----------------------------------------------------------------

    def register(self, session: Session, header: dict) -> bool:
        name, key = header.get("name"), header.get("key")
        if not isinstance(name, str) or not name:
            raise _bad("register_system_shared_memory: 'name' must be a non-empty string")
        if not isinstance(key, str) or not key.strip("/"):
            raise _bad(f"region '{name}': 'key' must be a shared-memory name")
        key = key.lstrip("/")
        if key.startswith(PREFIX) or "/" in key:
            raise _bad(f"region '{name}': that key is reserved for the daemon's own segments "
                       f"(names starting with '{PREFIX}')")
        if name in session.regions:
            raise TorchpoolError(errors.ALREADY_EXISTS, f"region '{name}' is already registered")
        offset, byte_size, token = header.get("offset", 0), header.get("byte_size"), header.get("token")
        if not isinstance(token, bytes) or len(token) != REGION_TOKEN_BYTES:
            raise _bad(f"region '{name}': 'token' must be {REGION_TOKEN_BYTES} bytes")
        try:
            shm = posix_ipc.SharedMemory("/" + key)
        except (posix_ipc.Error, ValueError, OSError):
            # the same answer whether it is missing or forbidden: no probing of names
            raise _bad(f"region '{name}': the daemon cannot open that segment") from None
        fd = shm.fd
        try:
            st = os.fstat(fd)
            _check_range(f"region '{name}'", offset, byte_size, st.st_size)
            if byte_size < REGION_TOKEN_BYTES:
                raise _bad(f"region '{name}': byte size must be at least {REGION_TOKEN_BYTES}")
            if os.pread(fd, REGION_TOKEN_BYTES, offset) != token:
                raise TorchpoolError(errors.INVALID_ARG,
                                     f"region '{name}': ownership proof failed (the token is not at "
                                     f"the region's offset); the daemon maps only segments the "
                                     f"client shows it can write")
            buf = mmap.mmap(fd, st.st_size)
        except BaseException:
            os.close(fd)
            raise
        session.regions[name] = Region(name, key, offset, byte_size, fd, st.st_ino, buf)
        return True

    def region(self, session: Optional[Session], ref: Any, what: str) -> tuple[Region, int, int]:
        """Resolve `[name, byte_size, offset]` against the session's regions."""
        if session is None:
            raise _bad(f"{what}: 'region' references need a session (say hello first)")
        if not (isinstance(ref, list) and len(ref) == 3 and isinstance(ref[0], str)):
            raise _bad(f"{what}: 'region' must be [name, byte_size, offset]")
        name, nbytes, offset = ref
        region = session.regions.get(name)
        if region is None or region.unregistering:
            raise _bad(f"{what}: no region '{name}' is registered by this session")
        region.check(f"{what} in region '{name}'", offset, nbytes)
        return region, offset, nbytes

    def unregister(self, session: Session, name: Any) -> bool:
        names = list(session.regions) if name is None else [name]
        for n in names:
            if n not in session.regions:
                raise _bad(f"no region '{n}' is registered by this session")
            self._unregister(session, n)
        return True

    def _unregister(self, session: Session, name: str) -> None:
        region = session.regions[name]
        region.unregistering = True
        if region.in_use == 0:
            self._drop_region(session, region)

    def region_done(self, session: Session, region: Region) -> None:
        region.in_use -= 1
        if region.unregistering and region.in_use == 0:
            self._drop_region(session, region)

    def _drop_region(self, session: Session, region: Region) -> None:
        session.regions.pop(region.name, None)
        self.forget([region.worker_ref()])
        region.close()

    def status(self, session: Session, name: Any) -> list[dict]:
        regions = session.regions.values() if name is None else \
            [r for r in session.regions.values() if r.name == name]
        if name is not None and not regions:
            raise _bad(f"no region '{name}' is registered by this session")
        return [{"name": r.name, "key": r.key, "offset": r.offset, "byte_size": r.byte_size,
                 "in_use": r.in_use, "unregistering": r.unregistering} for r in regions]
