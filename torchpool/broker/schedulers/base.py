"""The one interface the broker's loop uses to schedule a model version.

Each policy is its own implementation: `DirectScheduler` (no batching: one
request per execution, in arrival order), `DynamicBatcher` (Triton's dynamic
batcher) and `SequenceBatcher` (Triton's sequence batcher, `direct` and
`oldest`). The loop never asks which one it holds:

    accept:   scheduler.admit(req, call)         policy checks, may refuse
              scheduler.push(req, now)           queued (the scheduler stages it)
    dispatch: scheduler.take(instance, now)      the Batch an idle instance runs now
              scheduler.take_ahead(instance, now)   one to send a busy instance,
                                                  to run when it finishes (or None)
              scheduler.prepare(now)             write the next batch while busy
              scheduler.put_back(batch)          one sent ahead that never ran
    finish:   scheduler.finished(batch, outputs, read)   before its answers go out
    timers:   scheduler.next_deadline() / expire(now)    timeouts, idle sequences,
                                                  and requests it refuses later
    stop:     scheduler.drain()                  every request not yet started

For testing, a batching scheduler honours Triton's test switches
(`SchedulerHold`): TRITONSERVER_DELAY_SCHEDULER and
TRITONSERVER_BACKLOG_DELAY_SCHEDULER in the daemon's environment.
"""
from __future__ import annotations

import os
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Mapping, Optional, Sequence

from ...protocol.errors import TorchpoolError

if TYPE_CHECKING:
    from ...rules.request import InferCall
    from ...config import ModelConfig
    from ..batch import Batch, OutputEntry, SegmentRef
    from ..lane import ReplySocket
    from ..requests import InferRequest
    from ..supervisor import WorkerHandle

# read(segment, offset, nbytes) -> memoryview of a worker output's bytes
ReadOutput = Callable[["SegmentRef", int, int], memoryview]
# requests the scheduler gives up on, each with the error its client gets
Refusals = list[tuple["InferRequest", TorchpoolError]]

DELAY_SCHEDULER = "TRITONSERVER_DELAY_SCHEDULER"
BACKLOG_DELAY_SCHEDULER = "TRITONSERVER_BACKLOG_DELAY_SCHEDULER"


def _atoi(text: Optional[str]) -> int:
    """C's atoi, as Triton reads the switches: the leading integer, else 0."""
    m = re.match(r"\s*([+-]?\d+)", text or "")
    return int(m.group(1)) if m else 0


@dataclass
class SchedulerHold:
    """Triton's switches for testing its schedulers, which its QA's test.sh sets
    so that requests collect before the first batch whatever the timing of
    their arrival: with TRITONSERVER_DELAY_SCHEDULER=N a batching scheduler
    forms no batch until N requests are queued for its instances (the sequence
    batcher: in its slots; TRITONSERVER_BACKLOG_DELAY_SCHEDULER=M adds "and M
    requests wait in its backlog"); from then on it schedules as usual, for
    good. For testing only, as in Triton: a held scheduler answers nothing."""
    queued: int = 0
    backlog: int = 0

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] = os.environ) -> "SchedulerHold":
        return cls(_atoi(environ.get(DELAY_SCHEDULER)), _atoi(environ.get(BACKLOG_DELAY_SCHEDULER)))

    def holding(self, queued: int, backlog: Optional[int] = None) -> bool:
        """Whether the scheduler still waits, with `queued` requests for its
        instances and `backlog` in its backlog (a scheduler without one, the
        dynamic batcher, passes None; the backlog counts only while
        TRITONSERVER_DELAY_SCHEDULER holds, as in Triton)."""
        if self.queued <= 0:
            return False
        if queued < self.queued or (backlog is not None and backlog < self.backlog):
            return True
        self.queued = 0
        return False


class Scheduler(ABC):
    """Decides which accepted requests of one model version run together, on
    which instance, and when. Owns every request from `push` until it hands
    it out in a Batch (or back from `expire` / `drain`)."""

    config: "ModelConfig"
    # outputs the worker must return beyond what the client asked for, never
    # sent to the client (a sequence's implicit state)
    hidden_outputs: frozenset[str] = frozenset()

    @abstractmethod
    def admit(self, req: "InferRequest", call: "InferCall") -> None:
        """Checks only this policy makes (priority level, room in the queue,
        sequence flags), before the request holds anything. Raises
        TorchpoolError to refuse it at once."""

    @abstractmethod
    def push(self, req: "InferRequest", now: float) -> None:
        """Queue an accepted, validated request (`req.staged` holds its
        inputs until the scheduler writes them where the worker reads them).
        May raise TorchpoolError (the arena is full): the request is then
        answered with it and holds nothing of the scheduler's."""

    @abstractmethod
    def take(self, instance: WorkerHandle, now: float) -> Optional["Batch"]:
        """The batch the idle `instance` (a worker handle) runs now, or None.
        A returned batch with `error` set is failed instead of run."""

    def take_ahead(self, instance: WorkerHandle, now: float) -> Optional["Batch"]:
        """The batch the busy `instance` runs right after its current one, sent
        to it now so that it never waits for the broker between two; None
        (the default) where it must wait: a batch has to be formed when an
        instance is free (batching), or bound to one (sequences)."""
        return None

    def put_back(self, batch: "Batch") -> None:
        """A batch from `take_ahead` that never ran (its instance died first):
        queued again, ahead of the rest."""
        raise NotImplementedError

    def prepare(self, now: float) -> None:
        """The instances are busy: do now what the next batch will need."""

    def finished(self, batch: "Batch", outputs: Optional[Sequence["OutputEntry"]], read: ReadOutput) -> None:
        """`batch` finished: `outputs` are the worker's output descriptors, or
        None when it failed (error, crash, timeout). Called before its answers
        are sent, while the outputs are still readable."""

    def direct_refusal(self) -> Optional[str]:
        """Why this policy keeps the model's requests in the daemon, so that
        no worker may take them on a direct path (broker/direct.py asks);
        None where a worker can apply it itself. By default the daemon
        keeps them: a policy says otherwise only where it knows so."""
        return "its requests are sequenced by the daemon"

    def instance_ready(self, instance: WorkerHandle) -> None:
        """`instance` (a worker handle) is ready to run batches: at its start
        and after each restart, before it takes any. A scheduler that places
        requests on instances before they ask (a sequence's slot) counts it
        from now, not from its first take."""

    def instance_gone(self, instance: WorkerHandle) -> Refusals:
        """An instance died or stopped: requests bound to it that can no
        longer run (a sequence's slot), to be failed."""
        return []

    def cancel(self, sock: ReplySocket, identity: bytes) -> Refusals:
        """The connection (sock, routing id) is gone: its queued requests,
        which nothing can answer, to be failed instead of run. By default
        none: a batching policy may keep them with the batch they are in."""
        return []

    def next_deadline(self) -> Optional[float]:
        """When `expire` next has something to do (time.monotonic()), or None."""
        return None

    def expire(self, now: float) -> Refusals:
        """Apply timeouts; also hands out requests refused after `push`."""
        return []

    @abstractmethod
    def drain(self) -> list["InferRequest"]:
        """Every request not yet handed out (to be failed); the scheduler is
        empty after, and holds no shared memory."""

    @abstractmethod
    def __len__(self) -> int:
        """Requests accepted and not yet handed out in a batch."""
