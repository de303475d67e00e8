"""Helpers for the gateways' tests: raw requests, raw sockets, an HTTP
gateway run inside the test process (with limits a test can make small),
the gateway process of a daemon and its memory."""
from __future__ import annotations

import asyncio
import http.client
import json
import socket
import threading
import time
from pathlib import Path
from typing import Any, Optional

from .daemon import descendants


def request(port: int, method: str, path: str, body: bytes = b"", headers: Optional[dict] = None,
            timeout: float = 30.0) -> tuple[int, dict, bytes]:
    """One request on a fresh connection: (status, headers with lower-case names, body)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        conn.close()


def error_of(body: bytes) -> str:
    doc = json.loads(body)
    assert list(doc) == ["error"], doc
    return doc["error"]


def connect(port: int, timeout: float = 30.0) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


class ResponseReader:
    """Reads HTTP responses one after the other from a raw socket."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = b""

    def _fill(self) -> None:
        data = self.sock.recv(1 << 20)
        if not data:
            raise ConnectionError("closed by the server")
        self.buf += data

    def read(self) -> tuple[int, dict, bytes]:
        while b"\r\n\r\n" not in self.buf:
            self._fill()
        head, self.buf = self.buf.split(b"\r\n\r\n", 1)
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = {k.strip().lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:])}
        if status == 100:
            return self.read()
        length = int(headers.get("content-length", 0))
        while len(self.buf) < length:
            self._fill()
        body, self.buf = self.buf[:length], self.buf[length:]
        return status, headers, body


def closed_by_server(sock: socket.socket, timeout: float) -> bool:
    """True once the server closes `sock` (EOF or reset) within `timeout` s;
    whatever it sends first is read and dropped."""
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        sock.settimeout(left)
        try:
            if not sock.recv(1 << 16):
                return True
        except (ConnectionResetError, BrokenPipeError):
            return True
        except socket.timeout:
            return False


class InProcessGateway:
    """`start_http` on an event loop in a thread of this process, for a daemon
    at `url`, with `limits` (timeouts short enough for a test)."""

    def __init__(self, url: str, **limits: Any) -> None:
        from torchpool.gateway.http_server import Limits

        self.url = url
        self.limits = Limits(**limits)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.server: Any = None
        self.backend: Any = None

    def __enter__(self) -> "InProcessGateway":
        from torchpool.gateway.backend import Backend
        from torchpool.gateway.http_server import start_http

        async def start() -> None:
            self.backend = Backend(self.url)
            self.server = await start_http(self.backend, "127.0.0.1", 0, self.limits)

        self.thread.start()
        asyncio.run_coroutine_threadsafe(start(), self.loop).result(30)
        return self

    @property
    def port(self) -> int:
        return self.server.port

    def connections(self) -> int:
        return self.call(lambda: len(self.server.connections))

    def close(self) -> None:
        """The server's close (answers what it received first); once."""
        async def stop() -> None:
            await self.server.close()

        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(60)

    def call(self, fn: Any) -> Any:
        """`fn()` on the gateway's loop (to look at its connections safely)."""
        async def run() -> Any:
            return fn()
        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(10)

    def __exit__(self, *exc: object) -> None:
        async def stop() -> None:
            await self.server.close()
            await self.backend.close()

        try:
            asyncio.run_coroutine_threadsafe(stop(), self.loop).result(60)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
            self.loop.close()


# --- the gateway process of a daemon ---------------------------------------------------

def gateway_pid(daemon: Any) -> int:
    """The gateway process under the daemon (0 if none runs now)."""
    for pid in descendants(daemon.pid()):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            if b"torchpool.gateway" in cmd or b"torchpool gateway" in cmd:   # before / after its title
                return pid
        except OSError:
            continue
    return 0


def memory(pid: int, field: str = "VmRSS") -> int:
    """A process's resident memory (VmRSS) or its peak (VmHWM), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def reset_peak(pid: int) -> None:
    """Start VmHWM afresh at the current VmRSS (proc(5): clear_refs "5")."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")
