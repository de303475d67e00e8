"""The frontend: ROUTER sockets on every --listen URL.

Clients are DEALER sockets; every message arrives as
`[routing id, header, payload...]` and every answer goes back the same way.
"""
from __future__ import annotations

import errno
import logging
import os
import socket
from typing import Any, Sequence

import zmq

from ..protocol import messages

log = logging.getLogger("torchpool.broker")


class AddressInUse(Exception):
    pass


def ipc_path(url: str) -> str | None:
    return url[len("ipc://"):] if url.startswith("ipc://") else None


def _claim_ipc_path(path: str) -> None:
    """Refuse a socket file a live daemon listens on; remove a dead one's.

    libzmq would silently replace the file and steal the address from a
    running daemon, so we ask the kernel first.
    """
    if not os.path.exists(path):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        return
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
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


class Frontend:
    def __init__(self, ctx: zmq.Context, urls: Sequence[str]) -> None:
        self.urls = list(urls)
        self.sockets: list[zmq.Socket] = []
        self.notifies_disconnect = False        # ROUTER_NOTIFY took (libzmq with drafts)
        self._ipc_files: list[str] = []
        try:
            for url in self.urls:
                self._bind(ctx, url)
        except BaseException:
            self.close()
            raise

    def _bind(self, ctx: zmq.Context, url: str) -> None:
        path = ipc_path(url)
        if path:
            _claim_ipc_path(path)
        sock = ctx.socket(zmq.ROUTER)
        self.sockets.append(sock)               # closed by close() whatever fails below
        sock.setsockopt(zmq.LINGER, 1000)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 0)   # a vanished client must not raise
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.SNDHWM, 0)
        try:
            # an empty message tells us a client went away: its session is released
            # at once. It is a draft option in libzmq builds without drafts; the
            # client lease covers those.
            sock.setsockopt(zmq.ROUTER_NOTIFY, zmq.NOTIFY_DISCONNECT)
            self.notifies_disconnect = True
        except (zmq.ZMQError, AttributeError):
            pass
        try:
            sock.bind(url)
        except zmq.ZMQError as exc:
            raise AddressInUse(f"cannot listen on {url}: {exc}") from None
        if path:
            os.chmod(path, 0o660)
            self._ipc_files.append(path)

    def send(self, sock: zmq.Socket, identity: bytes, header: dict, frames: Sequence[Any] = ()) -> None:
        sock.send_multipart([identity, messages.pack(header), *frames], copy=True)

    def close(self) -> None:
        for sock in self.sockets:
            sock.close(linger=1000)
        self.sockets.clear()
        for path in self._ipc_files:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        self._ipc_files.clear()
