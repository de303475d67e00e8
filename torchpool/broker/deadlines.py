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
        due = None
        for mv in self._with_deadlines():
            when = mv.scheduler.next_deadline()
            if due is None or when < due:
                due = when
        return due

    def due(self, now: float) -> list[ModelVersion]:
        """The versions whose scheduler has a deadline at or before `now`."""
        if not self._timed:
            return []
        return [mv for mv in self._with_deadlines() if mv.scheduler.next_deadline() <= now]

    def _with_deadlines(self) -> list[ModelVersion]:
        timed = self._timed
        if not timed:
            return []
        found = []
        for mv in list(timed):
            scheduler = mv.scheduler
            if scheduler is None or scheduler.next_deadline() is None:
                timed.discard(mv)
            else:
                found.append(mv)
        return found


__all__ = ["SchedulerDeadlines"]
