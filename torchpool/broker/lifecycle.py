"""Whether the daemon is stopping: one flag the server sets and its parts read."""
from __future__ import annotations


class Stopping:
    """Set once, when the daemon starts shutting down (SIGTERM, SIGINT,
    --exit-on-error); never cleared. The parts that refuse new work or treat a
    worker's end as expected once the daemon stops share this one object:
    `stopping()` says whether it is stopping now."""

    __slots__ = ("_stopping",)

    def __init__(self) -> None:
        self._stopping = False

    def set(self) -> None:
        self._stopping = True

    def __call__(self) -> bool:
        return self._stopping

    def __repr__(self) -> str:
        return f"Stopping({self._stopping})"
