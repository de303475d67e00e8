"""Client regions (Triton's system shared memory) in the broker: who may
register what, the challenge that proves it, and the guarded mapping.

A region is a segment the client owns and names. Registering it is a
challenge: the daemon opens the segment, checks that its owner and mode let
the peer (its uid and groups from SO_PEERCRED) write it, and answers a fresh
nonce; the client writes the nonce at the region's offset and calls again;
the daemon reads it back from the same inode. Only then is the segment
mapped, under the SIGBUS guard (shm/guard.py): the client may shrink it at
any moment, and a read of ours that finds it shrunk makes the region broken,
never a crash. The sessions (sessions.py) keep the regions and their limits.
"""
from __future__ import annotations

import mmap
import os
import secrets
import socket
import stat
import time
from dataclasses import dataclass
from typing import Optional, Sequence
import posix_ipc

from ..protocol import errors
from ..protocol.errors import TorchpoolError
from ..protocol.internal import DEVICE_REF, SegmentRef
from ..protocol.messages import BAD_CUDA_HANDLE, CUDA_IPC_HANDLE_BYTES, REGION_TOKEN_MIN_BYTES, region_token_bytes
from ..protocol.names import check_shm_key, unusable_segment
from ..shm import guard
from ..shm.naming import PREFIX

# Offsets and byte sizes are unsigned 64-bit values, as in Triton (its SIZE_MAX)
SIZE_MAX = (1 << 64) - 1
CHALLENGE_TTL_S = 30.0        # a registration must answer its challenge within this


def bad(message: str) -> TorchpoolError:
    return TorchpoolError(errors.INVALID_ARG, message)


def check_uint64(what: str, offset: object, nbytes: object) -> tuple[int, int]:
    """offset and nbytes are ints in [0, 2^64): returned as such."""
    if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0 or offset > SIZE_MAX:
        raise bad(f"{what}: offset {offset!r} is not an integer in [0, 2^64)")
    if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0 or nbytes > SIZE_MAX:
        raise bad(f"{what}: byte size {nbytes!r} is not an integer in [0, 2^64)")
    return offset, nbytes


def check_range(what: str, offset: object, nbytes: object, size: int) -> None:
    """offset and nbytes are ints, >= 0, and offset + nbytes fits in size."""
    offset, nbytes = check_uint64(what, offset, nbytes)
    if offset + nbytes > size:
        raise bad(f"{what}: offset {offset} + byte size {nbytes} = {offset + nbytes} exceeds "
                   f"the {size} bytes available")


def check_window(name: str, byte_size: int, what: str, offset: object, nbytes: object) -> tuple[int, int]:
    """A request's (offset, nbytes) within a region of `byte_size` bytes:
    Triton's checks in its order and words (SharedMemoryManager::GetMemoryInfo)."""
    offset, nbytes = check_uint64(what, offset, nbytes)
    if offset >= byte_size:
        raise bad(f"Invalid offset for shared memory region: '{name}'")
    if nbytes > SIZE_MAX - offset:
        raise bad(f"Integer overflow detected: byte_size ({nbytes}) + offset ({offset}) exceeds maximum "
                  f"value ({SIZE_MAX}) for region '{name}'")
    if offset + nbytes > byte_size:
        raise bad(f"Invalid offset + byte size for shared memory region: '{name}'")
    return offset, nbytes


@dataclass(frozen=True)
class Peer:
    """Who is at the other end of a side-channel connection (SO_PEERCRED)."""

    pid: int
    uid: int
    gid: int
    groups: frozenset[int] = frozenset()

    @classmethod
    def of(cls, conn: socket.socket) -> "Peer":
        import struct
        pid, uid, gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                            struct.calcsize("3i")))
        return cls(pid, uid, gid, frozenset({gid}) | _supplementary_groups(pid))

    def may_write(self, st: os.stat_result) -> bool:
        """Could this peer open a file with this owner and mode for writing?"""
        if self.uid == 0:
            return True
        if st.st_uid == self.uid:
            return bool(st.st_mode & stat.S_IWUSR)
        if st.st_gid in self.groups:
            return bool(st.st_mode & stat.S_IWGRP)
        return bool(st.st_mode & stat.S_IWOTH)


def _supplementary_groups(pid: int) -> frozenset[int]:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("Groups:"):
                    return frozenset(int(g) for g in line.split()[1:])
    except (OSError, ValueError):
        pass
    return frozenset()


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
    guarded: Optional[guard.GuardedRange] = None   # over buf: a shrink is a flag, not a SIGBUS
    given_key: str = ""           # the key as registered (status shows it so, as Triton does)
    in_use: int = 0
    unregistering: bool = False

    @property
    def broken(self) -> bool:
        """The client shrank the segment under a read of ours: what we read
        since is zeros, and the region is unusable until registered again."""
        return self.guarded is not None and self.guarded.faulted

    def check(self, what: str, offset: object, nbytes: object) -> tuple[int, int]:
        """A request's (offset, nbytes) within the region and the segment now:
        Triton's checks in its order and words (SharedMemoryManager::GetMemoryInfo).
        Returns them, checked."""
        offset, nbytes = check_window(self.name, self.byte_size, what, offset, nbytes)
        end = self.offset + offset + nbytes
        if self.broken or end > os.fstat(self.fd).st_size or end > len(self.buf):
            raise bad(f"{what}: region '{self.name}' is smaller than registered "
                       f"(the segment shrank); unregister and register it again")
        return offset, nbytes

    def view(self, offset: int, nbytes: int) -> memoryview:
        start = self.offset + offset
        return memoryview(self.buf)[start:start + nbytes]

    def worker_ref(self) -> list[object]:
        """How a worker names it: the key plus the inode, so a re-created
        segment under the same name is never mistaken for this one (as an
        input's location: rules/validation.py SessionRegion)."""
        return [self.key, self.ino]

    def segment_ref(self) -> SegmentRef:
        """The same, as a FORGET names it (protocol/internal.py)."""
        return [self.key, self.ino]

    def close(self) -> None:
        if self.guarded is not None:
            self.guarded.release()
        try:
            self.buf.close()
        except BufferError:
            pass
        os.close(self.fd)


_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)    # Linux's value (Python names it from 3.13)


@dataclass(eq=False)
class CudaRegion:
    """Client GPU memory registered under a name (Triton's CUDA shared
    memory): a CUDA IPC handle the workers open (worker/cuda_ipc.py). The
    broker never touches CUDA, so it cannot open the handle: it checks the
    request's window against the registered size, and the worker checks that
    size against the allocation the handle names when it opens it."""

    name: str
    handle: bytes
    device_id: int
    byte_size: int
    in_use: int = 0
    unregistering: bool = False
    offset = 0                    # the handle names the region's first byte
    broken = False                # no segment a client could shrink under us

    def check(self, what: str, offset: object, nbytes: object) -> tuple[int, int]:
        return check_window(self.name, self.byte_size, what, offset, nbytes)

    def view(self, offset: int, nbytes: int) -> memoryview:
        """What validation measures the input by: `nbytes` of an untouched
        anonymous mapping, reserving nothing (no memory behind it until read;
        nothing reads it: the bytes are on the GPU, and such a request runs
        alone, in place). A size the kernel will not map even so is the
        request's error, not the broker's."""
        try:
            space = mmap.mmap(-1, max(1, nbytes), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE)
        except (OSError, OverflowError, ValueError):
            raise bad(f"CUDA shared memory region '{self.name}': {nbytes} bytes at offset {offset} are more "
                      f"than this server can take as one input") from None
        return memoryview(space)[:nbytes]

    def worker_ref(self) -> list[object]:
        return [DEVICE_REF, self.handle, self.device_id]

    def segment_ref(self) -> SegmentRef:
        return [DEVICE_REF, self.handle, self.device_id]

    def close(self) -> None:
        """Nothing of it is open in the broker (FORGET closes it in the workers)."""


def open_cuda_region(name: str, raw_handle: object, device_id: object, byte_size: object,
                     gpus: Sequence[int]) -> CudaRegion:
    """A CUDA region to register, checked as far as the broker can."""
    if not isinstance(raw_handle, bytes) or len(raw_handle) != CUDA_IPC_HANDLE_BYTES:
        raise bad(BAD_CUDA_HANDLE)
    if type(device_id) is not int or device_id < 0:
        raise bad(f"region '{name}': 'device_id' must be an unsigned integer")
    _, size = check_uint64(f"region '{name}'", 0, byte_size)
    if not gpus:              # Triton's words where it has no GPU support
        raise bad(f"failed to register CUDA shared memory region: '{name}', GPUs not supported")
    if device_id not in gpus:
        raise bad(f"failed to register CUDA shared memory region: '{name}', device {device_id} is not a "
                  f"GPU of this server (its GPUs: {', '.join(map(str, gpus))})")
    return CudaRegion(name, raw_handle, device_id, size)


@dataclass(eq=False)
class Challenge:
    """A registration waiting for the client to write `nonce` at `offset`."""

    key: str
    offset: int
    byte_size: int
    nonce: bytes
    fd: int
    ino: int
    expires: float
    given_key: str = ""


def region_key(name: str, key: object) -> str:
    """The shm_open name a register call gives, checked (without the leading '/')."""
    key = check_shm_key(name, key)
    if key.startswith(PREFIX):
        raise bad(f"region '{name}': that key is reserved for the daemon's own segments "
                  f"(names starting with '{PREFIX}')")
    return key


def open_challenge(peer: Peer, name: str, key: str, offset: object, byte_size: object,
                   given_key: str = "") -> Challenge:
    """Open the segment for `peer` and pick the nonce it must write
    (`key` checked by region_key; `given_key` as the client wrote it)."""
    if not guard.AVAILABLE:
        raise TorchpoolError(errors.UNSUPPORTED, "registered regions need torchpool's compiled "
                                                 "SIGBUS guard, which this installation lacks")
    try:
        shm = posix_ipc.SharedMemory("/" + key)
    except (posix_ipc.Error, ValueError, OSError):
        # the same answer whether it is missing or forbidden: no probing of names
        raise unusable_segment(name) from None
    fd = shm.fd
    try:
        st = os.fstat(fd)
        if not peer.may_write(st):
            raise unusable_segment(name)
        offset, byte_size = check_uint64(f"region '{name}'", offset, byte_size)
        if offset + byte_size > st.st_size:
            raise unusable_segment(name)
        token_bytes = region_token_bytes(st.st_size, offset)
        if token_bytes < REGION_TOKEN_MIN_BYTES:
            raise bad(f"region '{name}': the segment has {st.st_size - offset} bytes from offset {offset}; "
                      f"the daemon needs {REGION_TOKEN_MIN_BYTES} there for the proof that the client "
                      f"can write it")
    except BaseException:
        os.close(fd)
        raise
    return Challenge(key, offset, byte_size, secrets.token_bytes(token_bytes), fd, st.st_ino,
                     time.monotonic() + CHALLENGE_TTL_S, given_key or key)


def answer_challenge(c: Challenge, name: str, answer: object) -> Region:
    """The region, mapped under the guard, once the nonce is where it belongs
    (takes the challenge's fd either way)."""
    try:
        st = os.fstat(c.fd)
        if (answer != c.nonce or st.st_ino != c.ino or c.offset + c.byte_size > st.st_size
                or os.pread(c.fd, len(c.nonce), c.offset) != c.nonce):
            raise bad(f"region '{name}': ownership proof failed (the challenge is not at the "
                      f"region's offset); the daemon maps only segments the client shows "
                      f"it can write")
        buf = mmap.mmap(c.fd, st.st_size)
        try:
            guarded = guard.protect(buf)
        except BaseException:
            buf.close()
            raise
    except BaseException:
        os.close(c.fd)
        raise
    return Region(name, c.key, c.offset, c.byte_size, c.fd, c.ino, buf, guarded, c.given_key)
