"""The client arena and the mappings of outputs lent in place.

- `ClientArena`: the session's arena segments (created by the daemon, handed
  to us as fds over the side channel, local.py; mapped read-write and
  pre-faulted here), carved into blocks: a block header
  (protocol/tensors.py) in front of the data. Inputs are copied once into a
  block and travel as descriptors; `empty()` hands out blocks as numpy arrays
  that travel with no copy at all.
- `OutputMaps`: read-only mappings of the workers' segments (read-only fds
  from the side channel), where outputs lent to a local client are viewed
  in place.

Nothing here talks to the daemon: the flows (flows.py) decide when to ask
for another segment.
"""
from __future__ import annotations

import collections
import itertools
import math
import mmap
import os
import weakref
from typing import TYPE_CHECKING, Optional, Sequence, Union

import numpy as np

from ..protocol import errors
from ..protocol.errors import InferenceError
from ..protocol.tensors import BLOCK_HEADER_BYTES, ShmRef, clear_block_header, write_block_header
from ..shm.arena import FreeList
from ..shm.bulkcopy import copy_into
from ..shm.segment import Segment

if TYPE_CHECKING:

    from .local import LocalLink
    from .values import Source

ALIGN = 64                             # blocks start (and so data starts) 64-byte aligned
DEFAULT_ARENA_CAP = 1 << 30            # the most arena this client asks the daemon for
# How much of a new segment is faulted in when it is mapped. Blocks are carved
# from the front, so the first MiBs serve every small request from the first
# call; faulting in all of a 64 MiB segment cost 58 ms of CPU per client here
# (holding the GIL, so every thread of the process waited) and kept 64 MiB
# resident for a client that may only ever send a few KiB. Larger tensors
# fault their pages in at their first use. 1 MiB, not 4: the 4 MiB took ~3 ms
# of a session's first call, which a burst of new clients pays in turn.
PREFAULT_BYTES = 1 << 20
ENV_LOCAL = "TORCHPOOL_LOCAL"          # "0" turns the automatic local path off


def block_size(nbytes: int) -> int:
    """Bytes a block with `nbytes` of data takes in the arena (header included)."""
    return (BLOCK_HEADER_BYTES + max(nbytes, 0) + ALIGN - 1) & ~(ALIGN - 1)


def local_wanted(local: Optional[bool]) -> bool:
    """Should this client ask for the local path? `local=None` follows the
    environment (TORCHPOOL_LOCAL=0 turns it off). Whether it gets it is for
    the side channel to say: only a client on the daemon's host reaches it."""
    if local is None:
        local = os.environ.get(ENV_LOCAL, "1").strip().lower() not in ("0", "false", "no", "off")
    return bool(local)


class ArenaBlock:
    """A block of the client arena. `start` is the header; data at start + 64."""

    __slots__ = ("segment", "start", "size", "capacity", "address", "in_flight", "garbage",
                 "user", "__weakref__")

    def __init__(self, segment: str, start: int, size: int, address: int) -> None:
        self.segment = segment
        self.start = start
        self.size = size                        # whole block, header included
        self.capacity = size - BLOCK_HEADER_BYTES  # data bytes it can hold
        self.address = address                  # virtual address of the data
        self.in_flight = 0                      # requests that name it
        self.garbage = False                    # an empty() block whose array is gone
        self.user = False                       # handed out by empty()

    @property
    def data_offset(self) -> int:
        return self.start + BLOCK_HEADER_BYTES


def _address_of(buf: Union[mmap.mmap, memoryview, bytes, bytearray]) -> int:
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
        self._free: dict[str, FreeList] = {}
        self._base: dict[str, int] = {}            # segment -> address of its first byte
        self._generations = itertools.count(1)
        # blocks whose arrays are gone (empty(), kept outputs)
        self._dead: collections.deque[ArenaBlock] = collections.deque()
        self.user_blocks: dict[int, ArenaBlock] = {}          # data address -> live empty() block
        self.grow_refused = False
        self.growing = False            # an arena_grow is in flight (asyncio: one at a time)

    # segments
    def map_segment(self, name: str, fd: int, prefault: bool = True) -> Segment:
        """Map an arena segment the daemon handed us (taking its fd)."""
        seg = Segment.from_fd(name, fd)            # read-write, size from fstat
        try:
            if prefault:
                seg.prefault(PREFAULT_BYTES)       # MADV_POPULATE_WRITE, else touch each page
            base = _address_of(seg.buf)
        except BaseException:
            seg.close()
            raise
        self.segments[name] = seg
        self._free[name] = FreeList(seg.size)
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
                return ArenaBlock(name, start, size, self._base[name] + start + BLOCK_HEADER_BYTES)
        return None

    def free(self, block: ArenaBlock) -> None:
        free = self._free.get(block.segment)
        if free is None:
            return            # a segment of a closed arena
        seg = self.segments[block.segment]
        clear_block_header(seg.buf, block.start)    # a stale descriptor can never match
        free.free(block.start, block.size)

    def data(self, block: ArenaBlock, nbytes: Optional[int] = None) -> memoryview:
        n = block.capacity if nbytes is None else nbytes
        start = block.data_offset
        return memoryview(self.segments[block.segment].buf)[start:start + n]

    def write(self, block: ArenaBlock, src: Source, nbytes: int) -> None:
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

    def hand_out(self, block: ArenaBlock, nbytes: int) -> ShmRef:
        """Stamp a fresh generation and `nbytes` into the header; the descriptor."""
        generation = next(self._generations)
        write_block_header(self.segments[block.segment].buf, block.start, generation, nbytes)
        return ShmRef(block.segment, block.data_offset, nbytes, generation)

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
    """Read-only mappings of worker segments, by name, made on first use from
    the fd the daemon handed us (`link`: the session's side channel).

    The daemon's memory cannot be resized, so a mapping is never stale; the
    cache is dropped whenever the session changes, so a restarted daemon's
    segments are mapped afresh. A dropped mapping stays alive as long as
    arrays view it.
    """

    def __init__(self) -> None:
        self._maps: dict[str, mmap.mmap] = {}
        self.link: Optional[LocalLink] = None    # the session's side channel, when local

    def get(self, name: str, end: int) -> mmap.mmap:
        mm = self._maps.get(name)
        if mm is None:
            mm = self._maps[name] = self._attach(name)
        if end > len(mm):
            raise InferenceError(errors.INTERNAL, f"output block [{end} bytes] lies beyond its "
                                                  f"shared-memory segment ({len(mm)} bytes)")
        return mm

    def _attach(self, name: str) -> mmap.mmap:
        if self.link is None or not isinstance(name, str):
            raise InferenceError(errors.INTERNAL, f"an output lent in shared memory {name!r} "
                                                  f"without a local session")
        fd = self.link.take(name)
        try:
            return mmap.mmap(fd, os.fstat(fd).st_size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        finally:
            os.close(fd)

    def clear(self) -> None:
        self._maps.clear()       # live arrays keep their mmap objects alive
        self.link = None
