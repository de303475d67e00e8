"""What a client's socket monitor says about its connection to the daemon.

A ZeroMQ DEALER queues requests whether or not anyone listens, so silence
alone does not say why a call got no answer. The socket's monitor reports
what happened underneath, and a call uses it to say which it was:

    handshake succeeded, still connected   DEADLINE_EXCEEDED: the daemon is slow
                                           (the request may still run)
    connection dropped after that          UNAVAILABLE at once: the daemon went
                                           away with the request
    never connected                        UNAVAILABLE after the timeout, with
                                           why when a CURVE handshake failed

and, for ipc://, whether anything is there at all: a socket file that does
not exist fails a call before it is sent, and one nobody accepts on (a
daemon killed outright leaves it) fails it as soon as a connection attempt
is refused. Over tcp:// a refused connection still waits for the timeout:
the daemon may be restarting, and a firewall drops rather than refuses.

The monitor socket is read only by whoever owns the client's socket (the
sync client's reader thread, the asyncio client's loop); `drain()` takes
what it queued, and the other methods read the state it built.
"""
from __future__ import annotations

import itertools
import os
from typing import TYPE_CHECKING, Optional, TypedDict, Union, cast

import zmq

if TYPE_CHECKING:
    import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from ..protocol import errors
from .types import NoAnswer

class MonitorEvent(TypedDict):
    """One event of a socket's monitor, as zmq's parse_monitor_message gives it."""

    event: int
    value: int
    endpoint: bytes


_monitor_ids = itertools.count()     # inproc names are never reused, even after a client is gone
_HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                     | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
_EVENTS = (_HANDSHAKE_FAILED | zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED
           | zmq.EVENT_CONNECT_RETRIED)

_NO_KEYS = ("the security handshake failed: the server uses CURVE and this client has no "
            "server_key/client_key")
_MISMATCH = "the security handshake failed: this client uses CURVE and the server does not"
_NO_DETAIL = "the CURVE handshake failed: check server_key (it must be the server's public key)"


def _handshake_problem(event: int, value: int, has_keys: bool) -> Optional[str]:
    """What a failed handshake (a socket monitor event) says, in the user's terms."""
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        if value == 400:
            return ("the server refused this client's CURVE key: client_key's public key is not "
                    "in the server's authorized keys (--curve-authorized-keys)")
        return f"the server refused the connection (ZAP status {value})"
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
        return _NO_KEYS if not has_keys else _MISMATCH
    if event in (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL):
        # without keys the handshake is NULL, which only fails against a CURVE
        # server; the mismatch event itself may be lost to a retried connection
        return _NO_DETAIL if has_keys else _NO_KEYS
    return None


def timeout_error(url: str, timeout: float, why: Optional[str] = None) -> NoAnswer:
    """No daemon answered within `timeout` and none was ever connected; `why`
    when the connection says why (a refused handshake). Over tcp:// a server
    using CURVE answers nothing to a client it refuses, so the message says
    where to look."""
    if why:
        hint = why
    elif url.startswith("tcp://"):
        hint = ("is the server running and listening there? if the server uses CURVE, "
                "check server_key/client_key")
    else:
        hint = "is the server running and listening there?"
    return NoAnswer(errors.UNAVAILABLE, f"no answer from torchpool at {url} within {timeout:g} s ({hint})")


Mark = tuple[int, int]      # (connections lost, connect attempts retried) when a request was sent


def stop_monitor(sock: zmq.Socket[bytes]) -> None:
    """Stop `sock`'s monitor before the socket or the monitor's reader closes.

    libzmq's I/O thread sends monitor events with a blocking send: a socket
    that lingers after close (delivering a goodbye to a daemon that is gone,
    retrying the connection) would otherwise send its events to a reader
    that no longer exists and freeze the I/O thread, and with it every other
    client of the process (found as a hang of the next client after one
    whose daemon stopped)."""
    if not sock.closed:
        try:
            sock.disable_monitor()
        except zmq.ZMQError:
            pass


class ConnectionWatch:
    """The monitor of one client socket and what it has said so far.

    Create it before the socket connects, so that no event is missed."""

    def __init__(self, ctx: Union[zmq.Context[zmq.Socket[bytes]], zmq.asyncio.Context], sock: zmq.Socket[bytes],
                 url: str, has_keys: bool) -> None:
        self.url = url
        path = url[len("ipc://"):] if url.startswith("ipc://") else None
        # an abstract socket (ipc://@name) has no file to look for
        self.ipc_path = path if path and not path.startswith("@") else None
        self.connected = False                 # a handshake succeeded and the connection holds
        self.losses = 0                        # connections that dropped after their handshake
        self.retries = 0                       # connect attempts ZeroMQ had to retry
        self.handshake: Optional[str] = None   # why the last handshake failed, if it did
        self._has_keys = has_keys
        endpoint = f"inproc://torchpool.client.monitor.{next(_monitor_ids)}"
        sock.monitor(endpoint, _EVENTS)
        # a plain socket also from an asyncio context (socket_class): drain() never awaits
        plain = cast("zmq.Context[zmq.Socket[bytes]]", ctx)
        self.socket = plain.socket(zmq.PAIR, socket_class=zmq.Socket)
        # libzmq sends monitor events from the context's I/O thread and blocks
        # there when they are not read: an idle client that keeps failing to
        # connect would freeze every socket of the context after ~2,000
        # events. Our end takes them all instead (read at the next call), and
        # RECONNECT_IVL_MAX (set by the client) keeps that to ~1 a second.
        self.socket.setsockopt(zmq.RCVHWM, 0)
        self.socket.connect(endpoint)
        # Readable when the monitor may have news (ZMQ_FD: it stays readable
        # until drain() has looked): a poller that waits on this plain fd
        # spares libzmq two checks of the monitor socket per wait.
        self.fd = cast(int, self.socket.get(zmq.FD))       # (an int option: get() is typed int | bytes)

    def drain(self) -> None:
        """Take every event the monitor queued (never waits)."""
        sock = self.socket
        # EVENTS first: a recv that finds nothing raises, which costs more than the call path can spare
        while not sock.closed and cast(int, sock.get(zmq.EVENTS)) & zmq.POLLIN:
            self._feed(parse_monitor_message(sock.recv_multipart(zmq.NOBLOCK)))

    def _feed(self, event: MonitorEvent) -> None:
        kind = event["event"]
        if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self.connected, self.handshake = True, None
        elif kind == zmq.EVENT_DISCONNECTED:
            if self.connected:
                self.connected = False
                self.losses += 1
        elif kind == zmq.EVENT_CONNECT_RETRIED:
            self.retries += 1
        else:
            problem = _handshake_problem(kind, event["value"], self._has_keys)
            # a retried connection may fail with no detail after one that said
            # why: the reason is kept
            if problem and (problem != _NO_DETAIL or self.handshake is None):
                self.handshake = problem

    def mark(self) -> Mark:
        """Where the story stands as a request is sent (drain first)."""
        return self.losses, self.retries

    def before_send(self) -> Optional[NoAnswer]:
        """The error of a request that must not be sent: an ipc:// socket
        file that does not exist. Costs a stat only while not connected."""
        if self.connected or self.ipc_path is None or os.path.exists(self.ipc_path):
            return None
        return NoAnswer(errors.UNAVAILABLE, self._missing(), sent=False)

    def failure(self, mark: Mark) -> Optional[NoAnswer]:
        """Why a request sent at `mark` will get no answer, if the events
        since say so already (drain first)."""
        losses, retries = mark
        if self.losses > losses:
            return NoAnswer(errors.UNAVAILABLE, f"lost the connection to torchpool at {self.url} before "
                                                f"the answer came (did the daemon stop? the request may "
                                                f"or may not have run)")
        if (self.ipc_path is not None and not self.connected and self.retries > retries
                and self.handshake is None):
            if not os.path.exists(self.ipc_path):
                return NoAnswer(errors.UNAVAILABLE, self._missing())
            return NoAnswer(errors.UNAVAILABLE, f"no torchpool daemon at {self.url}: nothing accepts "
                                                f"connections on the socket file (a daemon that was "
                                                f"killed leaves it behind; is the daemon running? "
                                                f"check --listen)")
        return None

    def _missing(self) -> str:
        return (f"no torchpool daemon at {self.url}: the socket file does not exist "
                f"(is the daemon running? check --listen)")

    def no_answer(self, timeout: float) -> NoAnswer:
        """The error of a request that got no answer within `timeout` s."""
        if self.connected:
            return NoAnswer(errors.DEADLINE_EXCEEDED, f"torchpool at {self.url} did not answer within "
                                                      f"{timeout:g} s (it is reachable: the request may "
                                                      f"still run)")
        return timeout_error(self.url, timeout, self.handshake)

    def close(self, sock: zmq.Socket[bytes]) -> None:
        """Stop watching `sock`, then close our end (in that order: see
        stop_monitor). Before `sock` itself closes."""
        stop_monitor(sock)
        self.socket.close(linger=0)
