"""The reaper closes segments off the caller's thread, in order."""
from __future__ import annotations

import mmap
import os
import threading

from torchpool.shm.reaper import Reaper
from torchpool.shm.segment import Segment

closed_by: list[tuple[str, str]] = []


class Watched(Segment):
    __slots__ = ()

    def close(self) -> None:
        closed_by.append((self.name, threading.current_thread().name))
        super().close()


class Broken(Segment):
    __slots__ = ()

    def close(self) -> None:
        raise OSError("boom")


def watched(name: str) -> Watched:
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    os.ftruncate(fd, 4096)
    return Watched(name, mmap.mmap(fd, 4096), 4096, fd)


def test_the_reaper_closes_on_its_own_thread_in_order() -> None:
    closed_by.clear()
    reaper = Reaper()
    segments = [watched(f"w{i}") for i in range(3)]
    for seg in segments:
        reaper.close(seg)
    reaper.stop()                                       # waits for everything given before
    assert closed_by == [(f"w{i}", "torchpool-reaper") for i in range(3)]
    assert all(seg.fd == -1 and seg.buf.closed for seg in segments)
    late = watched("late")
    reaper.close(late)                                  # after stop: at once, on the caller's thread
    assert closed_by[-1] == ("late", threading.current_thread().name) and late.fd == -1


def test_a_failing_close_does_not_stop_the_reaper() -> None:
    reaper = Reaper()
    reaper.close(Broken("broken", mmap.mmap(-1, 4096), 4096))
    good = Segment.create("reaper-good", 4096)
    reaper.close(good)
    reaper.stop()
    assert good.fd == -1 and good.buf.closed
