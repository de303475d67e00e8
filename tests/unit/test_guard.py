"""The SIGBUS guard (torchpool.shm.guard) and the worker's region maps under it.

Every test that makes a process touch memory beyond the end of a shrunk
segment runs that in a child interpreter: a guard that does not work kills
the child, not pytest. The children use memfd segments shrunk with
ftruncate, as a client would shrink its registered region, and print JSON.
"""
from __future__ import annotations

import json
import mmap
import os
import signal
import subprocess
import sys
import textwrap

import posix_ipc
import pytest

from torchpool.protocol import errors
from torchpool.shm import guard, regions
from torchpool.shm.regions import RegionError, RegionMaps

P = mmap.PAGESIZE

PRELUDE = textwrap.dedent("""
    import faulthandler, json, mmap, os, sys, threading
    faulthandler.enable()       # as pytest has it: the guard must chain to it
    from torchpool.shm import guard
    P = mmap.PAGESIZE

    def segment(pages, fill=1):
        fd = os.memfd_create("guard-test")
        os.ftruncate(fd, pages * P)
        m = mmap.mmap(fd, pages * P)
        m[:] = bytes([fill]) * (pages * P)
        return fd, m

    def report(**values):
        print(json.dumps(values), flush=True)
""")


# Without the extension only test_the_guard_is_built fails: one clear failure
needs_guard = pytest.mark.skipif(not guard.AVAILABLE, reason="the _sigbus extension was not built")


def run_child(body: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(body)],
                          capture_output=True, text=True, timeout=120)


def child_values(body: str) -> dict:
    proc = run_child(body)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_guard_is_built() -> None:
    # scripts/test installs torchpool with its C extensions; without this one
    # workers refuse every client region
    assert guard.AVAILABLE and guard.CAPACITY >= 1024


@needs_guard
def test_a_read_beyond_the_shrunk_end_reads_zeros_and_flags_the_range() -> None:
    proc = run_child("""
        fd, m = segment(4)
        g = guard.protect(m)
        before = g.faulted
        os.ftruncate(fd, P)                   # the client shrinks its segment
        value = memoryview(m)[3 * P]          # a page that is gone
        report(before=before, value=value, faulted=g.faulted, first=m[0])
        g.release()
        report(released_faulted=g.faulted)    # the flag survives release()
        m.close()
    """)
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    # the whole range is replaced: even the page still inside the segment
    # reads zeros now (it held ones), so the region is broken from then on
    assert lines == [{"before": False, "value": 0, "faulted": True, "first": 0},
                     {"released_faulted": True}]


@needs_guard
def test_writes_through_torch_on_several_threads_survive_and_flag_the_range() -> None:
    got = child_values("""
        import torch
        torch.set_num_threads(2)
        fd, m = segment(256)                  # 1 MiB: fill_ splits it over both threads
        g = guard.protect(m)
        t = torch.frombuffer(m, dtype=torch.uint8)
        os.ftruncate(fd, P)
        t[P:].fill_(7)                        # into pages that are gone
        report(faulted=g.faulted, written=int(t[-1]), first=int(t[0]), threads=torch.get_num_threads())
    """)
    # the write landed in throwaway anonymous pages, the segment's first page is
    # no longer visible
    assert got == {"faulted": True, "written": 7, "first": 0, "threads": 2}


@needs_guard
def test_a_write_through_numpy_survives() -> None:
    got = child_values("""
        import numpy as np
        fd, m = segment(4)
        g = guard.protect(m)
        a = np.frombuffer(m, np.uint8)
        os.ftruncate(fd, 0)
        a[2 * P:3 * P] = 9
        report(faulted=g.faulted, written=int(a[2 * P]), size=os.fstat(fd).st_size)
        del a
        g.release()
        m.close()
    """)
    assert got == {"faulted": True, "written": 9, "size": 0}


@needs_guard
def test_a_fault_on_another_thread_is_handled() -> None:
    got = child_values("""
        fd, m = segment(4)
        g = guard.protect(m)
        os.ftruncate(fd, P)
        seen = []
        reader = threading.Thread(target=lambda: seen.append(memoryview(m)[2 * P + 5]))
        reader.start()
        reader.join()
        report(seen=seen, faulted=g.faulted, main=threading.get_ident() != reader.ident)
    """)
    assert got == {"seen": [0], "faulted": True, "main": True}


@needs_guard
def test_only_the_range_hit_is_flagged() -> None:
    got = child_values("""
        fd_a, a = segment(4, fill=1)
        fd_b, b = segment(4, fill=2)
        ga, gb = guard.protect(a), guard.protect(b)
        os.ftruncate(fd_a, P)
        value = a[3 * P]
        report(value=value, a=ga.faulted, b=gb.faulted, b_data=[b[0], b[4 * P - 1]])
    """)
    assert got == {"value": 0, "a": True, "b": False, "b_data": [2, 2]}


@needs_guard
@pytest.mark.parametrize("case", ["unguarded", "released"])
def test_a_fault_outside_every_guarded_range_still_kills_through_faulthandler(case: str) -> None:
    # the guard is installed (another mapping is protected), and a mapping it
    # does not guard (never, or no longer) is shrunk and read: the process
    # must die of SIGBUS after faulthandler has reported it, as without us
    proc = run_child(f"""
        fd_g, guarded = segment(1)
        g = guard.protect(guarded)
        fd, m = segment(4)
        if {case!r} == "released":
            guard.protect(m).release()
        os.ftruncate(fd, 0)
        print("before", flush=True)
        value = m[0]
        report(survived=value, guarded=g.faulted)
    """)
    assert proc.returncode == -signal.SIGBUS, (proc.returncode, proc.stdout, proc.stderr)
    assert proc.stdout == "before\n"
    assert "Fatal Python error: Bus error" in proc.stderr


@needs_guard
def test_the_guard_goes_back_on_top_of_a_handler_installed_after_it() -> None:
    # faulthandler enabled again after the first protect(): the next protect()
    # re-installs the guard above it; a guarded fault is still survived, and an
    # unguarded one still ends in SIGBUS (no two handlers passing it around)
    body = """
        fd_a, a = segment(4)
        ga = guard.protect(a)
        faulthandler.disable()
        faulthandler.enable()
        fd_b, b = segment(4)
        gb = guard.protect(b)
        os.ftruncate(fd_b, 0)
        report(value=b[P], b=gb.faulted, a=ga.faulted)
        fd, m = segment(4)
        os.ftruncate(fd, 0)
        m[0]
        report(survived=True)
    """
    proc = run_child(body)
    assert proc.returncode == -signal.SIGBUS, (proc.returncode, proc.stdout, proc.stderr)
    assert json.loads(proc.stdout.splitlines()[0]) == {"value": 0, "b": True, "a": False}
    assert "Fatal Python error: Bus error" in proc.stderr


@needs_guard
def test_a_sigbus_sent_by_a_process_is_not_swallowed() -> None:
    proc = run_child("""
        fd, m = segment(1)
        g = guard.protect(m)
        import signal
        os.kill(os.getpid(), signal.SIGBUS)
        report(survived=True)
    """)
    assert proc.returncode == -signal.SIGBUS, (proc.returncode, proc.stdout, proc.stderr)
    assert proc.stdout == ""


@needs_guard
def test_protect_and_release_reuse_slots_beyond_the_capacity() -> None:
    m = mmap.mmap(-1, 2 * P)
    try:
        for _ in range(guard.CAPACITY + 100):
            g = guard.protect(m)
            assert g.faulted is False
            g.release()
            g.release()                       # idempotent
        # released handles stay released when their slot is reused
        old = guard.protect(m)
        old.release()
        new = guard.protect(m)
        old.release()
        assert new.faulted is False and "guarded" in repr(new)
        new.release()
    finally:
        m.close()


@needs_guard
def test_the_table_fills_up_with_a_clear_error() -> None:
    m = mmap.mmap(-1, P)
    held = []
    try:
        with pytest.raises(RuntimeError, match="guarded ranges are in use"):
            for _ in range(guard.CAPACITY + 1):
                held.append(guard.protect(m))
        assert len(held) == guard.CAPACITY   # no other test left a range behind
    finally:
        for g in held:
            g.release()
    guard.protect(m).release()                # a slot is free again
    m.close()


@needs_guard
def test_protect_keeps_no_buffer_export_and_refuses_unaligned_or_empty_buffers() -> None:
    m = mmap.mmap(-1, 2 * P)
    g = guard.protect(m)
    with pytest.raises(ValueError, match="page boundary"):
        guard.protect(memoryview(m)[1:])
    with pytest.raises(ValueError, match="empty"):
        guard.protect(bytearray())
    g.release()
    m.close()                                 # no export left behind by protect()


# --- the worker's region maps ------------------------------------------------

REGION_PRELUDE = """
    import posix_ipc
    import numpy as np
    import torch
    from torchpool.shm.regions import RegionError, RegionMaps
    shm = posix_ipc.SharedMemory("/" + KEY)
    ref = [KEY, os.fstat(shm.fd).st_ino]
    maps = RegionMaps()

    def refused(end):
        try:
            maps.get(ref, end, "input 'X' for model 'm'")
        except RegionError as exc:
            return [exc.code, exc.message]
        return None
"""


@pytest.fixture
def region():
    """A 4-page client segment of fives; the child maps it by name."""
    key = f"torchpool.test-guard-{os.getpid()}"
    shm = posix_ipc.SharedMemory("/" + key, posix_ipc.O_CREX, size=4 * P)
    with mmap.mmap(shm.fd, 4 * P) as m:
        m[:] = b"\x05" * (4 * P)
    yield shm, key
    os.close(shm.fd)
    shm.unlink()


def region_child(key: str, body: str) -> dict:
    return child_values(f"KEY = {key!r}\n" + textwrap.dedent(REGION_PRELUDE) + textwrap.dedent(body))


@needs_guard
def test_region_maps_guard_their_mappings_and_refuse_a_broken_region_until_dropped(region) -> None:
    _, key = region
    got = region_child(key, """
        buf = maps.get(ref, 4 * P, "input 'X' for model 'm'")
        before = [buf[3 * P], maps.broken(ref)]
        os.ftruncate(shm.fd, P)              # the client shrinks it while the model reads
        during = [buf[3 * P], maps.broken(ref)]
        os.ftruncate(shm.fd, 4 * P)          # grown back: still broken, nothing remapped
        refusal = refused(P)
        still = maps.broken(ref)
        maps.drop(ref)                        # the broker forgot it
        after_drop = maps.broken(ref)
        fresh = maps.get(ref, 4 * P, "input 'X' for model 'm'")
        fresh[0] = 6
        maps.drop(ref)
        maps.drop(ref)                        # twice is harmless
        report(before=before, during=during, refusal=refusal, still=still, after_drop=after_drop,
               fresh=[fresh.closed, maps.broken(ref)])
    """)
    assert got == {
        "before": [5, False], "during": [0, True],
        "refusal": [errors.INVALID_ARG, "input 'X' for model 'm': the region's segment shrank while "
                                        "in use; unregister and register it again"],
        "still": True, "after_drop": False, "fresh": [True, False]}


@needs_guard
def test_region_maps_keep_the_older_mapping_of_a_grown_segment_guarded(region) -> None:
    _, key = region
    got = region_child(key, """
        first = maps.get(ref, 4 * P, "input 'X' for model 'm'")
        # torch.frombuffer keeps no buffer export: a tensor of the same batch
        # may still read the first mapping after the region is mapped again
        tensor = torch.frombuffer(first, dtype=torch.uint8)
        os.ftruncate(shm.fd, 8 * P)
        grown = maps.get(ref, 8 * P, "output 'Y' for model 'm'")
        kept = [len(grown) // P, first.closed, int(tensor[3 * P])]
        os.ftruncate(shm.fd, P)
        hit = [int(tensor[3 * P]), maps.broken(ref), refused(P) is not None]
        del tensor
        maps.drop(ref)
        report(kept=kept, hit=hit, closed=[first.closed, grown.closed])
    """)
    assert got == {"kept": [8, False, 5], "hit": [0, True, True], "closed": [True, True]}


@needs_guard
def test_region_maps_unmap_a_still_viewed_mapping_later_and_keep_it_guarded_meanwhile(region) -> None:
    _, key = region
    got = region_child(key, """
        mapping = maps.get(ref, 4 * P, "input 'X' for model 'm'")
        array = np.frombuffer(mapping, np.uint8)
        maps.drop(ref)                        # the broker forgot it; the array still views it
        open_after_drop = not mapping.closed
        os.ftruncate(shm.fd, P)
        value = int(array[3 * P])             # guarded even after the drop
        del array
        maps.drop(["none", 0])                # the next drop unmaps it
        report(open_after_drop=open_after_drop, value=value, closed=mapping.closed)
    """)
    assert got == {"open_after_drop": True, "value": 0, "closed": True}


def test_region_maps_refuse_regions_without_the_guard(region, monkeypatch) -> None:
    shm, key = region
    ref = [key, os.fstat(shm.fd).st_ino]
    monkeypatch.setattr(regions.guard, "AVAILABLE", False)
    with pytest.raises(RegionError, match="compiled SIGBUS guard") as info:
        RegionMaps().get(ref, P, "input 'X' for model 'm'")
    assert "input 'X' for model 'm'" in info.value.message


def test_protect_without_the_extension_says_so(monkeypatch) -> None:
    monkeypatch.setattr(guard, "_sigbus", None)
    with pytest.raises(RuntimeError, match=r"SIGBUS guard \(torchpool.shm._sigbus\) was not compiled"):
        guard.protect(bytearray(P))
