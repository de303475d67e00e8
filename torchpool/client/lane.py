"""The request lane: a local session's inference over its side channel.

A sync `Client` whose session attached with `"lane": true` sends its
inference requests (and arena_grow) over the side channel's unix socket
instead of its ZeroMQ socket (protocol/lane.py says why and how). The
calls, threads and deadlines work as on the ZeroMQ socket (SharedSocket:
one waiting thread reads for all); what differs is the transport:

- the segments the daemon hands over (fds, local.py) arrive on the same
  socket, before the answer that names them: the reader keeps them for
  `LocalLink.take`;
- the socket closing means the daemon stopped or ended the session: every
  call in flight fails at once with UNAVAILABLE, and later calls go over
  ZeroMQ again (where the daemon says whether the session still exists).
"""
from __future__ import annotations

import select
import socket
import time
from typing import Callable, Optional, Protocol, Union

from ..protocol import errors, lane, messages
from ..shm.fdpass import DONTWAIT
from .channel import SharedSocket, CallWaiter
from .types import NoAnswer



class LaneLink(Protocol):
    """What a lane reads through: a LocalLink (the session's side channel) or
    a DirectLink (a direct path's socket)."""

    sock: socket.socket

    def recv(self) -> tuple[memoryview, list[int]]: ...

    def keep(self, data: memoryview, fds: list[int]) -> None:
        """A datagram that is no answer: keep the segments handed over in it (or close its fds)."""


def assemble(pieces: list[Union[bytes, memoryview]], data: memoryview, fds: list[int],
             link: LaneLink) -> Optional[tuple[list[memoryview], list[Union[memoryview, bytes]]]]:
    """One datagram read from a lane or a direct path: the answer's frames
    and payload once it is whole; None while it comes in pieces (kept in
    `pieces`) or for segments handed over ahead of the answer naming them
    (given to `link.keep`)."""
    kind = data[0]
    if kind == lane.MORE:
        pieces.append(bytes(data[1:]))     # the receive buffer is reused
        return None
    if kind != lane.LAST:
        link.keep(data, fds)
        return None
    if pieces:
        pieces.append(data[1:])
        frames = lane.decode(b"".join(pieces))
        pieces.clear()
        return frames, list(frames[1:])
    frames = lane.decode(data[1:])
    return frames, [bytes(f) for f in frames[1:]]   # out of the reused buffer

class LaneSocket(SharedSocket):
    zmq_fallback = True         # a call it could not send goes over ZeroMQ (sync.py)

    def __init__(self, link: LaneLink, url: str, on_late: Callable[[object], None]) -> None:
        self._link = link
        self._url = url
        self.fd = link.sock.fileno()
        self.lost = False                  # the daemon closed it: nothing more comes
        self._pieces: list[Union[bytes, memoryview]] = []     # of an answer that came in several datagrams
        super().__init__(self.fd, None, on_late)

    def _transmit(self, w: CallWaiter, now: Optional[float] = None) -> None:
        error = None
        if self.lost:
            error = self._lost_error(sent=False)
        else:
            assert w.frames is not None     # each call is sent once
            datagram = lane.request(w.frames)
            while True:
                try:
                    self._link.sock.sendmsg(datagram, (), DONTWAIT)
                    break
                except BlockingIOError:
                    # the daemon has not read what we sent yet: wait for room, as
                    # ZeroMQ's queue would, until the call's own deadline
                    remaining = w.deadline - time.monotonic()
                    if remaining <= 0:
                        error = NoAnswer(errors.DEADLINE_EXCEEDED, f"torchpool at {self._url} did not "
                                                                   f"take the request in time (it has not "
                                                                   f"read this client's earlier ones)",
                                         sent=False)
                        break
                    # answers keep coming meanwhile: read them, or the daemon,
                    # finding this client not reading, would end its session
                    readable, _, _ = select.select([self.fd], [self.fd], [], min(remaining, 0.1))
                    if readable:
                        self._read_one(None)
                except OSError:
                    self._lose()
                    error = self._lost_error(sent=False)
                    break
        w.frames = None
        if error is not None:
            self._finish(w, error=error)

    def _read_one(self, me: Optional[CallWaiter]) -> None:
        link = self._link
        try:
            data, fds = link.recv()
        except BlockingIOError:
            return
        except OSError:
            data, fds = memoryview(b""), []    # (empty: lost)
        if not data:
            self._lose()
            return
        answer = assemble(self._pieces, data, fds, link)
        if answer is None:
            return
        frames, payload = answer
        self._deliver(me, messages.unpack(frames[0]), payload)

    def _lose(self) -> None:
        """The daemon closed the lane: every call sent on it fails now."""
        self.lost = True
        with self._lock:
            waiting = list(self._waiting.values())
        for w in waiting:
            if w.frames is None:                    # sent: no answer will come
                self._finish(w, error=self._lost_error(sent=True))

    def _lost_error(self, sent: bool) -> NoAnswer:
        return NoAnswer(errors.UNAVAILABLE, f"torchpool at {self._url} closed this client's local "
                                            f"side channel (it stopped, or ended the session)", sent=sent)

    def _no_answer(self, timeout: float) -> NoAnswer:
        return NoAnswer(errors.DEADLINE_EXCEEDED, f"torchpool at {self._url} did not answer within "
                                                  f"{timeout:g} s (it is reachable: the request may "
                                                  f"still run)")

    def _on_deadline(self) -> None:
        pass

    def _on_monitor(self) -> None:
        pass
