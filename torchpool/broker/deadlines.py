"""The schedulers' deadlines, as the broker's loop sees them.

A scheduler may have a deadline (a queued request's timeout, a batch's
queue delay, an idle sequence): the loop must wake for the earliest and then
let the scheduler expire what is due. The loop runs twice per request, so
it does not scan every version of every model: `SchedulerDeadlines` keeps
the versions whose scheduler may have one. A scheduler only gains a deadline
through push / finished / expire, each followed by a dispatch, which calls
`touch`; a version leaves the set once its scheduler has none.
"""
from __future__ import annotations

from typing import Optional

from .registry import ModelVersion


class SchedulerDeadlines:
    def __init__(self) -> None:
        self._timed: set[ModelVersion] = set()

    def touch(self, mv: ModelVersion) -> None:
        """`mv`'s scheduler was just used: it may have a deadline now."""
        self._timed.add(mv)

    def earliest(self) -> Optional[float]:
        """The earliest deadline of any scheduler (time.monotonic()), or None."""
        return min((when for _, when in self._deadlines()), default=None)

    def due(self, now: float) -> list[ModelVersion]:
        """The versions whose scheduler has a deadline at or before `now`."""
        return [mv for mv, when in self._deadlines() if when <= now]

    def _deadlines(self) -> list[tuple[ModelVersion, float]]:
        """(version, its scheduler's next deadline); a version without one leaves the set."""
        timed = self._timed
        if not timed:
            return []
        found = []
        for mv in list(timed):
            when = mv.scheduler.next_deadline() if mv.scheduler is not None else None
            if when is None:
                timed.discard(mv)
            else:
                found.append((mv, when))
        return found


__all__ = ["SchedulerDeadlines"]
