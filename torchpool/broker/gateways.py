"""The HTTP/gRPC gateway as the daemon's child process.

The gateway (torchpool/gateway) is a client of this daemon, not part of it:
its own process, with its own GIL, so parsing HTTP and protobuf never delays
the broker's loop. The daemon starts it once its own sockets are bound,
waits for its one status line (so a busy port fails `torchpool serve` with a
one-line error, exit status 2), restarts it if it dies, and stops it on
shutdown. The gateway exits by itself if the daemon is killed (PDEATHSIG).
"""
from __future__ import annotations

import logging
import os
import select
import signal
import subprocess
import sys
import time
from typing import Optional

from .options import ServerOptions

log = logging.getLogger("torchpool.broker")

START_TIMEOUT = 30.0       # importing grpc and binding two ports takes well under a second
STOP_TIMEOUT = 5.0
RESTART_DELAYS = (0.5, 1.0, 2.0, 5.0, 10.0)   # after crashes in a row; a run of 60 s resets it
STABLE_AFTER = 60.0


class GatewayError(Exception):
    """The gateway could not start (its own one-line reason)."""


def gateway_url(listen: list[str]) -> str:
    """The daemon address the gateway connects to: an ipc:// one if any
    (cheapest, and never subject to CURVE), else the first tcp:// one."""
    for url in listen:
        if url.startswith("ipc://"):
            return url
    return listen[0]


class GatewayProcess:
    def __init__(self, options: ServerOptions, log_level: str) -> None:
        self.options = options
        self.log_level = log_level
        self.url = gateway_url(options.listen)
        self.proc: Optional[subprocess.Popen[bytes]] = None
        self.ports: dict[str, int] = {}
        self._crashes = 0
        self._started_at = 0.0
        self._restart_at: Optional[float] = None

    def _command(self, status_fd: int) -> list[str]:
        o = self.options
        cmd = [sys.executable, "-m", "torchpool.gateway", "--url", self.url,
               "--log-level", self.log_level, "--log-format", o.log_format,
               "--status-fd", str(status_fd), "--parent-pid", str(os.getpid())]
        # a restart keeps the ports the first start got (port 0 = any)
        if o.http_port is not None:
            cmd += ["--http-port", str(self.ports.get("http", o.http_port)), "--http-host", o.http_host]
        if o.grpc_port is not None:
            cmd += ["--grpc-port", str(self.ports.get("grpc", o.grpc_port)), "--grpc-host", o.grpc_host]
        cmd += ["--http-max-input-size", str(o.http_max_input_size),
                "--grpc-max-input-size", str(o.grpc_max_input_size),
                f"--allow-client-shm={str(o.allow_client_shm).lower()}",
                "--gateway-max-in-flight-per-caller", str(o.gateway_max_in_flight_per_caller),
                "--http-max-connections", str(o.http_max_connections),
                "--grpc-max-connections", str(o.grpc_max_connections),
                "--grpc-max-streams-per-peer", str(o.grpc_max_streams_per_peer)]
        for prefix in o.allow_client_shm_prefixes:
            cmd += ["--allow-client-shm-prefix", prefix]
        return cmd

    def start(self) -> None:
        """Start it and wait for its ports; GatewayError if it cannot serve them."""
        r, w = os.pipe()
        try:
            self.proc = subprocess.Popen(self._command(w), pass_fds=(w,), stdin=subprocess.DEVNULL)
        finally:
            os.close(w)
        try:
            line = _read_line(r, START_TIMEOUT)
        finally:
            os.close(r)
        if line.startswith("ready "):
            import json
            self.ports = json.loads(line[len("ready "):])
            self._started_at = time.monotonic()
            return
        if not line:
            self.proc.kill()           # silent for START_TIMEOUT, or exited without a word
        self._reap()
        raise GatewayError(line[len("error "):] if line.startswith("error ") else
                           "the HTTP/gRPC gateway did not start (its log is above)")

    def check(self) -> None:
        """Called now and then from the broker's loop: restart a dead gateway
        (after a delay that grows while it keeps dying)."""
        now = time.monotonic()
        if self._restart_at is not None:
            if now >= self._restart_at:
                self._restart_at = None
                try:
                    self.start()
                    log.info("gateway restarted (ports %s)", self.ports)
                except GatewayError as exc:
                    log.error("gateway restart failed: %s", exc)
                    self._schedule_restart(now)
            return
        if self.proc is None or self.proc.poll() is None:
            return
        code = self.proc.returncode
        self.proc = None
        if now - self._started_at >= STABLE_AFTER:
            self._crashes = 0
        log.error("the HTTP/gRPC gateway exited (%s); restarting it",
                  f"signal {-code}" if code < 0 else f"status {code}")
        self._schedule_restart(now)

    def _schedule_restart(self, now: float) -> None:
        self._restart_at = now + RESTART_DELAYS[min(self._crashes, len(RESTART_DELAYS) - 1)]
        self._crashes += 1

    def begin_stop(self) -> None:
        """Shutdown starts: the gateway stops taking requests and finishes
        those in flight while the broker drains them."""
        self._restart_at = None
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def stop(self) -> None:
        self.begin_stop()
        self._reap()

    def _reap(self) -> None:
        if self.proc is None:
            return
        try:
            self.proc.wait(STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None


def _read_line(fd: int, timeout: float) -> str:
    """The status line, or "" if the writer closed or the time ran out."""
    deadline = time.monotonic() + timeout
    data = b""
    while b"\n" not in data:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return ""
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        data += chunk
    return data.split(b"\n", 1)[0].decode(errors="replace")
