"""End to end: one `Client` shared by threads against a real daemon, and a
slow daemon answered as DEADLINE_EXCEEDED.

Each thread sends its own inputs and checks its own outputs, so an answer
handed to the wrong thread fails the test; the daemon's statistics say every
request arrived once.
"""
from __future__ import annotations

import asyncio
import gc
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from torchpool.client import AsyncClient, Client, NoAnswer
from torchpool.protocol import errors
from torchpool.protocol.errors import InferenceError

from ..support.daemon import Daemon, descendants, free_tcp_port
from ..support.models.slow import slow_iterations
from ..support.threads import in_threads

THREADS = 8
SLACK = 1.5          # seconds a deadline may fire late on a loaded 2-core machine
ELEMENTS = 20_000    # identity inputs of 80 kB: they travel through the arena


@pytest.fixture(scope="module")
def pool(small_repository: Path, tmp_path_factory: pytest.TempPathFactory):
    d = Daemon(small_repository, tmp_path_factory.mktemp("threads"), tcp_port=free_tcp_port()).start()
    yield d
    assert d.stop() == 0, d.log()


def addsub_inputs(thread: int, i: int) -> dict:
    """Inputs no other call of the test sends."""
    return {"INPUT0": np.full((1, 16), thread * 100_000 + i, np.float32),
            "INPUT1": np.arange(16, dtype=np.float32).reshape(1, 16) * (thread + 1)}


def addsub_calls(c: Client, thread: int, count: int) -> int:
    for i in range(count):
        inputs = addsub_inputs(thread, i)
        out = c.infer("addsub", inputs)
        np.testing.assert_array_equal(out["OUTPUT0"], inputs["INPUT0"] + inputs["INPUT1"])
        np.testing.assert_array_equal(out["OUTPUT1"], inputs["INPUT0"] - inputs["INPUT1"])
    return count


def inference_count(c: Client, model: str) -> int:
    return c.statistics(model)["model_stats"][0]["inference_count"]


def test_eight_threads_share_one_client_for_10000_calls(pool: Daemon) -> None:
    per_thread = 10_000 // THREADS
    with Client(pool.url, timeout=60) as c:
        before = inference_count(c, "addsub")
        done = in_threads(THREADS, lambda t: addsub_calls(c, t, per_thread))
        assert done == [per_thread] * THREADS, [d for d in done if not isinstance(d, int)][:3]
        assert inference_count(c, "addsub") - before == 10_000
        assert c.is_local                  # over the shared-memory session


def test_threads_over_tcp_share_one_client(pool: Daemon) -> None:
    with Client(pool.urls[1], timeout=60, local=False) as c:
        assert in_threads(THREADS, lambda t: addsub_calls(c, t, 100)) == [100] * THREADS


def test_threads_share_the_arena_and_the_outputs_lent_to_it(pool: Daemon) -> None:
    """Inputs copied into the arena, empty() buffers sent with no copy, outputs
    lent in place and kept across calls: from 4 threads at once, nothing
    mixed up and every block back in the arena at the end."""
    calls = 60

    def work(t: int) -> int:
        kept = []
        buf = c.empty((ELEMENTS,))
        for i in range(calls):
            if i % 2:
                buf[:] = t * 1000 + i
                x = buf
            else:
                x = np.full(ELEMENTS, t * 1000 + i, np.float32)
            out = c.infer("identity", {"INPUT__0": x})
            assert out["OUTPUT__0"][0] == t * 1000 + i and out["OUTPUT__0"][-1] == t * 1000 + i
            if i % 10 == 0:
                kept.append((t * 1000 + i, out["OUTPUT__0"]))   # a lent view, held on
        for value, arr in kept:                                  # still what it was
            assert (arr == value).all(), value
        return calls

    with Client(pool.url, timeout=60) as c:
        assert in_threads(4, work) == [calls] * 4
        assert c.is_local
        stats = c.transfer_stats()
        assert stats["bytes_zero_copy"] == 4 * (calls // 2) * ELEMENTS * 4
        assert stats["bytes_copied"] == 4 * (calls // 2) * ELEMENTS * 4
        gc.collect()
        c.infer("identity", {"INPUT__0": np.ones(ELEMENTS, np.float32)}, copy=True)
        arena = c._state.arena
        assert arena.free_bytes == arena.mapped_bytes, "arena blocks were not given back"
        assert not c._state.quarantine


def test_a_slow_call_times_out_while_the_other_threads_are_served(pool: Daemon) -> None:
    n = slow_iterations(2.0)
    with Client(pool.url, timeout=60) as c:
        c.infer("slow", {"INPUT__0": np.array([10])})            # warm
        slow_done = threading.Event()
        served_meanwhile = [0] * 4

        def slow() -> tuple[Any, float]:
            started = time.monotonic()
            try:
                return c.infer("slow", {"INPUT__0": np.array([n])}, timeout=0.5), 0.0
            except InferenceError as exc:
                return exc, time.monotonic() - started
            finally:
                slow_done.set()

        def fast(t: int) -> int:
            i = 0
            while not slow_done.is_set():
                addsub_calls(c, t, 1)
                served_meanwhile[t] += 1
                i += 1
            return i

        outcomes = in_threads(5, lambda t: slow() if t == 4 else fast(t))
        exc, took = outcomes[4]
        assert isinstance(exc, NoAnswer) and exc.code == errors.DEADLINE_EXCEEDED, exc
        assert exc.message == (f"torchpool at {pool.url} did not answer within 0.5 s "
                               f"(it is reachable: the request may still run)")
        assert 0.5 <= took < 0.5 + SLACK, took
        assert all(count >= 5 for count in served_meanwhile), served_meanwhile
        # the slow answer comes later and is put aside; the next slow call gets its own
        assert int(c.infer("slow", {"INPUT__0": np.array([7])})["OUTPUT__0"][0]) == 7
        assert addsub_calls(c, 0, 3) == 3


def slow_worker(d: Daemon) -> int:
    """The pid of the `slow` model's worker (its process title names it)."""
    for pid in descendants(d.proc.pid):
        try:
            if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"torchpool worker slow v1"):
                return pid
        except OSError:
            continue
    raise AssertionError("no worker of slow")


@pytest.mark.parametrize("scheme", ["ipc", "tcp"])
def test_a_slow_daemon_is_deadline_exceeded_not_unavailable(pool: Daemon, scheme: str) -> None:
    """The model's worker is stopped (SIGSTOP) while the call waits: it
    cannot answer within the call's timeout however fast this machine is."""
    url = next(u for u in pool.urls if u.startswith(scheme))
    worker = slow_worker(pool)
    with Client(url, timeout=60) as c:
        c.infer("slow", {"INPUT__0": np.array([10])})
        os.kill(worker, signal.SIGSTOP)
        try:
            with pytest.raises(NoAnswer) as exc:
                c.infer("slow", {"INPUT__0": np.array([11])}, timeout=0.3)
        finally:
            os.kill(worker, signal.SIGCONT)
        assert exc.value.code == errors.DEADLINE_EXCEEDED
        assert exc.value.message == (f"torchpool at {url} did not answer within 0.3 s "
                                     f"(it is reachable: the request may still run)")
        assert int(c.infer("slow", {"INPUT__0": np.array([12])})["OUTPUT__0"][0]) == 12

    async def main() -> None:
        async with AsyncClient(url, timeout=60) as c:
            await c.infer("slow", {"INPUT__0": np.array([10])})
            os.kill(worker, signal.SIGSTOP)
            try:
                with pytest.raises(NoAnswer) as exc:
                    await c.infer("slow", {"INPUT__0": np.array([11])}, timeout=0.3)
            finally:
                os.kill(worker, signal.SIGCONT)
            assert exc.value.code == errors.DEADLINE_EXCEEDED
            assert "did not answer within 0.3 s" in exc.value.message
            assert int((await c.infer("slow", {"INPUT__0": np.array([12])}))["OUTPUT__0"][0]) == 12
    asyncio.run(main())
