"""The daemon's CPU ledger: which of its CPU workers are running a batch now.

CPU workers whose models set no thread counts share the daemon's CPUs
(affinity and cgroup quota: config.devices.cpu_budget) by what they are doing,
not only by how many there are. Sized once by their number, two idle-most
instances on two cores ran a ResNet-18 on one thread each at concurrency 1,
half what the machine gives (issue 40, item 5). Instead each such worker marks
its slot here while it runs a batch and sizes its intra-op pool, per batch, to
its share of the CPUs among the workers busy at that moment: one busy
instance uses the whole machine, many busy instances do not oversubscribe it.

One byte per slot in one small sealed memfd the broker makes (no name: like
every segment the daemon owns, nobody can open it by name) and hands to each
such worker as an argument of its process (`LedgerFd`: multiprocessing passes
the fd on). A worker writes only its own byte; the broker clears the slot of a
worker that died mid-batch. Reads and writes of single
bytes need no lock: a worker that counts a neighbour a moment late takes one
thread too many or too few for one batch.
"""
from __future__ import annotations

from multiprocessing import reduction
from typing import Optional, Protocol

from .segment import Segment

SLOTS = 256              # CPU workers past this many keep their fixed share
_BUSY = b"\x01"


class CpuLedger:
    """The ledger's mapping (the broker's, or a worker's)."""

    def __init__(self, segment: Segment) -> None:
        self.segment = segment
        self.buf = segment.buf

    @classmethod
    def create(cls) -> "CpuLedger":
        """The broker's: it keeps the fd to hand on."""
        return cls(Segment.create("cpu-ledger", SLOTS))

    @classmethod
    def attach(cls, fd: int) -> "CpuLedger":
        """A worker's (it takes the fd)."""
        return cls(Segment.from_fd("cpu-ledger", fd))

    def handle(self) -> "LedgerFd":
        return LedgerFd(self.segment.fd)

    def busy(self, slot: int) -> int:
        """Mark `slot` busy; how many slots are busy now, itself included."""
        buf = self.buf
        buf[slot] = 1
        return buf[:SLOTS].count(_BUSY)

    def idle(self, slot: int) -> None:
        self.buf[slot] = 0

    def close(self) -> None:
        self.segment.close()


class LedgerFd:
    """The ledger's fd as an argument of a worker process: pickled,
    multiprocessing hands the fd itself on (as it does a socket's)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple[object, tuple[object]]:
        return _received, (reduction.DupFd(self.fd),)


class _Passed(Protocol):
    """What multiprocessing's DupFd gives the new process."""
    def detach(self) -> int: ...


def _received(dup: _Passed) -> LedgerFd:
    return LedgerFd(dup.detach())


class SlotPool:
    """The broker's side: which slots are free for new CPU workers."""

    def __init__(self, ledger: CpuLedger) -> None:
        self.ledger = ledger
        self.free = list(range(SLOTS - 1, -1, -1))     # popped from the end: slot 0 first

    def take(self) -> Optional[int]:
        """A free slot, None when every one is taken."""
        return self.free.pop() if self.free else None

    def give_back(self, slot: int) -> None:
        """A worker's slot, once it is gone: idle (it may have died mid-batch), free."""
        self.ledger.idle(slot)
        self.free.append(slot)
