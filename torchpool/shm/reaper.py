"""Closing shared memory off the caller's thread.

Freeing a segment's pages is paid by whichever close (or munmap) drops the
last reference to it: 15-30 ms for a 64 MiB segment whose pages were all
touched (measured on a 2-core VM). On the broker's loop that is time in
which nobody is served: a client that came and went in a loop held every
other client's p99 at 15-20 ms. The Reaper closes segments on a thread of
its own; munmap and close release the GIL, so the loop goes on meanwhile.
(Freeing the pages at once with fallocate(PUNCH_HOLE) would spare the other
holders too, but a client whose session expired may still hold arrays in
its old arena and send them again: its memory must stay its own.)
"""
from __future__ import annotations

import logging
import queue
import threading
from typing import Optional

from .segment import Segment

log = logging.getLogger("torchpool.shm")


class Reaper:
    """Closes segments on its own thread, in the order they were given."""

    def __init__(self, name: str = "torchpool-reaper") -> None:
        self._queue: queue.SimpleQueue[Optional[Segment]] = queue.SimpleQueue()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def close(self, seg: Segment) -> None:
        """Close `seg` soon (at once, on this thread, once stopped)."""
        if self._stopped:
            self._reap(seg)
        else:
            self._queue.put(seg)

    def stop(self) -> None:
        """Close everything given so far and end the thread."""
        if not self._stopped:
            self._stopped = True
            self._queue.put(None)
            self._thread.join()

    def _run(self) -> None:
        while True:
            seg = self._queue.get()
            if seg is None:
                return
            self._reap(seg)

    @staticmethod
    def _reap(seg: Segment) -> None:
        try:
            seg.close()
        except Exception:       # never lose the thread: the next segment must still go
            log.exception("closing shared-memory segment %s failed", seg.name)
