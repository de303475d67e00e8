"""Load generators: closed loop (N requests always outstanding) and open loop
(requests sent on a schedule, whatever the answers do).

Two drivers with one interface (`start(level)`, `stop()`, `close()`):

    ThreadLoad   one thread per outstanding request, each with its own
                 synchronous Client (the default: see docs/perf.md for the
                 measurement that chose it), or all sharing one
    AsyncLoad    one AsyncClient on an event loop in one thread, one task
                 per outstanding request

Every completed request is handed to a `Recorder` as (end_ns, latency_ns,
late_ns) on the monotonic clock; the first failure stops the measurement.
"""
from __future__ import annotations

import asyncio
import random
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from ..client import AsyncClient, Client

CLOSED, OPEN = "concurrency", "request_rate"
READY_SLACK_S = 10.0      # beyond one request's timeout, for the load's clients to warm up


class Recorder:
    """Completed requests, shared by the load's threads and the measuring loop."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._done: list[tuple[int, int, int]] = []
        self.error: Optional[BaseException] = None
        self.failed = threading.Event()

    def record(self, end_ns: int, latency_ns: int, late_ns: int = 0) -> None:
        with self._lock:
            self._done.append((end_ns, latency_ns, late_ns))

    def fail(self, exc: BaseException) -> None:
        """Keep the first failure and wake the measuring loop."""
        with self._lock:
            if self.error is None:
                self.error = exc
        self.failed.set()

    def drain(self) -> list[tuple[int, int, int]]:
        with self._lock:
            done, self._done = self._done, []
        return done


@dataclass
class Target:
    """What every request asks: the model, and its inputs taken in turn."""
    model: str
    version: Optional[str]
    requests: Sequence[dict]
    timeout: float

    def inputs(self, k: int) -> dict:
        return self.requests[k % len(self.requests)]


class Schedule:
    """Send times of an open loop: gaps of 1/rate, or Poisson arrivals
    (exponential gaps of mean 1/rate). Shared by the senders: each takes the
    next time under a lock."""

    def __init__(self, rate: float, poisson: bool, start_ns: int, seed: int = 0) -> None:
        self._gap_s = 1.0 / rate
        self._rate = rate
        self._poisson = poisson
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._next_ns = float(start_ns)

    def next(self) -> int:
        with self._lock:
            at = self._next_ns
            gap = self._rng.expovariate(self._rate) if self._poisson else self._gap_s
            self._next_ns += gap * 1e9
        return int(at)


ClientFactory = Callable[[], Any]


class ThreadLoad:
    """N threads, each with its own synchronous Client (kept across levels)."""

    def __init__(self, target: Target, recorder: Recorder, make_client: ClientFactory,
                 max_threads: int, poisson: bool) -> None:
        self.target, self.recorder = target, recorder
        self._make_client = make_client
        self._max_threads = max_threads
        self._poisson = poisson
        self._clients: list[Client] = []
        self._threads: list[threading.Thread] = []
        self._stop = threading.Event()
        self._schedule: Optional[Schedule] = None

    def start(self, mode: str, level: float) -> None:
        """Start the threads; return once each has made one unmeasured request
        (a new client's first one says hello and maps its arena: ~0.1-0.4 s)."""
        self._stop.clear()
        count = int(level) if mode == CLOSED else self._max_threads
        while len(self._clients) < count:
            self._clients.append(self._make_client())
        work = self._closed_loop if mode == CLOSED else self._open_loop
        self._schedule = None
        # the open loop's clock starts when every sender is ready, not before
        ready = threading.Barrier(count + 1, action=None if mode == CLOSED else
                                  lambda: setattr(self, "_schedule",
                                                  Schedule(level, self._poisson, time.monotonic_ns())))
        self._threads = [threading.Thread(target=self._run, args=(work, self._clients[i], i, ready),
                                          name=f"perf-{mode}-{i}", daemon=True) for i in range(count)]
        for t in self._threads:
            t.start()
        try:
            ready.wait(self.target.timeout + READY_SLACK_S)
        except threading.BrokenBarrierError:
            if not self.recorder.failed.is_set():
                self.recorder.fail(TimeoutError(f"the load's {count} clients were not ready within "
                                                f"{self.target.timeout + READY_SLACK_S:g} s"))

    def _run(self, work: Callable, client: Client, first: int, ready: threading.Barrier) -> None:
        if not self._send(client, first):
            ready.abort()
            return
        try:
            ready.wait()
        except threading.BrokenBarrierError:
            return
        work(client, first)

    def _send(self, client: Client, k: int) -> bool:
        """One request; False (and the failure recorded) if it failed."""
        t = self.target
        try:
            client.infer(t.model, t.inputs(k), version=t.version, timeout=t.timeout)
        except Exception as exc:            # any failure ends the run, reported by the measuring loop
            self.recorder.fail(exc)
            return False
        return True

    def _closed_loop(self, client: Client, first: int) -> None:
        k = first
        while not self._stop.is_set() and not self.recorder.failed.is_set():
            start = time.monotonic_ns()
            if not self._send(client, k):
                return
            end = time.monotonic_ns()
            self.recorder.record(end, end - start)
            k += 1

    def _open_loop(self, client: Client, first: int) -> None:
        k = first
        schedule = self._schedule
        while not self.recorder.failed.is_set():
            due = schedule.next()
            wait_s = max(0.0, (due - time.monotonic_ns()) / 1e9)
            # the stop event is the timer: stopping never waits for a far send time
            if self._stop.wait(wait_s):
                return
            start = time.monotonic_ns()
            if not self._send(client, k):
                return
            end = time.monotonic_ns()
            self.recorder.record(end, end - start, start - due)
            k += 1

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join()
        self._threads = []

    def close(self) -> None:
        self.stop()
        for c in self._clients:
            c.close()
        self._clients = []


class AsyncLoad:
    """One AsyncClient on an event loop of its own thread, one task per
    outstanding request."""

    def __init__(self, target: Target, recorder: Recorder, make_client: ClientFactory,
                 max_threads: int, poisson: bool) -> None:
        self.target, self.recorder = target, recorder
        self._make_client = make_client
        self._max_outstanding = max_threads
        self._poisson = poisson
        self._client: Optional[AsyncClient] = None
        self._stop = threading.Event()
        self._running: Optional[Any] = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="perf-async", daemon=True)
        self._thread.start()

    def start(self, mode: str, level: float) -> None:
        """Start the tasks once one unmeasured request has gone through (the
        client's first says hello and maps its arena)."""
        self._stop.clear()
        if not asyncio.run_coroutine_threadsafe(self._send(0, None, measured=False), self._loop).result():
            return                          # the recorder holds the failure
        main = self._closed(int(level)) if mode == CLOSED else self._open(level)
        self._running = asyncio.run_coroutine_threadsafe(main, self._loop)

    def _client_here(self) -> AsyncClient:
        if self._client is None:            # made on the loop's thread, where it is used
            self._client = self._make_client()
        return self._client

    async def _send(self, k: int, due: Optional[int], measured: bool = True) -> bool:
        t = self.target
        start = time.monotonic_ns()
        try:
            await self._client_here().infer(t.model, t.inputs(k), version=t.version, timeout=t.timeout)
        except Exception as exc:
            self.recorder.fail(exc)
            return False
        end = time.monotonic_ns()
        if measured:
            self.recorder.record(end, end - start, 0 if due is None else start - due)
        return True

    def _going(self) -> bool:
        return not self._stop.is_set() and not self.recorder.failed.is_set()

    async def _closed(self, n: int) -> None:
        async def one(first: int) -> None:
            k = first
            while self._going() and await self._send(k, None):
                k += n

        await asyncio.gather(*(one(i) for i in range(n)))

    async def _open(self, rate: float) -> None:
        schedule = Schedule(rate, self._poisson, time.monotonic_ns())
        room = asyncio.Semaphore(self._max_outstanding)
        tasks: set[asyncio.Task] = set()

        async def one(k: int, due: int) -> None:
            try:
                await self._send(k, due)
            finally:
                room.release()

        k = 0
        while self._going():
            due = schedule.next()
            # short naps, so that stop() is seen even at a low rate
            while self._going() and (wait_s := (due - time.monotonic_ns()) / 1e9) > 0:
                await asyncio.sleep(min(wait_s, 0.05))
            await room.acquire()
            if not self._going():
                room.release()
                break
            task = asyncio.ensure_future(one(k, due))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            k += 1
        await asyncio.gather(*tasks)

    def stop(self) -> None:
        self._stop.set()
        if self._running is not None:
            self._running.result()
            self._running = None

    def close(self) -> None:
        self.stop()
        if self._client is not None:
            asyncio.run_coroutine_threadsafe(self._client.aclose(), self._loop).result()
            self._client = None
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()


def make_load(use_async: bool, target: Target, recorder: Recorder, url: str, client_options: dict,
              max_threads: int, poisson: bool, shared_client: bool = False) -> "ThreadLoad | AsyncLoad":
    """The driver asked for, its clients made with `client_options` (timeout,
    keys). `shared_client`: the threads share one Client (it is thread-safe),
    so one session and one arena instead of one per thread."""
    if use_async:
        return AsyncLoad(target, recorder, lambda: AsyncClient(url, **client_options), max_threads, poisson)
    shared: list[Client] = []

    def make_client() -> Client:
        if not shared_client:
            return Client(url, **client_options)
        if not shared:
            shared.append(Client(url, **client_options))
        return shared[0]                    # closing it once per thread is harmless: close() is idempotent

    return ThreadLoad(target, recorder, make_client, max_threads, poisson)
