"""The broker's one event loop: file descriptors, ZeroMQ sockets and timers.

Everything in the broker runs on this loop's thread: handlers registered for
fds (worker sockets, process sentinels, the signal wake-up pipe), for
ZeroMQ sockets (the frontend), and timers. Nothing blocks in a handler.
"""
from __future__ import annotations

import collections
import heapq
import itertools
import os
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Union

import zmq

from ..rules.spin import SpinWait


_POLLOUT = int(zmq.POLLOUT)


@dataclass(order=True)
class _Timer:
    when: float
    seq: int
    action: Callable[[], None] = field(compare=False)


# what the loop polls: a file descriptor or a ZeroMQ socket
Watched = Union[int, zmq.Socket[bytes]]


class Loop:
    def __init__(self, spin_us: int = 0) -> None:
        self.poller = zmq.Poller()
        # the wait for an answer expected soon (`wait`): the direct paths' one
        # wait policy and window (rules/spin.py, --direct-spin-us)
        self.answer_wait = SpinWait(spin_us)
        self._handlers: dict[Watched, Callable[[], None]] = {}
        self._writers: dict[Watched, Callable[[], None]] = {}   # fds waited on until writable
        self._timers: list[_Timer] = []
        self._seq = itertools.count()
        self._door: Optional[int] = None           # eventfd: actions from other threads
        self._from_threads: collections.deque[Callable[[], None]] = collections.deque()

    def open_door(self) -> None:
        """Let other threads have actions run here (`call_from_thread`): the
        metrics server's thread, which must read the loop's state as of now."""
        if self._door is None:
            self._door = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
            self.watch(self._door, self._run_from_threads)

    def call_from_thread(self, action: Callable[[], None]) -> None:
        """Run `action` on the loop's thread soon (thread-safe; `open_door` first)."""
        assert self._door is not None, "open_door() was not called"
        self._from_threads.append(action)
        os.eventfd_write(self._door, 1)

    def _run_from_threads(self) -> None:
        assert self._door is not None
        try:
            os.eventfd_read(self._door)
        except BlockingIOError:
            pass
        while self._from_threads:
            self._from_threads.popleft()()

    def watch(self, fd_or_socket: Watched, handler: Callable[[], None]) -> None:
        """Call `handler` whenever `fd_or_socket` is readable."""
        self._handlers[fd_or_socket] = handler
        self.poller.register(fd_or_socket, zmq.POLLIN)

    def unwatch(self, fd_or_socket: Watched) -> None:
        self._writers.pop(fd_or_socket, None)
        if self._handlers.pop(fd_or_socket, None) is not None:
            self.poller.unregister(fd_or_socket)

    def watching(self, fd_or_socket: Watched) -> bool:
        return fd_or_socket in self._handlers

    def watch_writable(self, fd: int, handler: Callable[[], None]) -> None:
        """Also call `handler` when `fd` (watched for reading) can be written."""
        self._writers[fd] = handler
        self.poller.register(fd, zmq.POLLIN | zmq.POLLOUT)

    def unwatch_writable(self, fd: int) -> None:
        if self._writers.pop(fd, None) is not None and fd in self._handlers:
            self.poller.register(fd, zmq.POLLIN)

    def call_later(self, delay: float, action: Callable[[], None]) -> None:
        heapq.heappush(self._timers, _Timer(time.monotonic() + delay, next(self._seq), action))

    def next_timer(self) -> Optional[float]:
        return self._timers[0].when if self._timers else None

    def run_timers(self) -> None:
        now = time.monotonic()
        while self._timers and self._timers[0].when <= now:
            heapq.heappop(self._timers).action()

    def wait(self, timeout_ms: Optional[int], expecting: bool) -> bool:
        """`poll(timeout_ms)`; while `expecting` an answer (a worker runs one
        of our batches) and recent ones came sooner than the window, polling
        without sleeping first: the answer then costs no wake-up, while a
        slow model or an idle daemon sleeps at once."""
        if expecting:
            return self.answer_wait.wait(self.poll, timeout_ms)
        return self.poll(timeout_ms)

    def poll(self, timeout_ms: Optional[int]) -> bool:
        """Wait up to `timeout_ms` (None: for ever, 0: not at all) and run
        the handlers of what is readable. True when anything was."""
        events = self.poller.poll(timeout_ms)
        for obj, event in events:
            if event & _POLLOUT:
                writer = self._writers.get(obj)
                if writer is not None:
                    writer()
                if event == _POLLOUT:
                    continue
            handler = self._handlers.get(obj)
            if handler is not None:
                handler()
        return bool(events)
