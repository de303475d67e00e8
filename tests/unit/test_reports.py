"""The report ring (protocol/reports.py): a worker's reports of direct
requests, read by the broker from memory they share."""
from __future__ import annotations

import os

from torchpool.protocol import reports
from torchpool.protocol.reports import SLOTS, ReportRing, open_ring

TOKEN = "0123456789abcdef" * 2


def pair() -> tuple[ReportRing, ReportRing]:
    """The broker's ring and the worker's mapping of it."""
    broker, fd = ReportRing.create()
    try:
        worker = open_ring(fd)
    finally:
        os.close(fd)
    assert worker is not None
    return broker, worker


def test_reports_written_are_read_once_in_order() -> None:
    broker, worker = pair()
    assert broker.take() == []
    assert worker.put([1, 500, 20, TOKEN, [4, 2, 1, 2, 3]])
    assert worker.put([1, 600, 30, TOKEN, None])
    assert worker.put([0, 700, 0, TOKEN, None])
    assert broker.take() == [(1, 500, 20, TOKEN, [4, 2, 1, 2, 3]), (1, 600, 30, TOKEN, None),
                             (0, 700, 0, TOKEN, None)]
    assert broker.take() == []
    assert worker.put([1, 800, 0, TOKEN, [1, 1, 4, 5, 6]])
    assert broker.take() == [(1, 800, 0, TOKEN, [1, 1, 4, 5, 6])]


def test_a_full_ring_refuses_until_read_and_says_half_full_once() -> None:
    broker, worker = pair()
    nudges = 0
    for i in range(SLOTS):
        assert worker.put([1, i, 0, TOKEN, None])
        nudges += worker.half_full()
    assert nudges == 1                                  # once per filling past half
    assert not worker.put([1, 0, 0, TOKEN, None])       # full: the worker sends it as SERVED
    got = broker.take()
    assert [r[1] for r in got] == list(range(SLOTS))
    assert not worker.half_full()
    assert worker.put([1, 7, 0, TOKEN, None])
    assert broker.take() == [(1, 7, 0, TOKEN, None)]


def test_the_broker_reads_at_most_one_ring_of_a_count_it_cannot_trust() -> None:
    broker, worker = pair()
    worker.put([1, 1, 0, TOKEN, None])
    reports._COUNT.pack_into(worker.map, reports._WRITTEN, 1 << 60)    # a broken worker's count
    assert len(broker.take()) == SLOTS
    assert broker.take() == []


def test_memory_that_is_not_a_ring_is_refused() -> None:
    fd = os.memfd_create("not-a-ring")
    try:
        os.ftruncate(fd, 4096)
        assert open_ring(fd) is None
    finally:
        os.close(fd)
