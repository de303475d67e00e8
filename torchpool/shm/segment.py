"""One POSIX shared-memory segment, mapped into this process.

Ownership follows CPython's `multiprocessing.shared_memory`: exactly one owner
creates a segment (O_CREAT | O_EXCL, mode 0600) and unlinks it exactly once;
everyone else only attaches and closes. A segment whose creation fails half way
is unlinked at once.
"""
from __future__ import annotations

import mmap
import os
from typing import Optional

import posix_ipc

SHM_DIR = "/dev/shm"

# Linux >= 5.14 faults every page in with one madvise call; older kernels
# refuse it and we touch the pages one by one instead.
_MADV_POPULATE_WRITE: Optional[int] = getattr(mmap, "MADV_POPULATE_WRITE", 23)


class Segment:
    """A mapped segment. `buf` is the mmap (a writable buffer)."""

    __slots__ = ("name", "size", "buf", "owner", "_closed")

    def __init__(self, name: str, buf: mmap.mmap, size: int, owner: bool) -> None:
        self.name = name
        self.buf = buf
        self.size = size
        self.owner = owner
        self._closed = False

    @classmethod
    def create(cls, name: str, size: int, prefault: bool = True, mode: int = 0o600) -> "Segment":
        """Create a new segment (fails if the name exists) and map it."""
        if size <= 0:
            raise ValueError("segment size must be positive")
        shm = posix_ipc.SharedMemory("/" + name, posix_ipc.O_CREX, mode=mode, size=size)
        try:
            buf = mmap.mmap(shm.fd, size)
        except BaseException:
            shm.unlink()
            raise
        finally:
            shm.close_fd()
        seg = cls(name, buf, size, owner=True)
        if prefault:
            seg.prefault()
        return seg

    @classmethod
    def attach(cls, name: str) -> "Segment":
        """Map an existing segment; its size is what the kernel says (fstat)."""
        shm = posix_ipc.SharedMemory("/" + name)
        try:
            size = os.fstat(shm.fd).st_size
            if size <= 0:
                raise ValueError(f"shared-memory segment '{name}' is empty")
            buf = mmap.mmap(shm.fd, size)
        finally:
            shm.close_fd()
        return cls(name, buf, size, owner=False)

    def prefault(self) -> None:
        """Touch every page now, so the first request does not pay page faults."""
        if _MADV_POPULATE_WRITE is not None:
            try:
                self.buf.madvise(_MADV_POPULATE_WRITE)
                return
            except OSError:
                pass
        page = mmap.PAGESIZE
        for off in range(0, self.size, page):
            self.buf[off] = 0

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            try:
                self.buf.close()
            except BufferError:
                # A view still points into the mapping (e.g. a tensor a caller
                # kept). Leave the mapping to the garbage collector; the name
                # is still unlinked by the owner, so nothing leaks.
                pass

    def unlink(self) -> None:
        """Remove the name (owner only). The memory goes when the last map does."""
        unlink_segment(self.name)

    def __repr__(self) -> str:
        return f"Segment({self.name!r}, {self.size})"


def unlink_segment(name: str) -> bool:
    """Unlink a segment by name; False if it was already gone."""
    try:
        posix_ipc.unlink_shared_memory("/" + name)
        return True
    except posix_ipc.ExistentialError:
        return False
