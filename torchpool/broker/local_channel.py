"""The side channel of local clients: a unix socket next to the frontend.

A client on this host that wants the shared-memory path (or to register
regions) connects here after `hello` and sends `{"op": "attach", "session":
token}` (`"arena": false` when it wants no arena, only regions). The kernel tells the
daemon who connected (SO_PEERCRED: pid, uid, gid), the daemon checks the
allow-lists, makes the session local and answers with the fds of its arena
(SCM_RIGHTS). The connection stays open for the session's life: later
segments (a grown arena, worker memory holding outputs lent to it) come the
same way, always before the answer that names them; its closing ends the
session. A tcp peer can never get a local session: it cannot reach this
socket. Messages are msgpack maps, one per SOCK_SEQPACKET datagram.

A client that attaches with `"lane": true` then also sends its inference
requests here, and gets their answers here (lane.py, protocol/lane.py):
two process hops fewer than through ZeroMQ's I/O threads. It is told
(`"direct": true`) when it may ask for direct paths to workers (direct.py).

Each connection counts against the daemon's connection limit (connections.py,
shared with the frontend): past it, one is answered RESOURCE_EXHAUSTED and
closed. Should accept() find no fd free anyway, the connection is taken off
the backlog with the one fd kept spare for that, and closed: a listener left
readable would have the loop spin on it.
"""
from __future__ import annotations

import errno
import functools
import grp
import logging
import os
import pwd
import socket
from typing import Callable, Optional

from ..protocol import errors, messages
from ..protocol import lane as lane_protocol
from ..protocol.errors import TorchpoolError
from ..shm.fdpass import close_all, recv_with_fds, send_with_fds
from .connections import Connections
from .frontend import claim_socket_path
from .lane import Lane
from .loop import Loop
from .regions import Peer
from .sessions import Session, SessionManager

log = logging.getLogger("torchpool.broker")

ATTACH_TIMEOUT_S = 10.0       # a connection that does not attach by then is closed
MAX_MESSAGE = 4096
LANE_BURST = 64               # lane requests read in one turn before others get theirs


def _uids(users: list[str]) -> set[int]:
    out = set()
    for u in users:
        out.add(int(u) if u.isdigit() else pwd.getpwnam(u).pw_uid)
    return out


def _gids(groups: list[str]) -> set[int]:
    out = set()
    for g in groups:
        out.add(int(g) if g.isdigit() else grp.getgrnam(g).gr_gid)
    return out


class LocalChannel:
    def __init__(self, path: str, loop: Loop, sessions: SessionManager, allow_users: list[str],
                 allow_groups: list[str], max_pending: int, max_pending_per_user: int,
                 connections: Connections, max_unread_replies: int = 0, *,
                 on_requests: Callable[[Lane, list[bytes]], None],
                 on_lane_gone: Callable[[Lane, bytes], None] = lambda sock, identity: None,
                 offers_direct: bool = False) -> None:
        self.path = path
        self.loop = loop
        self.sessions = sessions
        self.allow_uids = _uids(allow_users)       # KeyError for an unknown name: a startup error
        self.allow_gids = _gids(allow_groups)
        self.max_pending = max_pending
        self.max_pending_per_user = max_pending_per_user
        self._pending: dict[int, tuple[socket.socket, int]] = {}     # not attached yet: (conn, uid)
        self._attached: dict[int, tuple[socket.socket, Session]] = {}
        self._lanes: dict[int, Lane] = {}
        self.max_unread_replies = max_unread_replies
        self.connections = connections     # the daemon's connection count and limit
        self._counted: set[int] = set()    # fds of connections counted in `connections`
        # a lane's requests: (lane, [datagram]) -> None (the intake's);
        # (lane, identity) -> None when a lane goes (its queued requests are cancelled)
        self.on_requests = on_requests
        self.on_lane_gone = on_lane_gone
        self.offers_direct = offers_direct   # a lane may ask for direct paths (direct.py)
        claim_socket_path(path, socket.SOCK_SEQPACKET)
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            self.listener.bind(path)
            os.chmod(path, 0o660)          # the owner and the group, as the ipc:// socket
            self.listener.listen(128)
            self.listener.setblocking(False)
            self._spare = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)   # for _shed
        except BaseException:
            self.listener.close()
            raise
        loop.watch(self.listener.fileno(), self._accept)

    def _allowed(self, peer: Peer) -> bool:
        if not self.allow_uids and not self.allow_gids:
            return True                    # the socket file's permissions decide
        return peer.uid == os.getuid() or peer.uid in self.allow_uids or bool(peer.groups & self.allow_gids)

    def _accept(self) -> None:
        try:
            conn, _ = self.listener.accept()
        except OSError as exc:
            if exc.errno in (errno.EMFILE, errno.ENFILE):
                self._shed()
            return
        conn.setblocking(False)
        if not self.connections.admit(self.path):
            self._refuse(conn, TorchpoolError(errors.RESOURCE_EXHAUSTED, "the daemon holds as many "
                                              "client connections as it accepts (--max-connections)"))
            return
        self._counted.add(conn.fileno())
        # connections that never attach hold a slot for ATTACH_TIMEOUT_S: one user
        # cannot take them all and lock everyone else out of the local path
        uid = Peer.of(conn).uid
        if len(self._pending) >= self.max_pending or \
                sum(1 for _, u in self._pending.values() if u == uid) >= self.max_pending_per_user:
            self._refuse(conn, TorchpoolError(errors.RESOURCE_EXHAUSTED,
                                              "too many local connections of this user waiting to "
                                              "attach (--max-sessions-per-peer)"))
            return
        self._pending[conn.fileno()] = (conn, uid)
        self.loop.watch(conn.fileno(), functools.partial(self._on_readable, conn))
        self.loop.call_later(ATTACH_TIMEOUT_S, functools.partial(self._attach_deadline, conn))

    def _shed(self) -> None:
        """No fd is free: the spare one takes the connection off the backlog to close it."""
        os.close(self._spare)
        try:
            self.listener.accept()[0].close()
        except OSError:
            pass
        finally:
            self._spare = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        self.connections.refuse(self.path, "no file descriptor is free")

    def _attach_deadline(self, conn: socket.socket) -> None:
        entry = self._pending.get(conn.fileno())
        if entry is not None and entry[0] is conn:
            self._drop(conn)

    def _refuse(self, conn: socket.socket, err: TorchpoolError) -> None:
        try:
            conn.send(messages.pack({"ok": False, "error": err.to_wire()}), socket.MSG_DONTWAIT)
        except OSError:
            pass
        self._uncount(conn)
        conn.close()

    def _uncount(self, conn: socket.socket) -> None:
        fd = conn.fileno()
        if fd in self._counted:
            self._counted.discard(fd)
            self.connections.gone()

    def _on_readable(self, conn: socket.socket) -> None:
        fd = conn.fileno()
        ln = self._lanes.get(fd)
        if ln is not None:
            self._read_lane(conn, ln)
            return
        try:
            data, fds = recv_with_fds(conn, MAX_MESSAGE, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return
        except OSError:
            data, fds = b"", []
        close_all(fds)                     # a client has no fds to give us
        attached = self._attached.get(fd)
        if not data:                       # the client closed it: its session ends
            if attached is not None:
                self.sessions.channel_closed(attached[1])
            self._drop(conn)
            return
        if attached is not None:
            return                         # nothing more is expected from an attached client
        self._pending.pop(fd, None)
        try:
            peer = Peer.of(conn)
            if not self._allowed(peer):
                log.warning("refused a local session to uid %d (pid %d): not in --local-allow-user/"
                            "--local-allow-group", peer.uid, peer.pid)
                raise TorchpoolError(errors.UNAVAILABLE, "this user may not use the daemon's local "
                                                         "shared-memory path")
            try:
                request = messages.unpack(data)
            except Exception:
                request = None
            if not isinstance(request, dict) or request.get("op") != "attach":
                raise TorchpoolError(errors.INVALID_ARG, "expected {'op': 'attach', 'session': token}")
            answer, fds = self.sessions.attach(request.get("session"), peer, conn,
                                               arena=request.get("arena", True) is not False)
        except TorchpoolError as exc:
            self.loop.unwatch(fd)
            self._refuse(conn, exc)
            return
        session = self.sessions.sessions[request["session"]]
        self._attached[fd] = (conn, session)
        if request.get("lane") is True:
            # a lane that stops reading loses its session: once the reply that found it out is sent
            self._lanes[fd] = Lane(conn, session, self.loop, self.max_unread_replies,
                                   lambda ln: self.loop.call_later(0.0, lambda: self._end_lane(ln)),
                                   lambda ln: self.on_lane_gone(ln, ln.identity))
            answer["lane"] = True
            if self.offers_direct:
                answer["direct"] = True
        try:
            send_with_fds(conn, messages.pack(answer), fds, socket.MSG_DONTWAIT)
        except OSError:
            self.sessions.channel_closed(session)

    def _read_lane(self, conn: socket.socket, ln: Lane) -> None:
        """Requests on an attached lane, a burst at a time; its end ends its session."""
        burst: list[bytes] = []
        gone = False
        for _ in range(LANE_BURST):
            try:
                # recv, not recvmsg: fds a client sends are closed by the kernel
                data = conn.recv(lane_protocol.MAX_DATAGRAM + 1, socket.MSG_DONTWAIT)
            except BlockingIOError:
                break
            except OSError:
                data = b""
            if not data:
                gone = True
                break
            burst.append(data)
        if burst and not ln.closed:
            self.on_requests(ln, burst)
        if gone or ln.closed:
            self._end_lane(ln)

    def _end_lane(self, ln: Lane) -> None:
        """The lane closed, or stopped reading: it goes, and its session with it."""
        if ln.conn.fileno() >= 0:
            self._drop(ln.conn)
            self.sessions.channel_closed(ln.session)

    def close_channel(self, conn: socket.socket) -> None:
        """The session ended (SessionManager): its channel goes too."""
        self._drop(conn)

    def _drop(self, conn: socket.socket) -> None:
        fd = conn.fileno()
        if fd < 0:
            return
        self._pending.pop(fd, None)
        self._attached.pop(fd, None)
        ln = self._lanes.pop(fd, None)
        self.loop.unwatch(fd)
        if ln is not None:
            ln.close()
        self._uncount(conn)
        conn.close()

    def close(self) -> None:
        for conn, _ in list(self._pending.values()) + list(self._attached.values()):  # lanes too
            self._drop(conn)
        self.loop.unwatch(self.listener.fileno())
        self.listener.close()
        os.close(self._spare)
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def default_path(listen: list[str], daemon: str) -> str:
    """Beside the first ipc:// socket, else in the runtime directory."""
    for url in listen:
        if url.startswith("ipc://"):
            return url[len("ipc://"):] + ".local"
    runtime = os.environ.get("XDG_RUNTIME_DIR") or "/tmp"
    return os.path.join(runtime, f"torchpool-{daemon}.local")


def resolve_path(option: Optional[str], listen: list[str], daemon: str) -> Optional[str]:
    """--local-socket: None = the default place, "" = no local path."""
    if option == "":
        return None
    return option or default_path(listen, daemon)
