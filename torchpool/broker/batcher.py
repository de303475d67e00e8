"""Dynamic batching: Triton's dynamic batcher for one model version.

A version whose config has `dynamic_batching { }` gets a `DynamicBatcher` as
its `ModelVersion.queue` (it speaks the container protocol the rest of the
broker uses on that deque: len, bool, iteration, clear). Requests wait in one
FIFO per priority level; a batch is formed by Triton's rules:

    scan the queues in priority order (level 1 first; within a level, the
    requests that timed out with DELAY come after the others), adding
    requests while the batch stays within the largest preferred size (or
    max_batch_size) and every non-ragged input has the same shape beyond the
    batch dimension (and the same inputs are present). Send it when
      - it reached the largest preferred size, or the next request cannot
        join (too big, another shape, or it must run alone), or
      - it reached a preferred size (the largest one reached is sent), or
      - its oldest request has waited max_queue_delay_microseconds;
    otherwise wait until that delay is over or more requests arrive.

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

`batch_input` tensors are computed per batch (`batch_input_values`) and the
outputs are split back per request (`split_outputs`): rows along dim 0,
`BYTES` by element count, `BATCH_SCATTER_WITH_INPUT_SHAPE` by each request's
source input shape.
"""
from __future__ import annotations

import heapq
import itertools
import math
import struct
from array import array
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

from ..config import ModelConfig, TensorSpec
from ..protocol import datatypes, errors
from ..protocol.errors import TorchpoolError
from ..shm.arena import Arena, ArenaFull, Block
from ..shm.bulkcopy import copy_into
from .requests import InferRequest, output_shape
from .batch import write_tensors

MiB = 1 << 20
# A forming batch reserves room for max_batch_size rows of fixed-size inputs,
# up to this much per input; beyond it the block grows when needed.
RESERVE_LIMIT = 16 * MiB
SCATTER = "BATCH_SCATTER_WITH_INPUT_SHAPE"
_LENGTH = struct.Struct("<I")


@dataclass(eq=False)
class Batch:
    """One model execution: its requests, and where the worker finds the inputs."""

    requests: list[InferRequest]
    items: int                        # batch size (Triton counts a 0-row request as 1)
    rows: int                         # rows along dim 0, summed over the requests
    inputs: list                      # worker descriptors
    outputs: list                     # outputs the worker is asked for
    blocks: list[Block] = field(default_factory=list)   # broker arena blocks, freed when it finished
    seq: Optional[int] = None         # answer order (preserve_ordering)
    error: Optional[TorchpoolError] = None   # could not be formed: fail its requests

    @classmethod
    def single(cls, req: InferRequest) -> "Batch":
        """A request run on its own (the default scheduler): staged already."""
        return cls([req], req.batch_size, req.rows, req.inputs, req.outputs)


# ------------------------------------------------------------ batch inputs

def _accumulate(values: list[int]) -> list[int]:
    return list(itertools.accumulate(values))


def batch_input_values(cfg: ModelConfig, requests: list[InferRequest]) -> list[tuple[str, str, list, bytes]]:
    """The `batch_input` tensors of a batch: [(target name, datatype, shape, bytes)].

    Each kind reads its source input's shape in every request, as Triton does:
    BATCH_ELEMENT_COUNT [requests] element counts; BATCH_ACCUMULATED_ELEMENT_COUNT
    [requests] running sums (end offsets); ..._WITH_ZERO [requests + 1] with a
    leading 0; BATCH_MAX_ELEMENT_COUNT_AS_SHAPE [largest count] (zeros: only
    the shape carries information); BATCH_ITEM_SHAPE [batch items, rank - 1]
    each item's shape without the batch dimension; BATCH_ITEM_SHAPE_FLATTEN
    the same, flattened.
    """
    out = []
    for entry in cfg.batch_inputs:
        kind = entry["kind"]
        source = entry["source_input"][0]
        wire = "INT32" if entry["data_type"] == "TYPE_INT32" else "FP32"
        shapes = [r.shapes[source] for r in requests]
        counts = [math.prod(s) for s in shapes]
        if kind == "BATCH_ELEMENT_COUNT":
            values, shape = counts, [len(counts)]
        elif kind == "BATCH_ACCUMULATED_ELEMENT_COUNT":
            values, shape = _accumulate(counts), [len(counts)]
        elif kind == "BATCH_ACCUMULATED_ELEMENT_COUNT_WITH_ZERO":
            values, shape = [0] + _accumulate(counts), [len(counts) + 1]
        elif kind == "BATCH_MAX_ELEMENT_COUNT_AS_SHAPE":
            biggest = max(counts, default=0)
            values, shape = [0] * biggest, [biggest]
        elif kind in ("BATCH_ITEM_SHAPE", "BATCH_ITEM_SHAPE_FLATTEN"):
            rank = max((len(s) - 1 for s in shapes), default=0)
            values = [d for s in shapes for _ in range(s[0] if s else 0) for d in s[1:]]
            items = sum(s[0] for s in shapes if s)
            shape = [items, rank] if kind == "BATCH_ITEM_SHAPE" else [len(values)]
        else:  # the config parser accepts only the kinds above
            raise TorchpoolError(errors.UNSUPPORTED, f"model '{cfg.name}': batch input kind "
                                                     f"'{kind}' is not supported")
        data = array("i" if wire == "INT32" else "f", values).tobytes()
        for target in entry["target_name"]:
            out.append((str(target), wire, shape, data))
    return out


def stage_batch_inputs(cfg: ModelConfig, requests: list[InferRequest], arena: Arena,
                       ) -> tuple[list[list], list[Block]]:
    """Compute a batch's `batch_input` tensors and write them into the arena."""
    return write_tensors(batch_input_values(cfg, requests), arena)


# ------------------------------------------------------------ splitting outputs

def scatter_sources(cfg: ModelConfig) -> dict[str, str]:
    """BATCH_SCATTER_WITH_INPUT_SHAPE outputs and their source inputs."""
    return {str(t): entry["source_input"][0] for entry in cfg.batch_outputs
            if entry.get("kind", SCATTER) == SCATTER for t in entry["target_name"]}


def _bytes_boundaries(data: memoryview, counts: list[int], name: str, model: str) -> list[int]:
    """Byte offsets where each request's BYTES elements start (and the end)."""
    bounds, pos = [0], 0
    for count in counts:
        for _ in range(count):
            if pos + 4 > len(data):
                raise TorchpoolError(errors.INTERNAL, f"output '{name}' of model '{model}' is a "
                                                      f"truncated BYTES tensor")
            pos += 4 + _LENGTH.unpack_from(data, pos)[0]
        bounds.append(pos)
    return bounds


def check_reused_outputs(batch: Batch, descriptors: list, reused: frozenset, label: str) -> None:
    """A worker said these outputs are views of input blocks handed over for
    reuse: each must lie inside such an input of this batch (which then has
    one request), or the answer would point at memory the client did not
    offer. Raises TorchpoolError otherwise."""
    offered = [d for d in batch.inputs if len(d) > 7 and d[7] is True]
    for name, _datatype, _shape, segment, offset, nbytes in descriptors:
        if name not in reused:
            continue
        if len(batch.requests) != 1 or not any(
                d[3] == segment and d[4] <= offset and offset + nbytes <= d[4] + d[5] for d in offered):
            raise TorchpoolError(errors.INTERNAL, f"{label}: output '{name}' was answered as a view "
                                                  f"of an input block it does not lie in")


def split_outputs(cfg: ModelConfig, batch: Batch, descriptors: list,
                  read: Callable[[Any, int, int], memoryview]) -> list[list[tuple]]:
    """Each request's own part of a batch's outputs.

    `descriptors` are the worker's `[name, datatype, shape, segment, offset,
    nbytes]`; `read(segment, offset, nbytes)` gives an output's bytes (only
    BYTES outputs are read). Returns, per request, `(name, datatype, client
    shape, segment, offset, nbytes)` for each output it asked for, in its
    order: a byte sub-range of the batch output, no copy. Raises
    TorchpoolError when the model's outputs cannot be split.
    """
    requests = batch.requests
    model = cfg.name
    batching = cfg.max_batch_size > 0
    scatter = scatter_sources(cfg)
    single = len(requests) == 1
    parts: dict[str, list[tuple]] = {}
    for name, datatype, shape, segment, offset, nbytes in descriptors:
        spec = cfg.output(name)
        if name in scatter:
            if datatype == "BYTES":
                raise TorchpoolError(errors.UNSUPPORTED, f"output '{name}' of model '{model}': "
                                                         f"{SCATTER} does not support BYTES")
            size = datatypes.element_size(datatype)
            pos, pieces = offset, []
            for r in requests:
                src = list(r.shapes[scatter[name]])
                n = math.prod(src) * size
                pieces.append((datatype, src, segment, pos, n))
                pos += n
            if pos - offset > nbytes:
                raise TorchpoolError(errors.INTERNAL,
                                     f"output '{name}' of model '{model}' has {nbytes} bytes, but "
                                     f"scattering it with the shapes of input '{scatter[name]}' needs "
                                     f"{pos - offset}")
        elif single:
            pieces = [(datatype, output_shape(spec, shape, batching), segment, offset, nbytes)]
        elif datatype == "BYTES":
            count = shape[0] if shape else 0
            if batch.rows == 0 or count % batch.rows:
                raise TorchpoolError(errors.INTERNAL,
                                     f"output '{name}' of model '{model}' has {count} strings for a "
                                     f"batch of {batch.rows}: it cannot be split per request")
            per_row = count // batch.rows
            counts = [r.rows * per_row for r in requests]
            bounds = _bytes_boundaries(read(segment, offset, nbytes), counts, name, model)
            pieces = [(datatype, output_shape(spec, [c], batching), segment, offset + bounds[i],
                       bounds[i + 1] - bounds[i]) for i, c in enumerate(counts)]
        else:
            if not shape or shape[0] != batch.rows:
                got = shape[0] if shape else "no"
                raise TorchpoolError(errors.INTERNAL,
                                     f"output '{name}' of model '{model}' has {got} rows for a batch "
                                     f"of {batch.rows} rows from {len(requests)} requests: a batched "
                                     f"output must keep the batch dimension first")
            row = nbytes // batch.rows if batch.rows else 0
            pieces, start = [], offset
            for r in requests:
                n = r.rows * row
                pieces.append((datatype, output_shape(spec, [r.rows] + list(shape[1:]), batching),
                               segment, start, n))
                start += n
        parts[name] = pieces
    out = []
    for i, r in enumerate(requests):
        mine = []
        for o in r.outputs:
            name = o if isinstance(o, str) else o[0]
            if name in parts:
                datatype, shape, segment, offset, nbytes = parts[name][i]
                mine.append((name, datatype, shape, segment, offset, nbytes))
        out.append(mine)
    return out


# ------------------------------------------------------------ the forming batch

class _Buffer:
    """One input's contiguous space in a forming batch."""

    __slots__ = ("spec", "arena", "block", "capacity", "used", "reserve")

    def __init__(self, spec: TensorSpec, arena: Arena, reserve: int) -> None:
        self.spec = spec
        self.arena = arena
        self.block: Optional[Block] = None
        self.capacity = 0
        self.used = 0
        self.reserve = reserve           # capacity to take on the first allocation

    def ensure(self, end: int) -> None:
        """Room for bytes up to `end` (may raise ArenaFull). Growing keeps what
        was written (a copy: only when a variable-size input outgrows its room)."""
        if end <= self.capacity and self.block is not None:
            return
        size = max(end, self.reserve, 2 * self.capacity, 64)
        block = self.arena.alloc(size)
        if self.block is not None:
            if self.used:
                self.arena.view(block)[:self.used] = self.arena.view(self.block)[:self.used]
            self.arena.free(self.block)
        self.block, self.capacity = block, size

    def write(self, start: int, payload: Any) -> int:
        n = len(payload)
        if n:
            self.ensure(start + n)
            seg = self.arena.segments[self.block.segment].buf
            base = self.block.offset + start
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


class _Forming:
    """The batch that goes out next, being written while the instances are busy."""

    def __init__(self, arena: Arena, key: Any, max_items: int) -> None:
        self.arena = arena
        self.key = key
        self.max_items = max_items
        self.requests: list[InferRequest] = []
        self.marks: list[dict[str, int]] = []        # per request: input -> start offset
        self.buffers: dict[str, _Buffer] = {}
        self.elements: list[dict[str, int]] = []     # per request: input -> element count
        self.deferred: list[tuple[str, int, Any]] = []   # request 0's inputs left in place
        self.items = 0
        self.copied = 0                              # bytes written (for the transfer counters)

    def _buffer(self, spec: TensorSpec, shape: list, nbytes: int, rows: int) -> _Buffer:
        buf = self.buffers.get(spec.name)
        if buf is None:
            fixed = spec.datatype != "BYTES" and not spec.allow_ragged_batch and rows > 0
            reserve = min(nbytes // rows * self.max_items, RESERVE_LIMIT) if fixed else 4 * nbytes
            buf = self.buffers[spec.name] = _Buffer(spec, self.arena, max(reserve, nbytes))
        return buf

    def append(self, req: InferRequest) -> None:
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

    def finish(self, cfg: ModelConfig) -> tuple[list, list[Block], int]:
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
                descriptors.append([name, spec.datatype, model_shape, *location])
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
            descriptors.append([name, spec.datatype, batch_shape, block.segment, block.offset, nbytes, 0])
        self.buffers = {}
        return descriptors, blocks, passed

    def free(self) -> None:
        for buf in self.buffers.values():
            buf.free()
        self.buffers = {}
        self.requests, self.marks, self.elements, self.deferred = [], [], [], []
        self.items = 0


# ------------------------------------------------------------ the batcher

class DynamicBatcher:
    """Priority queues, queue policies and batch forming for one model version."""

    def __init__(self, cfg: ModelConfig, arena: Arena, transfer: Optional[dict] = None) -> None:
        db = cfg.dynamic_batching or {}
        self.cfg = cfg
        self.arena = arena
        self.transfer = transfer if transfer is not None else {}
        self.max_batch = max(1, cfg.max_batch_size)
        preferred = [p for p in db.get("preferred_batch_size", []) if 0 < p <= self.max_batch]
        self.preferred = frozenset(preferred)
        self.max_preferred = max(preferred) if preferred else self.max_batch
        self.delay = db.get("max_queue_delay_microseconds", 0) / 1e6
        self.preserve_ordering = bool(db.get("preserve_ordering", False))
        self.levels = max(1, db.get("priority_levels", 0))
        self.default_level = max(1, db.get("default_priority_level", 0) or 1)
        default_policy = db.get("default_queue_policy") or {}
        overrides = db.get("priority_queue_policy") or {}
        self.policies = [overrides.get(str(level), overrides.get(level, default_policy))
                         for level in range(1, self.levels + 1)]
        self.main: list[deque[InferRequest]] = [deque() for _ in range(self.levels)]
        self.delayed: list[deque[InferRequest]] = [deque() for _ in range(self.levels)]
        self.count = 0
        self._deadlines: list[tuple[float, int, InferRequest]] = []
        self._arrivals = itertools.count()
        self.forming: Optional[_Forming] = None
        self._changed = False
        self.wake_at: Optional[float] = None      # a dispatch timer is set for this time
        # preserve_ordering: batches are answered in the order they were sent
        self._seq = itertools.count()
        self.held: dict[int, tuple] = {}
        self.next_answer = 0

    # --- the container protocol ModelVersion.queue users rely on ------------------

    def __len__(self) -> int:
        return self.count

    def __bool__(self) -> bool:
        return self.count > 0

    def __iter__(self) -> Iterator[InferRequest]:
        return iter(list(self._ordered()))

    def clear(self) -> None:
        """Forget every queued request (the caller answers them)."""
        for q in (*self.main, *self.delayed):
            for req in q:
                req.queued = False
            q.clear()
        self.count = 0
        self._deadlines.clear()
        if self.forming is not None:
            self.forming.free()
            self.forming = None

    # --- admission --------------------------------------------------------------

    def level_of(self, priority: Any) -> int:
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
                and f.items + req.batch_size <= self.max_preferred):
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
        return heap[0][0] if heap else None

    def expire(self, now: float) -> list[InferRequest]:
        """Apply the queue policies to requests past their timeout: DELAY moves
        them behind their level's other requests; REJECT returns them (the
        caller answers them)."""
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
                rejected.append(req)
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
        reqs: list[InferRequest] = []
        items, best, send_now, key, oldest = 0, 0, False, None, None
        for req in self._ordered():
            n = req.batch_size
            if reqs and (req.exclusive or req.key != key or items + n > self.max_preferred):
                send_now = True          # the batch cannot grow any more
                break
            if not reqs:
                key = req.key
            reqs.append(req)
            items += n
            if oldest is None or req.enqueued < oldest:
                oldest = req.enqueued
            if req.exclusive or items >= self.max_preferred:
                send_now = True
                break
            if items in self.preferred:
                best = len(reqs)
        if not reqs:
            return reqs, False, None
        if send_now:
            return reqs, True, None
        if best:
            return reqs[:best], True, None
        wake = oldest + self.delay
        return reqs, now >= wake, wake

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
            f = self.forming = _Forming(self.arena, reqs[0].key, self.max_preferred)
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

    def take(self, now: float) -> tuple[Optional[Batch], Optional[float]]:
        """The batch to run now, or (None, the time it will be due)."""
        reqs, ready, wake = self._select(now)
        if not ready:
            if self._changed:
                self._changed = False
                try:
                    self._sync(reqs)
                except ArenaFull:
                    pass
            return None, wake
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
            inputs, blocks, passed = f.finish(self.cfg)
            self._count("input_bytes_in_place", passed)
        except ArenaFull as exc:
            if self.forming is not None:
                self.forming.free()
                self.forming = None
            err = TorchpoolError(errors.UNAVAILABLE, f"model '{self.cfg.name}': {exc}; retry later "
                                                     f"or raise --shm-limit")
            return Batch(reqs, items, rows, [], [], error=err), None
        batch = Batch(reqs, items, rows, inputs, self._outputs(reqs), blocks)
        if self.cfg.batch_inputs:
            try:
                extra, extra_blocks = stage_batch_inputs(self.cfg, reqs, self.arena)
            except ArenaFull as exc:
                for block in blocks:
                    self.arena.free(block)
                batch.blocks = []
                batch.error = TorchpoolError(errors.UNAVAILABLE, f"model '{self.cfg.name}': {exc}")
                return batch, None
            batch.inputs.extend(extra)
            batch.blocks.extend(extra_blocks)
        for req in reqs:
            req.staged = []          # the inputs are in the batch now
        if self.preserve_ordering:
            batch.seq = next(self._seq)
        return batch, None

    def _outputs(self, reqs: list[InferRequest]) -> list:
        if len(reqs) == 1:
            return reqs[0].outputs
        wanted = {o if isinstance(o, str) else o[0] for r in reqs for o in r.outputs}
        return [t.name for t in self.cfg.outputs if t.name in wanted]
