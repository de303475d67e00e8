"""Shared-memory segments mapped into this process.

`Segment` is the daemon's own memory: an unnamed `memfd` sealed against
shrinking and growing (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL). It has no
name in /dev/shm to guess or open; a process gets it only by being handed its
file descriptor (inheritance, or SCM_RIGHTS over a unix socket: fdpass.py),
and nobody who holds it, a client included, can change its size. So every
access to it is safe from SIGBUS without checking sizes, and nothing is left
behind when the processes holding it are gone.

`NamedSegment` is a POSIX segment with a name (mode 0600): what workers of
one model version share their weights through (weights.py). Ownership
follows CPython's `multiprocessing.shared_memory`: exactly one owner creates
it (O_CREAT | O_EXCL) and unlinks it exactly once; others attach and close.
"""
from __future__ import annotations

import fcntl
import mmap
import os
from typing import Optional

import posix_ipc

SHM_DIR = "/dev/shm"

# Linux >= 5.14 faults every page in with one madvise call; older kernels
# refuse it and we touch the pages one by one instead.
_MADV_POPULATE_WRITE: Optional[int] = getattr(mmap, "MADV_POPULATE_WRITE", 23)

# What a client holding the fd must not be able to do: shrink the memory
# under the daemon (SIGBUS), grow it, or lift the seals.
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
# Linux 5.1: no write() and no new writable shared mapping, by anyone, from
# now on; the mappings that exist keep writing. A read-only fd alone is not
# enough: a memfd's inode has mode 0777, so whoever holds one can reopen it
# writable through /proc/self/fd. (Python's fcntl lacks the name before 3.12.)
F_SEAL_FUTURE_WRITE = getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x0010)


def _prefault(buf: mmap.mmap, size: int) -> None:
    """Touch the first `size` bytes' pages now, so the first request does not pay page faults."""
    if _MADV_POPULATE_WRITE is not None:
        try:
            buf.madvise(_MADV_POPULATE_WRITE, 0, size)
            return
        except OSError:
            pass
    for off in range(0, size, mmap.PAGESIZE):
        buf[off] = buf[off]


def _unmap(buf: mmap.mmap) -> None:
    try:
        buf.close()
    except BufferError:
        # A view still points into the mapping (e.g. a tensor a caller kept).
        # Leave the mapping to the garbage collector: the memory goes when the
        # last mapping does.
        pass


class Segment:
    """A sealed memfd, mapped. `buf` is the mmap; `fd` is kept open only by
    processes that hand the segment on (-1 otherwise)."""

    __slots__ = ("name", "size", "buf", "fd", "_closed")

    def __init__(self, name: str, buf: mmap.mmap, size: int, fd: int = -1) -> None:
        self.name = name          # the daemon's id for it (descriptors carry it); not a path
        self.buf = buf
        self.size = size
        self.fd = fd
        self._closed = False

    @classmethod
    def create(cls, name: str, size: int, prefault: bool = True, only_we_write: bool = False) -> "Segment":
        """New zeroed memory of `size` bytes, sealed; keeps its fd to hand on.
        `only_we_write`: this process's mapping is the only writable one there
        will ever be (F_SEAL_FUTURE_WRITE): what it lends cannot be altered."""
        if size <= 0:
            raise ValueError("segment size must be positive")
        fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        buf = None
        try:
            os.ftruncate(fd, size)
            if only_we_write:
                buf = mmap.mmap(fd, size)
                fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS | F_SEAL_FUTURE_WRITE)
            else:
                fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
                buf = mmap.mmap(fd, size)
        except BaseException:
            if buf is not None:
                buf.close()
            os.close(fd)
            raise
        seg = cls(name, buf, size, fd)
        if prefault:
            seg.prefault()
        return seg

    @classmethod
    def from_fd(cls, name: str, fd: int, writable: bool = True, keep_fd: bool = False) -> "Segment":
        """Map a segment whose fd we were handed (and take the fd: it is kept
        with `keep_fd`, closed otherwise). Refuses memory that is not sealed
        against shrinking: only then is mapping it safe."""
        try:
            size = os.fstat(fd).st_size
            if size <= 0:
                raise ValueError(f"shared-memory segment '{name}' is empty")
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
            if seals & fcntl.F_SEAL_SHRINK == 0:
                raise ValueError(f"shared-memory segment '{name}' is not sealed against shrinking")
            writable = writable and not seals & (F_SEAL_FUTURE_WRITE | fcntl.F_SEAL_WRITE)
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
            buf = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=prot)
        except BaseException:
            os.close(fd)
            raise
        if not keep_fd:
            os.close(fd)
            fd = -1
        return cls(name, buf, size, fd)

    def readonly_fd(self) -> int:
        """A new fd of this memory that can only be read (and not resized):
        what a client gets for outputs lent to it. The caller closes it."""
        return os.open(f"/proc/self/fd/{self.fd}", os.O_RDONLY | os.O_CLOEXEC)

    def prefault(self, nbytes: Optional[int] = None) -> None:
        """Fault in the first `nbytes` (all of it by default)."""
        _prefault(self.buf, self.size if nbytes is None else min(nbytes, self.size))

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            _unmap(self.buf)
            if self.fd >= 0:
                os.close(self.fd)
                self.fd = -1

    def __repr__(self) -> str:
        return f"Segment({self.name!r}, {self.size})"


class NamedSegment:
    """A POSIX shared-memory segment with a name, mapped. `buf` is the mmap."""

    __slots__ = ("name", "size", "buf", "owner", "_closed")

    def __init__(self, name: str, buf: mmap.mmap, size: int, owner: bool) -> None:
        self.name = name
        self.buf = buf
        self.size = size
        self.owner = owner
        self._closed = False

    @classmethod
    def create(cls, name: str, size: int, prefault: bool = True, mode: int = 0o600) -> "NamedSegment":
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
            _prefault(buf, size)
        return seg

    @classmethod
    def attach(cls, name: str) -> "NamedSegment":
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

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            _unmap(self.buf)

    def unlink(self) -> None:
        """Remove the name (owner only). The memory goes when the last map does."""
        unlink_segment(self.name)

    def __repr__(self) -> str:
        return f"NamedSegment({self.name!r}, {self.size})"


def unlink_segment(name: str) -> bool:
    """Unlink a named segment; False if it was already gone."""
    try:
        posix_ipc.unlink_shared_memory("/" + name)
        return True
    except posix_ipc.ExistentialError:
        return False
