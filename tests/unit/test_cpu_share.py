"""The daemon's CPU ledger (shm/cpu_ledger.py) and a worker's share of the
CPUs per batch (worker/cpu_share.py): a worker alone takes every CPU of the
budget, busy neighbours divide them, at least one thread each, and a slot
given back is idle and free again."""
from __future__ import annotations

import os

import torch

from torchpool.shm.cpu_ledger import SLOTS, CpuLedger, SlotPool
from torchpool.worker.cpu_share import CpuShare


def _ledger() -> CpuLedger:
    return CpuLedger.create()


def test_busy_counts_every_busy_slot_and_idle_clears_one() -> None:
    ledger = _ledger()
    try:
        assert ledger.busy(3) == 1
        assert ledger.busy(200) == 2
        assert ledger.busy(3) == 2            # marking again counts once
        ledger.idle(3)
        assert ledger.busy(0) == 2
        other = CpuLedger.attach(os.dup(ledger.segment.fd))   # a worker's mapping sees the broker's
        try:
            assert other.busy(SLOTS - 1) == 3
        finally:
            other.close()
    finally:
        ledger.close()


def test_a_worker_takes_its_share_of_the_budget_among_the_busy_ones() -> None:
    before = torch.get_num_threads()
    ledger = _ledger()
    try:
        share = CpuShare(ledger, 0, 4)
        share.take()
        assert torch.get_num_threads() == 4        # alone: the whole budget
        share.give()
        ledger.busy(1)                             # a neighbour runs a batch
        share.take()
        assert torch.get_num_threads() == 2
        share.give()
        for slot in (2, 3, 4, 5):                  # more busy workers than CPUs
            ledger.busy(slot)
        share.take()
        assert torch.get_num_threads() == 1        # never fewer than one
        share.give()
        assert ledger.busy(0) == 6 and ledger.busy(1) == 6
    finally:
        ledger.close()
        torch.set_num_threads(before)


def test_a_slot_given_back_is_idle_and_taken_again() -> None:
    ledger = _ledger()
    try:
        pool = SlotPool(ledger)
        first, second = pool.take(), pool.take()
        assert (first, second) == (0, 1)
        ledger.busy(0)                             # its worker died mid-batch
        pool.give_back(0)
        assert ledger.busy(1) == 1                 # slot 0 was cleared
        assert pool.take() == 0
        taken = [pool.take() for _ in range(SLOTS - 2)]
        assert None not in taken and pool.take() is None    # every slot taken
    finally:
        ledger.close()
