"""Client connections and the file descriptors they cost: refused before the limit.

Every client connection holds one of the broker's file descriptors: ZeroMQ's
ipc:// and tcp:// connections (accepted in libzmq's I/O thread) and the
local side channel's (accepted by local_channel.py). libzmq 4.3's ipc://
listener does not expect EMFILE: at the limit it asserts ("Too many open
files (src/ipc_listener.cpp:297)") and the broker dies with SIGABRT. So:

  - at start the soft RLIMIT_NOFILE is raised to the hard limit
    (`raise_open_files_limit`; the systemd unit sets LimitNOFILE);
  - connections are counted, ZeroMQ's through a monitor per frontend socket
    (ACCEPTED, DISCONNECTED), and one accepted past `--max-connections` is
    shut down at once: libzmq sees it end and closes it, the client's
    ZeroMQ socket retries later, and the connections already open go on
    being served. The default leaves a quarter of the limit (at least
    RESERVE_MIN) free for everything else the broker opens (workers,
    segments, the reply paths of sessions), and for the connections libzmq
    accepts between the monitor's report and the shutdown.
"""
from __future__ import annotations

import logging
import resource
import socket
import struct
import time
from typing import Callable, Optional, Union

import zmq

log = logging.getLogger("torchpool.broker")

# fds always kept for what is not a counted client connection: the broker's own
# (workers, segments, sessions) and the connections libzmq has accepted and
# not yet closed after their shutdown. Under a flood of ZeroMQ clients that
# reconnect at once when refused (2,000 to 5,000 of them) the latter peaked
# at about 360 on the 2-core VM; 256 was not enough at a limit of 1024.
RESERVE_MIN = 512
REFUSAL_LOG_INTERVAL_S = 10.0   # at most one warning about refused connections this often
_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED
_ACCEPTED = int(zmq.EVENT_ACCEPTED)
_DISCONNECTED = int(zmq.EVENT_DISCONNECTED)
_NOBLOCK = int(zmq.NOBLOCK)
_EVENT_FRAME = struct.Struct("=HI")      # a monitor event's first frame: event, value (the fd)


def raise_open_files_limit(logger: logging.Logger = log) -> int:
    """Raise the soft RLIMIT_NOFILE to the hard one (logged to `logger`: the
    gateway process calls this too); returns the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError) as exc:
            logger.warning("open files: cannot raise the soft limit %d to the hard limit %d: %s",
                           soft, hard, exc)
            return soft
        logger.info("open files: soft limit raised from %d to the hard limit %d", soft, hard)
        return hard
    logger.info("open files: soft limit %d, hard limit %s", soft,
                "unlimited" if hard == resource.RLIM_INFINITY else hard)
    return soft


def default_max_connections(open_files: Optional[int] = None) -> int:
    """--max-connections when not given: the soft fd limit less its reserve."""
    if open_files is None:
        open_files = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return max(1, open_files - max(RESERVE_MIN, open_files // 4))


class Connections:
    """The count of client connections against one limit, for every listener."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.count = 0
        self.refused = 0
        self._logged_at = -REFUSAL_LOG_INTERVAL_S

    def admit(self, where: str) -> bool:
        """Count a new connection, or say it must be refused (and count that)."""
        if self.count < self.limit:
            self.count += 1
            return True
        self.refuse(where, f"{self.count} client connections are open, the limit (--max-connections)")
        return False

    def refuse(self, where: str, why: str) -> None:
        """A connection refused on `where`: logged, at most once every few seconds."""
        self.refused += 1
        now = time.monotonic()
        if now - self._logged_at >= REFUSAL_LOG_INTERVAL_S:
            self._logged_at = now
            log.warning("refusing new connections on %s: %s; %d refused so far", where, why, self.refused)

    def gone(self) -> None:
        self.count -= 1


class ZmqConnectionWatch:
    """The connections of one frontend ROUTER socket, counted from its monitor.

    libzmq allows one monitor a socket: `other_events` are watched too and
    handed to `on_other(url, event, value)` (auth.py's failed CURVE handshakes)."""

    def __init__(self, sock: zmq.Socket[bytes], url: str, connections: Connections, other_events: int = 0,
                 on_other: Optional[Callable[[str, int, int], None]] = None) -> None:
        self.url = url
        self.connections = connections
        self.on_other = on_other
        self._counted: set[int] = set()          # fds of this socket's counted connections
        address = f"inproc://torchpool-connections-{id(sock):x}"
        sock.monitor(address, _EVENTS | other_events)
        self.monitor = sock.context.socket(zmq.PAIR)
        # no high-water mark: a dropped event would leave the count wrong for good
        self.monitor.setsockopt(zmq.RCVHWM, 0)
        self.monitor.setsockopt(zmq.LINGER, 0)
        self.monitor.connect(address)
        self._sock = sock
        self._local = _local_address(url)
        self._family = socket.AF_UNIX if url.startswith("ipc://") else None   # tcp: v4 or v6

    def on_events(self) -> None:
        """Count what was accepted and what ended; shut down what is over the limit.
        Cheap per event (a few us): under a flood of reconnecting clients this
        must keep up with libzmq accepting them."""
        monitor = self.monitor
        while True:
            try:
                event, fd = _EVENT_FRAME.unpack_from(monitor.recv(_NOBLOCK))
                monitor.recv(_NOBLOCK)          # the endpoint: the same for every event here
            except zmq.Again:
                return
            if event == _ACCEPTED:
                if self.connections.admit(self.url):
                    self._counted.add(fd)
                else:
                    _shut_down(fd, self._family, self._local)
            elif event == _DISCONNECTED:
                if fd in self._counted:         # a refused one was never counted
                    self._counted.discard(fd)
                    self.connections.gone()
            elif self.on_other is not None:
                self.on_other(self.url, event, fd)

    def close(self) -> None:
        try:
            self._sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self.monitor.close(linger=0)


def _local_address(url: str) -> Union[str, int]:
    """What getsockname() of a connection accepted on `url` says: the ipc
    path, or the tcp port (the host may be a wildcard)."""
    if url.startswith("ipc://"):
        return url[len("ipc://"):]
    return int(url.rsplit(":", 1)[1])


def _shut_down(fd: int, family: Optional[int], local: Union[str, int]) -> None:
    """End the connection libzmq holds at `fd` (it closes the fd itself).
    The fd is checked to be a connection of this listener first: by the
    time its event is read, libzmq may have closed it and the number may
    name something else of the broker's."""
    try:
        # family and type given: no getsockopt calls to find them out (tcp's
        # family is found, it may be v4 or v6)
        conn = socket.socket(family, socket.SOCK_STREAM, 0, fd) if family else socket.socket(fileno=fd)
    except OSError:
        return                                  # not a socket (any more)
    try:
        name = conn.getsockname()
        if (name if isinstance(local, str) else (name[1] if isinstance(name, tuple) else None)) == local:
            conn.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    finally:
        conn.detach()                           # the fd stays libzmq's
