"""Signals for the broker's one-threaded loop: a handler only records, the loop acts.

A handler appends the signal number; Python's wakeup fd (one end of a
socketpair) makes the poller return, and the loop takes what arrived, in
order, with `drain()`. Nothing is logged and no lock is taken inside a
handler. The handlers a process had before are captured by `install` and
put back by `restore`, so an embedding program or a test gets its own back.
"""
from __future__ import annotations

import signal
import socket
from types import FrameType
from typing import Callable, Optional, Sequence, Union


class SignalInbox:
    def __init__(self, signals: Sequence[int]) -> None:
        self.signals = tuple(signals)
        self._arrived: list[int] = []
        self._old: dict[int, Union[Callable[[int, Optional[FrameType]], object], int, signal.Handlers, None]] = {}
        self._wake_r: Optional[socket.socket] = None
        self._wake_w: Optional[socket.socket] = None

    def install(self) -> int:
        """Record these signals from now on; returns the fd the loop watches."""
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        signal.set_wakeup_fd(self._wake_w.fileno(), warn_on_full_buffer=False)
        for sig in self.signals:
            self._old[sig] = signal.signal(sig, self._record)
        return self._wake_r.fileno()

    def _record(self, signum: int, frame: Optional[FrameType]) -> None:
        self._arrived.append(signum)

    def drain(self) -> list[int]:
        """The signals that arrived since the last call, oldest first."""
        try:
            while self._wake_r is not None and self._wake_r.recv(512):
                pass
        except BlockingIOError:
            pass
        arrived, self._arrived = self._arrived, []
        return arrived

    def restore(self) -> None:
        for sig, handler in self._old.items():
            signal.signal(sig, handler)
        self._old.clear()
        if self._wake_w is not None:
            signal.set_wakeup_fd(-1)
            self._wake_w.close()
            if self._wake_r is not None:          # (set with _wake_w)
                self._wake_r.close()
            self._wake_w = self._wake_r = None


__all__ = ["SignalInbox"]
