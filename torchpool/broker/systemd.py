"""systemd integration: sd_notify(3) over $NOTIFY_SOCKET, and the watchdog.

Written against the documented datagram protocol instead of a library: it is
one sendto() of "KEY=VALUE" lines to a unix socket (an abstract one when the
path starts with '@').
"""
from __future__ import annotations

import os
import socket
from typing import Optional


class Notifier:
    """Sends READY=1, STATUS=..., STOPPING=1 and WATCHDOG=1 when run by systemd."""

    def __init__(self, environ: Optional[dict] = None) -> None:
        env = os.environ if environ is None else environ
        self.address = env.get("NOTIFY_SOCKET") or None
        self._sock: Optional[socket.socket] = None
        if self.address:
            if self.address.startswith("@"):
                self.address = "\0" + self.address[1:]
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        self.watchdog_interval = self._watchdog_interval(env)

    @staticmethod
    def _watchdog_interval(env) -> Optional[float]:
        """Half of WATCHDOG_USEC, as sd_watchdog_enabled(3) recommends."""
        usec = env.get("WATCHDOG_USEC")
        pid = env.get("WATCHDOG_PID")
        if not usec or (pid and pid.isdigit() and int(pid) != os.getpid()):
            return None
        try:
            return int(usec) / 1e6 / 2
        except ValueError:
            return None

    @property
    def enabled(self) -> bool:
        return self._sock is not None

    def notify(self, *lines: str) -> None:
        if self._sock is None:
            return
        try:
            self._sock.sendto("\n".join(lines).encode(), self.address)
        except OSError:
            pass  # systemd going away must never take the daemon down

    def ready(self, status: str) -> None:
        self.notify("READY=1", f"STATUS={status}", f"MAINPID={os.getpid()}")

    def status(self, status: str) -> None:
        self.notify(f"STATUS={status}")

    def stopping(self) -> None:
        self.notify("STOPPING=1", "STATUS=shutting down")

    def watchdog(self) -> None:
        self.notify("WATCHDOG=1")

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
