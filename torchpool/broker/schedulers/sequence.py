"""Sequence batching (`sequence_batching { }`): Triton's sequence batcher.

A request names its sequence with a correlation id and START / END flags.
Each live sequence holds a *slot* of one instance (a worker handle) from
START until END or until it was idle for `max_sequence_idle_microseconds`;
every instance has `max_batch_size` slots (`oldest`: max_candidate_sequences,
when set). A START that finds no free slot waits in the backlog, oldest
first, until a slot frees up. Requests of one sequence run one at a time, in
the order they arrived; requests of different sequences on the same instance
run together in one batch, one request per sequence:

- `direct { }`: the batch holds the front request of each slot of the
  instance that has one (lowest slot first), in slot order. With
  `max_queue_delay_microseconds` and `minimum_slot_utilization`, a batch
  with fewer ready slots than the utilisation waits at most that long.
- `oldest { }`: the front requests of the instance's candidate sequences,
  oldest first, formed as the dynamic batcher does (`preferred_batch_size`,
  `max_queue_delay_microseconds`, up to max_batch_size).

Rows of one batch must agree on every input's shape beyond the batch
dimension, the implicit states' shapes included (a request whose state has
another shape runs in a later batch); a request that must run alone (outputs
into a region) runs alone.

Each row gets its controls and its sequence's implicit state
(sequence_tensors.py); the state outputs are kept per sequence (never sent
to the client: `hidden_outputs`) and may change shape (`dims: [-1]`).

A direct batch has one row per slot from 0 to the highest slot that runs
a request, as in Triton: an empty slot in between gets a row of zeros with
READY false (CORRID 0) and `Batch.row_starts` says where each request's row
is (not with `batch_output`s, nor for a request that runs alone: there
the rows are the requests', in slot order).

For testing, as in Triton, TRITONSERVER_DELAY_SCHEDULER=N holds the batcher
until N requests are queued in the slots (and, with
TRITONSERVER_BACKLOG_DELAY_SCHEDULER=M, M in the backlog): base.py.

A worker that dies takes its sequences with it: their waiting requests fail
with an error naming the model, the sequence and the instance, their slots
are gone, and a later request of such a sequence without START is told so.
"""
from __future__ import annotations

import itertools
import logging
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional, Sequence as Seq, cast

from ...config import ModelConfig
from ...protocol import errors
from ...rules.batching import limits, select_batch
from ...rules.validation import WorkerOutput
from ...protocol.errors import TorchpoolError
from ...shm.arena import Arena, ArenaFull
from ..batch import Batch, OutputEntry
from ..requests import CorrId, InferRequest, SequenceFlags
from .base import ReadOutput, Refusals, Scheduler, SchedulerHold
from .sequence_tensors import (StateValue, check_corrid, layout_rows, parse_control, parse_flags, parse_state,
                               split_state, stage_rows)

if TYPE_CHECKING:
    from ...rules.request import InferCall
    from ..supervisor import WorkerHandle

log = logging.getLogger("torchpool.broker")


# ------------------------------------------------------------------ bookkeeping

@dataclass(eq=False)
class Sequence:
    corrid: CorrId
    queue: deque[InferRequest] = field(default_factory=deque)   # its requests not yet handed out
    state: dict[str, StateValue] = field(default_factory=dict)   # input -> (shape, bytes)
    home: Optional["_Instance"] = None                    # the instance whose slot it holds
    slot: int = -1
    running: Optional[InferRequest] = None                # its request in a batch
    last: float = 0.0                                     # last request arrived or finished


@dataclass(eq=False)
class _Instance:
    handle: WorkerHandle
    order: int                                            # registration order (ties between instances)
    slots: list[Optional[Sequence]]


@dataclass(eq=False)
class _Front:
    """A candidate sequence's front request, as the batching rules see it."""
    seq: Sequence
    key: tuple[object, ...]
    batch_size: int = 1

    @property
    def exclusive(self) -> bool:
        return self.seq.queue[0].exclusive

    @property
    def enqueued(self) -> float:
        return self.seq.queue[0].enqueued


@dataclass(eq=False)
class SequenceBatchContext:
    """A sequence batch's own bookkeeping (Batch.context)."""
    members: list[tuple[Sequence, InferRequest]]          # in batch.requests order
    instance: WorkerHandle


# ------------------------------------------------------------------ the scheduler

def _flags(req: InferRequest) -> SequenceFlags:
    """A queued request's sequence flags."""
    flags = req.sequence
    assert flags is not None        # admit() parsed them before the request was queued
    return flags


class SequenceBatcher(Scheduler):
    """Triton's sequence batcher (`direct` and `oldest`) for one model version."""

    def __init__(self, config: ModelConfig, model_dir: Path, arena: Arena,
                 transfer: Optional[Counter[str]] = None, hold: Optional[SchedulerHold] = None) -> None:
        sb = config.sequence_batching or {}
        self.config = config
        self.model = config.name
        self.arena = arena
        self.transfer = transfer if transfer is not None else Counter()
        self.batching = config.max_batch_size > 0
        self.max_batch = max(1, config.max_batch_size)
        self.oldest = sb.get("oldest") is not None
        oldest, direct = sb.get("oldest") or {}, sb.get("direct") or {}     # (the one in use: self.oldest)
        strategy = oldest if self.oldest else direct
        self.slot_count = self.max_batch
        if self.oldest and int(oldest.get("max_candidate_sequences", 0) or 0) > 0:
            self.slot_count = int(oldest["max_candidate_sequences"])
        self.limits = limits(self.max_batch, oldest.get("preferred_batch_size", ()) if self.oldest else (),
                             int(strategy.get("max_queue_delay_microseconds", 0) or 0))
        self.delay = self.limits.delay
        # (a direct strategy's: oldest has none)
        self.min_utilization = float((0 if self.oldest else direct.get("minimum_slot_utilization", 0)) or 0)
        self.idle_s = int(sb.get("max_sequence_idle_microseconds") or 1_000_000) / 1e6
        self.controls = [parse_control(config.name, entry) for entry in sb.get("control_input", ())]
        self.states = [parse_state(config.name, s, model_dir, self.batching) for s in config.sequence_states()]
        self.hidden_outputs = frozenset(s.spec.output_name for s in self.states)
        self.sequences: dict[CorrId, Sequence] = {}       # live ids (END not yet pushed)
        self.backlog: deque[Sequence] = deque()        # started, waiting for a slot
        self.instances: dict[WorkerHandle, _Instance] = {}
        self.lost: dict[CorrId, str] = {}                 # ids whose instance died, until START again
        self.count = 0
        self.wake_at: Optional[float] = None
        self._order = 0
        self._arrivals = itertools.count()
        self.clock: Callable[[], float] = time.monotonic   # `finished` is told no time
        self.hold = hold or SchedulerHold()

    # --- admission --------------------------------------------------------------

    def admit(self, req: InferRequest, call: InferCall) -> None:
        req.sequence = parse_flags(call.sequence, self.model)
        check_corrid(self.controls, req.sequence.corrid, self.model)
        self._check_known(req)

    def _check_known(self, req: InferRequest) -> None:
        flags = _flags(req)
        if flags.start or flags.corrid in self.sequences:
            return
        lost = self.lost.get(flags.corrid)
        if lost is not None:
            raise TorchpoolError(errors.UNAVAILABLE, f"{lost}; start it again with the START flag")
        raise TorchpoolError(errors.INVALID_ARG,
                             f"inference request for sequence {flags.corrid} to model '{self.model}' "
                             f"must specify the START flag on the first request of the sequence")

    def push(self, req: InferRequest, now: float) -> None:
        flags = _flags(req)
        if req.batch_size > 1:
            raise TorchpoolError(errors.INVALID_ARG, f"inference request to model '{self.model}' must "
                                                     f"specify batch-size 1 due to requirements of "
                                                     f"sequence batcher")
        self._check_known(req)
        seq = self.sequences.get(flags.corrid)
        if seq is None:
            seq = self.sequences[flags.corrid] = Sequence(flags.corrid, last=now)
            self.lost.pop(flags.corrid, None)
            if not self._place(seq):
                self.backlog.append(seq)
        elif flags.start:
            log.warning("sequence %s for model '%s' has a conflict. The previous sequence did not end "
                        "before this sequence start. Previous sequence will be terminated early.",
                        flags.corrid, self.model)
        req.enqueued = now
        req.arrival = next(self._arrivals)
        req.queued = True
        seq.queue.append(req)
        seq.last = now
        self.count += 1
        if flags.end:
            del self.sequences[flags.corrid]      # a new START with this id is a new sequence

    # --- slots --------------------------------------------------------------------

    def _instance(self, handle: WorkerHandle) -> _Instance:
        inst = self.instances.get(handle)
        if inst is None:
            inst = self.instances[handle] = _Instance(handle, self._order, [None] * self.slot_count)
            self._order += 1
        return inst

    def _place(self, seq: Sequence) -> bool:
        """Give `seq` the free slot with the lowest index (on any instance)."""
        best = None
        for inst in self.instances.values():
            for i, held in enumerate(inst.slots):
                if held is None:
                    if best is None or (i, inst.order) < (best[1], best[0].order):
                        best = (inst, i)
                    break
        if best is None:
            return False
        inst, i = best
        inst.slots[i] = seq
        seq.home, seq.slot = inst, i
        return True

    def _release(self, seq: Sequence) -> None:
        """Free the slot `seq` holds and hand it to the oldest backlog sequence."""
        inst, i = seq.home, seq.slot
        if inst is None:
            return
        inst.slots[i] = None
        seq.home, seq.slot = None, -1
        if self.backlog and self.instances.get(inst.handle) is inst:
            nxt = self.backlog.popleft()
            inst.slots[i] = nxt
            nxt.home, nxt.slot = inst, i

    def _fill(self, inst: _Instance) -> None:
        for i, held in enumerate(inst.slots):
            if not self.backlog:
                return
            if held is None:
                seq = self.backlog.popleft()
                inst.slots[i] = seq
                seq.home, seq.slot = inst, i

    # --- forming batches ------------------------------------------------------------

    def _key(self, seq: Sequence, req: InferRequest) -> tuple[object, ...]:
        """Requests with equal keys may share a batch."""
        shapes = tuple(self._state_of(seq, req)[s.spec.input_name][0][1:] for s in self.states)
        return (req.key, shapes)

    def _state_of(self, seq: Sequence, req: InferRequest) -> dict[str, StateValue]:
        if _flags(req).start or not seq.state:
            return {s.spec.input_name: (s.shape, s.initial) for s in self.states}
        return seq.state

    def _queued_in_slots(self) -> int:
        return sum(len(seq.queue) for inst in self.instances.values() for seq in inst.slots if seq is not None)

    def _ready(self, inst: _Instance) -> list[Sequence]:
        return [s for s in inst.slots if s is not None and s.queue and s.running is None]

    def take(self, instance: WorkerHandle, now: float) -> Optional[Batch]:
        inst = self._instance(instance)
        self._fill(inst)
        if self.hold.holding(queued=self._queued_in_slots(),
                             backlog=sum(len(seq.queue) for seq in self.backlog)):
            return None
        ready = self._ready(inst)
        if not ready:
            return None
        members = self._select_oldest(ready, now) if self.oldest else self._select_direct(ready, now)
        if not members:
            return None
        return self._form(inst, members, now)

    def _select_direct(self, ready: list[Sequence], now: float) -> list[Sequence]:
        if self.delay > 0 and self.min_utilization > 0:
            oldest = min(s.queue[0].enqueued for s in ready)
            if len(ready) / self.slot_count < self.min_utilization and now < oldest + self.delay:
                self._wake(oldest + self.delay)
                return []
        first = ready[0]
        if first.queue[0].exclusive:
            return [first]
        key = self._key(first, first.queue[0])
        return [s for s in ready if not s.queue[0].exclusive and self._key(s, s.queue[0]) == key]

    def _select_oldest(self, ready: list[Sequence], now: float) -> list[Sequence]:
        """The dynamic batcher's rules (rules/batching.py) over the front
        requests of the candidate sequences, oldest first, as Triton's oldest
        strategy runs a dynamic batcher over its candidates."""
        ready = sorted(ready, key=lambda s: (s.queue[0].enqueued, s.queue[0].arrival))
        fronts = [_Front(seq, self._key(seq, seq.queue[0])) for seq in ready]
        chosen, go, due = select_batch(fronts, self.limits, now)
        if go:
            return [front.seq for front in chosen]
        if due is not None:         # (None only when nothing is ready)
            self._wake(due)
        return []

    def _wake(self, when: float) -> None:
        if self.wake_at is None or when < self.wake_at:
            self.wake_at = when

    def _form(self, inst: _Instance, seqs: list[Sequence], now: float) -> Batch:
        """Hand out the front request of each of `seqs` as one batch."""
        members: list[tuple[Sequence, InferRequest]] = []
        for seq in seqs:
            req = seq.queue.popleft()
            req.queued = False
            self.count -= 1
            if cast(SequenceFlags, req.sequence).start:     # (set: admit)
                seq.state = {}
            if not seq.state:
                seq.state = {s.spec.input_name: (s.shape, s.initial) for s in self.states}
            seq.running = req
            seq.last = now
            members.append((seq, req))
        requests = [req for _seq, req in members]
        # Triton's direct layout, unless the rows must be the requests' (a request
        # with outputs into a region runs alone; scatter outputs follow the requests)
        empty_slots = (not self.oldest and self.batching and not self.config.batch_outputs
                       and not requests[0].exclusive)
        rows_of, starts = layout_rows(requests, [seq.slot for seq in seqs], empty_slots)
        batch = Batch(requests, sum(r.batch_size for r in requests), sum(r.rows for r in rows_of), [],
                      self._outputs(requests), context=SequenceBatchContext(members, inst.handle),
                      row_starts=starts, padding=len(rows_of) - len(requests))
        by_req = {id(req): seq for seq, req in members}
        try:
            batch.inputs, batch.blocks, copied, passed = stage_rows(
                self.config, self.arena, rows_of, self.controls, self.states,
                lambda r: by_req[id(r)].state, self.batching)
            self._count("input_bytes_copied", copied)
            self._count("input_bytes_in_place", passed)
        except ArenaFull as exc:
            batch.error = TorchpoolError(errors.UNAVAILABLE, f"model '{self.model}': {exc}; retry later "
                                                             f"or raise --shm-limit")
            for seq, _req in members:
                seq.running = None            # failed, not run: the state stays as it was
        for seq, req in members:
            req.staged = []
            if _flags(req).end:
                self._release(seq)            # the slot goes to the backlog now, as in Triton
        return batch

    def _count(self, key: str, n: int) -> None:
        if n:
            self.transfer[key] = self.transfer.get(key, 0) + n

    def _outputs(self, requests: list[InferRequest]) -> list[WorkerOutput]:
        if len(requests) == 1:
            return requests[0].outputs
        names: list[WorkerOutput] = []
        for r in requests:
            for o in r.outputs:
                name = o if isinstance(o, str) else cast(str, o[0])   # [name, ...]
                if name not in names:
                    names.append(name)
        return names

    def finished(self, batch: Batch, outputs: Optional[Seq[OutputEntry]], read: ReadOutput) -> None:
        ctx = batch.context
        if not isinstance(ctx, SequenceBatchContext):
            return
        now = self.clock()
        by_name = {d[0]: d for d in outputs or ()}
        captured = outputs is not None and self.states and batch.error is None
        if captured:
            try:
                states = {s.spec.input_name: split_state(self.model, s, by_name.get(s.spec.output_name),
                                                         batch.rows, batch.starts(), self.batching, read)
                          for s in self.states}
            except TorchpoolError as exc:
                log.error("%s", exc.message)
                captured = False
        for i, (seq, req) in enumerate(ctx.members):
            if seq.running is not req:
                continue                       # the sequence was dropped meanwhile
            seq.running = None
            seq.last = now
            if _flags(req).end:
                seq.state = {}
            elif captured:
                seq.state = {name: parts[i] for name, parts in states.items()}

    def instance_ready(self, instance: WorkerHandle) -> None:
        # Every instance has its slots from its start, as Triton's batchers
        # do: two STARTs that arrive before the second instance's first take
        # would otherwise share the first one's slots (qa/L0_sequence_batcher
        # test_half_batch on two instances ran them as batches of two).
        self._fill(self._instance(instance))

    def instance_gone(self, instance: WorkerHandle) -> Refusals:
        inst = self.instances.pop(instance, None)
        if inst is None:
            return []
        out: Refusals = []
        for seq in inst.slots:
            if seq is None:
                continue
            message = (f"model '{self.model}': sequence {seq.corrid} was lost: instance "
                       f"{str(getattr(instance, 'label', instance))} running it stopped")
            for req in seq.queue:
                req.queued = False
                out.append((req, TorchpoolError(errors.UNAVAILABLE, message)))
            self.count -= len(seq.queue)
            seq.queue.clear()
            seq.home, seq.slot, seq.state = None, -1, {}
            if self.sequences.get(seq.corrid) is seq:
                del self.sequences[seq.corrid]
                self.lost[seq.corrid] = message
            if len(self.lost) > 4096:
                self.lost.pop(next(iter(self.lost)))
        # the backlog waits for another instance's slot
        for other in self.instances.values():
            self._fill(other)
        return out

    def next_deadline(self) -> Optional[float]:
        due = self.wake_at
        for inst in self.instances.values():
            for seq in inst.slots:
                if seq is not None and seq.running is None and not seq.queue:
                    when = seq.last + self.idle_s
                    if due is None or when < due:
                        due = when
        return due

    def expire(self, now: float) -> Refusals:
        if self.wake_at is not None and self.wake_at <= now:
            self.wake_at = None
        for inst in list(self.instances.values()):
            for seq in list(inst.slots):
                if seq is None or seq.running is not None or seq.queue or seq.last + self.idle_s > now:
                    continue
                log.debug("model '%s': sequence %s idle for %.1f s: released", self.model, seq.corrid,
                          self.idle_s)
                if self.sequences.get(seq.corrid) is seq:
                    del self.sequences[seq.corrid]
                seq.state = {}
                self._release(seq)
        return []

    def drain(self) -> list[InferRequest]:
        out = []
        seen = set()
        for seq in [*self.backlog, *(s for inst in self.instances.values() for s in inst.slots if s)]:
            if id(seq) in seen:
                continue
            seen.add(id(seq))
            for req in seq.queue:
                req.queued = False
                out.append(req)
            seq.queue.clear()
        self.backlog.clear()
        self.sequences.clear()
        self.instances.clear()
        self.count = 0
        self.wake_at = None
        return out

    def __len__(self) -> int:
        return self.count


__all__ = ["SequenceBatcher", "SequenceBatchContext", "SequenceFlags", "parse_flags"]
