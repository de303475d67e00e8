"""A local client's request lane: its side channel, carrying its inference.

A client that attached with `"lane": true` sends its inference requests
(and arena_grow) over its side channel as lane datagrams
(protocol/lane.py); the broker answers there. The lane is a connection as
the frontend's are: requests count in flight against the client's process
(the pid the kernel gave at attach, as for ipc://), and replies it does not
read wait here, at most --max-unread-replies of them; one more ends its
session (as a frontend connection that stops reading loses its sessions),
which closes the lane. A lane that closes ends its session
(local_channel.py) and fails its queued requests.
"""
from __future__ import annotations

import collections
import itertools
import logging
import socket
from typing import TYPE_CHECKING, Callable, Sequence, Union

import zmq

from ..protocol import errors, lane, messages
from ..protocol.errors import TorchpoolError
from .loop import Loop

if TYPE_CHECKING:
    from typing_extensions import Buffer

    from .sessions import Session, SessionManager

log = logging.getLogger("torchpool.broker")

_serials = itertools.count(1)


class Lane:
    """The sending half of one lane; LocalChannel reads its requests."""

    def __init__(self, conn: socket.socket, session: Session, loop: Loop, max_unread: int,
                 on_stalled: Callable[["Lane"], None], on_gone: Callable[["Lane"], None]) -> None:
        self.conn = conn
        self.session = session
        self.identity = b"lane:%d" % next(_serials)   # what schedulers cancel by
        pid = session.peer.pid if session.peer is not None else 0
        # in flight per process, as ipc:// counts it; a peer whose pid we cannot see counts alone
        self.client: ClientKey = ("pid", pid) if pid > 0 else (self, self.identity)
        self.loop = loop
        self.max_unread = max_unread
        self._on_stalled = on_stalled
        self._on_gone = on_gone
        self._outbox: collections.deque[bytes] = collections.deque()   # datagrams not taken yet
        self._queued = 0                # replies (messages) waiting in the outbox
        self.closed = False

    def send(self, header: messages.Header, frames: Sequence[zmq.Frame | Buffer] = ()) -> bool:
        """Send one reply; False when it was dropped (the client does not
        read, or is gone). Never blocks."""
        if self.closed:
            return False
        # (mypy does not narrow on __class__: the generator yields Buffers)
        grams = lane.datagrams([messages.pack(header),
                                *(f.buffer if f.__class__ is zmq.Frame else f  # type: ignore[list-item]
                                  for f in frames)])
        if not self._outbox:
            for i, gram in enumerate(grams):
                try:
                    self.conn.sendmsg(gram, (), socket.MSG_DONTWAIT)
                except BlockingIOError:
                    grams = grams[i:]       # the rest waits, whatever the limit: it is begun
                    break
                except OSError:
                    self.close()
                    return False
            else:
                return True
        elif self.max_unread and self._queued >= self.max_unread:
            # it does not read: as a frontend connection that stops reading, it loses its
            # session (its memory goes back), which closes the lane
            log.warning("local client (pid %s) does not read its replies: %d are queued for it "
                        "(--max-unread-replies); ending its session", self.client[1], self._queued)
            self.close()
            self._on_stalled(self)
            return False
        self._queued += 1
        if not self._outbox:
            self.loop.watch_writable(self.conn.fileno(), self._flush)
        for gram in grams:      # copied: they may view memory that goes back once this returns
            self._outbox.append(b"".join(gram))
        return True

    def _flush(self) -> None:
        outbox = self._outbox
        while outbox:
            gram = outbox[0]
            try:
                self.conn.send(gram, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return
            except OSError:
                self.close()
                return
            outbox.popleft()
            if gram[0] == lane.LAST:
                self._queued -= 1
        self.loop.unwatch_writable(self.conn.fileno())

    def close(self) -> None:
        """The connection is gone (or its session ended): nothing more is sent,
        and its queued requests are cancelled."""
        if self.closed:
            return
        self.closed = True
        if self._outbox:
            self._outbox.clear()
            if self.conn.fileno() >= 0:
                self.loop.unwatch_writable(self.conn.fileno())
        self._on_gone(self)


# where a request came in and its reply goes: a frontend socket or a lane
ReplySocket = Union[zmq.Socket[bytes], Lane]
# whom a request counts against in flight (frontend.InFlight.client_of, Lane.client):
# ("pid", pid) for a process on this host, else (socket or lane, routing id)
ClientKey = Union[tuple[str, int], tuple[ReplySocket, bytes]]


def lane_session(ln: Lane, header: messages.Header, sessions: SessionManager) -> Session:
    """The session a lane request runs in: the lane's own, which the header
    must name; raises SESSION_LOST once it has ended."""
    session = ln.session
    if header.get("session") != session.token:
        raise TorchpoolError(errors.INVALID_ARG, "a request on a session's side channel must name that "
                                                 "session")
    return sessions.get(session.token)      # SESSION_LOST when it ended; renews the lease
