"""Start and stop a real torchpool daemon for end-to-end tests."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Optional

ROOT = Path(__file__).resolve().parents[2]


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

    def __init__(self, repository: Path, workdir: Path, *extra: str, tcp_port: Optional[int] = None,
                 env: Optional[dict] = None) -> None:
        self.env = None if env is None else {**os.environ, **env}
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
        # log() shows this run only: a daemon restarted in the same workdir
        # must not be taken as ready by its predecessor's ready line
        self._log_offset = self._log.tell()
        self.proc = subprocess.Popen(self.args, stdout=self._log, stderr=subprocess.STDOUT, cwd=ROOT,
                                     env=self.env)
        if wait_ready:
            wait_for(lambda: "torchpool ready" in self.log() or self.proc.poll() is not None,
                     timeout, "the daemon's ready line")
            assert self.proc.poll() is None, f"daemon exited early:\n{self.log()}"
        return self

    def log(self) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(getattr(self, "_log_offset", 0))
                return f.read().decode(errors="replace")
        except FileNotFoundError:
            return ""

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0, leaves_nothing: bool = True) -> int:
        """Signal the daemon and wait for it; its exit status. With
        `leaves_nothing`, every process it had (gateway, fork server,
        resource tracker, workers, helpers) must be gone by the time it has
        exited cleanly: it reaps them itself, so this is no guess about
        timing."""
        if self.proc is None:
            return 0
        children = [(pid, started_at(pid)) for pid in descendants(self.proc.pid)] \
            if self.proc.poll() is None else []
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
            raise AssertionError(f"daemon did not stop within {timeout} s:\n{self.log()}") from None
        finally:
            self._log.close()
        if leaves_nothing and code == 0:            # a clean stop, not a kill
            left = [(pid, cmdline(pid)) for pid, start in children
                    if start is not None and started_at(pid) == start]
            assert not left, f"the daemon exited leaving processes behind: {left}"
        return code

    def pid(self) -> int:
        return self.proc.pid


# Every process this test session starts inherits this marker in its
# environment (forked workers too), so the session's leak checks count only
# its own processes and not a daemon someone runs beside it (scripts/run).
SESSION_MARKER = "TORCHPOOL_TEST_SESSION"
os.environ.setdefault(SESSION_MARKER, f"{os.getpid()}.{time.time_ns()}")


def of_this_session(pid: int) -> bool:
    """True if `pid` was started by this test session (its environment says so)."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return False
    return f"{SESSION_MARKER}={os.environ[SESSION_MARKER]}".encode() in environ.split(b"\0")


def torchpool_processes(ours_only: bool = False) -> list[tuple[int, str]]:
    """Processes of torchpool still running (daemon, fork server, workers), but
    not us; only this test session's with `ours_only`."""
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
        if "torchpool" in cmd and "pytest" not in cmd and (not ours_only or of_this_session(int(entry))):
            found.append((int(entry), cmd))
    return found


def torchpool_segments() -> list[str]:
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith("torchpool."))


# --- helpers for end-to-end tests ------------------------------------------------

def started_at(pid: int) -> Optional[int]:
    """When process `pid` started (clock ticks since boot), or None when it
    has exited (a zombie has): with the pid, names one process, not a later
    one that took its number."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()
    return None if fields[0] == "Z" else int(fields[19])


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def descendants(pid: int) -> list[int]:
    """Every live descendant of `pid` (fork server, resource tracker, workers)."""
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for task in tasks:
            try:
                children = Path(f"/proc/{parent}/task/{task}/children").read_text().split()
            except OSError:
                continue
            for child in map(int, children):
                if child not in found:
                    found.append(child)
                    todo.append(child)
    return found


def alive(pid: int) -> bool:
    """True while `pid` runs (a zombie counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def cpu_ticks(pid: int) -> int:
    """utime + stime of `pid` in clock ticks (grows only while it computes)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def daemon_segments(urls: list[str]) -> list[str]:
    """/dev/shm segments of the daemon(s) listening on `urls` (any pid)."""
    from torchpool.shm import daemon_id

    prefix = f"torchpool.{daemon_id(urls)}."
    return [n for n in torchpool_segments() if n.startswith(prefix)]


def memfds(pid: int) -> dict[str, int]:
    """The daemon memory (sealed memfds) process `pid` holds open: name -> size.
    The daemon's segments have no name in /dev/shm; this is how a test sees them."""
    found = {}
    fd_dir = f"/proc/{pid}/fd"
    try:
        entries = os.listdir(fd_dir)
    except FileNotFoundError:
        return found
    for fd in entries:
        try:
            target = os.readlink(f"{fd_dir}/{fd}")
            if target.startswith("/memfd:torchpool."):
                found[target[len("/memfd:"):].removesuffix(" (deleted)")] = os.stat(f"{fd_dir}/{fd}").st_size
        except OSError:
            pass
    return found


def worker_pids(log: str, model: str) -> list[int]:
    """Pids of the workers spawned for `model`, in order, from a --log-level debug log."""
    import re

    pattern = re.compile(r"spawned worker \d+ \(pid (\d+)\) for model '" + re.escape(model) + "' ")
    return [int(m.group(1)) for m in pattern.finditer(log)]


class RawConnection:
    """A bare DEALER socket speaking docs/protocol.md by hand (zmq + msgpack)."""

    def __init__(self, url: str) -> None:
        import zmq

        self._zmq = zmq
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(url)

    @staticmethod
    def pack(obj: object) -> bytes:
        import msgpack

        return msgpack.packb(obj, use_bin_type=True)

    def send(self, *frames: bytes) -> None:
        self.sock.send_multipart(list(frames))

    def recv(self, timeout: float = 10.0) -> tuple[dict, list[bytes]]:
        import msgpack

        if not self.sock.poll(int(timeout * 1000)):
            raise AssertionError(f"no answer within {timeout} s")
        reply = self.sock.recv_multipart()
        return msgpack.unpackb(reply[0], raw=False, strict_map_key=False), reply[1:]

    def call(self, *frames: bytes, timeout: float = 10.0) -> tuple[dict, list[bytes]]:
        self.send(*frames)
        return self.recv(timeout)

    def pending(self, timeout: float) -> bool:
        """True if a message arrives within `timeout` s (used to prove there is no extra one)."""
        return bool(self.sock.poll(int(timeout * 1000)))

    def close(self) -> None:
        self.sock.close(linger=0)

    def __enter__(self) -> "RawConnection":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def free_tcp_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
