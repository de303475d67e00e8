"""The frontend: ROUTER sockets on every --listen URL, and what it knows of
each connection.

Clients are DEALER sockets; every message arrives as
`[routing id, header, payload...]` and every answer goes back the same way,
through `send`, the one path out. A connection is a routing id on one socket.

    ipc://  plain ROUTER (the socket file's mode guards it)
    tcp://  a CURVE server with a ZAP allow-list when --curve-secret-key is
            given (auth.py); without it, loopback only unless --insecure-tcp

The frontend keeps two limits (ARCHITECTURE.md, "Trust boundaries"):
requests in flight per client process or tcp connection (`InFlight`,
--max-in-flight-per-client) and, per connection, replies it has not read
(--max-unread-replies: the socket's send high-water mark). A reply to a
connection whose queue is full, or that is gone, is dropped (it could not
be delivered anyway), the connection is marked as not reading and reported
once through `on_stalled`; its requests are refused until a reply gets
through again. Connections in all are bounded below the open-files limit
(connections.py, --max-connections): one past it is shut down as it comes.
"""
from __future__ import annotations

import errno
import logging
import os
import socket
from typing import TYPE_CHECKING, Callable, Optional, Sequence

import zmq

from ..protocol import errors, messages
from ..protocol.errors import TorchpoolError
from .auth import HANDSHAKE_EVENTS, CurveAuth, SecurityError, check_options, is_loopback, is_tcp
from .connections import Connections, ZmqConnectionWatch, default_max_connections
from .lane import ClientKey, Lane, ReplySocket

if TYPE_CHECKING:
    from typing_extensions import Buffer

    from .loop import Loop
    from .options import ServerOptions
    from .requests import InferRequest

log = logging.getLogger("torchpool.broker")

_MAX_MARKS = 4096     # connections remembered as stalled (or gone); the oldest are forgotten
# send flags as plain ints: pyzmq's enum arithmetic (send_multipart ORs
# SNDMORE into every frame's flags) costs microseconds per reply
_MORE = int(zmq.SNDMORE | zmq.NOBLOCK)
_LAST = int(zmq.NOBLOCK)
_EVENTS = int(zmq.EVENTS)


class AddressInUse(Exception):
    pass


def ipc_path(url: str) -> str | None:
    return url[len("ipc://"):] if url.startswith("ipc://") else None


def claim_socket_path(path: str, kind: int = socket.SOCK_STREAM) -> None:
    """Refuse a socket file a live daemon listens on; remove a dead one's.

    libzmq would silently replace the file and steal the address from a
    running daemon (and so would a bind after an unlink), so we ask the
    kernel first, with a socket of the listener's `kind` (the ipc://
    frontends are streams, the local side channel is SOCK_SEQPACKET).
    """
    if not os.path.exists(path):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        return
    probe = socket.socket(socket.AF_UNIX, kind)
    try:
        probe.connect(path)
    except OSError as exc:
        if exc.errno in (errno.ECONNREFUSED, errno.ENOENT):
            log.warning("removing stale socket file %s left by a dead daemon", path)
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            return
        raise
    else:
        raise AddressInUse(f"{path} is in use by a running process (is another torchpool serving it?)")
    finally:
        probe.close()


class InFlight:
    """Unanswered infer requests per client: a process on this host (ipc://,
    known by the pid the kernel gives libzmq) or a tcp connection.

    Counting a local process and not its connection means a client cannot
    multiply its share by reconnecting: closing a connection does not cancel
    what it sent (without ROUTER_NOTIFY the daemon does not even learn of it),
    so an offender opening connection after connection could otherwise queue
    the limit's worth of work each time. A request is added when it is
    accepted and taken away when its one final answer goes out
    (Answers.release): removal is idempotent, so no path can count it twice.
    A client at its limit has its next request refused at once with
    RESOURCE_EXHAUSTED; other clients are not affected."""

    def __init__(self, limit: int) -> None:
        self.limit = limit                 # 0: no limit
        self._by_client: dict[ClientKey, set[InferRequest]] = {}

    @staticmethod
    def client_of(sock: ReplySocket, identity: bytes, frame: zmq.Frame, local: bool) -> ClientKey:
        """Who a request counts against: ("pid", n) for a process on this host
        (`local`: it came over ipc://, where libzmq's Peer-Address of the
        message is "host:uid:gid:pid", from SO_PEERCRED), else the connection
        (socket, routing id)."""
        if local:
            try:
                address = frame.get("Peer-Address")    # (a str property: pyzmq types every one int | str)
                pid = address.rpartition(":")[2] if isinstance(address, str) else ""
            except zmq.ZMQError:
                pid = ""
            if pid.isdigit() and pid != "0":     # 0: a peer in a pid namespace we cannot see
                return ("pid", int(pid))
        return (sock, identity)

    def check(self, client: ClientKey) -> None:
        if not self.limit:
            return
        held = self._by_client.get(client)
        if held is not None and len(held) >= self.limit:
            who = f"this client (process {client[1]})" if client[0] == "pid" else "this connection"
            raise TorchpoolError(errors.RESOURCE_EXHAUSTED,
                                 f"{who} has {len(held)} requests in flight; this server accepts at "
                                 f"most {self.limit} per client process or tcp connection "
                                 f"(--max-in-flight-per-client)")

    def add(self, req: InferRequest) -> None:
        client = req.client
        assert client is not None       # an accepted request counts against one (Intake._accept_infer)
        held = self._by_client.get(client)
        if held is None:
            held = self._by_client[client] = set()
        held.add(req)

    def done(self, req: InferRequest) -> None:
        client = req.client
        if client is None:              # never added
            return
        held = self._by_client.get(client)
        if held is not None:
            held.discard(req)
            if not held:
                del self._by_client[client]

    def __len__(self) -> int:
        """Requests in flight of every client."""
        return sum(len(held) for held in self._by_client.values())


class Frontend:
    """The daemon's listening sockets, one ROUTER per URL; the one path
    replies take out; and per-connection state (in flight, not reading).

    `max_in_flight`: unanswered requests per client (0: no limit; InFlight).
    `max_unread_replies`: replies queued for one connection before it counts
    as not reading (0: no limit). `max_connections`: client connections in
    all (0: from the open-files limit; `connections`, which the local side
    channel counts against too). `on_stalled(identity)`: told once when a
    connection stops reading, or is found gone (its sessions can go);
    `on_gone(sock, identity)` once more when it is gone."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], urls: Sequence[str], *,
                 curve_secret_key: Optional[str] = None, curve_authorized_keys: Optional[str] = None,
                 insecure_tcp: bool = False,
                 max_in_flight: int = 0, max_unread_replies: int = 0, max_connections: int = 0,
                 on_stalled: Optional[Callable[[bytes], None]] = None,
                 on_gone: Optional[Callable[[ReplySocket, bytes], None]] = None) -> None:
        self.urls = list(urls)
        self.sockets: list[zmq.Socket[bytes]] = []
        self.connections = Connections(max_connections or default_max_connections())
        self._watches: list[ZmqConnectionWatch] = []
        self.notifies_disconnect = False        # ROUTER_NOTIFY took (libzmq with drafts)
        self.in_flight = InFlight(max_in_flight)
        self.max_unread_replies = max_unread_replies
        self.on_stalled = on_stalled
        self.on_gone = on_gone                  # (sock, routing id)
        self._remote: set[zmq.Socket[bytes]] = set()  # sockets of tcp:// URLs
        self._url_of: dict[zmq.Socket[bytes], str] = {}
        self._stalled: dict[tuple[zmq.Socket[bytes], bytes], int] = {}   # -> replies dropped since
        self._gone: dict[tuple[zmq.Socket[bytes], bytes], None] = {}     # reported gone already
        self._ipc_files: list[str] = []
        self._auth: Optional[CurveAuth] = check_options(self.urls, curve_secret_key, curve_authorized_keys,
                                                        insecure_tcp)
        try:
            made = [self._socket(ctx, url) for url in self.urls]
            if self._auth is not None and not self._remote:
                log.warning("--curve-secret-key given but no tcp:// address to secure with it")
                self._auth = None
            auth = self._auth
            if auth is not None:
                auth.start(ctx)                 # ZAP answers before any CURVE socket listens
            for sock, url in made:
                on_failed = auth.handshake_failed if auth is not None and sock in self._remote else None
                self._watches.append(ZmqConnectionWatch(
                    sock, url, self.connections, HANDSHAKE_EVENTS if on_failed is not None else 0,
                    on_failed))
                self._bind(sock, url)
                self._say_how_secure(url, insecure_tcp)
        except BaseException:
            self.close()
            raise

    @classmethod
    def from_options(cls, ctx: zmq.Context[zmq.Socket[bytes]], options: ServerOptions, *,
                     on_stalled: Optional[Callable[[bytes], None]] = None,
                     on_gone: Optional[Callable[[ReplySocket, bytes], None]] = None) -> "Frontend":
        """A frontend on `options.listen` (a ServerOptions) with its access options and limits."""
        return cls(ctx, options.listen, curve_secret_key=options.curve_secret_key,
                   curve_authorized_keys=options.curve_authorized_keys, insecure_tcp=options.insecure_tcp,
                   max_in_flight=options.max_in_flight_per_client,
                   max_unread_replies=options.max_unread_replies,
                   max_connections=options.max_connections, on_stalled=on_stalled, on_gone=on_gone)

    def watch_connections(self, loop: Loop) -> None:
        """Count connections (and refuse those over the limit) as they come, on `loop`."""
        for watch in self._watches:
            loop.watch(watch.monitor, watch.on_events)

    def _socket(self, ctx: zmq.Context[zmq.Socket[bytes]], url: str) -> tuple[zmq.Socket[bytes], str]:
        sock = ctx.socket(zmq.ROUTER)
        self.sockets.append(sock)               # closed by close() whatever fails below
        self._url_of[sock] = url
        sock.setsockopt(zmq.LINGER, 1000)
        # A reply to a connection that is gone, or whose queue is full (it
        # does not read), raises at once instead of waiting or vanishing:
        # send() drops it and marks the connection.
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.SNDHWM, max(0, self.max_unread_replies))
        # Requests a connection sent that the broker has not read yet. More
        # than its in-flight limit could not be accepted anyway, so beyond
        # that ZeroMQ stops reading its stream: a flooding client is slowed
        # down by its own socket (TCP / unix backpressure) and fair queueing
        # keeps serving the others, instead of the broker buffering without
        # bound. 0 (no limit) when the in-flight limit is off.
        sock.setsockopt(zmq.RCVHWM, max(0, self.in_flight.limit))
        try:
            # an empty message tells us a client went away: its session is released
            # at once. It is a draft option in libzmq builds without drafts; the
            # client lease and failed sends (EHOSTUNREACH) cover those.
            sock.setsockopt(zmq.ROUTER_NOTIFY, zmq.NOTIFY_DISCONNECT)
            self.notifies_disconnect = True
        except (zmq.ZMQError, AttributeError):
            pass
        if is_tcp(url):
            self._remote.add(sock)
            if self._auth is not None:
                self._auth.secure(ctx, sock, url)
        elif ipc_path(url) is None:
            raise SecurityError(f"cannot listen on {url}: only ipc:// and tcp:// addresses are served")
        return sock, url

    def _bind(self, sock: zmq.Socket[bytes], url: str) -> None:
        path = ipc_path(url)
        if path:
            claim_socket_path(path)
        try:
            sock.bind(url)
        except zmq.ZMQError as exc:
            raise AddressInUse(f"cannot listen on {url}: {exc}") from None
        if path:
            os.chmod(path, 0o660)
            self._ipc_files.append(path)

    def _say_how_secure(self, url: str, insecure_tcp: bool) -> None:
        if not is_tcp(url) or self._auth is not None:
            return
        if is_loopback(url):
            log.info("%s is unauthenticated and unencrypted (loopback: reachable from this host "
                     "only; --curve-secret-key secures it)", url)
        else:
            log.warning("%s is unauthenticated and unencrypted (--insecure-tcp): anyone who can "
                        "reach it can run and load models", url)

    # -- connections

    def is_remote(self, sock: ReplySocket) -> bool:
        """True for a tcp:// socket (not a local ipc:// one)."""
        return sock in self._remote

    def stalled(self, sock: ReplySocket, identity: bytes) -> bool:
        """True while the connection counts as not reading its replies."""
        return bool(self._stalled) and (sock, identity) in self._stalled

    def forget(self, sock: zmq.Socket[bytes], identity: bytes) -> None:
        """The connection closed (ROUTER_NOTIFY): nothing to remember of it."""
        self._stalled.pop((sock, identity), None)

    def send(self, sock: ReplySocket, identity: bytes, header: messages.Header,
             frames: Sequence[zmq.Frame | Buffer] = ()) -> bool:
        """Send one reply; False when it was dropped: the connection does not
        read (its queue holds max_unread_replies) or is gone. Never blocks,
        never raises for a client's sake. A local client's lane sends its own."""
        if isinstance(sock, Lane):
            return sock.send(header, frames)
        try:
            # a ROUTER refuses (EAGAIN, EHOSTUNREACH) on the first frame or not at all
            try:
                sock.send(identity, _MORE)
            except zmq.Again:
                # The queue looks full, but libzmq learns that the peer's side
                # took messages only from commands its send() reads at most once
                # a millisecond: a reading client answered in a burst can look
                # full. ZMQ_EVENTS reads them now; then one more try decides.
                sock.get(_EVENTS)
                sock.send(identity, _MORE)
            if frames:
                sock.send(messages.pack(header), _MORE)
                last = len(frames) - 1
                for i, frame in enumerate(frames):
                    sock.send(frame, _MORE if i < last else _LAST)
            else:
                sock.send(messages.pack(header), _LAST)
        except zmq.Again:
            self._not_reading(sock, identity)
            return False
        except zmq.ZMQError as exc:
            if exc.errno != errno.EHOSTUNREACH:
                raise
            self._is_gone(sock, identity)
            return False
        if self._gone:
            self._gone.pop((sock, identity), None)   # a peer that chose its own routing id came back
        if self._stalled and (sock, identity) in self._stalled:
            dropped = self._stalled.pop((sock, identity))
            log.info("connection %s on %s reads its replies again (%d were dropped meanwhile)",
                     identity.hex(), self._url_of.get(sock), dropped)
        return True

    def _not_reading(self, sock: zmq.Socket[bytes], identity: bytes) -> None:
        key = (sock, identity)
        if key in self._stalled:
            self._stalled[key] += 1
            return
        if len(self._stalled) >= _MAX_MARKS:
            self._stalled.pop(next(iter(self._stalled)))
        self._stalled[key] = 1
        log.warning("connection %s on %s does not read its replies: %d are queued for it "
                    "(--max-unread-replies); dropping its replies and refusing its requests until "
                    "it reads", identity.hex(), self._url_of.get(sock), self.max_unread_replies)
        self._report(identity)

    def _is_gone(self, sock: zmq.Socket[bytes], identity: bytes) -> None:
        key = (sock, identity)
        self._stalled.pop(key, None)
        if key in self._gone:
            return
        if len(self._gone) >= _MAX_MARKS:
            self._gone.pop(next(iter(self._gone)))
        self._gone[key] = None
        log.debug("connection %s on %s is gone: its replies are dropped", identity.hex(),
                  self._url_of.get(sock))
        self._report(identity)
        if self.on_gone is not None:
            self.on_gone(sock, identity)

    def _report(self, identity: bytes) -> None:
        if self.on_stalled is not None:
            try:
                self.on_stalled(identity)
            except Exception:   # the reply path must not fail for it
                log.exception("releasing the sessions of connection %s failed", identity.hex())

    def close(self) -> None:
        for watch in self._watches:
            watch.close()
        self._watches.clear()
        for sock in self.sockets:
            sock.close(linger=1000)
        self.sockets.clear()
        self._remote.clear()
        if self._auth is not None:
            self._auth.stop()                  # after the CURVE sockets: ZAP is never missing
        for path in self._ipc_files:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        self._ipc_files.clear()
