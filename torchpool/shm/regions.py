"""Client block headers and the worker's mappings of client regions."""
from __future__ import annotations

import mmap
import os

import posix_ipc

from ..protocol import errors
from ..protocol.errors import TorchpoolError
from ..protocol.tensors import BLOCK_HEADER_BYTES, BLOCK_HEADER_LAYOUT, BLOCK_MAGIC  # noqa: F401

# The client block header is a wire fact: protocol/tensors.py owns it. These
# names stay for the worker and the broker's sessions, which read headers.
HEADER_BYTES = BLOCK_HEADER_BYTES               # bytes in front of a block's data
BLOCK_HEADER = BLOCK_HEADER_LAYOUT              # the struct: magic, reserved, generation, nbytes


class RegionError(TorchpoolError):
    """A request's region cannot be used (INVALID_ARG)."""

    def __init__(self, message: str) -> None:
        super().__init__(errors.INVALID_ARG, message)


class RegionMaps:
    """Registered client regions mapped in a worker, by (key, inode).

    The inode tells a re-created segment under the same name from the one the
    client registered; the real size is checked (fstat) before each use, so a
    segment shrunk after registration is an error, not a SIGBUS.
    """

    def __init__(self) -> None:
        self._maps: dict[tuple[str, int], tuple[int, mmap.mmap]] = {}

    def get(self, ref: list, end: int, what: str) -> mmap.mmap:
        key, ino = ref[0], ref[1]
        entry = self._maps.get((key, ino))
        if entry is None:
            entry = self._attach(key, ino, what)
        fd, buf = entry
        size = os.fstat(fd).st_size
        if end > size:
            raise RegionError(f"{what}: the region's segment is smaller than registered")
        if end > len(buf):       # it grew since we mapped it
            buf.close()
            buf = mmap.mmap(fd, size)
            self._maps[(key, ino)] = (fd, buf)
        return buf

    def _attach(self, key: str, ino: int, what: str) -> tuple[int, mmap.mmap]:
        try:
            shm = posix_ipc.SharedMemory("/" + key)
        except (posix_ipc.Error, ValueError, OSError):
            raise RegionError(f"{what}: the region's segment cannot be opened") from None
        fd = shm.fd
        st = os.fstat(fd)
        if st.st_ino != ino or st.st_size == 0:
            os.close(fd)
            raise RegionError(f"{what}: the region's segment was replaced after registration")
        entry = (fd, mmap.mmap(fd, st.st_size))
        self._maps[(key, ino)] = entry
        return entry

    def drop(self, ref: list) -> None:
        entry = self._maps.pop((ref[0], ref[1]), None)
        if entry is not None:
            try:
                entry[1].close()
            except BufferError:
                pass
            os.close(entry[0])

