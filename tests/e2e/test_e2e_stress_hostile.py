"""One misbehaving client beside four honest ones (bounded, loopback).

The honest clients run the same fixed work twice: alone, then while an
offender (its own process, so it shares no interpreter lock with them)
cycles through the attacks of issue 10: a hello flood on one connection,
a BYTES tensor over the element limit, a region shrunk under its requests,
requests it never reads the answers of, and garbage. The honest clients must
lose nothing and get correct answers, and their p99 latency with the
offender must stay within 3x of the runs without it. The daemon must be up
afterwards with nothing restarted.
"""
from __future__ import annotations

import gc
import multiprocessing
import os
import threading
import time
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest

from torchpool.client import Client
from torchpool.protocol.errors import InferenceError

from ..support.daemon import Daemon, wait_for, worker_pids
from ..support.offender import ELEMENTS, offend
from ..support.models.basic import write_plus_one
from ..support.models.core import instances

HONEST = 4
REQUESTS = 300                   # per honest client and phase
PAIRS = 3                        # alternating phases alone / beside the offender, pooled


@pytest.fixture(scope="module")
def stress_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    root = tmp_path_factory.mktemp("stress_repo")
    write_plus_one(root, instances(2, "KIND_CPU"))
    d = Daemon(root, tmp_path_factory.mktemp("stress"), "--log-level", "info",
               "--max-sessions-per-peer", "8", "--max-bytes-elements", "100000",
               "--max-in-flight-per-client", "64", "--max-unread-replies", "64").start()
    yield d
    assert d.stop() == 0, d.log()


def honest_run(url: str) -> tuple[list[float], int]:
    """Every honest client's latencies (seconds) and the number of wrong or lost answers."""
    latencies: list[list[float]] = [[] for _ in range(HONEST)]
    wrong = [0] * HONEST

    def client(i: int) -> None:
        x = np.full(ELEMENTS, float(i), np.float32)
        with Client(url, timeout=30) as c:
            for _ in range(REQUESTS):
                start = time.perf_counter()
                try:
                    y = c.infer("plus_one", {"INPUT__0": x})["OUTPUT__0"]
                    ok = y.shape == x.shape and bool(np.all(y == x + 1))
                except InferenceError:
                    ok = False
                latencies[i].append(time.perf_counter() - start)
                wrong[i] += not ok
    threads = [threading.Thread(target=client, args=(i,)) for i in range(HONEST)]
    # This process holds torch, pytest and every test module: a full garbage
    # collection here took 120 ms, landing in whichever phase it fell in and
    # setting that phase's p99. It is not the daemon's doing: no collection
    # while the clients measure.
    gc.disable()
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        gc.enable()
    return [v for per in latencies for v in per], sum(wrong)


def p99(values: list[float]) -> float:
    return float(np.percentile(values, 99))


def measure(url: str, stop_file: str) -> tuple[list[float], list[float], int, dict]:
    """Honest latencies alone, then beside the offender; (alone, beside, lost, offender counts)."""
    alone, lost_alone = honest_run(url)
    ctx = multiprocessing.get_context("spawn")
    manager = ctx.Manager()
    counts = manager.dict()
    offender = ctx.Process(target=offend, args=(url, stop_file, counts))
    offender.start()
    try:
        wait_for(lambda: "refused" in counts or not offender.is_alive(), 60, "the offender's first round")
        assert offender.is_alive(), "the offender died"
        beside, lost_beside = honest_run(url)
    finally:
        Path(stop_file).touch()
        offender.join(60)
    seen = dict(counts)
    manager.shutdown()
    assert offender.exitcode == 0 and seen.get("rounds", 0) >= 1
    os.unlink(stop_file)
    return alone, beside, lost_alone + lost_beside, seen


def test_honest_clients_keep_their_latency_beside_an_offender(stress_daemon: Daemon, tmp_path: Path) -> None:
    url = stress_daemon.url
    pids = worker_pids(stress_daemon.log(), "plus_one")
    honest_run(url)                                     # warm-up: sessions, arenas, caches
    ratios = []
    # This 2-core machine is noisy, and the p99 of one phase of 1,200 requests
    # moves by 2x from one run to the next: each side's p99 is taken over
    # PAIRS alternating phases (drift of the machine falls on both), and a
    # ratio over the bound is measured once more, afresh. Losing an answer is
    # never forgiven.
    for _ in range(2):
        alone: list[float] = []
        beside: list[float] = []
        for _ in range(PAIRS):
            a, b, lost, seen = measure(url, str(tmp_path / "stop"))
            assert lost == 0
            assert len(a) == len(b) == HONEST * REQUESTS
            alone += a
            beside += b
            print(f"p99 alone {p99(a) * 1e3:.2f} ms, beside the offender {p99(b) * 1e3:.2f} ms; "
                  f"offender rounds {seen.get('rounds')}, refused {seen.get('refused')}")
        # 1 ms floor: on an idle loopback the p99 of a tiny request is a fraction of that
        ratios.append(p99(beside) / max(p99(alone), 1e-3))
        print(f"over {PAIRS} pairs: p99 alone {p99(alone) * 1e3:.2f} ms, beside {p99(beside) * 1e3:.2f} ms "
              f"({ratios[-1]:.2f}x)")
        if ratios[-1] <= 3.0:
            break
    assert min(ratios) <= 3.0, f"honest p99 grew {ratios} x beside the offender"
    assert stress_daemon.proc.poll() is None
    assert worker_pids(stress_daemon.log(), "plus_one") == pids, "a worker was restarted"
