"""A CPU worker's share of the daemon's CPUs, taken per batch (shm/cpu_ledger.py).

Before each batch the worker marks itself busy in the daemon's CPU ledger and
sets its intra-op threads to its share of the daemon's CPUs among the workers
busy then (config.devices.threads_per_worker: at least one each); after the
batch it marks itself idle. torch.set_num_threads is called only when the share
changed (~0.2 µs when it did not; the OpenMP pool keeps its threads).
"""
from __future__ import annotations

import torch

from ..config.devices import threads_per_worker
from ..shm.cpu_ledger import CpuLedger


class CpuShare:
    def __init__(self, ledger: CpuLedger, slot: int, budget: int) -> None:
        self.ledger = ledger
        self.slot = slot
        self.budget = budget
        self.threads = torch.get_num_threads()

    def take(self) -> None:
        """Busy from now: this batch's threads."""
        threads = threads_per_worker(self.budget, self.ledger.busy(self.slot))
        if threads != self.threads:
            torch.set_num_threads(threads)
            self.threads = threads

    def give(self) -> None:
        """The batch is done: the other workers may take this worker's CPUs."""
        self.ledger.idle(self.slot)

    def close(self) -> None:
        self.ledger.idle(self.slot)
        self.ledger.close()
