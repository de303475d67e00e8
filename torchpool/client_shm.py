"""The client side of shared memory (docs/protocol.md, last section).

Everything here is transport-free: the sync and the asyncio client both run
the same *flows*, generators that yield `Call`s (frames to send, an id to
wait for) and receive the answer `(header, payload frames)`, or have the
error answer thrown in. Only the few lines that send and wait differ between
`Client` and `AsyncClient` (torchpool/client.py).

What lives here:

- `ClientArena`: the session's arena segments (created by the daemon, mapped
  read-write and pre-faulted here), carved into blocks with a 64-byte header
  (`u32 magic 0x31425054, u32 0, u64 generation, u64 nbytes`) in front of the
  data. Inputs are copied once into a block and travel as descriptors;
  `empty()` hands out blocks as numpy arrays that travel with no copy at all.
- `OutputMaps`: read-only mappings of the workers' segments, where outputs
  lent to a local client are viewed in place. A lent output is released
  (`"release"` in a later request header) when the last numpy view of it is
  garbage (`weakref.finalize` on the base array).
- `SharedMemoryRef`, `OutputRef`, `RegionOutput`: Triton-style registered
  regions as inputs and outputs.
- `ClientState`: one client's session, arena, stats, and the flows.

Nothing here imports torch at import time.
"""
from __future__ import annotations

import collections
import itertools
import math
import mmap
import os
import re
import secrets
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Generator, Iterable, Mapping, Optional, Sequence

import numpy as np

from .protocol import datatypes, errors, messages
from .protocol.errors import InferenceError
from .shm.bulkcopy import copy_into
from .shm.arena import _FreeList
from .shm.segment import SHM_DIR, Segment

# --- the block header (docs/protocol.md "Sessions") ---------------------------------

BLOCK_HEADER = 64                      # bytes in front of every arena block's data
# the block header the daemon checks: magic "TPB1", reserved, generation, nbytes
from .shm.regions import BLOCK_HEADER as HEADER, BLOCK_MAGIC  # noqa: E402
from .shm.naming import boot_id  # noqa: E402
ALIGN = 64                             # blocks start (and so data starts) 64-byte aligned
TOKEN_BYTES = 16                       # the ownership proof of a registered region

DEFAULT_ARENA_CAP = 1 << 30            # the most arena this client asks the daemon for
ENV_LOCAL = "TORCHPOOL_LOCAL"          # "0" turns the automatic local path off

from .protocol.messages import (  # noqa: E402
    OP_ARENA_GROW, OP_GOODBYE, OP_HELLO, OP_REGISTER, OP_SHM_STATUS, OP_UNREGISTER)


def _align(n: int) -> int:
    return (n + ALIGN - 1) & ~(ALIGN - 1)


def block_size(nbytes: int) -> int:
    """Bytes a block with `nbytes` of data takes in the arena (header included)."""
    return _align(BLOCK_HEADER + max(nbytes, 0))


def write_header(buf: Any, start: int, generation: int, nbytes: int) -> None:
    """Write a block header at `start` (the block's first byte; data at start + 64)."""
    HEADER.pack_into(buf, start, BLOCK_MAGIC, 0, generation, nbytes)


def read_header(buf: Any, start: int) -> tuple[int, int, int]:
    """(magic, generation, nbytes) of the block header at `start`."""
    magic, _, generation, nbytes = HEADER.unpack_from(buf, start)
    return magic, generation, nbytes


def local_wanted(local: Optional[bool]) -> bool:
    """Should this client ask for the local path? `local=None` follows the
    environment (TORCHPOOL_LOCAL=0 turns it off); never without a writable
    /dev/shm or a boot id to prove we share the host."""
    if local is None:
        local = os.environ.get(ENV_LOCAL, "1").strip().lower() not in ("0", "false", "no", "off")
    return bool(local) and os.access(SHM_DIR, os.W_OK) and bool(boot_id())


# --- public value types -------------------------------------------------------------

def _shm_key(key: str) -> str:
    return "/" + key.lstrip("/")


@dataclass(frozen=True)
class SharedMemoryRef:
    """An input whose bytes are in a registered region:
    `SharedMemoryRef(region, byte_size, offset=0, datatype="FP32", shape=(1, 16))`.

    `region` is the name given to `register_system_shared_memory`; `offset`
    is relative to the region's own offset; `byte_size` bytes starting there
    hold the tensor (C order; BYTES in Triton's length-prefixed layout).
    """

    region: str
    byte_size: int
    offset: int = 0
    datatype: str = ""
    shape: tuple = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        if self.datatype not in datatypes.WIRE_DATATYPES:
            raise ValueError(f"SharedMemoryRef for region '{self.region}': datatype must be one of "
                             f"{sorted(datatypes.WIRE_DATATYPES)}, got {self.datatype!r}")
        if self.byte_size < 0 or self.offset < 0:
            raise ValueError(f"SharedMemoryRef for region '{self.region}': byte_size and offset "
                             f"must be non-negative")

    def wire(self) -> list:
        return [self.region, int(self.byte_size), int(self.offset)]


@dataclass(frozen=True)
class OutputRef:
    """Ask for output `name` to be written straight into a registered region:
    `infer(..., outputs=["OUT0", OutputRef("OUT1", "my_region", 4096)])`.
    The result then holds a `RegionOutput` for it."""

    name: str
    region: str
    byte_size: int
    offset: int = 0

    def wire(self) -> dict:
        return {"name": self.name, "region": [self.region, int(self.byte_size), int(self.offset)]}


@dataclass(frozen=True)
class RegionOutput:
    """An output the worker wrote into the caller's region: `nbytes` bytes at
    `offset` (relative to the region's offset) of region `region`, a tensor of
    `datatype` and `shape`. The bytes are in the caller's memory;
    `as_array(buf)` views them as numpy given the caller's mapping of the
    region (`buf` = the region's bytes, i.e. the segment starting at the
    registered offset)."""

    name: str
    region: str
    offset: int
    nbytes: int
    datatype: str
    shape: tuple

    def as_array(self, buf: Any) -> np.ndarray:
        if self.datatype == "BYTES":
            items = datatypes.decode_bytes(memoryview(buf).cast("B")[self.offset:self.offset + self.nbytes])
            arr = np.empty(len(items), dtype=object)
            arr[:] = items
            return arr.reshape(self.shape)
        dtype = datatypes.numpy_dtype(self.datatype)
        return np.frombuffer(buf, dtype=dtype, count=self.nbytes // dtype.itemsize,
                             offset=self.offset).reshape(self.shape)


class InferResult(dict):
    """{output name: array} — also a context manager:

        with client.infer(model, inputs) as out:
            use(out["OUTPUT0"])

    On exit it drops its own references. Outputs lent in place by the daemon
    are released when the last view of them is garbage, never earlier: a
    view kept beyond the `with` stays valid (until `close()`).
    """

    def release(self) -> None:
        self.clear()

    def __enter__(self) -> "InferResult":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.clear()


class NoAnswer(InferenceError):
    """No answer within the time limit (the request may still be running)."""


class SessionLost(Exception):
    """The daemon no longer knows our session (lease expired, daemon restarted)."""

    def __init__(self, token: Optional[str], error: InferenceError) -> None:
        super().__init__(str(error))
        self.token = token
        self.error = error


_SESSION_ERROR = re.compile(r"\b(unknown|expired|invalid|no such) session\b|\bsession\b.*\bexpired\b", re.I)


def is_session_error(exc: InferenceError) -> bool:
    """The daemon forgot the session we named (it says so with NOT_FOUND)."""
    return bool(_SESSION_ERROR.search(exc.message or "")) and exc.code in (
        errors.NOT_FOUND, errors.INVALID_ARG, errors.UNAVAILABLE)


def _is_release_error(exc: InferenceError) -> bool:
    return exc.code == errors.INVALID_ARG and "'release'" in (exc.message or "")


class Call:
    """One request a flow wants sent: the driver sends `frames` and answers
    with the reply to `rid` (or throws the error / NoAnswer in)."""

    __slots__ = ("rid", "frames", "timeout")

    def __init__(self, rid: int, frames: list, timeout: Optional[float]) -> None:
        self.rid, self.frames, self.timeout = rid, frames, timeout


Flow = Generator[Call, Any, Any]


# --- the client arena ----------------------------------------------------------------

class ArenaBlock:
    """A block of the client arena. `start` is the header; data at start + 64."""

    __slots__ = ("segment", "start", "size", "capacity", "address", "in_flight", "garbage",
                 "user", "__weakref__")

    def __init__(self, segment: str, start: int, size: int, address: int) -> None:
        self.segment = segment
        self.start = start
        self.size = size                        # whole block, header included
        self.capacity = size - BLOCK_HEADER     # data bytes it can hold
        self.address = address                  # virtual address of the data
        self.in_flight = 0                      # requests that name it
        self.garbage = False                    # an empty() block whose array is gone
        self.user = False                       # handed out by empty()

    @property
    def data_offset(self) -> int:
        return self.start + BLOCK_HEADER


def _address_of(buf: Any) -> int:
    arr = np.frombuffer(buf, dtype=np.uint8, count=1)
    try:
        return arr.ctypes.data
    finally:
        del arr


class ClientArena:
    """The session's arena: segments the daemon created for us, blocks we carve.

    Allocation and freeing are local (no round trip). Blocks the caller holds
    through `empty()` are freed when their array is garbage: the finalizer
    only queues the block (it may run on any thread); the queue is drained
    by the owning thread at the next allocation.
    """

    def __init__(self, cap: int = DEFAULT_ARENA_CAP) -> None:
        self.cap = cap
        self.segments: dict[str, Segment] = {}
        self._free: dict[str, _FreeList] = {}
        self._base: dict[str, int] = {}            # segment -> address of its first byte
        self._generations = itertools.count(1)
        self._dead: collections.deque = collections.deque()   # blocks whose arrays are gone (empty(), kept outputs)
        self.user_blocks: dict[int, ArenaBlock] = {}          # data address -> live empty() block
        self.grow_refused = False
        self.growing = False            # an arena_grow is in flight (asyncio: one at a time)

    # segments
    def map_segment(self, name: str, prefault: bool = True) -> Segment:
        seg = Segment.attach(name)                 # read-write, size from fstat
        try:
            if prefault:
                seg.prefault()                     # MADV_POPULATE_WRITE, else touch each page
            base = _address_of(seg.buf)
        except BaseException:
            seg.close()
            raise
        self.segments[name] = seg
        self._free[name] = _FreeList(seg.size)
        self._base[name] = base
        return seg

    @property
    def mapped_bytes(self) -> int:
        return sum(s.size for s in self.segments.values())

    @property
    def free_bytes(self) -> int:
        self._drain()
        return sum(f.free_bytes for f in self._free.values())

    # blocks
    def alloc(self, nbytes: int) -> Optional[ArenaBlock]:
        """A block with room for `nbytes` of data, or None when nothing fits."""
        self._drain()
        size = block_size(nbytes)
        for name, free in self._free.items():
            start = free.alloc(size)
            if start is not None:
                return ArenaBlock(name, start, size, self._base[name] + start + BLOCK_HEADER)
        return None

    def free(self, block: ArenaBlock) -> None:
        free = self._free.get(block.segment)
        if free is None:
            return            # a segment of a closed arena
        seg = self.segments[block.segment]
        HEADER.pack_into(seg.buf, block.start, 0, 0, 0, 0)   # a stale descriptor can never match
        free.free(block.start, block.size)

    def data(self, block: ArenaBlock, nbytes: Optional[int] = None) -> memoryview:
        n = block.capacity if nbytes is None else nbytes
        start = block.data_offset
        return memoryview(self.segments[block.segment].buf)[start:start + n]

    def write(self, block: ArenaBlock, src: Any, nbytes: int) -> None:
        """Copy a prepared source (bytes, or any numpy array: strided or
        byte-swapped ones are converted on the way) into the block's data."""
        start = block.data_offset
        buf = self.segments[block.segment].buf
        if isinstance(src, np.ndarray) and not (src.flags.c_contiguous and src.dtype.isnative):
            dst = np.frombuffer(buf, dtype=src.dtype.newbyteorder("="), count=src.size,
                                offset=start).reshape(src.shape)
            np.copyto(dst, src, casting="equiv")
            return
        copy_into(memoryview(buf)[start:start + nbytes], src)

    def hand_out(self, block: ArenaBlock, nbytes: int) -> list:
        """Stamp a fresh generation and `nbytes` into the header; the descriptor."""
        generation = next(self._generations)
        write_header(self.segments[block.segment].buf, block.start, generation, nbytes)
        return [block.segment, block.data_offset, nbytes, generation]

    # empty(): blocks the caller holds as arrays
    def empty(self, shape: Sequence[int], dtype: np.dtype) -> Optional[np.ndarray]:
        dtype = np.dtype(dtype)
        count = math.prod(shape)
        nbytes = count * dtype.itemsize
        block = self.alloc(nbytes)
        if block is None:
            return None
        block.user = True
        base = np.frombuffer(self.data(block, nbytes), dtype=dtype, count=count)
        self.user_blocks[block.address] = block
        fin = weakref.finalize(base, self._dead.append, block)
        fin.atexit = False
        return base.reshape(shape)

    def keep(self, block: ArenaBlock) -> np.ndarray:
        """A read-only byte array over a block's data that owns the block:
        the block is freed once the array (and every view of it) is gone."""
        base = np.frombuffer(self.data(block), dtype=np.uint8)
        base.flags.writeable = False
        fin = weakref.finalize(base, self._dead.append, block)
        fin.atexit = False
        return base

    def lookup(self, arr: np.ndarray) -> Optional[ArenaBlock]:
        """The empty() block `arr` can be sent from with no copy: it starts at
        the block's data start, is C-contiguous and fits the block."""
        if not self.user_blocks:
            return None
        block = self.user_blocks.get(arr.__array_interface__["data"][0])
        if (block is None or block.garbage or not arr.flags.c_contiguous
                or arr.nbytes > block.capacity or not arr.dtype.isnative):
            return None
        return block

    def flight_done(self, block: ArenaBlock) -> None:
        block.in_flight -= 1
        if block.in_flight == 0 and block.garbage:
            self.free(block)

    def _drain(self) -> None:
        dead = self._dead
        while dead:
            block = dead.popleft()
            self.user_blocks.pop(block.address, None)
            block.garbage = True
            if block.in_flight == 0:
                self.free(block)

    def close(self) -> None:
        """Unmap (the daemon owns and unlinks the segments). Arrays from
        empty() that are still alive keep their mapping alive."""
        for seg in self.segments.values():
            seg.close()
        self.segments.clear()
        self._free.clear()
        self.user_blocks.clear()


# --- outputs lent in place -------------------------------------------------------------

class OutputMaps:
    """Read-only mappings of worker segments, by name, made on first use.

    Worker segment names are never reused by a daemon (they carry the daemon
    pid and a worker serial); the cache is dropped whenever the session
    changes, so a restarted daemon's segments are mapped afresh. A dropped
    mapping stays alive as long as arrays view it.
    """

    def __init__(self) -> None:
        self._maps: dict[str, mmap.mmap] = {}

    def get(self, name: str, end: int) -> mmap.mmap:
        mm = self._maps.get(name)
        if mm is None or end > len(mm):
            mm = self._maps[name] = self._attach(name)
        if end > len(mm):
            raise InferenceError(errors.INTERNAL, f"output block [{end} bytes] lies beyond its "
                                                  f"shared-memory segment ({len(mm)} bytes)")
        return mm

    @staticmethod
    def _attach(name: str) -> mmap.mmap:
        import posix_ipc

        if not isinstance(name, str) or "/" in name:
            raise InferenceError(errors.INTERNAL, f"malformed output segment name {name!r}")
        try:
            shm = posix_ipc.SharedMemory("/" + name, read_only=True)
        except (posix_ipc.Error, OSError) as exc:
            raise InferenceError(errors.UNAVAILABLE, f"cannot map the daemon's output segment "
                                                     f"'{name}': {exc}") from None
        try:
            size = os.fstat(shm.fd).st_size
            return mmap.mmap(shm.fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        finally:
            shm.close_fd()

    def clear(self) -> None:
        self._maps.clear()       # live arrays keep their mmap objects alive

    def __len__(self) -> int:
        return len(self._maps)


# --- inputs ---------------------------------------------------------------------------

def prepare_input(name: str, value: Any) -> tuple[str, list[int], Any]:
    """(datatype, shape, source): source is a numpy array (maybe not
    contiguous, maybe not native byte order) or the encoded bytes of a BYTES
    tensor. Torch tensors are viewed through numpy (no copy when on the CPU)."""
    if type(value).__module__.startswith("torch"):
        import torch  # the caller already has torch loaded

        t = value.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        t = t.resolve_conj().resolve_neg()
        if t.dtype == torch.bfloat16:
            return "BF16", list(t.shape), t.view(torch.int16).numpy().view(np.uint16)
        value = t.numpy()
    if isinstance(value, (list, tuple)):
        if value and all(isinstance(v, (str, bytes, bytearray)) for v in value):
            return "BYTES", [len(value)], datatypes.encode_bytes(value)
        value = np.asarray(value)
    if not isinstance(value, np.ndarray):
        value = np.asarray(value)
    if value.dtype.kind in ("O", "S", "U"):
        flat = value.reshape(-1)
        return "BYTES", list(value.shape), datatypes.encode_bytes(flat.tolist())
    try:
        datatype = datatypes.wire_from_numpy(value.dtype)
    except TypeError:
        raise InferenceError(errors.INVALID_ARG,
                             f"input '{name}': numpy dtype {value.dtype} is not supported") from None
    return datatype, list(value.shape), value


def inline_buffer(src: Any) -> memoryview:
    """The C-contiguous, native-order bytes of a prepared source."""
    if isinstance(src, np.ndarray):
        if not src.dtype.isnative:
            src = src.astype(src.dtype.newbyteorder("="))
        src = np.ascontiguousarray(src).reshape(-1)   # memoryview cannot cast a 0 in a shape
    return memoryview(src).cast("B")


def _nbytes(src: Any) -> int:
    return src.nbytes if isinstance(src, np.ndarray) else len(src)


class _NeedRoom(Exception):
    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes


class _Encoded:
    __slots__ = ("entries", "frames", "blocks", "lent", "stats")

    def __init__(self) -> None:
        self.entries: list[dict] = []
        self.frames: list = []
        self.blocks: list[ArenaBlock] = []      # copy blocks: freed when answered
        self.lent: list[ArenaBlock] = []        # empty() blocks in flight
        self.stats = [0, 0, 0]                  # copied, zero-copy, inline


# --- the client state and its flows ----------------------------------------------------

class ClientState:
    """A client's session, arena, lent outputs, regions and transfer counts."""

    def __init__(self, url: str, local: Optional[bool] = None,
                 arena_cap: int = DEFAULT_ARENA_CAP) -> None:
        self.url = url
        self.ids = itertools.count(1)
        self.want_local = local_wanted(local)
        self.arena_cap = arena_cap
        self.session: Optional[str] = None
        self.local = False                      # the daemon agreed: arena + outputs in place
        self.lease_s: Optional[float] = None
        self.unsupported = False                # the daemon does not speak sessions
        self.hello_error: Optional[InferenceError] = None
        self.used_session = False               # a session existed once: re-hello when lost
        self.arena: Optional[ClientArena] = None
        self.outputs = OutputMaps()
        self.releases: collections.deque = collections.deque()   # (session, [seg, off, gen])
        self.regions: dict[str, tuple[str, int, int]] = {}      # name -> (key, byte_size, offset)
        # requests we stopped waiting for: id -> (session, arena, copy blocks, empty() blocks)
        self.quarantine: dict[Any, tuple[Optional[str], Optional[ClientArena], list, list]] = {}
        self.stats = {"bytes_copied": 0, "bytes_zero_copy": 0, "bytes_inline": 0}
        self.closed = False

    # -- plumbing
    def call(self, op: str, timeout: Optional[float], **fields: Any) -> Call:
        rid = next(self.ids)
        header = {"v": messages.PROTOCOL_VERSION, "op": op, "id": rid, **fields}
        return Call(rid, [messages.pack(header)], timeout)

    def session_fields(self) -> dict:
        """`session` and queued releases for the next request header."""
        if self.session is None:
            self.releases.clear()
            return {}
        fields: dict = {"session": self.session}
        rel = self._take_releases()
        if rel:
            fields["release"] = rel
        return fields

    def _take_releases(self) -> list:
        out, q, token = [], self.releases, self.session
        while q:
            owner, item = q.popleft()
            if owner == token:
                out.append(item)
        return out

    def needs_hello(self, required: bool = False) -> bool:
        if self.session is not None or self.unsupported or self.closed:
            return False
        return required or self.want_local or self.used_session

    def require_session(self) -> None:
        if self.session is None:
            if self.unsupported:
                raise InferenceError(errors.UNSUPPORTED, f"torchpool at {self.url} does not support "
                                                         f"shared-memory sessions (hello refused)")
            raise self.hello_error or InferenceError(errors.UNAVAILABLE,
                                                     f"no session with torchpool at {self.url}")

    def session_lost(self, token: Optional[str]) -> None:
        """Forget a session the daemon no longer knows (if it is still ours)."""
        if token is not None and token == self.session:
            self._drop_session()

    def _drop_session(self) -> None:
        self.session = None
        self.local = False
        self.releases.clear()
        self.quarantine.clear()
        self.outputs.clear()
        if self.arena is not None:
            self.arena.close()
            self.arena = None

    # -- hello / goodbye
    def hello_flow(self, timeout: Optional[float]) -> Flow:
        local = self.want_local
        for attempt in range(2):
            try:
                header, _ = yield self.call(OP_HELLO, timeout, boot_id=boot_id(), local=local)
            except NoAnswer:
                raise
            except InferenceError as exc:
                if exc.code == errors.CANCELLED:      # the client was closed meanwhile
                    raise
                # an older daemon (UNSUPPORTED) or one that refuses: inline, silently
                self.hello_error = exc
                if exc.code in (errors.UNSUPPORTED, errors.INVALID_ARG, errors.NOT_FOUND):
                    self.unsupported = True
                return False
            res = header.get("result") or {}
            token = res.get("session")
            if not isinstance(token, str):
                self.unsupported = True
                return False
            self.session, self.used_session, self.hello_error = token, True, None
            self.lease_s = res.get("lease_s")
            self.outputs.clear()
            if not (local and res.get("local")):
                self.local = False
                break
            arena = ClientArena(self.arena_cap)
            try:
                if res.get("block_header", BLOCK_HEADER) != BLOCK_HEADER:
                    raise ValueError(f"block header of {res.get('block_header')} bytes")
                for seg in res.get("arena") or []:
                    arena.map_segment(seg["segment"])
            except Exception:
                # Same boot id but not the same /dev/shm (e.g. another container):
                # give the session back and say hello as a remote client.
                arena.close()
                yield from self._quiet(self.call(OP_GOODBYE, timeout, session=token))
                self.session, local = None, False
                continue
            self.arena, self.local = arena, True
            break
        # a session that replaced a lost one gets the caller's regions back
        for name, (key, byte_size, offset) in list(self.regions.items()):
            try:
                yield from self._register(name, key, byte_size, offset, timeout)
            except SessionLost:
                raise
            except InferenceError:
                self.regions.pop(name, None)
        return True

    def _quiet(self, call: Call) -> Flow:
        try:
            yield call
        except InferenceError:
            pass

    def goodbye_call(self, timeout: Optional[float]) -> Optional[Call]:
        """The goodbye (with queued releases) that closes our session, if any."""
        if self.session is None:
            return None
        fields = self.session_fields()
        return self.call(OP_GOODBYE, timeout, **fields)

    def close(self) -> None:
        self.closed = True
        self._drop_session()
        self.quarantine.clear()

    # -- generic requests on the session
    def exchange(self, op: str, timeout: Optional[float], fields: dict) -> Flow:
        """One request with `session` and releases; session errors become SessionLost."""
        extra = self.session_fields()
        token = extra.get("session")
        try:
            reply = yield self.call(op, timeout, **fields, **extra)
        except NoAnswer:
            raise
        except InferenceError as exc:
            if token is not None and is_session_error(exc):
                raise SessionLost(token, exc) from None
            if extra.get("release") and _is_release_error(exc):
                # the daemon took those blocks back already (their worker died):
                # drop the releases, ask again
                reply = yield self.call(op, timeout, **fields, session=token)
            else:
                raise
        return reply

    def control_flow(self, op: str, timeout: Optional[float], fields: dict) -> Flow:
        header, _ = yield from self.exchange(op, timeout, fields)
        return header.get("result")

    # -- infer
    def encode_inputs(self, inputs: Mapping[str, Any], arena: Optional[ClientArena]) -> _Encoded:
        """Entries and payload frames; inputs go to the arena when there is one.
        Raises _NeedRoom (having freed what it took) when the arena is full."""
        enc = _Encoded()
        need = 0
        try:
            for name, value in inputs.items():
                if isinstance(value, SharedMemoryRef):
                    if self.session is None:
                        raise InferenceError(errors.INVALID_ARG, f"input '{name}': a region needs a "
                                                                 f"session (register the region first)")
                    enc.entries.append({"name": name, "datatype": value.datatype,
                                        "shape": list(value.shape), "region": value.wire()})
                    enc.stats[1] += value.byte_size
                    continue
                datatype, shape, src = prepare_input(name, value)
                entry = {"name": name, "datatype": datatype, "shape": shape}
                enc.entries.append(entry)
                nbytes = _nbytes(src)
                if arena is not None and nbytes > 0:
                    if isinstance(src, np.ndarray):   # built in place with empty(): never copied
                        block = arena.lookup(src)
                        if block is not None and block.in_flight == 0:
                            entry["shm"] = arena.hand_out(block, nbytes)
                            block.in_flight += 1
                            enc.lent.append(block)
                            enc.stats[1] += nbytes
                            continue
                if arena is not None and nbytes > messages.LOCAL_MIN_BYTES:
                    block = arena.alloc(nbytes) if need == 0 else None
                    if block is None:
                        need += block_size(nbytes)
                        continue
                    enc.blocks.append(block)
                    arena.write(block, src, nbytes)
                    entry["shm"] = arena.hand_out(block, nbytes)
                    # our own copy: an output that is a view of it (an identity,
                    # an in-place model) may come back pointing into it
                    entry["reuse"] = True
                    enc.stats[0] += nbytes
                    continue
                data = inline_buffer(src)
                if data.nbytes <= messages.INLINE_LIMIT:
                    entry["data"] = bytes(data)
                else:
                    enc.frames.append(data)
                    entry["data"] = len(enc.frames)
                enc.stats[2] += data.nbytes
        except BaseException:
            self.finish(enc, arena, answered=True)
            raise
        if need:
            self.finish(enc, arena, answered=True)
            raise _NeedRoom(need)
        return enc

    def finish(self, enc: _Encoded, arena: Optional[ClientArena], answered: bool,
               rid: Any = None, token: Optional[str] = None) -> None:
        """The request is over (answered) or lost (no answer: keep its blocks
        until a late answer arrives, or the session ends)."""
        if not answered:
            if rid is not None and (token is not None or enc.blocks or enc.lent):
                self.quarantine[rid] = (token, arena, enc.blocks, enc.lent)
        elif arena is not None:
            for block in enc.blocks:
                arena.free(block)
            for block in enc.lent:
                arena.flight_done(block)
        enc.blocks, enc.lent = [], []

    def _encode(self, inputs: Mapping[str, Any], timeout: Optional[float]) -> Flow:
        """Encode into the arena, growing it once if needed; inline otherwise."""
        arena = self.arena if self.local else None
        if arena is None:
            return self.encode_inputs(inputs, None), None
        try:
            return self.encode_inputs(inputs, arena), arena
        except _NeedRoom as room:
            need = room.nbytes
        if (yield from self._grow(arena, need, timeout)):
            try:
                return self.encode_inputs(inputs, arena), arena
            except _NeedRoom:
                pass
        return self.encode_inputs(inputs, None), None      # this request goes inline

    def _grow(self, arena: ClientArena, need: int, timeout: Optional[float]) -> Flow:
        """Add an arena segment of at least `need` bytes; False if not now.
        One grow at a time: concurrent requests (asyncio) that find no room
        while one is in flight go inline instead of each adding a segment."""
        if arena.growing or arena.grow_refused or arena.mapped_bytes + need > arena.cap:
            return False
        arena.growing = True
        try:
            header, _ = yield from self.exchange(OP_ARENA_GROW, timeout, {"size": need})
            arena.map_segment((header.get("result") or {})["segment"])
        except (NoAnswer, SessionLost):
            raise
        except (InferenceError, KeyError, TypeError, OSError, ValueError):
            arena.grow_refused = True
            return False
        finally:
            arena.growing = False
        return True

    def infer_flow(self, model: str, inputs: Mapping[str, Any], outputs: Optional[Sequence[Any]],
                   version: Any, timeout: Optional[float], copy: bool, priority: int = 0,
                   sequence: Optional[dict] = None) -> Flow:
        enc, arena = yield from self._encode(inputs, timeout)
        wanted = None
        if outputs is not None:
            wanted = [o.wire() if isinstance(o, OutputRef) else o for o in outputs]
        header = {"v": messages.PROTOCOL_VERSION, "op": messages.OP_INFER, "id": 0,
                  "model": model, "version": "" if version is None else str(version),
                  "inputs": enc.entries, "outputs": wanted,
                  "timeout_us": int(timeout * 1e6) if timeout else 0}
        if priority:
            header["priority"] = int(priority)
        if sequence:
            header["sequence"] = sequence
        if self.local:
            header["output_shm"] = True
        extra = self.session_fields()
        header.update(extra)
        token = extra.get("session")
        answered, rid = False, None
        try:
            for attempt in range(2):
                rid = header["id"] = next(self.ids)
                try:
                    reply_header, payload = yield Call(rid, [messages.pack(header), *enc.frames], timeout)
                except NoAnswer:
                    raise
                except InferenceError as exc:
                    answered = True
                    if token is not None and is_session_error(exc):
                        raise SessionLost(token, exc) from None
                    if attempt == 0 and header.pop("release", None) and _is_release_error(exc):
                        answered = False
                        continue
                    raise
                answered = True
                break
            s = self.stats
            s["bytes_copied"] += enc.stats[0]
            s["bytes_zero_copy"] += enc.stats[1]
            s["bytes_inline"] += enc.stats[2]
            # before finish(): outputs that point into our input blocks keep them
            return self.decode_outputs(reply_header, payload, copy, token, enc, arena)
        finally:
            self.finish(enc, arena, answered, rid, token)

    # -- outputs
    def decode_outputs(self, header: dict, frames: Sequence[Any], copy: bool,
                       token: Optional[str] = None, enc: Optional[_Encoded] = None,
                       arena: Optional[ClientArena] = None) -> InferResult:
        """The outputs of an answer to a request sent in session `token`
        (with the input blocks `enc` holds in `arena`)."""
        token = self.session if token is None else token
        result = InferResult()
        entries = header.get("outputs") or []
        error: Optional[BaseException] = None
        kept: dict[ArenaBlock, np.ndarray] = {}
        for e in entries:
            try:
                if "shm" in e:
                    result[e["name"]] = self._lent_output(e, copy, token)
                elif "own" in e:
                    result[e["name"]] = _reused_output(e, copy, enc, arena, kept)
                elif "region" in e:
                    region, nbytes, offset = e["region"]
                    result[e["name"]] = RegionOutput(e["name"], region, offset, nbytes,
                                                     e["datatype"], tuple(e["shape"]))
                else:
                    arr = output_array(e, frames)
                    result[e["name"]] = np.array(arr) if copy and isinstance(arr, np.ndarray) else arr
            except BaseException as exc:   # keep going: every lent block must be released
                error = error or exc
        if error is not None:
            raise error
        return result

    def _lent_output(self, e: dict, copy: bool, token: Optional[str]) -> Any:
        segment, offset, nbytes, generation = e["shm"]
        rel = (token, [segment, offset, generation])
        datatype, shape = e["datatype"], e["shape"]
        keep = False
        try:
            mm = self.outputs.get(segment, offset + nbytes)
            data = memoryview(mm)[offset:offset + nbytes]
            if datatype == "BYTES" or datatype == "BF16":
                return output_array({"datatype": datatype, "shape": shape, "data": data}, ())
            base = np.frombuffer(data, dtype=datatypes.numpy_dtype(datatype))
            if copy:
                return base.reshape(shape).copy()
            arr = base.reshape(shape)
            fin = weakref.finalize(base, self.releases.append, rel)
            fin.atexit = False
            keep = True
            return arr
        finally:
            if not keep:
                self.releases.append(rel)

    def late_reply(self, header: Any) -> None:
        """The answer of a request we stopped waiting for: free its blocks and
        hand back any outputs it was lent."""
        if not isinstance(header, dict):
            return
        held = self.quarantine.pop(header.get("id"), None)
        if held is None:
            return            # not ours, or of a session that is gone
        token, arena, blocks, lent = held
        if arena is not None and arena is self.arena:
            for block in blocks:
                arena.free(block)
            for block in lent:
                arena.flight_done(block)
        for e in header.get("outputs") or []:
            if isinstance(e, dict) and isinstance(e.get("shm"), list) and len(e["shm"]) == 4:
                seg, off, _n, gen = e["shm"]
                self.releases.append((token, [seg, off, gen]))

    # -- empty()
    def empty_flow(self, shape: Sequence[int], datatype: str, timeout: Optional[float]) -> Flow:
        if datatype == "BYTES" or datatype not in datatypes.WIRE_DATATYPES:
            raise InferenceError(errors.INVALID_ARG, f"empty(): datatype must be a fixed-size "
                                                     f"datatype, got {datatype!r}")
        dtype = datatypes.numpy_dtype(datatype)
        shape = tuple(int(d) for d in shape)
        if any(d < 0 for d in shape):
            raise InferenceError(errors.INVALID_ARG, f"empty(): negative dimension in {list(shape)}")
        arena = self.arena if self.local else None
        if arena is None:
            return np.empty(shape, dtype)
        arr = arena.empty(shape, dtype)
        if arr is None:
            need = block_size(math.prod(shape) * dtype.itemsize)
            if (yield from self._grow(arena, need, timeout)):
                arr = arena.empty(shape, dtype)
        return np.empty(shape, dtype) if arr is None else arr

    # -- registered regions
    def _register(self, name: str, key: str, byte_size: int, offset: int,
                  timeout: Optional[float]) -> Flow:
        import posix_ipc

        if not isinstance(key, str) or not key.strip("/"):
            raise InferenceError(errors.INVALID_ARG, f"region '{name}': key must be a shared-memory name")
        if not isinstance(offset, int) or not isinstance(byte_size, int) or offset < 0 or byte_size < 0:
            raise InferenceError(errors.INVALID_ARG, f"region '{name}': offset and byte_size must be "
                                                     f"non-negative integers")
        try:
            shm = posix_ipc.SharedMemory(_shm_key(key))
        except (posix_ipc.Error, ValueError, OSError) as exc:
            raise InferenceError(errors.INVALID_ARG, f"region '{name}': this client cannot open "
                                                     f"its shared-memory segment ({exc})") from None
        fd = shm.fd
        try:
            size = os.fstat(fd).st_size
            if offset + max(byte_size, TOKEN_BYTES) > size:
                raise InferenceError(errors.INVALID_ARG,
                                     f"region '{name}': offset {offset} + byte size {byte_size} does "
                                     f"not fit the segment's {size} bytes")
            saved = os.pread(fd, TOKEN_BYTES, offset)
            token = secrets.token_bytes(TOKEN_BYTES)
            os.pwrite(fd, token, offset)
            try:
                yield from self.exchange(OP_REGISTER, timeout,
                                         {"name": name, "key": key, "byte_size": byte_size,
                                          "offset": offset, "token": token})
            finally:
                os.pwrite(fd, saved, offset)
        finally:
            os.close(fd)
        self.regions[name] = (key, byte_size, offset)
        return True

    def register_flow(self, name: str, key: str, byte_size: int, offset: int,
                      timeout: Optional[float]) -> Flow:
        return (yield from self._register(name, key, byte_size, offset, timeout))

    def unregister_flow(self, name: Optional[str], timeout: Optional[float]) -> Flow:
        result = yield from self.control_flow(OP_UNREGISTER, timeout, {"name": name})
        if name is None:
            self.regions.clear()
        else:
            self.regions.pop(name, None)
        return result

    def status_flow(self, name: Optional[str], timeout: Optional[float]) -> Flow:
        return (yield from self.control_flow(OP_SHM_STATUS, timeout, {"name": name}))

    def transfer_stats(self) -> dict:
        return dict(self.stats)


def _reused_output(e: dict, copy: bool, enc: Optional[_Encoded], arena: Optional[ClientArena],
                   kept: dict[ArenaBlock, np.ndarray]) -> Any:
    """An output that is a view of one of this request's input blocks (the
    model returned its input, or a part of it): a read-only array on that
    block, which stays ours until the array goes. `kept` maps the blocks
    this answer already took to their whole-block arrays."""
    segment, offset, nbytes = e["own"]
    name = e.get("name")
    for block in [*kept, *(enc.blocks if enc is not None else ())]:
        if block.segment == segment and block.data_offset <= offset \
                and offset + nbytes <= block.data_offset + block.capacity:
            break
    else:
        raise InferenceError(errors.INTERNAL, f"output '{name}' points into an input block this "
                                              f"request did not send")
    base = kept.get(block)
    if base is None:
        base = kept[block] = arena.keep(block)
        enc.blocks.remove(block)          # no longer freed with the request
    start = offset - block.data_offset
    data = base[start:start + nbytes]
    datatype, shape = e["datatype"], e["shape"]
    if datatype == "BYTES" or datatype == "BF16":
        return output_array({"datatype": datatype, "shape": shape, "data": data.tobytes()}, ())
    arr = data.view(datatypes.numpy_dtype(datatype)).reshape(shape)
    return arr.copy() if copy else arr


def sequence_field(sequence_id: Any, start: bool, end: bool) -> Optional[dict]:
    """The `sequence` header field of a request (None when it names no sequence)."""
    if not sequence_id and not start and not end:
        return None
    return {"id": sequence_id, "start": bool(start), "end": bool(end)}


def needs_session(inputs: Mapping[str, Any], outputs: Optional[Iterable[Any]]) -> bool:
    """Does this request name registered regions (so it cannot run without a session)?"""
    if any(isinstance(v, SharedMemoryRef) for v in inputs.values()):
        return True
    return outputs is not None and any(isinstance(o, OutputRef) for o in outputs)


# --- decoding outputs that came as bytes ---------------------------------------------

def output_array(entry: dict, frames: Sequence[Any]) -> Any:
    """A response tensor from inline bytes or a payload frame: a read-only
    numpy view (no copy), BYTES as an object array, BF16 as a torch tensor."""
    data = messages.tensor_payload(entry, frames)
    datatype, shape = entry["datatype"], entry["shape"]
    if datatype == "BYTES":
        items = datatypes.decode_bytes(data)
        arr = np.empty(len(items), dtype=object)
        arr[:] = items
        return arr.reshape(shape)
    if datatype == "BF16":
        import torch

        raw = np.frombuffer(data, dtype=np.int16).copy()
        return torch.from_numpy(raw).view(torch.bfloat16).reshape(shape)
    # A read-only view, no copy: it keeps the ZeroMQ frame (or bytes) alive.
    return np.frombuffer(data, dtype=datatypes.numpy_dtype(datatype)).reshape(shape)


def run_sync(flow: Flow, send: Callable[[Call], Any]) -> Any:
    """Drive a flow with a blocking `send(call) -> (header, frames)`."""
    try:
        call = next(flow)
        while True:
            try:
                reply = send(call)
            except BaseException as exc:
                call = flow.throw(exc)
            else:
                call = flow.send(reply)
    except StopIteration as stop:
        return stop.value


async def run_async(flow: Flow, send: Callable[[Call], Any]) -> Any:
    """Drive a flow with an awaitable `send(call) -> (header, frames)`."""
    try:
        call = next(flow)
        while True:
            try:
                reply = await send(call)
            except BaseException as exc:
                call = flow.throw(exc)
            else:
                call = flow.send(reply)
    except StopIteration as stop:
        return stop.value
