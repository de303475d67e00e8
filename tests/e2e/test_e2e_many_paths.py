"""Many models, many clients in one process, many connections (issue 26.1).

A client process with more than ~120 direct paths hung: every call ended in
DEADLINE_EXCEEDED and the daemon logged nothing. The cause was the client's
own reader (client/channel.py): it told a ready socket apart by identity
(`item is sock`), and a lane's or a direct path's socket is an int fd; past
fd 256 an int is a new object on every poll, so no answer was ever read
again. Two threads with a Client each over 60 models crossed it after ~970
answers; 8 processes × 25 threads with a Client each timed out too. Here
each shape runs against a real daemon with 60 models, and every call must
be answered.
"""
from __future__ import annotations

import multiprocessing
import os
import random
import threading
from typing import Iterator

import numpy as np
import pytest

from torchpool.client import Client
from torchpool.examples import addsub_repository

from ..support.daemon import Daemon

MODELS = 60
A = np.arange(16, dtype=np.float32).reshape(1, 16)


@pytest.fixture(scope="module")
def sixty(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    repo = tmp_path_factory.mktemp("sixty")
    addsub_repository(repo, MODELS)
    d = Daemon(repo, tmp_path_factory.mktemp("sixty_daemon")).start(timeout=120)
    yield d
    assert d.stop() == 0, d.log()


def calls(url: str, seed: int, count: int, models: int, results: list, fds: list) -> None:
    """`count` calls on random models of the first `models`, each answer checked."""
    rng = random.Random(seed)
    names = [f"addsub_{i:02d}" for i in range(models)]
    with Client(url, timeout=10) as c:
        for i in range(count):
            b = np.full((1, 16), float(i % 7), np.float32)
            try:
                out = c.infer(rng.choice(names), {"INPUT0": A, "INPUT1": b})
                np.testing.assert_array_equal(out["OUTPUT0"], A + b)
                np.testing.assert_array_equal(out["OUTPUT1"], A - b)
                results.append(True)
            except Exception as exc:     # counted, and named in the failure
                results.append(f"{type(exc).__name__}: {exc}")
        fds.append(len(os.listdir("/proc/self/fd")))


@pytest.mark.parametrize("threads,models", [(2, 60), (4, 30)])
def test_clients_of_one_process_over_many_models_are_all_answered(sixty: Daemon, threads: int,
                                                                   models: int) -> None:
    results: list = []
    fds: list = []
    per_thread = 500 if threads == 2 else 300      # each Client opens a path to nearly every model
    workers = [threading.Thread(target=calls, args=(sixty.url, s, per_thread, models, results, fds))
               for s in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    failures = [r for r in results if r is not True]
    assert failures == [] and len(results) == threads * per_thread, failures[:3]
    assert max(fds) > 256, "the shape did not reach the fds where the client used to hang"


def _process(url: str, seed: int, threads: int, count: int, queue: multiprocessing.Queue) -> None:
    results: list = []
    workers = [threading.Thread(target=calls, args=(url, seed * 100 + t, count, MODELS, results, []))
               for t in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    queue.put(results)


def test_two_hundred_connections_get_every_answer(sixty: Daemon) -> None:
    """8 processes × 25 threads, a Client (a connection, a session) each."""
    ctx = multiprocessing.get_context("spawn")      # clean processes: no zmq state forked
    queue = ctx.Queue()
    procs = [ctx.Process(target=_process, args=(sixty.url, p, 25, 12, queue)) for p in range(8)]
    for p in procs:
        p.start()
    results = [r for _ in procs for r in queue.get(timeout=300)]
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    failures = [r for r in results if r is not True]
    assert failures == [] and len(results) == 8 * 25 * 12, failures[:3]
