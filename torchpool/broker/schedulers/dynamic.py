"""Dynamic batching: Triton's dynamic batcher for one model version.

A version whose config has `dynamic_batching { }` is scheduled by a
`DynamicBatcher`. Requests wait in one FIFO per priority level; a batch is formed by Triton's rules:

    scan the queues in priority order (level 1 first; within a level, the
    requests that timed out with DELAY come after the others) and form the
    batch from them by the rules of rules/batching.py (Triton's
    GetDynamicBatch: the same inputs with the same shapes beyond the batch
    dimension, sent at the largest preferred size reached, or when the batch
    cannot grow; once the oldest request has waited
    max_queue_delay_microseconds, everything that fits in max_batch_size).

For testing, as in Triton, TRITONSERVER_DELAY_SCHEDULER=N in the daemon's
environment holds the batcher until N requests are queued (base.py).

Queue policies per priority level: `max_queue_size` (a request beyond it is
rejected at once), `default_timeout_microseconds` (a request's own shorter
`timeout_us` overrides it when `allow_timeout_override`), `timeout_action`
REJECT (answered "Request timeout expired") or DELAY (moved behind the
level's other requests, never rejected).

Staging (double buffering): the batch the batcher would send next is kept
*forming* while the instances are busy. Each request is written once, as it
arrives, into one contiguous block per input in the broker's arena; when an
instance frees up the batch goes out as it is (the worker views each block as
the batch tensor, zero copy). The forming batch is only a cache of that
copying work: if the next batch changes (a timeout, a higher priority
request), the rows that are still right are kept and the rest rewritten.
A batch of one request whose inputs are already in shared memory (a local
client's arena or a registered region) is not copied at all.

`batch_input` tensors are computed per batch (broker/batch.py); the answer
path splits the outputs back per request and, with `preserve_ordering`,
answers batches in the order they were sent.
"""
from __future__ import annotations

import heapq
import itertools
from collections import Counter, deque
from typing import TYPE_CHECKING, Iterator, Optional

from ...config import ModelConfig
from ...protocol import errors
from ...rules.batching import batch_limits, select_batch
from ...protocol.errors import TorchpoolError
from ...shm.arena import Arena, ArenaFull
from ..batch import Batch, stage_batch_inputs
from ..requests import InferRequest
from ...rules.validation import TIMEOUT, WorkerOutput
from .base import Refusals, Scheduler, SchedulerHold
from .forming import FormingBatch

if TYPE_CHECKING:
    from ...rules.request import InferCall
    from ..supervisor import WorkerHandle


class DynamicBatcher(Scheduler):
    """Priority queues, queue policies and batch forming for one model version."""

    def __init__(self, cfg: ModelConfig, arena: Arena, transfer: Optional[Counter[str]] = None,
                 hold: Optional[SchedulerHold] = None) -> None:
        db = cfg.dynamic_batching or {}
        self.cfg = self.config = cfg
        self.arena = arena
        self.transfer = transfer if transfer is not None else {}
        self.limits = batch_limits(cfg)
        self.hold = hold or SchedulerHold()
        self.levels = max(1, db.get("priority_levels", 0))
        self.default_level = max(1, db.get("default_priority_level", 0) or 1)
        default_policy = db.get("default_queue_policy") or {}
        overrides = db.get("priority_queue_policy") or {}
        # (by level as a string: normalize.py's keys, pbtxt's and JSON's alike)
        self.policies = [overrides.get(str(level), default_policy) for level in range(1, self.levels + 1)]
        self.main: list[deque[InferRequest]] = [deque() for _ in range(self.levels)]
        self.delayed: list[deque[InferRequest]] = [deque() for _ in range(self.levels)]
        self.count = 0
        self._deadlines: list[tuple[float, int, InferRequest]] = []
        self._arrivals = itertools.count()
        self.forming: Optional[FormingBatch] = None
        self._changed = False
        self.wake_at: Optional[float] = None      # the batch waiting for more requests is due then

    def __len__(self) -> int:
        return self.count

    def drain(self) -> list[InferRequest]:
        out = list(self._ordered())
        for q in (*self.main, *self.delayed):
            for req in q:
                req.queued = False
            q.clear()
        self.count = 0
        self._deadlines.clear()
        self.wake_at = None
        if self.forming is not None:
            self.forming.free()
            self.forming = None
        return out

    # --- admission --------------------------------------------------------------

    def direct_refusal(self) -> Optional[str]:
        """A worker forms batches of its direct requests by the same rules
        (rules/batching.py), but not what needs the whole queue."""
        db = self.cfg.dynamic_batching or {}
        policies = [db.get("default_queue_policy") or {}, *(db.get("priority_queue_policy") or {}).values()]
        if db.get("priority_levels", 0) > 1 or any(
                p.get("default_timeout_microseconds") or p.get("max_queue_size") or p.get("allow_timeout_override")
                for p in policies):
            return "the daemon orders its queue (priority levels, queue timeouts or sizes)"
        if any(spec.allow_ragged_batch for spec in self.cfg.inputs):
            return "the daemon batches its ragged inputs"
        if self.hold.queued:
            return "the daemon holds its batcher (TRITONSERVER_DELAY_SCHEDULER, a switch for testing)"
        return None

    def admit(self, req: InferRequest, call: InferCall) -> None:
        req.level = self.level_of(call.priority)
        self.check_room(req)

    def level_of(self, priority: object) -> int:
        """The request's priority level (1 = highest). 0, absent or above
        priority_levels mean default_priority_level, as in Triton."""
        if priority is None:
            return self.default_level
        if not isinstance(priority, int) or isinstance(priority, bool) or priority < 0:
            raise TorchpoolError(errors.INVALID_ARG,
                                 f"request for model '{self.cfg.name}' has an invalid priority "
                                 f"{priority!r}: expected a non-negative integer")
        if priority == 0 or priority > self.levels:
            return self.default_level
        return priority

    def check_room(self, req: InferRequest) -> None:
        """Reject at once when the request's priority level is full."""
        policy = self.policies[req.level - 1]
        limit = policy.get("max_queue_size", 0)
        level = req.level - 1
        if limit and len(self.main[level]) + len(self.delayed[level]) >= limit:
            where = f" at priority level {req.level}" if self.levels > 1 else ""
            raise TorchpoolError(errors.UNAVAILABLE,
                                 f"Exceeds maximum queue size: model '{self.cfg.name}' already has "
                                 f"{limit} requests queued{where} (max_queue_size {limit}); retry later")

    def push(self, req: InferRequest, now: float) -> None:
        policy = self.policies[req.level - 1]
        timeout_us = policy.get("default_timeout_microseconds", 0)
        if policy.get("allow_timeout_override") and req.timeout_us > 0 \
                and (timeout_us == 0 or req.timeout_us < timeout_us):
            timeout_us = req.timeout_us      # a request may shorten its timeout, never extend it
        req.enqueued = now
        req.deadline = now + timeout_us / 1e6 if timeout_us else None
        req.queued = True
        req.delayed = False
        req.arrival = next(self._arrivals)
        self.main[req.level - 1].append(req)
        self.count += 1
        if req.deadline is not None:
            heapq.heappush(self._deadlines, (req.deadline, req.arrival, req))
        f = self.forming
        if (not self._changed and f is not None and f.requests and len(f.requests) == self.count - 1
                and self.levels == 1 and not self.delayed[0] and req.key == f.key
                and f.items + req.batch_size <= self.limits.max_preferred):
            # the common case: the forming batch holds the whole queue and the
            # newcomer fits behind it; write it now (no rescan)
            before = f.copied
            try:
                f.append(req)
            except ArenaFull:
                self._changed = True
            self._count("input_bytes_copied", f.copied - before)
            return
        self._changed = True

    # --- timeouts -----------------------------------------------------------------

    def next_deadline(self) -> Optional[float]:
        heap = self._deadlines
        while heap and (not heap[0][2].queued or heap[0][2].deadline is None):
            heapq.heappop(heap)
        due = heap[0][0] if heap else None
        if self.wake_at is not None and (due is None or self.wake_at < due):
            return self.wake_at
        return due

    def expire(self, now: float) -> Refusals:
        """Apply the queue policies to requests past their timeout: DELAY moves
        them behind their level's other requests; REJECT returns them (the
        caller answers them). A waiting batch that fell due is taken by the
        next `take`."""
        if self.wake_at is not None and self.wake_at <= now:
            self.wake_at = None
        rejected = []
        heap = self._deadlines
        while heap and heap[0][0] <= now:
            _, _, req = heapq.heappop(heap)
            if not req.queued or req.deadline is None:
                continue
            level = req.level - 1
            self.main[level].remove(req)
            req.deadline = None
            if self.policies[level].get("timeout_action") == "DELAY":
                req.delayed = True
                self.delayed[level].append(req)
            else:
                req.queued = False
                self.count -= 1
                rejected.append((req, TorchpoolError(errors.UNAVAILABLE, TIMEOUT)))
            self._changed = True
        return rejected

    # --- forming batches ------------------------------------------------------------

    def _ordered(self) -> Iterator[InferRequest]:
        for level in range(self.levels):
            yield from self.main[level]
            yield from self.delayed[level]

    def _select(self, now: float) -> tuple[list[InferRequest], bool, Optional[float]]:
        """The requests of the next batch, whether it should go now, and else
        when it should go at the latest."""
        return select_batch(self._ordered(), self.limits, now)

    def _sync(self, reqs: list[InferRequest]) -> None:
        """Make the forming batch hold exactly `reqs`, keeping what is right."""
        f = self.forming
        if not reqs:
            if f is not None:
                f.truncate(0)
            return
        if f is None or f.key != reqs[0].key:
            if f is not None:
                f.free()
            f = self.forming = FormingBatch(self.arena, reqs[0].key, self.limits.max_preferred)
        same = 0
        for a, b in zip(f.requests, reqs):
            if a is not b:
                break
            same += 1
        f.truncate(same)
        before = f.copied
        try:
            for req in reqs[same:]:
                f.append(req)
        finally:
            self._count("input_bytes_copied", f.copied - before)

    def _count(self, key: str, n: int) -> None:
        if n:
            self.transfer[key] = self.transfer.get(key, 0) + n

    def prepare(self, now: float) -> None:
        """Write the requests of the batch that goes out next, now (the
        instances are busy, or it waits for more requests)."""
        if not self._changed:
            return
        self._changed = False
        reqs, _ready, _wake = self._select(now)
        try:
            self._sync(reqs)
        except ArenaFull:
            pass                 # the batch is written when it goes out (or fails then)

    def take(self, instance: WorkerHandle, now: float) -> Optional[Batch]:
        """The batch to run now; None while it waits for more requests (until
        `next_deadline`, or while the test switch holds it)."""
        if self.hold.holding(queued=self.count):
            return None
        reqs, ready, wake = self._select(now)
        if not ready:
            self.wake_at = wake
            if self._changed:
                self._changed = False
                try:
                    self._sync(reqs)
                except ArenaFull:
                    pass
            return None
        self.wake_at = None
        for req in reqs:
            q = self.delayed[req.level - 1] if req.delayed else self.main[req.level - 1]
            if q and q[0] is req:
                q.popleft()
            else:
                q.remove(req)
            req.queued = False
        self.count -= len(reqs)
        self._changed = True
        items = sum(r.batch_size for r in reqs)
        rows = sum(r.rows for r in reqs)
        try:
            self._sync(reqs)
            f, self.forming = self.forming, None
            assert f is not None      # ready: the rules sent a batch, so `reqs` is not empty and _sync formed it
            inputs, blocks, passed = f.finish(self.cfg)
            self._count("input_bytes_in_place", passed)
        except ArenaFull as exc:
            if self.forming is not None:
                self.forming.free()
                self.forming = None
            err = TorchpoolError(errors.UNAVAILABLE, f"model '{self.cfg.name}': {exc}; retry later "
                                                     f"or raise --shm-limit")
            return Batch(reqs, items, rows, [], [], error=err)
        batch = Batch(reqs, items, rows, inputs, self._outputs(reqs), blocks)
        if self.cfg.batch_inputs:
            try:
                extra, extra_blocks = stage_batch_inputs(self.cfg, reqs, self.arena)
            except ArenaFull as exc:
                for block in blocks:
                    self.arena.free(block)
                batch.blocks = []
                batch.error = TorchpoolError(errors.UNAVAILABLE, f"model '{self.cfg.name}': {exc}")
                return batch
            batch.inputs.extend(extra)
            batch.blocks.extend(extra_blocks)
        for req in reqs:
            req.staged = []          # the inputs are in the batch now
        return batch

    def _outputs(self, reqs: list[InferRequest]) -> list[WorkerOutput]:
        if len(reqs) == 1:
            return reqs[0].outputs
        wanted = {o if isinstance(o, str) else o[0] for r in reqs for o in r.outputs}
        return [t.name for t in self.cfg.outputs if t.name in wanted]
