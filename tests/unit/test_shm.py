"""Shared memory: segments, arenas, naming and stale-segment cleanup (no daemon)."""
from __future__ import annotations

import fcntl
import mmap
import os
import socket
import stat
import subprocess
import sys
import uuid

import numpy as np
import posix_ipc
import pytest

from torchpool.shm import (Arena, ArenaFull, Block, MappedSegments, NamedSegment, Segment, daemon_id,
                           remove_segments_with_prefix, remove_stale_segments, segment_prefix,
                           unlink_segment)
from torchpool.shm.fdpass import recv_with_fds, send_with_fds
from torchpool.shm.arena import ALIGN

KiB = 1024


@pytest.fixture
def arena(prefix):
    a = Arena(lambda i: f"{prefix}{i}", 64 * KiB, 256 * KiB)
    yield a
    a.close()


def shm_names(prefix: str) -> list[str]:
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith(prefix))


# ----------------------------------------------------------------- segments

def test_daemon_memory_has_no_name_and_cannot_be_resized(prefix) -> None:
    seg = Segment.create(prefix + "a", 8192)
    try:
        assert shm_names(prefix) == []                       # nothing in /dev/shm to guess or open
        seals = fcntl.fcntl(seg.fd, fcntl.F_GET_SEALS)
        assert seals & (fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL) == \
            fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
        # what a client holding the fd would try: shrink, grow, lift the seals
        with pytest.raises(PermissionError):
            os.ftruncate(seg.fd, 4096)
        with pytest.raises(PermissionError):
            os.ftruncate(seg.fd, 16384)
        with pytest.raises(PermissionError):
            fcntl.fcntl(seg.fd, fcntl.F_ADD_SEALS, 0)
        assert os.fstat(seg.fd).st_size == 8192
    finally:
        seg.close()
    with pytest.raises(ValueError):
        Segment.create(prefix + "zero", 0)


def test_a_handed_fd_maps_the_same_bytes(prefix) -> None:
    seg = Segment.create(prefix + "b", 10_000, prefault=False)
    mapped = MappedSegments()
    try:
        other = mapped.add(seg.name, os.dup(seg.fd))
        assert other.size == 10_000 and other.fd == -1 and mapped.get(seg.name) is other
        seg.buf[0:5] = b"hello"
        assert bytes(other.buf[0:5]) == b"hello"             # one memory, two mappings
        other.buf[9_995:10_000] = b"world"
        assert bytes(seg.buf[9_995:10_000]) == b"world"
        mapped.drop(lambda name: name == seg.name)
        assert mapped.find(seg.name) is None and seg.name not in mapped
    finally:
        mapped.close()
        seg.close()


def test_read_only_fd_can_neither_write_nor_resize(prefix) -> None:
    seg = Segment.create(prefix + "r", 4096)
    fd = seg.readonly_fd()
    try:
        seg.buf[0:3] = b"abc"
        with pytest.raises(PermissionError):
            mmap.mmap(fd, 4096, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        with pytest.raises(OSError):
            os.ftruncate(fd, 0)
        with pytest.raises(OSError):
            os.pwrite(fd, b"x", 0)
        view = mmap.mmap(fd, 4096, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        assert view[0:3] == b"abc"
        view.close()
    finally:
        os.close(fd)
        seg.close()


def test_a_read_only_fd_reopened_through_proc_is_writable_unless_sealed(prefix) -> None:
    """A memfd's inode has mode 0777: whoever holds a read-only fd reopens it
    writable through /proc. Memory lent to clients is sealed with
    F_SEAL_FUTURE_WRITE (only_we_write) after the owner mapped it: the
    reopened fd is refused writable mappings and writes, and the owner's own
    mapping still writes."""
    plain = Segment.create(prefix + "plain", 4096)
    lent = Segment.create(prefix + "lent", 4096, only_we_write=True)
    fds = []
    try:
        for seg in (plain, lent):
            fds.append(seg.readonly_fd())
            fds.append(os.open(f"/proc/self/fd/{fds[-1]}", os.O_RDWR))      # allowed either way
        os.pwrite(fds[1], b"x", 0)
        assert plain.buf[0:1] == b"x"                      # unsealed: the read-only fd meant nothing
        with pytest.raises(PermissionError):
            mmap.mmap(fds[3], 4096, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        with pytest.raises(PermissionError):
            os.pwrite(fds[3], b"x", 0)
        lent.buf[0:3] = b"abc"                             # the owner's mapping writes on
        view = mmap.mmap(fds[3], 4096, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        assert view[0:3] == b"abc"
        view.close()
        # mapped again by another process of the daemon (the broker): read-only, whatever it asks
        again = Segment.from_fd("lent", os.dup(fds[2]), writable=True)
        with pytest.raises(TypeError):
            again.buf[0:1] = b"z"
        again.close()
    finally:
        for fd in fds:
            os.close(fd)
        plain.close()
        lent.close()


def test_unsealed_memory_is_refused() -> None:
    fd = os.memfd_create("torchpool.unsealed", os.MFD_CLOEXEC)
    os.ftruncate(fd, 4096)
    with pytest.raises(ValueError, match="not sealed"):
        Segment.from_fd("unsealed", fd)                     # takes (closes) the fd
    with pytest.raises(OSError):
        os.fstat(fd)


def test_segments_travel_as_fds_over_a_unix_socket(prefix) -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    segs = [Segment.create(f"{prefix}{i}", 4096 * (i + 1), prefault=False) for i in range(3)]
    try:
        for i, seg in enumerate(segs):
            seg.buf[0] = i + 1
        send_with_fds(a, b"three", [s.fd for s in segs])
        data, fds = recv_with_fds(b, 1024)
        assert data == b"three" and len(fds) == 3
        got = [Segment.from_fd(s.name, fd) for s, fd in zip(segs, fds)]
        assert [(g.size, g.buf[0]) for g in got] == [(4096, 1), (8192, 2), (12288, 3)]
        for g in got:
            g.close()
        send_with_fds(a, b"none", [])
        assert recv_with_fds(b, 1024) == (b"none", [])
    finally:
        for s in segs:
            s.close()
        a.close()
        b.close()


def test_named_segment_mode_is_0600_and_create_is_exclusive(prefix) -> None:
    seg = NamedSegment.create(prefix + "n", 4096)
    try:
        mode = os.stat(f"/dev/shm/{seg.name}").st_mode
        assert stat.S_ISREG(mode) and stat.S_IMODE(mode) == 0o600
        assert os.stat(f"/dev/shm/{seg.name}").st_uid == os.getuid()
        with pytest.raises(posix_ipc.ExistentialError):   # O_EXCL
            NamedSegment.create(prefix + "n", 4096)
        other = NamedSegment.attach(seg.name)
        seg.buf[0:5] = b"hello"
        assert bytes(other.buf[0:5]) == b"hello" and not other.owner and seg.owner
        other.close()
    finally:
        seg.unlink()
        seg.close()
    assert not shm_names(prefix + "n")
    assert unlink_segment(seg.name) is False              # already gone


def test_close_with_a_live_view_does_not_raise(prefix) -> None:
    seg = Segment.create(prefix + "v", 4096)
    view = np.frombuffer(seg.buf, np.uint8)
    seg.close()                      # a view still points into it: left to the GC
    assert view.shape == (4096,)


# ------------------------------------------------------------------- arenas

def test_alloc_is_aligned_and_writable(arena: Arena) -> None:
    blocks = [arena.alloc(n) for n in (1, 63, 64, 65, 1000)]
    assert all(b.offset % ALIGN == 0 for b in blocks)
    assert [b.size for b in blocks] == [1, 63, 64, 65, 1000]
    ends = sorted((b.offset, b.offset + b.size) for b in blocks)
    assert all(e1 <= s2 for (_, e1), (s2, _) in zip(ends, ends[1:]))     # no overlap
    for i, b in enumerate(blocks):
        arena.view(b)[:] = bytes([i + 1]) * b.size
    for i, b in enumerate(blocks):
        assert bytes(arena.view(b)) == bytes([i + 1]) * b.size
    assert len(arena.segments) == 1
    zero = arena.alloc(0)
    assert zero.size == 0 and len(arena.view(zero)) == 0


def test_free_coalesces_neighbours(arena: Arena) -> None:
    quarter = 16 * KiB
    a, b, c, d = (arena.alloc(quarter) for _ in range(4))
    assert [x.offset for x in (a, b, c, d)] == [0, quarter, 2 * quarter, 3 * quarter]
    assert arena.used_bytes == 64 * KiB
    arena.free(b)
    arena.free(a)                   # merges with b's range after it
    arena.free(c)                   # merges with a+b before it
    big = arena.alloc(3 * quarter)  # fits only if a, b and c became one range
    assert big.offset == 0 and big.segment == a.segment
    assert len(arena.segments) == 1
    arena.free(big)
    arena.free(d)
    assert arena.used_bytes == 0
    whole = arena.alloc(64 * KiB)
    assert whole.offset == 0 and len(arena.segments) == 1


def test_free_space_is_reused(arena: Arena) -> None:
    for _ in range(100):
        block = arena.alloc(40 * KiB)
        arena.free(block)
    assert len(arena.segments) == 1 and arena.used_bytes == 0


def test_grow_and_limit(arena: Arena, prefix: str) -> None:
    first = arena.alloc(48 * KiB)
    second = arena.alloc(48 * KiB)          # does not fit beside the first: a new segment
    assert first.segment != second.segment
    assert len(arena.segments) == 2 and arena.mapped_bytes == 128 * KiB
    assert shm_names(prefix) == []          # the daemon's memory has no names
    big = arena.alloc(100 * KiB)            # larger than a chunk: a segment of its own size
    assert arena.segments[big.segment].size >= 100 * KiB
    assert arena.mapped_bytes <= arena.limit
    with pytest.raises(ArenaFull) as exc:
        arena.alloc(64 * KiB)               # 128 + 100 + 64 > 256 KiB
    assert "256" in str(exc.value) or str(256 * KiB) in str(exc.value)
    # what is already there keeps working, freed space is usable again
    arena.free(second)
    again = arena.alloc(48 * KiB)
    assert again.segment == second.segment
    arena.view(again)[:4] = b"ok!!"
    assert bytes(arena.view(again)[:4]) == b"ok!!"


def test_reset_frees_everything(arena: Arena) -> None:
    for _ in range(3):
        arena.alloc(20 * KiB)
    assert arena.used_bytes > 0
    arena.reset()
    assert arena.used_bytes == 0
    assert arena.alloc(64 * KiB).offset == 0


def test_growing_announces_each_new_segment_and_close_releases_them(prefix: str) -> None:
    announced = []
    a = Arena(lambda i: f"{prefix}{i}", 64 * KiB, 1024 * KiB, announce=announced.append)
    a.alloc(60 * KiB)
    a.alloc(60 * KiB)
    assert [s.name for s in announced] == [f"{prefix}0", f"{prefix}1"] and shm_names(prefix) == []
    fds = [s.fd for s in announced]
    a.close()
    assert a.segments == {} and all(s.fd == -1 for s in announced)
    for fd in fds:
        with pytest.raises(OSError):
            os.fstat(fd)


def test_block_is_a_value() -> None:
    assert Block("s", 64, 10) == Block("s", 64, 10)


# ------------------------------------------------------------ names, cleanup

def test_daemon_id_is_stable_and_order_free() -> None:
    a = daemon_id(["ipc:///tmp/a.sock", "tcp://127.0.0.1:5555"])
    assert a == daemon_id(["tcp://127.0.0.1:5555", "ipc:///tmp/a.sock"])
    assert a != daemon_id(["ipc:///tmp/b.sock"])
    assert len(a) == 8 and int(a, 16) >= 0
    assert segment_prefix(a) == f"torchpool.{a}.{os.getpid()}."
    assert segment_prefix(a, 42) == f"torchpool.{a}.42."


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_remove_stale_segments_only_of_dead_daemons() -> None:
    daemon = uuid.uuid4().hex[:8]
    other_daemon = uuid.uuid4().hex[:8]
    dead = dead_pid()
    live_other = os.getppid()                 # alive, and not us
    names = {
        "dead": segment_prefix(daemon, dead) + "in0",
        "dead_worker": segment_prefix(daemon, dead) + "w3.0",
        "live": segment_prefix(daemon, live_other) + "in0",
        "mine": segment_prefix(daemon) + "in0",
        "other_daemon": segment_prefix(other_daemon, dead) + "in0",
    }
    segments = [NamedSegment.create(n, 4096, prefault=False) for n in names.values()]
    try:
        removed = remove_stale_segments(daemon)
        assert sorted(removed) == sorted([names["dead"], names["dead_worker"]])
        left = set(os.listdir("/dev/shm"))
        assert names["dead"] not in left and names["dead_worker"] not in left
        assert {names["live"], names["mine"], names["other_daemon"]} <= left
        assert remove_stale_segments(daemon) == []            # idempotent
    finally:
        for seg in segments:
            seg.unlink()
            seg.close()


def test_remove_segments_with_prefix(prefix: str) -> None:
    segs = [NamedSegment.create(f"{prefix}{i}", 4096, prefault=False) for i in range(3)]
    keep = NamedSegment.create(prefix[:-1] + "X.keep", 4096, prefault=False)
    try:
        assert sorted(remove_segments_with_prefix(prefix)) == sorted(s.name for s in segs)
        assert shm_names(prefix) == []
        assert keep.name in os.listdir("/dev/shm")
    finally:
        for s in segs:
            s.close()
        keep.unlink()
        keep.close()


def test_the_fd_receiver_reuses_one_buffer_and_takes_the_fds(prefix) -> None:
    from torchpool.shm.fdpass import FdReceiver

    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    seg = Segment.create(prefix + "f", 4096, prefault=False)
    receiver = FdReceiver(1 << 16)
    try:
        seg.buf[0] = 42
        send_with_fds(a, b"first", [seg.fd])
        data, fds = receiver.recv(b)
        assert bytes(data) == b"first" and len(fds) == 1
        got = Segment.from_fd("f", fds[0])
        assert got.buf[0] == 42
        got.close()
        send_with_fds(a, b"2nd", [])
        data, fds = receiver.recv(b)
        assert bytes(data) == b"2nd" and fds == []
        with pytest.raises(BlockingIOError):
            receiver.recv(b, socket.MSG_DONTWAIT)
        with pytest.raises(OSError, match="cut short"):      # larger than the buffer: never half a message
            a.send(b"x" * (1 << 17))
            receiver.recv(b)
        a.close()
        data, fds = receiver.recv(b)
        assert len(data) == 0 and fds == []                  # the peer closed
    finally:
        seg.close()
        b.close()
