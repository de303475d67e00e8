"""File descriptors over unix sockets (SCM_RIGHTS): how segments travel.

The daemon's memory has no names (segment.py), so a process that needs a
segment is handed its fd: broker <-> worker over their socket pair, broker ->
local client over the client's side channel. Every message is one datagram
of a SOCK_SEQPACKET socket; fds ride along with it, in order.
"""
from __future__ import annotations

import os
import socket
from typing import Sequence

MAX_FDS = 64          # per message; senders split larger sets


def send_with_fds(sock: socket.socket, data: bytes, fds: Sequence[int], flags: int = 0) -> None:
    """One datagram carrying `data` and duplicates of `fds` (the caller keeps its own)."""
    if fds:
        socket.send_fds(sock, [data], list(fds), flags)
    else:
        sock.send(data, flags)


def recv_with_fds(sock: socket.socket, bufsize: int, flags: int = 0) -> tuple[bytes, list[int]]:
    """One datagram and the fds that came with it (the caller owns them).
    Empty data means the peer closed the socket. Raises BlockingIOError as
    recv does under MSG_DONTWAIT."""
    # CLOEXEC: a received fd must not leak into a process we start later
    data, fds, msg_flags, _ = socket.recv_fds(sock, bufsize, MAX_FDS, flags | socket.MSG_CMSG_CLOEXEC)
    if msg_flags & socket.MSG_CTRUNC:
        close_all(fds)
        raise OSError("file descriptors were lost in transit (MSG_CTRUNC)")
    return data, fds


def close_all(fds: Sequence[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
