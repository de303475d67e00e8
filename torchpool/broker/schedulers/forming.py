"""A forming batch: the next batch's inputs written contiguously, once.

While the instances are busy, a batching scheduler keeps the batch it would
send next *forming*: each request is written, as it arrives, into one
contiguous block per input in the broker's arena; when an instance frees up
the batch goes out as it is (the worker views each block as the batch
tensor, zero copy). If the next batch changes (a timeout, a higher priority
request), the rows that are still right are kept and the rest rewritten.
A batch of one request whose inputs are already in shared memory (a local
client's arena or a registered region) is not copied at all.
"""
from __future__ import annotations

import math
from typing import Optional

from ...config import ModelConfig, TensorSpec
from ...protocol.internal import InputDescriptor
from ...shm.arena import Arena, Block
from ...shm.bulkcopy import copy_into
from ..batch import Row

MiB = 1 << 20
# A forming batch reserves room for max_batch_size rows of fixed-size inputs,
# up to this much per input; beyond it the block grows when needed.
RESERVE_LIMIT = 16 * MiB


class InputBuffer:
    """One input's contiguous space in a forming batch."""

    __slots__ = ("spec", "arena", "block", "capacity", "used", "reserve")

    def __init__(self, spec: TensorSpec, arena: Arena, reserve: int) -> None:
        self.spec = spec
        self.arena = arena
        self.block: Optional[Block] = None
        self.capacity = 0
        self.used = 0
        self.reserve = reserve           # capacity to take on the first allocation

    def ensure(self, end: int) -> Block:
        """Room for bytes up to `end` (may raise ArenaFull): the block. Growing keeps
        what was written (a copy: only when a variable-size input outgrows its room)."""
        if end <= self.capacity and self.block is not None:
            return self.block
        size = max(end, self.reserve, 2 * self.capacity, 64)
        block = self.arena.alloc(size)
        if self.block is not None:
            if self.used:
                self.arena.view(block)[:self.used] = self.arena.view(self.block)[:self.used]
            self.arena.free(self.block)
        self.block, self.capacity = block, size
        return block

    def write(self, start: int, payload: memoryview) -> int:
        n = len(payload)
        if n:
            block = self.ensure(start + n)
            seg = self.arena.segments[block.segment].buf
            base = block.offset + start
            copy_into(memoryview(seg)[base:base + n], payload)
        return n

    def take(self) -> Optional[Block]:
        """Hand the block to the batch (its size set to what it holds)."""
        block, self.block, self.capacity, self.used = self.block, None, 0, 0
        return block

    def free(self) -> None:
        if self.block is not None:
            self.arena.free(self.block)
        self.block, self.capacity, self.used = None, 0, 0


class FormingBatch:
    """The batch that goes out next, being written while the instances are busy."""

    def __init__(self, arena: Arena, key: Optional[tuple[object, ...]], max_items: int) -> None:
        self.arena = arena
        self.key = key
        self.max_items = max_items
        self.requests: list[Row] = []                # requests (a sequence batch: and empty slots)
        self.marks: list[dict[str, int]] = []        # per request: input -> start offset
        self.buffers: dict[str, InputBuffer] = {}
        self.elements: list[dict[str, int]] = []     # per request: input -> element count
        self.deferred: list[tuple[str, int, memoryview]] = []   # request 0's inputs left in place
        self.items = 0
        self.copied = 0                              # bytes written (for the transfer counters)

    def _buffer(self, spec: TensorSpec, shape: list[int], nbytes: int, rows: int) -> InputBuffer:
        buf = self.buffers.get(spec.name)
        if buf is None:
            fixed = spec.datatype != "BYTES" and not spec.allow_ragged_batch and rows > 0
            reserve = min(nbytes // rows * self.max_items, RESERVE_LIMIT) if fixed else 4 * nbytes
            buf = self.buffers[spec.name] = InputBuffer(spec, self.arena, max(reserve, nbytes))
        return buf

    def append(self, req: Row) -> None:
        """Write the request's inputs after the others (may raise ArenaFull,
        leaving the batch as it was)."""
        first = not self.requests
        plan = []
        for spec, shape, _model_shape, payload, location in req.staged:
            buf = self._buffer(spec, shape, len(payload), req.rows)
            plan.append((buf, payload, first and location is not None))
        flush = len(self.requests) == 1 and self.deferred
        for buf, payload, keep in plan:          # all allocations first
            if not keep:
                buf.ensure(buf.used + len(payload))
        if flush:
            for name, start, payload in self.deferred:
                self.buffers[name].ensure(start + len(payload))
        starts, elements = {}, {}
        for (buf, payload, keep), staged in zip(plan, req.staged):
            name = buf.spec.name
            starts[name] = buf.used
            elements[name] = math.prod(staged[1])
            if keep:
                self.deferred.append((name, buf.used, payload))
            else:
                self.copied += buf.write(buf.used, payload)
            buf.used += len(payload)
        if flush:
            for name, start, payload in self.deferred:
                self.copied += self.buffers[name].write(start, payload)
            self.deferred = []
        self.requests.append(req)
        self.marks.append(starts)
        self.elements.append(elements)
        self.items += req.batch_size

    def truncate(self, keep: int) -> None:
        """Forget requests from `keep` on (their rows get rewritten)."""
        if keep >= len(self.requests):
            return
        if keep == 0:
            for buf in self.buffers.values():
                buf.used = 0
            self.deferred = []
        else:
            for name, buf in self.buffers.items():
                buf.used = self.marks[keep][name]
        del self.requests[keep:], self.marks[keep:], self.elements[keep:]
        self.items = sum(r.batch_size for r in self.requests)

    def finish(self, cfg: ModelConfig) -> tuple[list[InputDescriptor], list[Block], int]:
        """The worker descriptors of the formed batch; the blocks it holds and
        the bytes passed in place. The buffers are handed over."""
        requests = self.requests
        single = len(requests) == 1
        in_place = {name for name, _start, _payload in self.deferred} if single else set()
        rows = sum(r.rows for r in requests)
        first = {staged[0].name: staged for staged in requests[0].staged}
        descriptors, blocks, passed = [], [], 0
        for name, buf in self.buffers.items():
            spec, shape, model_shape, payload, location = first[name]
            if name in in_place:
                assert location is not None         # (in place: it is in shared memory)
                descriptors.append(InputDescriptor(name, spec.datatype, model_shape,
                                                   *location))  # type: ignore[arg-type]  # see stage_inputs
                passed += len(payload)
                buf.free()
                continue
            if spec.allow_ragged_batch and cfg.max_batch_size > 0:
                batch_shape = [sum(e[name] for e in self.elements)]
            elif single:
                batch_shape = model_shape
            else:
                batch_shape = [rows] + list(model_shape[1:])
            nbytes = buf.used
            block = buf.take()
            if block is None:           # nothing written (zero bytes)
                block = self.arena.alloc(0)
            blocks.append(block)
            descriptors.append(InputDescriptor(name, spec.datatype, batch_shape, block.segment, block.offset, nbytes))
        self.buffers = {}
        return descriptors, blocks, passed

    def free(self) -> None:
        for buf in self.buffers.values():
            buf.free()
        self.buffers = {}
        self.requests, self.marks, self.elements, self.deferred = [], [], [], []
        self.items = 0
