"""Load generators: closed loop (N requests always outstanding) and open loop
(requests sent on a schedule, whatever the answers do).

Two drivers with one interface (`start(level)`, `stop()`, `close()`):

    ThreadLoad   one thread per outstanding request, each with a sender of
                 its own (the default: see docs/perf.md for the measurement
                 that chose it); the threads and their senders are kept
                 from one level to the next
    AsyncLoad    one async sender on an event loop in one thread, one task
                 per outstanding request

How a request is sent (torchpool's client, or tritonclient over gRPC or
HTTP) is the sender's: senders.py. A load only calls `sender.infer(k)`.

Every completed request is handed to a `Recorder` as (end_ns, latency_ns,
late_ns) on the monotonic clock; the first failure stops the measurement.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import queue
import random
import threading
import time
from typing import Callable, Optional, Protocol, Union, cast

CLOSED, OPEN = "concurrency", "request_rate"
READY_SLACK_S = 10.0      # beyond one request's wait, for the load's clients to warm up


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


class Sender(Protocol):
    """What a thread sends with (senders.py): request `k` of the run, then its close."""

    def infer(self, k: int) -> None: ...

    def close(self) -> None: ...


class AsyncSender(Protocol):
    """What the async load sends with, on its loop."""

    async def infer(self, k: int) -> None: ...

    async def aclose(self) -> None: ...


SenderFactory = Callable[[], Sender]
AsyncSenderFactory = Callable[[], AsyncSender]
AnySenderFactory = Union[SenderFactory, AsyncSenderFactory]


class SenderThread:
    """A thread that owns one sender: made in it on its first job, used by
    its jobs only, closed in it at the end (tritonclient.http's connections
    belong to the thread that made them). Jobs run one at a time."""

    def __init__(self, make_sender: SenderFactory, name: str) -> None:
        self._make_sender = make_sender
        self._sender: Optional[Sender] = None
        self._jobs: "queue.SimpleQueue[Optional[Callable[[], None]]]" = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    def sender(self) -> Sender:
        """Its sender, made now if not yet: call from its own jobs only."""
        if self._sender is None:
            self._sender = self._make_sender()
        return self._sender

    def run(self, job: Callable[[], None]) -> threading.Event:
        """Run `job` on this thread; the event is set when it has returned."""
        done = threading.Event()

        def wrapped() -> None:
            try:
                job()
            finally:
                done.set()

        self._jobs.put(wrapped)
        return done

    def _main(self) -> None:
        try:
            while (job := self._jobs.get()) is not None:
                job()
        finally:
            if self._sender is not None:
                try:
                    self._sender.close()
                except Exception:           # closing after a failed run: nothing more to say
                    pass

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join()


class ThreadLoad:
    """N threads, each with a sender of its own (kept across levels)."""

    def __init__(self, make_sender: SenderFactory, recorder: Recorder, wait_s: float, max_threads: int,
                 poisson: bool) -> None:
        self.recorder = recorder
        self._make_sender = make_sender
        self._ready_s = wait_s + READY_SLACK_S
        self._max_threads = max_threads
        self._poisson = poisson
        self._threads: list[SenderThread] = []
        self._running: list[threading.Event] = []
        self._ready: Optional[threading.Barrier] = None
        self._stop = threading.Event()
        self._schedule: Optional[Schedule] = None

    def start(self, mode: str, level: float) -> None:
        """Start the load; return once each sender has made one unmeasured
        request (a new client's first one connects; torchpool's also says
        hello and maps its arena: ~0.1-0.4 s)."""
        self._stop.clear()
        count = int(level) if mode == CLOSED else self._max_threads
        while len(self._threads) < count:
            self._threads.append(SenderThread(self._make_sender, f"perf-sender-{len(self._threads)}"))
        work = self._closed_loop if mode == CLOSED else self._open_loop
        self._schedule = None
        # the open loop's clock starts when every sender is ready, not before
        ready = self._ready = threading.Barrier(count + 1, action=None if mode == CLOSED else
                                                lambda: setattr(self, "_schedule",
                                                                Schedule(level, self._poisson,
                                                                         time.monotonic_ns())))
        self._running = [t.run(functools.partial(self._run, work, t, i, ready))
                         for i, t in enumerate(self._threads[:count])]
        try:
            ready.wait(self._ready_s)
        except threading.BrokenBarrierError:
            if not self.recorder.failed.is_set():
                self.recorder.fail(TimeoutError(f"the load's {count} clients were not ready within "
                                                f"{self._ready_s:g} s"))

    def _run(self, work: Callable, thread: SenderThread, first: int, ready: threading.Barrier) -> None:
        try:
            sender = thread.sender()
        except Exception as exc:            # a client that cannot be made fails the run
            self.recorder.fail(exc)
            ready.abort()
            return
        if not self._send(sender, first):
            ready.abort()
            return
        try:
            ready.wait()
        except threading.BrokenBarrierError:
            return
        work(sender, first)

    def _send(self, sender: Sender, k: int) -> bool:
        """One request; False (and the failure recorded) if it failed."""
        try:
            sender.infer(k)
        except Exception as exc:            # any failure ends the run, reported by the measuring loop
            self.recorder.fail(exc)
            return False
        return True

    def _closed_loop(self, sender: Sender, first: int) -> None:
        k = first
        while not self._stop.is_set() and not self.recorder.failed.is_set():
            start = time.monotonic_ns()
            if not self._send(sender, k):
                return
            end = time.monotonic_ns()
            self.recorder.record(end, end - start)
            k += 1

    def _open_loop(self, sender: Sender, first: int) -> None:
        k = first
        schedule = cast(Schedule, self._schedule)   # the barrier's action set it before any sender ran
        while not self.recorder.failed.is_set():
            due = schedule.next()
            wait_s = max(0.0, (due - time.monotonic_ns()) / 1e9)
            # the stop event is the timer: stopping never waits for a far send time
            if self._stop.wait(wait_s):
                return
            start = time.monotonic_ns()
            if not self._send(sender, k):
                return
            end = time.monotonic_ns()
            self.recorder.record(end, end - start, start - due)
            k += 1

    def stop(self) -> None:
        self._stop.set()
        if self._ready is not None:
            self._ready.abort()             # a sender still waiting for the others (interrupted start) goes
        for done in self._running:
            done.wait()
        self._running = []

    def close(self) -> None:
        self.stop()
        for t in self._threads:
            t.close()
        self._threads = []


class AsyncLoad:
    """One async sender on an event loop of its own thread, one task per
    outstanding request."""

    def __init__(self, make_sender: AsyncSenderFactory, recorder: Recorder, wait_s: float, max_threads: int,
                 poisson: bool) -> None:
        self.recorder = recorder
        self._make_sender = make_sender
        self._max_outstanding = max_threads
        self._poisson = poisson
        self._sender: Optional[AsyncSender] = None
        self._stop = threading.Event()
        self._running: Optional[concurrent.futures.Future[None]] = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="perf-async", daemon=True)
        self._thread.start()

    def start(self, mode: str, level: float) -> None:
        """Start the tasks once one unmeasured request has gone through (the
        client's first connects; torchpool's also says hello and maps its arena)."""
        self._stop.clear()
        if not asyncio.run_coroutine_threadsafe(self._send(0, None, measured=False), self._loop).result():
            return                          # the recorder holds the failure
        main = self._closed(int(level)) if mode == CLOSED else self._open(level)
        self._running = asyncio.run_coroutine_threadsafe(main, self._loop)

    def _sender_here(self) -> AsyncSender:
        if self._sender is None:            # made on the loop's thread, where it is used
            self._sender = self._make_sender()
        return self._sender

    async def _send(self, k: int, due: Optional[int], measured: bool = True) -> bool:
        start = time.monotonic_ns()
        try:
            await self._sender_here().infer(k)
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
        if self._sender is not None:
            try:
                asyncio.run_coroutine_threadsafe(self._sender.aclose(), self._loop).result()
            except Exception:               # closing after a failed run: nothing more to say
                pass
            self._sender = None
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()


def make_load(use_async: bool, make_sender: AnySenderFactory, recorder: Recorder, wait_s: float,
              max_threads: int, poisson: bool) -> "ThreadLoad | AsyncLoad":
    """The driver asked for, sending with what `make_sender` makes (senders.py:
    async senders with `use_async`). `wait_s`: the longest one request may wait
    for its answer."""
    if use_async:
        return AsyncLoad(cast(AsyncSenderFactory, make_sender), recorder, wait_s, max_threads, poisson)
    return ThreadLoad(cast(SenderFactory, make_sender), recorder, wait_s, max_threads, poisson)
