"""No batching: each request runs on its own, in arrival order.

A request is staged as it is accepted: inline inputs copied once into the
broker's arena, inputs already in shared memory passed by descriptor, its
`batch_input` tensors computed. An idle instance takes the oldest request
of the next connection in turn: connections are served round robin, each
in its own arrival order, so a client that floods the queue (up to its
--max-in-flight-per-client) delays its own requests, not everyone's. A
request with a timeout that has not started by then is answered "Request
timeout expired"; the queued requests of a connection found gone are
failed, not run (nothing could answer them).

A busy instance is sent the next request ahead (`take_ahead`), so that it
starts it the moment it finishes the one it runs, without waiting for the
broker's turn: under load the worker and the broker then work at the same
time. A request with a deadline is never sent ahead (its timeout applies
until it starts, and only the queue can keep that promise).
"""
from __future__ import annotations

import heapq
import itertools
from collections import Counter, deque
from typing import TYPE_CHECKING, Optional

from ...config import ModelConfig
from ...protocol import errors
from ...protocol.errors import TorchpoolError
from ...shm.arena import Arena, ArenaFull
from ..batch import Batch, stage_batch_inputs
from ..requests import InferRequest, stage_inputs
from ...rules.validation import TIMEOUT
from .base import Refusals, Scheduler

if TYPE_CHECKING:
    from ...rules.request import InferCall
    from ..lane import ReplySocket
    from ..supervisor import WorkerHandle


class DirectScheduler(Scheduler):
    def __init__(self, config: ModelConfig, arena: Arena, transfer: Counter[str]) -> None:
        self.config = config
        self.arena = arena
        self.transfer = transfer
        # one queue per connection, in turn order: a dict keeps insertion order,
        # and a connection served goes to the back by being deleted and re-added
        self.queues: dict[bytes, deque[InferRequest]] = {}
        self._count = 0
        self._deadlines: list[tuple[float, int, InferRequest]] = []
        self._order = itertools.count()

    def __len__(self) -> int:
        return self._count

    def admit(self, req: InferRequest, call: InferCall) -> None:
        pass

    def direct_refusal(self) -> Optional[str]:
        return None                 # one request at a time, in turn: a worker does the same

    def push(self, req: InferRequest, now: float) -> None:
        self._stage(req)
        if req.timeout_us > 0:
            req.deadline = now + req.timeout_us / 1e6
            heapq.heappush(self._deadlines, (req.deadline, next(self._order), req))
        req.queued = True
        queue = self.queues.get(req.identity)
        if queue is None:
            queue = self.queues[req.identity] = deque()
        queue.append(req)
        self._count += 1

    def _stage(self, req: InferRequest) -> None:
        cfg = self.config
        req.inputs, req.blocks = stage_inputs(req.staged, self.arena, cfg.name)
        for _spec, _shape, _model_shape, payload, location in req.staged:
            self.transfer["input_bytes_in_place" if location else "input_bytes_copied"] += len(payload)
        if cfg.batch_inputs:
            try:
                extra, blocks = stage_batch_inputs(cfg, [req], self.arena)
            except ArenaFull as exc:
                for block in req.blocks:
                    self.arena.free(block)
                req.blocks = []
                raise TorchpoolError(errors.UNAVAILABLE, f"model '{cfg.name}': {exc}; retry later or "
                                                         f"raise --shm-limit") from None
            req.inputs = req.inputs + extra
            req.blocks = req.blocks + blocks
        req.staged = []

    def take(self, instance: WorkerHandle, now: float) -> Optional[Batch]:
        queues = self.queues
        while queues:
            identity = next(iter(queues))
            queue = queues.pop(identity)
            req = queue.popleft()
            if queue:
                queues[identity] = queue          # its next request waits for the others' turn
            self._count -= 1
            req.queued = False
            if req.deadline is not None and now > req.deadline:
                return Batch([req], req.batch_size, req.rows, [], [], error=TorchpoolError(
                    errors.UNAVAILABLE, TIMEOUT))
            return Batch.single(req)
        return None

    def take_ahead(self, instance: WorkerHandle, now: float) -> Optional[Batch]:
        if not self.queues:
            return None
        head = self.queues[next(iter(self.queues))][0]
        return None if head.deadline is not None else self.take(instance, now)

    def put_back(self, batch: Batch) -> None:
        # (a request sent ahead has no deadline: nothing goes back on the heap)
        for req in reversed(batch.requests):
            queue = self.queues.pop(req.identity, None) or deque()
            queue.appendleft(req)
            # first in turn: it was taken before everything still queued
            self.queues = {req.identity: queue, **self.queues}
            req.queued = True
            self._count += 1

    def next_deadline(self) -> Optional[float]:
        heap = self._deadlines
        while heap and not heap[0][2].queued:
            heapq.heappop(heap)
        return heap[0][0] if heap else None

    def expire(self, now: float) -> Refusals:
        heap, late = self._deadlines, []
        while heap and heap[0][0] <= now:
            _, _, req = heapq.heappop(heap)
            if req.queued:
                req.queued = False
                late.append(req)
        if late:
            gone = set(map(id, late))
            for identity, queue in list(self.queues.items()):
                kept = deque(r for r in queue if id(r) not in gone)
                if kept:
                    self.queues[identity] = kept
                else:
                    del self.queues[identity]
            self._count -= len(late)
        return [(req, TorchpoolError(errors.UNAVAILABLE, TIMEOUT)) for req in late]

    def cancel(self, sock: ReplySocket, identity: bytes) -> Refusals:
        queue = self.queues.pop(identity, None)
        if not queue:
            return []
        gone = [r for r in queue if r.socket is sock]
        kept = deque(r for r in queue if r.socket is not sock)   # the same id on another socket
        if kept:
            self.queues[identity] = kept
        for req in gone:
            req.queued = False
        self._count -= len(gone)
        return [(req, TorchpoolError(errors.CANCELLED, "the client's connection is gone")) for req in gone]

    def drain(self) -> list[InferRequest]:
        out = [req for queue in self.queues.values() for req in queue]
        for req in out:
            req.queued = False
        self.queues.clear()
        self._count = 0
        self._deadlines.clear()
        return out
