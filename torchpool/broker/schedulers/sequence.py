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

Per row, the broker adds the tensors the model expects beyond the client's
inputs: controls (`control_input`: CONTROL_SEQUENCE_START / END / READY as
the configured false/true pair, CONTROL_SEQUENCE_CORRID as the id) and
implicit state (`state`): the state output of one request is the state input
of the sequence's next one, kept by the broker, never sent to the client
(`hidden_outputs`). On START the state is the configured `initial_state`
(zero_data or data_file, shaped by the initial state's dims) or zeros with
every variable dimension 1; after that it has whatever shape the model
returned (`dims: [-1]`). TYPE_STRING state is BYTES: 4-byte little-endian
length + bytes per element (zeros: empty strings).

With `EMPTY_SLOT_ROWS` (Triton's direct layout) a direct batch has one row
per slot from 0 to the highest slot that runs a request, and an empty slot
in between gets a row of zeros with READY false; `Batch.context.row_starts`
then says where each request's row is. Off (the default until the answer
path reads `row_starts`), the rows are the requests', in slot order.

A worker that dies takes its sequences with it: their waiting requests fail
with an error naming the model, the sequence and the instance, their slots
are gone, and a later request of such a sequence without START is told so.
"""
from __future__ import annotations

import itertools
import logging
import math
import struct
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from ...config import ModelConfig, SequenceState
from ...protocol import datatypes, errors
from ...protocol.errors import TorchpoolError
from ...shm.arena import Arena, ArenaFull
from ..batch import Batch, stage_batch_inputs, write_tensors
from ..requests import InferRequest
from .base import ReadOutput, Refusals, Scheduler
from .forming import FormingBatch

log = logging.getLogger("torchpool.broker")

START, END, READY, CORRID = ("CONTROL_SEQUENCE_START", "CONTROL_SEQUENCE_END",
                             "CONTROL_SEQUENCE_READY", "CONTROL_SEQUENCE_CORRID")
_PAIRS = {"int32_false_true": ("INT32", "<i"), "fp32_false_true": ("FP32", "<f"),
          "bool_false_true": ("BOOL", "<?")}
_CORRID_FORMATS = {"INT32": "<i", "UINT32": "<I", "INT64": "<q", "UINT64": "<Q"}
_LENGTH = struct.Struct("<I")

# Triton's direct layout: empty slots below the highest busy one get a
# not-ready row of zeros. Needs the answer path to split by
# `batch.context.row_starts`.
EMPTY_SLOT_ROWS = False


# ------------------------------------------------------------------ flags, controls, state

@dataclass(frozen=True)
class SequenceFlags:
    corrid: Any
    start: bool
    end: bool


def parse_flags(header: dict, model: str) -> SequenceFlags:
    """The request's `sequence` header field, checked (Triton's wording)."""
    raw = header.get("sequence")
    if not isinstance(raw, dict):
        raw = {}
    corrid = raw.get("id")
    valid_int = isinstance(corrid, int) and not isinstance(corrid, bool) and 0 < corrid < 2 ** 64
    if not (valid_int or (isinstance(corrid, str) and corrid)):
        raise TorchpoolError(errors.INVALID_ARG, f"inference request to model '{model}' must specify a "
                                                 f"non-zero or non-empty correlation ID")
    return SequenceFlags(corrid, raw.get("start") is True, raw.get("end") is True)


@dataclass(frozen=True)
class Control:
    name: str
    kind: str
    datatype: str
    pack: str                          # struct format of one element
    values: tuple = ()                 # (false, true); empty for CORRID

    def value(self, corrid: Any, start: bool, end: bool, ready: bool) -> bytes:
        if self.kind == CORRID:
            return struct.pack(self.pack, corrid if ready else 0)
        on = {START: start, END: end, READY: ready}[self.kind]
        return struct.pack(self.pack, self.values[1] if on else self.values[0])


def parse_control(model: str, entry: dict) -> Control:
    name = str(entry.get("name"))
    controls = entry.get("control") or []
    if len(controls) != 1:
        raise TorchpoolError(errors.INVALID_ARG, f"model '{model}': sequence control input '{name}' must "
                                                 f"have exactly one control")
    control = controls[0]
    kind = control.get("kind", START)
    if kind == CORRID:
        datatype = datatypes.config_to_wire(control.get("data_type", "TYPE_UINT64"))
        if datatype not in _CORRID_FORMATS:
            raise TorchpoolError(errors.INVALID_ARG, f"model '{model}': CONTROL_SEQUENCE_CORRID '{name}' "
                                                     f"must be INT32, UINT32, INT64 or UINT64")
        return Control(name, kind, datatype, _CORRID_FORMATS[datatype])
    for key, (datatype, pack) in _PAIRS.items():
        pair = control.get(key)
        if pair:
            if len(pair) != 2:
                raise TorchpoolError(errors.INVALID_ARG, f"model '{model}': control '{name}' {key} "
                                                         f"needs two values (false, true)")
            values = tuple(bool(v) for v in pair) if datatype == "BOOL" else tuple(pair)
            return Control(name, kind, datatype, pack, values)
    raise TorchpoolError(errors.INVALID_ARG, f"model '{model}': control '{name}' ({kind}) sets none of "
                                             f"int32_false_true, fp32_false_true, bool_false_true")


@dataclass(frozen=True)
class State:
    spec: SequenceState
    datatype: str                      # wire datatype
    shape: tuple[int, ...]             # the state input on START (batch dimension included)
    initial: bytes


def _element_bytes(datatype: str, count: int) -> bytes:
    """`count` zero elements (BYTES: empty strings)."""
    if datatype == "BYTES":
        return bytes(4 * count)
    return bytes(count * datatypes.element_size(datatype))


def parse_state(model: str, spec: SequenceState, model_dir: Path, batching: bool) -> State:
    """A state's datatype and START value, checked as Triton does."""
    name = spec.input_name
    try:
        datatype = datatypes.config_to_wire(spec.data_type)
    except (KeyError, ValueError):
        raise TorchpoolError(errors.INVALID_ARG, f"model '{model}': state '{name}' has an unsupported "
                                                 f"data type {spec.data_type}") from None
    prefix = (1,) if batching else ()
    init = spec.initial_state
    if not init:
        dims = tuple(1 if d < 0 else d for d in spec.dims)
        return State(spec, datatype, prefix + dims, _element_bytes(datatype, math.prod(dims)))
    if init.get("data_type", spec.data_type) != spec.data_type:
        raise TorchpoolError(errors.INVALID_ARG, f"The data type used for 'initial_state' field of state "
                                                 f"'{name}' does not match the state data type.")
    if not init.get("name"):
        raise TorchpoolError(errors.INVALID_ARG, f"Field 'name' must be set when using initial_state for "
                                                 f"state input '{name}'.")
    idims = tuple(int(d) for d in init.get("dims", ()))
    if len(idims) != len(spec.dims):
        raise TorchpoolError(errors.INVALID_ARG,
                             f"Number of dimensions in 'initial_state' doesn't match the size of 'state' "
                             f"dimensions for state input '{name}'. {len(idims)} != {len(spec.dims)}")
    for i, d in zip(idims, spec.dims):
        if i < 0:
            raise TorchpoolError(errors.INVALID_ARG, f"'initial_state' field for state input name "
                                                     f"'{name}' contains variable dimensions.")
        if d >= 0 and i != d:
            raise TorchpoolError(errors.INVALID_ARG, f"'initial_state' dim for input name '{name}' "
                                                     f"doesn't match 'state' dim description. {i} != {d}")
    count = math.prod(idims)
    initial = _element_bytes(datatype, count)
    if init.get("data_file"):
        path = model_dir / "initial_state" / str(init["data_file"])
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise TorchpoolError(errors.INVALID_ARG, f"model '{model}': initial state of '{name}': "
                                                     f"cannot read {path}: {exc.strerror}") from None
        if datatype == "BYTES":
            try:
                datatypes.decode_bytes(memoryview(data), count)
            except ValueError as exc:
                raise TorchpoolError(errors.INVALID_ARG, f"model '{model}': initial state file {path} "
                                                         f"of '{name}' is not {count} BYTES elements: "
                                                         f"{exc}") from None
            initial = data
        elif len(data) < len(initial):
            raise TorchpoolError(errors.INVALID_ARG,
                                 f"initial_state setting expects {len(initial)} bytes, but the data "
                                 f"provided from {init['data_file']} only has {len(data)} bytes.")
        else:
            initial = data[:len(initial)]
    return State(spec, datatype, prefix + idims, initial)


# ------------------------------------------------------------------ bookkeeping

@dataclass(eq=False)
class Sequence:
    corrid: Any
    queue: deque = field(default_factory=deque)           # its requests not yet handed out
    state: dict[str, tuple[tuple, bytes]] = field(default_factory=dict)   # input -> (shape, bytes)
    home: Optional["_Instance"] = None                    # the instance whose slot it holds
    slot: int = -1
    running: Optional[InferRequest] = None                # its request in a batch
    last: float = 0.0                                     # last request arrived or finished
    ended: bool = False                                   # END was handed out: no more requests


@dataclass(eq=False)
class _Instance:
    handle: Any
    order: int                                            # registration order (ties between instances)
    slots: list[Optional[Sequence]]


@dataclass(eq=False)
class SequenceBatchContext:
    """A sequence batch's own bookkeeping (Batch.context)."""
    members: list[tuple[Sequence, InferRequest]]          # in batch.requests order
    row_starts: list[int]                                 # each request's first row in the batch
    instance: Any


class _EmptyRow:
    """A not-ready slot inside a direct batch: zeros shaped like a real row."""

    __slots__ = ("staged", "rows", "batch_size", "shapes")

    def __init__(self, like: InferRequest) -> None:
        self.staged = []
        for spec, shape, model_shape, payload, _location in like.staged:
            n = math.prod(shape)
            data = _element_bytes(spec.datatype, n) if spec.datatype == "BYTES" else bytes(len(payload))
            self.staged.append((spec, shape, model_shape, memoryview(data), None))
        self.rows = like.rows
        self.batch_size = like.batch_size
        self.shapes = like.shapes


def _label(instance: Any) -> str:
    for attr in ("label", "name"):
        value = getattr(instance, attr, None)
        if isinstance(value, str) and value:
            return value
    return str(instance)


# ------------------------------------------------------------------ the scheduler

class SequenceBatcher(Scheduler):
    """Triton's sequence batcher (`direct` and `oldest`) for one model version."""

    def __init__(self, config: ModelConfig, model_dir: Path, arena: Arena,
                 transfer: Optional[Counter] = None) -> None:
        sb = config.sequence_batching or {}
        self.config = config
        self.model = config.name
        self.arena = arena
        self.transfer = transfer if transfer is not None else Counter()
        self.batching = config.max_batch_size > 0
        self.max_batch = max(1, config.max_batch_size)
        self.oldest = sb.get("oldest") is not None
        strategy = (sb.get("oldest") if self.oldest else sb.get("direct")) or {}
        self.slot_count = self.max_batch
        if self.oldest and int(strategy.get("max_candidate_sequences", 0) or 0) > 0:
            self.slot_count = int(strategy["max_candidate_sequences"])
        self.delay = int(strategy.get("max_queue_delay_microseconds", 0) or 0) / 1e6
        self.min_utilization = float(strategy.get("minimum_slot_utilization", 0) or 0)
        preferred = [int(p) for p in strategy.get("preferred_batch_size", ()) or ()
                     if 0 < int(p) <= self.max_batch] if self.oldest else []
        self.preferred = frozenset(preferred)
        self.max_preferred = max(preferred) if preferred else self.max_batch
        self.idle_s = int(sb.get("max_sequence_idle_microseconds") or 1_000_000) / 1e6
        self.controls = [parse_control(config.name, entry) for entry in sb.get("control_input", ())]
        self.states = [parse_state(config.name, s, model_dir, self.batching) for s in config.sequence_states()]
        self.hidden_outputs = frozenset(s.spec.output_name for s in self.states)
        self.sequences: dict[Any, Sequence] = {}       # live ids (END not yet pushed)
        self.backlog: deque[Sequence] = deque()        # started, waiting for a slot
        self.instances: dict[Any, _Instance] = {}
        self.lost: dict[Any, str] = {}                 # ids whose instance died, until START again
        self.count = 0
        self.wake_at: Optional[float] = None
        self._order = 0
        self._arrivals = itertools.count()
        self.clock: Callable[[], float] = time.monotonic   # `finished` is told no time

    # --- admission --------------------------------------------------------------

    def admit(self, req: InferRequest, header: dict) -> None:
        req.sequence = parse_flags(header, self.model)
        corrid = req.sequence.corrid
        for c in self.controls:
            if c.kind != CORRID:
                continue
            if not isinstance(corrid, int):
                raise TorchpoolError(errors.INVALID_ARG,
                                     f"model '{self.model}' takes the correlation ID as {c.datatype} in "
                                     f"'{c.name}': it must be an integer, got {corrid!r}")
            try:
                struct.pack(c.pack, corrid)
            except struct.error:
                raise TorchpoolError(errors.INVALID_ARG,
                                     f"correlation ID {corrid} does not fit {c.datatype} ('{c.name}' of "
                                     f"model '{self.model}')") from None
        self._check_known(req)

    def _check_known(self, req: InferRequest) -> None:
        flags = req.sequence
        if flags.start or flags.corrid in self.sequences:
            return
        lost = self.lost.get(flags.corrid)
        if lost is not None:
            raise TorchpoolError(errors.UNAVAILABLE, f"{lost}; start it again with the START flag")
        raise TorchpoolError(errors.INVALID_ARG,
                             f"inference request for sequence {flags.corrid} to model '{self.model}' "
                             f"must specify the START flag on the first request of the sequence")

    def push(self, req: InferRequest, now: float) -> None:
        flags = req.sequence
        if flags is None:
            raise TorchpoolError(errors.INTERNAL, f"model '{self.model}': request has no sequence flags")
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

    def _instance(self, handle: Any) -> _Instance:
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

    def _key(self, seq: Sequence, req: InferRequest) -> tuple:
        """Requests with equal keys may share a batch."""
        shapes = tuple(self._state_of(seq, req)[s.spec.input_name][0][1:] for s in self.states)
        return (req.key, shapes)

    def _state_of(self, seq: Sequence, req: InferRequest) -> dict:
        if req.sequence.start or not seq.state:
            return {s.spec.input_name: (s.shape, s.initial) for s in self.states}
        return seq.state

    def _ready(self, inst: _Instance) -> list[Sequence]:
        return [s for s in inst.slots if s is not None and s.queue and s.running is None]

    def take(self, instance: Any, now: float) -> Optional[Batch]:
        inst = self._instance(instance)
        self._fill(inst)
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
        ready = sorted(ready, key=lambda s: (s.queue[0].enqueued, s.queue[0].arrival))
        chosen: list[Sequence] = []
        items, best, send, key = 0, 0, False, None
        for seq in ready:
            req = seq.queue[0]
            if chosen and (req.exclusive or self._key(seq, req) != key or items + 1 > self.max_preferred):
                send = True
                break
            if not chosen:
                key = self._key(seq, req)
            chosen.append(seq)
            items += 1
            if req.exclusive or items >= self.max_preferred:
                send = True
                break
            if items in self.preferred:
                best = len(chosen)
        if send or self.delay <= 0:
            return chosen
        if best:
            return chosen[:best]
        due = chosen[0].queue[0].enqueued + self.delay
        if now >= due:
            return chosen
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
            if req.sequence.start:
                seq.state = {}
                seq.ended = False
            if not seq.state:
                seq.state = {s.spec.input_name: (s.shape, s.initial) for s in self.states}
            seq.running = req
            seq.last = now
            members.append((seq, req))
        requests = [req for _seq, req in members]
        # rows: the requests in slot order, or (Triton's layout) one row per slot
        rows_of: list = list(requests)
        starts, row = [], 0
        if EMPTY_SLOT_ROWS and not self.oldest and self.batching and len(members) < self.slot_count:
            by_slot = {seq.slot: req for seq, req in members}
            rows_of = [by_slot.get(i) or _EmptyRow(requests[0]) for i in range(max(by_slot) + 1)]
        for r in rows_of:
            if not isinstance(r, _EmptyRow):
                starts.append(row)
            row += r.rows
        context = SequenceBatchContext(members, starts, inst.handle)
        items = sum(r.batch_size for r in requests)
        batch = Batch(requests, items, row, [], self._outputs(requests), context=context)
        try:
            self._write(batch, rows_of, members)
        except ArenaFull as exc:
            for block in batch.blocks:
                self.arena.free(block)
            batch.blocks, batch.inputs = [], []
            batch.error = TorchpoolError(errors.UNAVAILABLE, f"model '{self.model}': {exc}; retry later "
                                                             f"or raise --shm-limit")
            for seq, _req in members:
                seq.running = None            # failed, not run: the state stays as it was
        for seq, req in members:
            req.staged = []
            if req.sequence.end:
                seq.ended = True
                self._release(seq)            # the slot goes to the backlog now, as in Triton
        return batch

    def _write(self, batch: Batch, rows_of: list, members: list[tuple[Sequence, InferRequest]]) -> None:
        forming = FormingBatch(self.arena, None, len(rows_of))
        try:
            for r in rows_of:
                forming.append(r)
            inputs, blocks, passed = forming.finish(self.config)
        except ArenaFull:
            forming.free()
            raise
        batch.inputs, batch.blocks = inputs, blocks
        self._count("input_bytes_copied", forming.copied)
        self._count("input_bytes_in_place", passed)
        by_req = {id(req): seq for seq, req in members}
        tensors = self._controls(rows_of, by_req) + self._state_tensors(rows_of, by_req)
        extra, extra_blocks = write_tensors(tensors, self.arena)
        batch.inputs.extend(extra)
        batch.blocks.extend(extra_blocks)
        if self.config.batch_inputs:
            extra, extra_blocks = stage_batch_inputs(self.config, rows_of, self.arena)
            batch.inputs.extend(extra)
            batch.blocks.extend(extra_blocks)

    def _count(self, key: str, n: int) -> None:
        if n:
            self.transfer[key] = self.transfer.get(key, 0) + n

    def _controls(self, rows_of: list, by_req: dict) -> list[tuple[str, str, list, bytes]]:
        out = []
        n = len(rows_of)
        for c in self.controls:
            parts = []
            for r in rows_of:
                if isinstance(r, _EmptyRow):
                    parts.append(c.value(0, False, False, False))
                else:
                    f = r.sequence
                    parts.append(c.value(f.corrid, f.start, f.end, True))
            out.append((c.name, c.datatype, [n, 1] if self.batching else [1], b"".join(parts)))
        return out

    def _state_tensors(self, rows_of: list, by_req: dict) -> list[tuple[str, str, list, bytes]]:
        out = []
        for s in self.states:
            name = s.spec.input_name
            real = [by_req[id(r)].state[name] for r in rows_of if not isinstance(r, _EmptyRow)]
            shape = list(real[0][0])
            if not self.batching:
                out.append((name, s.datatype, shape, real[0][1]))
                continue
            per_row = math.prod(shape[1:])
            empty = _element_bytes(s.datatype, per_row)
            data = b"".join(empty if isinstance(r, _EmptyRow) else by_req[id(r)].state[name][1]
                            for r in rows_of)
            out.append((name, s.datatype, [len(rows_of)] + shape[1:], data))
        return out

    def _outputs(self, requests: list[InferRequest]) -> list:
        if len(requests) == 1:
            return requests[0].outputs
        names: list[str] = []
        for r in requests:
            for o in r.outputs:
                name = o if isinstance(o, str) else o[0]
                if name not in names:
                    names.append(name)
        return names

    # --- after a batch ---------------------------------------------------------------

    def finished(self, batch: Batch, outputs: Optional[list], read: ReadOutput) -> None:
        ctx = batch.context
        if not isinstance(ctx, SequenceBatchContext):
            return
        now = self.clock()
        by_name = {d[0]: d for d in outputs or ()}
        captured = outputs is not None and self.states and batch.error is None
        if captured:
            try:
                states = {s.spec.input_name: self._split_state(s, by_name, batch, ctx, read)
                          for s in self.states}
            except TorchpoolError as exc:
                log.error("%s", exc.message)
                captured = False
        for i, (seq, req) in enumerate(ctx.members):
            if seq.running is not req:
                continue                       # the sequence was dropped meanwhile
            seq.running = None
            seq.last = now
            if req.sequence.end:
                seq.state = {}
            elif captured:
                seq.state = {name: parts[i] for name, parts in states.items()}

    def _split_state(self, s: State, by_name: dict, batch: Batch, ctx: SequenceBatchContext,
                     read: ReadOutput) -> list[tuple[tuple, bytes]]:
        """The state output of each request of the batch: [(shape, bytes)]."""
        name = s.spec.output_name
        d = by_name.get(name)
        if d is None:
            raise TorchpoolError(errors.INTERNAL, f"model '{self.model}' did not return its state "
                                                  f"output '{name}'")
        _name, datatype, shape, segment, offset, nbytes = d
        data = read(segment, offset, nbytes)
        shape = [int(x) for x in shape]
        if not self.batching:
            return [(tuple(shape), bytes(data))]
        rows = batch.rows
        if datatype == "BYTES":
            count = math.prod(shape)
            if rows == 0 or count % rows:
                raise TorchpoolError(errors.INTERNAL, f"state output '{name}' of model '{self.model}' "
                                                      f"has {count} strings for {rows} rows")
            per_row = count // rows
            if len(shape) == len(s.spec.dims) + 1 and shape[0] == rows:
                row_shape = (1, *shape[1:])
            else:
                row_shape = (1, per_row) if len(s.spec.dims) == 1 else (1, *s.shape[1:])
            bounds, pos = [0], 0
            for _ in range(rows):
                for _ in range(per_row):
                    if pos + 4 > len(data):
                        raise TorchpoolError(errors.INTERNAL, f"state output '{name}' of model "
                                                              f"'{self.model}' is a truncated BYTES tensor")
                    pos += 4 + _LENGTH.unpack_from(data, pos)[0]
                bounds.append(pos)
            return [(row_shape, bytes(data[bounds[r]:bounds[r + 1]])) for r in ctx.row_starts]
        if not shape or shape[0] != rows:
            raise TorchpoolError(errors.INTERNAL, f"state output '{name}' of model '{self.model}' has "
                                                  f"shape {shape} for a batch of {rows} rows: the batch "
                                                  f"dimension must come first")
        size = nbytes // rows if rows else 0
        row_shape = (1, *shape[1:])
        return [(row_shape, bytes(data[r * size:(r + 1) * size])) for r in ctx.row_starts]

    # --- instances, timers, shutdown ----------------------------------------------------

    def instance_gone(self, instance: Any) -> Refusals:
        inst = self.instances.pop(instance, None)
        if inst is None:
            return []
        out: Refusals = []
        for seq in inst.slots:
            if seq is None:
                continue
            message = (f"model '{self.model}': sequence {seq.corrid} was lost: instance "
                       f"{_label(instance)} running it stopped")
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
                if seq is None or seq.running is not None or seq.queue or now - seq.last < self.idle_s:
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


__all__ = ["SequenceBatcher", "SequenceBatchContext", "SequenceFlags", "parse_flags", "EMPTY_SLOT_ROWS"]
