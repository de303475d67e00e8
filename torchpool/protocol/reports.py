"""The report ring: a worker's reports of the direct requests it answered,
in memory it shares with the broker.

A worker reports every direct request (worker/direct.py) to the broker: its
outcome and timings for the model's statistics, its path for its client's
lease. As one message each, the reports cost the broker a wake-up and
~100 µs of CPU per request on the development VM, competing with the
client and the worker for the CPUs. Written here, a report costs the
worker one struct write and the broker nothing until it reads the ring:
before it answers statistics or server metadata (so a client that reads
them after an answer finds its request counted: the worker writes the
report before it sends the answer), on a timer, and when the worker tells
it the ring is half full (an empty SERVED). When the ring is full the
worker sends its reports as SERVED messages instead.

Layout (little-endian): the worker's count of records written (u64) and
the broker's count of records read (u64), each on its own cache line, then
SLOTS records of RECORD: its outcome (OK, FAILED, TIMED_OUT), then the execution the request was the first
of (batch size, requests, input, infer and output ns; requests 0: none),
request ns, queue ns, and its client's session token. The broker made the memory (a
memfd, handed over with the worker's first direct path) and reads only
what the counts say was written; a record it cannot use is skipped.
"""
from __future__ import annotations

import mmap
import os
import struct
from typing import Optional

# a record's outcome (its first field)
FAILED = 0          # the model failed (Triton's BACKEND)
OK = 1
TIMED_OUT = 2       # its deadline passed before it could start (Triton's REJECTED)

SLOTS = 1024
RECORD = struct.Struct("<IIqqqqqq32s")     # session tokens are 32 hex digits (sessions.py)
_COUNT = struct.Struct("<Q")
_WRITTEN, _READ = 0, 64
_HEADER = 128
SIZE = _HEADER + SLOTS * RECORD.size

# A SERVED record: (ok, ns, queue_ns, session, [items, requests, input_ns, infer_ns, output_ns] or None)
Record = tuple[int, int, int, str, Optional[list[int]]]


class ReportRing:
    """One worker's ring, as either side maps it."""

    def __init__(self, fd: int) -> None:
        """Map the ring at `fd` (the caller keeps the fd)."""
        if os.fstat(fd).st_size != SIZE:
            raise ValueError(f"a report ring is {SIZE} bytes")
        self.map = mmap.mmap(fd, SIZE)
        self.written = self.read_count = 0      # each side's own count (never trusted from the other)
        self.pending = 0                        # the worker's: written, not read, at its last put
        self.nudged = False

    @classmethod
    def create(cls) -> tuple["ReportRing", int]:
        """A new ring and its fd (for the worker; the caller closes it)."""
        fd = os.memfd_create("torchpool-reports", os.MFD_CLOEXEC)
        os.ftruncate(fd, SIZE)
        return cls(fd), fd

    # ------------------------------------------------------------ worker

    def put(self, record: Record) -> bool:
        """Write one report (False: the ring is full)."""
        self.pending = self.written - _COUNT.unpack_from(self.map, _READ)[0]
        if self.pending >= SLOTS:
            return False
        ok, ns, queue_ns, session, execution = record
        items, requests, input_ns, infer_ns, output_ns = execution or (0, 0, 0, 0, 0)
        RECORD.pack_into(self.map, _HEADER + (self.written % SLOTS) * RECORD.size, ok, requests, items,
                         input_ns, infer_ns, output_ns, ns, queue_ns, session.encode())
        self.written += 1
        self.pending += 1
        _COUNT.pack_into(self.map, _WRITTEN, self.written)   # after the record: the broker reads up to it
        return True

    def half_full(self) -> bool:
        """True once per filling past half, as of the last put (the worker
        then tells the broker)."""
        if self.pending < SLOTS // 2:
            self.nudged = False
            return False
        if self.nudged:
            return False
        self.nudged = True
        return True

    # ------------------------------------------------------------ broker

    def take(self) -> list[Record]:
        """The reports written since the last take, as SERVED records
        `(ok, ns, queue_ns, session, execution or None)`."""
        written = _COUNT.unpack_from(self.map, _WRITTEN)[0]
        start = self.read_count
        if written <= start:
            return []
        start = max(start, written - SLOTS)          # (a worker cannot make the broker read past its ring)
        out: list[Record] = []
        for i in range(start, written):
            ok, requests, items, input_ns, infer_ns, output_ns, ns, queue_ns, session = RECORD.unpack_from(
                self.map, _HEADER + (i % SLOTS) * RECORD.size)
            out.append((ok, ns, queue_ns, session.decode("ascii", "replace"),
                        [items, requests, input_ns, infer_ns, output_ns] if requests else None))
        self.read_count = written
        _COUNT.pack_into(self.map, _READ, written)
        return out

    def close(self) -> None:
        self.map.close()


def open_ring(fd: int) -> Optional[ReportRing]:
    """The ring at `fd`, or None when it is not one."""
    try:
        return ReportRing(fd)
    except (OSError, ValueError):
        return None
