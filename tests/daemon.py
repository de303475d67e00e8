"""Start and stop a real torchpool daemon for end-to-end tests."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Optional

ROOT = Path(__file__).resolve().parent.parent


def wait_for(predicate: Callable[[], object], timeout: float, what: str, interval: float = 0.02) -> object:
    """Poll `predicate` until it is truthy; fail with `what` after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


class Daemon:
    """`python -m torchpool serve` in a subprocess, logging to a file."""

    def __init__(self, repository: Path, workdir: Path, *extra: str, tcp_port: Optional[int] = None) -> None:
        self.socket_path = workdir / "torchpool.sock"
        self.url = f"ipc://{self.socket_path}"
        self.urls = [self.url] + ([f"tcp://127.0.0.1:{tcp_port}"] if tcp_port else [])
        self.log_path = workdir / "daemon.log"
        args = [sys.executable, "-m", "torchpool", "serve", "--model-repository", str(repository)]
        for url in self.urls:
            args += ["--listen", url]
        self.args = args + list(extra)
        self.proc: Optional[subprocess.Popen] = None

    def start(self, wait_ready: bool = True, timeout: float = 60.0) -> "Daemon":
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.args, stdout=self._log, stderr=subprocess.STDOUT, cwd=ROOT)
        if wait_ready:
            wait_for(lambda: "torchpool ready" in self.log() or self.proc.poll() is not None,
                     timeout, "the daemon's ready line")
            assert self.proc.poll() is None, f"daemon exited early:\n{self.log()}"
        return self

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
            raise AssertionError(f"daemon did not stop within {timeout} s:\n{self.log()}")
        finally:
            self._log.close()
        return code

    def pid(self) -> int:
        return self.proc.pid


def torchpool_processes() -> list[tuple[int, str]]:
    """Processes of ours still running (daemon, fork server, workers), but not us."""
    found = []
    me = os.getpid()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            cmd = (Path("/proc") / entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            stat = (Path("/proc") / entry / "stat").read_text()
        except OSError:
            continue
        if ") Z " in stat:      # a zombie waiting for its parent is already gone
            continue
        if "torchpool" in cmd and "pytest" not in cmd:
            found.append((int(entry), cmd))
    return found


def torchpool_segments() -> list[str]:
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith("torchpool."))
