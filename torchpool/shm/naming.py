"""Segment names: `torchpool.<daemon-id>.<daemon-pid>.<tag>`.

The daemon id is derived from what identifies a daemon to its clients (its
listen addresses), so a restarted daemon recognises segments its dead
predecessor left behind, while two daemons on one host never touch each
other's. The pid tells a live daemon's segments from a dead one's.
"""
from __future__ import annotations

import hashlib
import os
import re
from typing import Iterable, Iterator

from .segment import SHM_DIR, unlink_segment

PREFIX = "torchpool."
_NAME = re.compile(r"^torchpool\.([0-9a-f]{8})\.(\d+)\.")


def daemon_id(listen_urls: Iterable[str]) -> str:
    """A short stable id for a daemon, from its sorted listen URLs."""
    key = "\n".join(sorted(listen_urls)).encode()
    return hashlib.sha1(key).hexdigest()[:8]


def segment_prefix(daemon: str, pid: int | None = None) -> str:
    return f"{PREFIX}{daemon}.{os.getpid() if pid is None else pid}."


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _segments_of(daemon: str) -> Iterator[tuple[str, int]]:
    try:
        names = os.listdir(SHM_DIR)
    except FileNotFoundError:
        return
    for name in names:
        m = _NAME.match(name)
        if m and m.group(1) == daemon:
            yield name, int(m.group(2))


def remove_stale_segments(daemon: str) -> list[str]:
    """Unlink segments of this daemon id whose owning daemon is dead."""
    removed = []
    for name, pid in _segments_of(daemon):
        if pid != os.getpid() and not _pid_alive(pid) and unlink_segment(name):
            removed.append(name)
    return removed


def remove_segments_with_prefix(prefix: str) -> list[str]:
    """Unlink every segment whose name starts with `prefix` (shutdown sweep)."""
    try:
        names = os.listdir(SHM_DIR)
    except FileNotFoundError:
        return []
    return [n for n in names if n.startswith(prefix) and unlink_segment(n)]


def boot_id() -> str:
    """This host's boot id: a client and a daemon that see the same one share
    /dev/shm (the handshake of the local shared-memory path)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""
