"""The client's end of the daemon's side channel (the local shared-memory path).

After `hello`, a client on the daemon's host connects to the unix socket the
daemon named (`local_socket`) and attaches to its session. The daemon learns
who we are from the kernel and hands us, as file descriptors, the memory we
may use: our arena (read-write, sealed against resizing) and, later, the
worker memory that holds outputs lent to us (read-only). The daemon sends
each fd before the answer that names it, so by the time we read that answer
the fd is already waiting here: `take()` never has to wait.
"""
from __future__ import annotations

import os
import socket
from typing import TYPE_CHECKING, Optional

from ..protocol import errors, lane, messages
from ..protocol.errors import InferenceError
from ..shm.fdpass import DONTWAIT, FdReceiver, close_all, recv_with_fds

if TYPE_CHECKING:
    from .types import Lane

MAX_MESSAGE = lane.MAX_DATAGRAM      # the largest datagram the daemon sends here
ATTACH_TIMEOUT_S = 10.0


class LocalLink:
    """An attached side channel: the session's segments, by name, as fds."""

    def __init__(self, sock: socket.socket, arena: list[tuple[str, int]], lane: bool = False,
                 direct: bool = False) -> None:
        self.sock = sock
        self.arena = arena                       # [(segment name, fd)] handed at attach
        self._fds: dict[str, int] = {}           # pushed since, not taken yet
        # the daemon takes requests here (client/lane.py): then only the lane's
        # reader reads this socket, and it keeps what is pushed for take()
        self.lane_ok = lane
        self.direct_ok = direct                  # ... and hands out direct paths (direct.py)
        self.lane: Optional[Lane] = None
        self._receiver = FdReceiver(MAX_MESSAGE)

    @classmethod
    def attach(cls, path: str, token: str, timeout: Optional[float], arena: bool = True,
               lane: bool = False) -> "LocalLink":
        """Connect and attach; raises OSError (no such socket: not on the
        daemon's host) or InferenceError (the daemon refused)."""
        wait = min(timeout or ATTACH_TIMEOUT_S, ATTACH_TIMEOUT_S)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            sock.settimeout(wait)
            sock.connect(path)
            request = {"op": "attach", "session": token, "arena": arena}
            if lane:
                request["lane"] = True
            sock.send(messages.pack(request))
            data, fds = recv_with_fds(sock, MAX_MESSAGE)
            answer = messages.unpack(data) if data else None
            if not isinstance(answer, dict) or not answer.get("ok"):
                close_all(fds)
                err = (answer or {}).get("error") or {}
                raise InferenceError(err.get("code", errors.UNAVAILABLE),
                                     err.get("message", "the daemon closed its side channel"))
            names = [s["segment"] for s in answer.get("arena") or []]
            if len(names) != len(fds):
                close_all(fds)
                raise InferenceError(errors.INTERNAL, "the daemon's arena came without its memory")
            sock.setblocking(False)
            lane = lane and answer.get("lane") is True
            return cls(sock, list(zip(names, fds)), lane, lane and answer.get("direct") is True)
        except BaseException:
            sock.close()
            raise

    def take(self, name: str) -> int:
        """The fd of a segment the daemon handed us (the caller owns it)."""
        fd = self._fds.pop(name, None)
        if fd is None and self.lane is None:      # else the lane's reader has read what came
            self._drain()
            fd = self._fds.pop(name, None)
        if fd is None:
            raise InferenceError(errors.INTERNAL, f"the daemon named shared memory '{name}' it did "
                                                  f"not hand to this client")
        return fd

    def _drain(self) -> None:
        while True:
            try:
                data, fds = self.recv()
            except BlockingIOError:
                return
            except OSError:
                return
            if not data:
                close_all(fds)
                return                       # the daemon ended the session; requests will say so
            self.keep(data, fds)

    def recv(self) -> tuple[memoryview, list[int]]:
        """One datagram (a view, valid until the next recv) and its fds;
        BlockingIOError when none waits."""
        return self._receiver.recv(self.sock, DONTWAIT)

    def keep(self, data: memoryview, fds: list[int]) -> None:
        """Keep the fds of segments the daemon handed over, by name, for take()."""
        try:
            names = [s["segment"] for s in messages.unpack(data)["segments"]]
        except Exception:
            names = []
        if len(names) != len(fds):
            close_all(fds)
            return
        for n, fd in zip(names, fds):
            old = self._fds.pop(n, None)
            if old is not None:
                os.close(old)
            self._fds[n] = fd

    def close(self) -> None:
        close_all([fd for _, fd in self.arena])
        self.arena = []
        close_all(list(self._fds.values()))
        self._fds.clear()
        self.sock.close()
