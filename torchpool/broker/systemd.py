"""systemd integration: sd_notify(3) over $NOTIFY_SOCKET, and the watchdog.

Written against the documented datagram protocol instead of a library: it is
one sendto() of "KEY=VALUE" lines to a unix socket (an abstract one when the
path starts with '@').

What the daemon says, in order (scripts/torchpool.service is Type=notify-reload):

    STATUS=loading 0/7 model versions + EXTEND_TIMEOUT_USEC=...   loading starts
    STATUS=loading 3/7 model versions: mlp v1 READY                each version settles
    EXTEND_TIMEOUT_USEC=...        every EXTEND_EVERY s while loading: a slow load
                                   never meets TimeoutStartSec (--load-timeout bounds it)
    READY=1 + STATUS=serving ...   every startup version settled
    RELOADING=1 + MONOTONIC_USEC=  SIGHUP (systemctl reload) ... READY=1 when reloaded
    STOPPING=1                     SIGTERM
"""
from __future__ import annotations

import os
import socket
import time
from typing import Callable, Mapping, Optional

EXTEND_EVERY = 5.0              # seconds between EXTEND_TIMEOUT_USEC while models load
EXTEND_BY = 3 * EXTEND_EVERY    # each asks for this much more: two may be late before it runs out


class Notifier:
    """Sends READY=1, STATUS=..., STOPPING=1 and WATCHDOG=1 when run by systemd."""

    def __init__(self, environ: Optional[Mapping[str, str]] = None) -> None:
        env = os.environ if environ is None else environ
        self.address = env.get("NOTIFY_SOCKET") or None
        self._sock: Optional[socket.socket] = None
        if self.address:
            if self.address.startswith("@"):
                self.address = "\0" + self.address[1:]
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        self.watchdog_interval = self._watchdog_interval(env)

    @staticmethod
    def _watchdog_interval(env: Mapping[str, str]) -> Optional[float]:
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
        sock, address = self._sock, self.address
        if sock is None or address is None:      # (the socket is made only with an address)
            return
        try:
            sock.sendto("\n".join(lines).encode(), address)
        except OSError:
            pass  # systemd going away must never take the daemon down

    def ready(self, status: str) -> None:
        self.notify("READY=1", f"STATUS={status}", f"MAINPID={os.getpid()}")

    def status(self, status: str) -> None:
        self.notify(f"STATUS={status}")

    def loading(self, done: int, total: int, detail: str = "") -> None:
        """Startup progress: how many of the model versions have settled, and the last one."""
        self.status(f"loading {done}/{total} model versions" + (f": {detail}" if detail else ""))

    def extend_timeout(self, seconds: float = EXTEND_BY) -> None:
        """More time for the start (or reload) in progress, counted from now."""
        self.notify(f"EXTEND_TIMEOUT_USEC={int(seconds * 1e6)}")

    def reloading(self, status: str) -> None:
        """A reload starts; systemd waits for the next READY=1. MONOTONIC_USEC
        (CLOCK_MONOTONIC, as time.monotonic reads it on Linux) tells it this
        RELOADING=1 answers the reload it asked for (systemd >= 253 needs it)."""
        self.notify("RELOADING=1", f"MONOTONIC_USEC={time.monotonic_ns() // 1000}", f"STATUS={status}")

    def stopping(self) -> None:
        self.notify("STOPPING=1", "STATUS=shutting down")

    def watchdog(self) -> None:
        self.notify("WATCHDOG=1")

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


class ServiceStatus:
    """What systemd hears of the daemon's life. The server says what happens
    (loading starts, a version settles, ready, a reload starts or settles,
    stopping); this decides what to send and keeps the two timers: the
    watchdog, and EXTEND_TIMEOUT_USEC while a start or reload loads models,
    so TimeoutStartSec= need not cover the slowest load (--load-timeout does).
    Without $NOTIFY_SOCKET every call is a no-op and no timer runs."""

    def __init__(self, notifier: Notifier, call_later: Callable[[float, Callable[[], None]], object]) -> None:
        self.notifier = notifier
        self.call_later = call_later
        self.starting = True          # until the start's READY=1
        self.reloading = False        # RELOADING=1 sent, its READY=1 not yet
        self.stopping = False
        self._extending = False       # the EXTEND_TIMEOUT_USEC timer runs

    def loading_started(self, total: int) -> None:
        self.notifier.loading(0, total)
        self._keep_extending()
        if self.notifier.enabled and self.notifier.watchdog_interval:
            self._watchdog()

    def version_settled(self, done: int, total: int, detail: str) -> None:
        if self.starting:
            self.notifier.loading(done, total, detail)

    def ready(self, status: str) -> None:
        self.starting = False
        self.notifier.ready(status)

    def reload_started(self, status: str, loads: bool) -> None:
        """RELOADING=1, unless the start's READY=1 is still to come (it covers the reload too)."""
        if self.starting or self.stopping:
            return
        self.reloading = True
        self.notifier.reloading(status)
        if loads:
            self._keep_extending()

    def reload_settled(self, status: str) -> None:
        if self.reloading:
            self.reloading = False
            self.notifier.ready(status)

    def stop(self) -> None:
        if not self.stopping:
            self.stopping = True
            self.notifier.stopping()

    def close(self) -> None:
        self.notifier.close()

    def _loading(self) -> bool:
        return (self.starting or self.reloading) and not self.stopping

    def _keep_extending(self) -> None:
        """An extension now (a reload's timeout counts from its start), then
        every EXTEND_EVERY s while loading; one timer whatever the phases."""
        if not self.notifier.enabled:
            return
        self.notifier.extend_timeout()
        if not self._extending:
            self._extending = True
            self.call_later(EXTEND_EVERY, self._extend)

    def _extend(self) -> None:
        if self._loading():
            self.notifier.extend_timeout()
            self.call_later(EXTEND_EVERY, self._extend)
        else:
            self._extending = False

    def _watchdog(self) -> None:
        """WATCHDOG=1 from the main loop's timers: a stuck loop stops the pings."""
        interval = self.notifier.watchdog_interval
        if self.notifier.enabled and interval:   # (loading_started starts it only with one)
            self.notifier.watchdog()
            self.call_later(interval, self._watchdog)
