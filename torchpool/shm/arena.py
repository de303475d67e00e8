"""An arena: a few large pre-faulted segments carved into blocks in-process.

Segments are created once and reused; allocating and freeing a block is a
local operation (no round trip to another process). The arena grows by one
segment when nothing fits, up to `limit` bytes in all; `announce(segment)` is
called for each new one, so its owner can hand the fd to whoever reads it
before any descriptor names it.
"""
from __future__ import annotations

import bisect
import itertools
from typing import Callable, NamedTuple, Optional

from .segment import Segment

ALIGN = 64  # cache-line alignment keeps torch/numpy views fast and aligned


def _align(n: int) -> int:
    return (n + ALIGN - 1) & ~(ALIGN - 1)


class ArenaFull(Exception):
    """No room for a block, even after growing to the limit."""


class Block(NamedTuple):
    # a NamedTuple, not a frozen dataclass: blocks are made and freed on every
    # request, and building a frozen dataclass costs four times as much
    segment: str
    offset: int
    size: int


class FreeList:
    """First-fit free list over one segment, coalescing neighbours on free."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.starts: list[int] = [0]
        self.sizes: list[int] = [size]

    def alloc(self, n: int) -> Optional[int]:
        for i, free in enumerate(self.sizes):
            if free >= n:
                start = self.starts[i]
                if free == n:
                    del self.starts[i], self.sizes[i]
                else:
                    self.starts[i] += n
                    self.sizes[i] -= n
                return start
        return None

    def free(self, start: int, n: int) -> None:
        i = bisect.bisect_left(self.starts, start)
        # merge with the following free range
        if i < len(self.starts) and start + n == self.starts[i]:
            n += self.sizes[i]
            del self.starts[i], self.sizes[i]
        # merge with the preceding free range
        if i > 0 and self.starts[i - 1] + self.sizes[i - 1] == start:
            self.sizes[i - 1] += n
        else:
            self.starts.insert(i, start)
            self.sizes.insert(i, n)

    def reset(self) -> None:
        self.starts, self.sizes = [0], [self.size]

    @property
    def free_bytes(self) -> int:
        return sum(self.sizes)


class Arena:
    """Blocks in shared memory, owned by this process."""

    def __init__(self, name_for: Callable[[int], str], chunk_size: int,
                 limit: int, prefault: bool = True,
                 announce: Optional[Callable[[Segment], None]] = None) -> None:
        self._name_for = name_for          # segment number -> segment name
        self._announce = announce
        self.chunk_size = chunk_size
        self.limit = limit
        self._prefault = prefault
        self._counter = itertools.count()
        self.segments: dict[str, Segment] = {}
        self._free: dict[str, FreeList] = {}

    @property
    def mapped_bytes(self) -> int:
        return sum(s.size for s in self.segments.values())

    @property
    def used_bytes(self) -> int:
        return self.mapped_bytes - sum(f.free_bytes for f in self._free.values())

    def alloc(self, nbytes: int) -> Block:
        n = _align(max(nbytes, 1))
        for name, free in self._free.items():
            start = free.alloc(n)
            if start is not None:
                return Block(name, start, nbytes)
        name = self._grow(n)
        start = self._free[name].alloc(n)
        assert start is not None
        return Block(name, start, nbytes)

    def free(self, block: Block) -> None:
        self._free[block.segment].free(block.offset, _align(max(block.size, 1)))

    def reset(self) -> None:
        """Free every block at once (a worker's outputs after each batch)."""
        for free in self._free.values():
            free.reset()

    def view(self, block: Block) -> memoryview:
        return memoryview(self.segments[block.segment].buf)[block.offset:block.offset + block.size]

    def _grow(self, n: int) -> str:
        size = max(self.chunk_size, _align(n))
        if self.mapped_bytes + size > self.limit:
            raise ArenaFull(
                f"shared-memory arena full: {n} bytes needed, {self.mapped_bytes} of "
                f"{self.limit} bytes mapped and in use")
        seg = Segment.create(self._name_for(next(self._counter)), size, prefault=self._prefault)
        self.segments[seg.name] = seg
        self._free[seg.name] = FreeList(size)
        if self._announce is not None:
            self._announce(seg)
        return seg.name

    def close(self) -> None:
        for seg in self.segments.values():
            seg.close()
        self.segments.clear()
        self._free.clear()


class MappedSegments:
    """Segments of other processes, by name, mapped when their fd arrives."""

    def __init__(self, close: Callable[[Segment], None] = Segment.close) -> None:
        self._segments: dict[str, Segment] = {}
        self._close = close          # how a dropped segment is closed (a reaper's, in the broker)

    def add(self, name: str, fd: int, writable: bool = True, keep_fd: bool = False) -> Segment:
        """Map a segment we were handed (taking its fd); replaces one of the same name."""
        old = self._segments.pop(name, None)
        if old is not None:
            self._close(old)         # as a dropped one (a GPU worker unregisters it first)
        seg = self._segments[name] = Segment.from_fd(name, fd, writable=writable, keep_fd=keep_fd)
        return seg

    def get(self, name: str) -> Segment:
        """The segment; KeyError when its fd never came."""
        return self._segments[name]

    def find(self, name: str) -> Optional[Segment]:
        return self._segments.get(name)

    def __contains__(self, name: str) -> bool:
        return name in self._segments

    def drop(self, predicate: Callable[[str], bool]) -> None:
        for name in [n for n in self._segments if predicate(n)]:
            self._close(self._segments.pop(name))

    def close(self) -> None:
        self.drop(lambda _: True)
