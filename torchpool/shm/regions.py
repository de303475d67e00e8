"""Client block headers and the worker's mappings of client regions."""
from __future__ import annotations

import mmap
import os
from typing import Optional, Sequence, Union, cast

import posix_ipc

from ..protocol import errors
from ..protocol.errors import TorchpoolError
from ..protocol.names import is_path_component
from ..protocol.tensors import BLOCK_HEADER_BYTES, BLOCK_HEADER_LAYOUT, BLOCK_MAGIC  # noqa: F401
from . import guard
from .guard import GuardedRange

# The client block header is a wire fact: protocol/tensors.py owns it. These
# names stay for the worker and the broker's sessions, which read headers.
HEADER_BYTES = BLOCK_HEADER_BYTES               # bytes in front of a block's data
BLOCK_HEADER = BLOCK_HEADER_LAYOUT              # the struct: magic, reserved, generation, nbytes

# A client region on the wire: [key, inode] (protocol/internal.py)
RegionRef = Sequence[Union[str, int]]


class RegionError(TorchpoolError):
    """A request's region cannot be used (INVALID_ARG)."""

    def __init__(self, message: str) -> None:
        super().__init__(errors.INVALID_ARG, message)


class _Mapped:
    """A worker's mappings of one region, each under the SIGBUS guard: the
    current one, and older, smaller ones (the segment grew) that tensors of a
    batch may still view; all are unmapped when the region is dropped."""

    __slots__ = ("fd", "buf", "protected", "older")

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.buf: Optional[mmap.mmap] = None
        self.protected: Optional[GuardedRange] = None
        self.older: list[tuple[mmap.mmap, GuardedRange]] = []

    def map(self, size: int, what: str) -> mmap.mmap:
        buf = mmap.mmap(self.fd, size)
        try:
            protected = guard.protect(buf)
        except RuntimeError as exc:       # the guard's table is full
            buf.close()
            raise RegionError(f"{what}: cannot map one more client region in this worker "
                              f"({exc})") from None
        if self.buf is not None and self.protected is not None:    # (set together)
            # torch.frombuffer keeps no buffer export: closing the old mapping
            # now could pull it from under a tensor of the running batch
            self.older.append((self.buf, self.protected))
        self.buf, self.protected = buf, protected
        return buf

    @property
    def faulted(self) -> bool:
        return any(g.faulted for _, g in self.mappings())

    def mappings(self) -> list[tuple[mmap.mmap, GuardedRange]]:
        if self.buf is None or self.protected is None:      # (set together)
            return list(self.older)
        return self.older + [(self.buf, self.protected)]


class RegionMaps:
    """Registered client regions mapped in a worker, by (key, inode).

    The inode tells a re-created segment under the same name from the one the
    client registered. The real size is checked (fstat) before each use, which
    catches a segment shrunk before the request; one shrunk while the model
    reads or writes it is caught by the SIGBUS guard (shm/guard.py): the access
    completes on zero pages and the region is broken. `broken(ref)` tells the
    worker to fail the batch's requests that used it; `get` refuses a broken
    region until the broker forgets it (`drop`), so the client must register
    it again.
    """

    def __init__(self) -> None:
        self._maps: dict[tuple[Union[str, int], Union[str, int]], _Mapped] = {}    # by the ref's (key, inode)
        # mappings still viewed (a numpy array, a memoryview) when dropped:
        # they stay mapped and guarded until a later drop or attach closes them
        self._retired: list[tuple[mmap.mmap, GuardedRange]] = []

    def get(self, ref: RegionRef, end: int, what: str) -> mmap.mmap:
        key, ino = ref[0], ref[1]
        entry = self._maps.get((key, ino))
        if entry is None:
            entry = self._attach(cast(str, key), cast(int, ino), what)     # [key, inode] on the wire
        elif entry.faulted:
            raise RegionError(f"{what}: the region's segment shrank while in use; "
                              f"unregister and register it again")
        size = os.fstat(entry.fd).st_size
        if end > size:
            raise RegionError(f"{what}: the region's segment shrank below its registered size; "
                              f"unregister and register it again")
        buf = entry.buf
        if buf is None or end > len(buf):       # it grew since we mapped it (None: never, _attach maps)
            return entry.map(size, what)
        return buf

    def broken(self, ref: RegionRef) -> bool:
        """Whether a SIGBUS hit this region's mappings (the client shrank its
        segment while it was in use): what the worker read from the region
        since it was mapped may be zeros, what it wrote there is lost."""
        entry = self._maps.get((ref[0], ref[1]))
        return entry is not None and entry.faulted

    def _attach(self, key: str, ino: int, what: str) -> _Mapped:
        if not guard.AVAILABLE:
            raise RegionError(f"{what}: client regions need torchpool's compiled SIGBUS guard "
                              f"(torchpool.shm._sigbus), and this installation has none; "
                              f"reinstall torchpool with a C compiler, or send tensors inline "
                              f"or through the daemon's shared memory")
        self._close_retired()
        if not is_path_component(key):       # the broker checked it: never hand posix_ipc a NUL
            raise RegionError(f"{what}: the region's key is not a shared-memory name")
        try:
            shm = posix_ipc.SharedMemory("/" + key)
        except (posix_ipc.Error, ValueError, OSError):
            raise RegionError(f"{what}: the region's segment cannot be opened") from None
        entry = _Mapped(shm.fd)
        st = os.fstat(entry.fd)
        if st.st_ino != ino:
            os.close(entry.fd)
            raise RegionError(f"{what}: the region's segment was replaced after registration")
        if st.st_size == 0:
            os.close(entry.fd)
            raise RegionError(f"{what}: the region's segment shrank after registration; unregister "
                              f"and register it again")
        try:
            entry.map(st.st_size, what)
        except RegionError:
            os.close(entry.fd)
            raise
        self._maps[(key, ino)] = entry
        return entry

    def _close(self, mappings: list[tuple[mmap.mmap, GuardedRange]]) -> None:
        """Unmap, releasing each guard first: a guard left on an address range
        could later cover someone else's mapping there. A mapping still viewed
        cannot be unmapped yet: it is guarded again and retired."""
        for buf, protected in mappings:
            protected.release()
            try:
                buf.close()
            except BufferError:
                self._retired.append((buf, guard.protect(buf)))

    def _close_retired(self) -> None:
        retired, self._retired = self._retired, []
        self._close(retired)

    def drop(self, ref: RegionRef) -> None:
        self._close_retired()
        entry = self._maps.pop((ref[0], ref[1]), None)
        if entry is not None:
            self._close(entry.mappings())
            os.close(entry.fd)        # each mapping holds its own descriptor
