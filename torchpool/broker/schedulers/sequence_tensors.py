"""The tensors of a sequence batch: flags, controls, implicit state.

What the sequence batcher (sequence.py) adds to a batch beyond the clients'
inputs, and reads back from its outputs, in Triton's terms:

- the request's `sequence` field (correlation id, START, END), checked;
- control inputs (`control_input`): CONTROL_SEQUENCE_START / END / READY as
  the configured false/true pair (int32, fp32 or bool), CONTROL_SEQUENCE_CORRID
  as the id in the configured type; one value per row, READY false (and the
  rest zero) for an empty slot;
- implicit state (`state`): the START value from `initial_state` (zero_data
  or data_file, shaped by the initial state's dims, with Triton's checks and
  error texts) or zeros with every variable dimension 1; per row after that,
  whatever the model returned. TYPE_STRING state is BYTES (4-byte
  little-endian length + bytes per element; zeros are empty strings), one
  flat list for the whole batch.
"""
from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional, Union, cast

from ...config import ModelConfig, SequenceState
from ...config.shapes import ControlInput
from ...protocol import datatypes, errors
from ...protocol.internal import InputDescriptor
from ...protocol.errors import TorchpoolError
from ...rules.validation import Staged
from ...shm.arena import Arena, ArenaFull, Block
from ..batch import BrokerTensor, OutputEntry, SegmentRef, batch_input_values, write_tensors
from ..requests import CorrId, InferRequest, SequenceFlags
from .forming import FormingBatch

if TYPE_CHECKING:
    from .base import ReadOutput

START, END, READY, CORRID = ("CONTROL_SEQUENCE_START", "CONTROL_SEQUENCE_END",
                             "CONTROL_SEQUENCE_READY", "CONTROL_SEQUENCE_CORRID")
_PAIRS = {"int32_false_true": ("INT32", "<i"), "fp32_false_true": ("FP32", "<f"),
          "bool_false_true": ("BOOL", "<?")}
_CORRID_FORMATS = {"INT32": "<i", "UINT32": "<I", "INT64": "<q", "UINT64": "<Q"}
Tensors = list[BrokerTensor]                      # [(name, datatype, shape, bytes)]
# a sequence's implicit state input: (shape, bytes)
StateValue = tuple[tuple[int, ...], bytes]


def parse_flags(raw: object, model: str) -> SequenceFlags:
    """A request's `sequence` field (InferCall.sequence), checked (Triton's wording)."""
    if not isinstance(raw, dict):
        raw = {}
    corrid = raw.get("id")
    if not (isinstance(corrid, int) and not isinstance(corrid, bool) and 0 < corrid < 2 ** 64
            or isinstance(corrid, str) and corrid):
        raise TorchpoolError(errors.INVALID_ARG, f"inference request to model '{model}' must specify a "
                                                 f"non-zero or non-empty correlation ID")
    return SequenceFlags(corrid, raw.get("start") is True, raw.get("end") is True)


@dataclass(frozen=True)
class Control:
    name: str
    kind: str
    datatype: str
    pack: str                          # struct format of one element
    values: tuple[float, ...] = ()     # (false, true): ints, floats or bools; empty for CORRID

    def value(self, corrid: CorrId, start: bool, end: bool, ready: bool) -> bytes:
        if self.kind == CORRID:
            return struct.pack(self.pack, corrid if ready else 0)
        on = {START: start, END: end, READY: ready}[self.kind]
        return struct.pack(self.pack, self.values[1] if on else self.values[0])


def parse_control(model: str, entry: ControlInput) -> Control:
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
        if isinstance(pair, list) and pair:       # (a list, or absent: normalize.py)
            if len(pair) != 2:
                raise TorchpoolError(errors.INVALID_ARG, f"model '{model}': control '{name}' {key} "
                                                         f"needs two values (false, true)")
            values = tuple(bool(v) for v in pair) if datatype == "BOOL" else tuple(pair)
            return Control(name, kind, datatype, pack, values)
    raise TorchpoolError(errors.INVALID_ARG, f"model '{model}': control '{name}' ({kind}) sets none of "
                                             f"int32_false_true, fp32_false_true, bool_false_true")


def check_corrid(controls: list[Control], corrid: CorrId, model: str) -> None:
    """A CONTROL_SEQUENCE_CORRID input takes only ids that fit its type."""
    for c in controls:
        if c.kind != CORRID:
            continue
        if not isinstance(corrid, int):
            raise TorchpoolError(errors.INVALID_ARG, f"model '{model}' takes the correlation ID as "
                                                     f"{c.datatype} in '{c.name}': it must be an integer, "
                                                     f"got {corrid!r}")
        try:
            struct.pack(c.pack, corrid)
        except struct.error:
            raise TorchpoolError(errors.INVALID_ARG, f"correlation ID {corrid} does not fit {c.datatype} "
                                                     f"('{c.name}' of model '{model}')") from None


@dataclass(frozen=True)
class State:
    spec: SequenceState
    datatype: str                      # wire datatype
    shape: tuple[int, ...]             # the state input on START (batch dimension included)
    initial: bytes


def zero_elements(datatype: str, count: int) -> bytes:
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
        return State(spec, datatype, prefix + dims, zero_elements(datatype, math.prod(dims)))
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
    initial = zero_elements(datatype, count)
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


class EmptyRow:
    """A not-ready slot inside a direct batch: zeros shaped like a real row."""

    __slots__ = ("staged", "rows", "batch_size", "shapes")

    def __init__(self, like: InferRequest) -> None:
        self.staged: list[Staged] = []
        for spec, shape, model_shape, payload, _location in like.staged:
            n = math.prod(shape)
            data = zero_elements(spec.datatype, n) if spec.datatype == "BYTES" else bytes(len(payload))
            self.staged.append(Staged(spec, shape, model_shape, memoryview(data), None))
        self.rows = like.rows
        self.batch_size = like.batch_size
        self.shapes = like.shapes


# a sequence batch's row: a request's, or an empty slot's
SlotRow = Union[InferRequest, EmptyRow]


def layout_rows(requests: list[InferRequest], slots: list[int], empty_slots: bool
                ) -> tuple[list[SlotRow], Optional[list[int]]]:
    """A batch's rows and each request's first row (None: the requests' own
    rows, in order). `requests` run in `slots` (ascending); with
    `empty_slots` (Triton's direct layout) every slot from 0 to the highest
    busy one gets a row, an EmptyRow where it runs nothing."""
    if not empty_slots or slots == list(range(len(slots))):
        return list(requests), None
    by_slot = dict(zip(slots, requests))
    rows = [by_slot.get(i) or EmptyRow(requests[0]) for i in range(max(slots) + 1)]
    starts, row = [], 0
    for r in rows:
        if not isinstance(r, EmptyRow):
            starts.append(row)
        row += r.rows
    return rows, starts


def stage_rows(config: ModelConfig, arena: Arena, rows: list[SlotRow], controls: list[Control],
               states: list[State], state_of: Callable[[InferRequest], dict[str, StateValue]],
               batching: bool) -> tuple[list[InputDescriptor], list[Block], int, int]:
    """Write a sequence batch into the arena: the rows' inputs (contiguous),
    their controls and states, and the `batch_input`s. Returns (worker
    descriptors, blocks, bytes copied, bytes left in place); raises ArenaFull
    having freed what it took."""
    forming = FormingBatch(arena, None, len(rows))
    blocks: list[Block] = []
    try:
        for r in rows:
            forming.append(r)
        inputs, blocks, passed = forming.finish(config)
        tensors = control_tensors(controls, rows, batching) + state_tensors(states, rows, state_of, batching)
        for made in (tensors, batch_input_values(config, rows) if config.batch_inputs else []):
            extra, extra_blocks = write_tensors(made, arena)
            inputs.extend(extra)
            blocks.extend(extra_blocks)
    except ArenaFull:
        forming.free()
        for block in blocks:
            arena.free(block)
        raise
    return inputs, blocks, forming.copied, passed



def control_tensors(controls: list[Control], rows: list[SlotRow], batching: bool) -> Tensors:
    """One value per row (`rows`: requests and EmptyRows, in batch order)."""
    out = []
    for c in controls:
        parts = []
        for r in rows:
            if isinstance(r, EmptyRow):
                parts.append(c.value(0, False, False, False))
            else:
                f = cast(SequenceFlags, r.sequence)     # set: admitted by SequenceBatcher.admit
                parts.append(c.value(f.corrid, f.start, f.end, True))
        out.append((c.name, c.datatype, [len(rows), 1] if batching else [1], b"".join(parts)))
    return out


def state_tensors(states: list[State], rows: list[SlotRow],
                  state_of: Callable[[InferRequest], dict[str, StateValue]], batching: bool) -> Tensors:
    """Each state input: the rows' states stacked (they agree on the shape
    beyond the batch dimension); an EmptyRow's is zeros."""
    out = []
    for s in states:
        name = s.spec.input_name
        real = [state_of(r)[name] for r in rows if not isinstance(r, EmptyRow)]
        shape = list(real[0][0])
        if not batching:
            out.append((name, s.datatype, shape, real[0][1]))
            continue
        empty = zero_elements(s.datatype, math.prod(shape[1:]))
        data = b"".join(empty if isinstance(r, EmptyRow) else state_of(r)[name][1] for r in rows)
        out.append((name, s.datatype, [len(rows)] + shape[1:], data))
    return out


def split_state(model: str, s: State, descriptor: Optional[OutputEntry], rows: int, row_starts: list[int],
                batching: bool, read: ReadOutput) -> list[StateValue]:
    """A batch's state output cut per request (at `row_starts`): [(shape, bytes)].
    Raises TorchpoolError when it cannot be cut."""
    name = s.spec.output_name
    if descriptor is None:
        raise TorchpoolError(errors.INTERNAL, f"model '{model}' did not return its state output '{name}'")
    _name, datatype, shape, segment, offset, nbytes = descriptor
    # a state output is asked by name (hidden_outputs), never into a client's region: the
    # worker's arena, or bytes copied out of it (not a region's [key, inode])
    data = read(cast(SegmentRef, segment), offset, nbytes)
    shape = [int(x) for x in shape]
    if not batching:
        return [(tuple(shape), bytes(data))]
    if datatype == "BYTES":
        count = math.prod(shape)
        if rows == 0 or count % rows:
            raise TorchpoolError(errors.INTERNAL, f"state output '{name}' of model '{model}' has {count} "
                                                  f"strings for {rows} rows")
        per_row = count // rows
        if len(shape) == len(s.spec.dims) + 1 and shape[0] == rows:
            row_shape = (1, *shape[1:])
        else:                              # a flat List[str] of the whole batch
            row_shape = (1, per_row) if len(s.spec.dims) == 1 else (1, *s.shape[1:])
        try:
            bounds = datatypes.bytes_boundaries(data, [per_row] * rows)
        except ValueError as exc:
            raise TorchpoolError(errors.INTERNAL, f"state output '{name}' of model '{model}' is a "
                                                  f"truncated BYTES tensor: {exc}") from None
        return [(row_shape, bytes(data[bounds[r]:bounds[r + 1]])) for r in row_starts]
    if not shape or shape[0] != rows:
        raise TorchpoolError(errors.INTERNAL, f"state output '{name}' of model '{model}' has shape {shape} "
                                              f"for a batch of {rows} rows: the batch dimension must come "
                                              f"first")
    size = nbytes // rows if rows else 0
    return [((1, *shape[1:]), bytes(data[r * size:(r + 1) * size])) for r in row_starts]
