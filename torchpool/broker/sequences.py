"""Sequence batching (`sequence_batching { }`): stateful models.

A request names its sequence with a correlation id and START / END flags.
The broker runs the requests of one sequence one at a time, in the order they
arrived, and adds the tensors the model expects beyond the client's inputs:

- control inputs (`control_input`): CONTROL_SEQUENCE_START, _END, _READY as
  the configured false/true pair (int32, fp32 or bool), CONTROL_SEQUENCE_CORRID
  as the id in the configured type;
- implicit state (`state`): the state output of one request is fed as the
  state input of the next request of the sequence (the configured initial
  state, or zeros, on START). It is kept by the broker between requests and
  never sent to the client.

What this is not (yet): requests of different sequences are not batched
together (each runs as a batch of one, so the `direct` and `oldest`
strategies behave alike), and a sequence is not pinned to one instance (its
state lives in the broker, so any instance can run its next request).
`max_sequence_idle_microseconds` releases a sequence that saw no request for
that long; its next request then needs START again.
"""
from __future__ import annotations

import math
import struct
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from ..config import ModelConfig, SequenceState
from ..protocol import datatypes, errors
from ..protocol.errors import TorchpoolError
from .requests import InferRequest

START, END, READY, CORRID = ("CONTROL_SEQUENCE_START", "CONTROL_SEQUENCE_END",
                             "CONTROL_SEQUENCE_READY", "CONTROL_SEQUENCE_CORRID")
_PAIRS = {"int32_false_true": ("INT32", "<i"), "fp32_false_true": ("FP32", "<f"),
          "bool_false_true": ("BOOL", "<?")}
_CORRID_FORMATS = {"INT32": "<i", "UINT32": "<I", "INT64": "<q", "UINT64": "<Q"}


@dataclass(frozen=True)
class _Control:
    name: str
    kind: str
    datatype: str
    pack: str                          # struct format of one element
    values: tuple = ()                 # (false, true); empty for CORRID


@dataclass(frozen=True)
class _State:
    spec: SequenceState
    datatype: str                      # wire datatype
    initial: bytes                     # the state input on START


@dataclass(eq=False)
class Sequence:
    corrid: Any
    open: bool = True                           # started and not ended
    state: dict[str, tuple[list[int], bytes]] = field(default_factory=dict)   # input -> (shape, bytes)
    running: Optional[InferRequest] = None      # its request queued or executing
    waiting: deque = field(default_factory=deque)
    last_used: float = 0.0


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


class SequenceBatcher:
    """The live sequences of one model version and the tensors they add."""

    def __init__(self, cfg: ModelConfig, model_dir: Path) -> None:
        sb = cfg.sequence_batching or {}
        self.model = cfg.name
        self.batched = cfg.max_batch_size > 0
        self.idle_s = int(sb.get("max_sequence_idle_microseconds") or 1_000_000) / 1e6
        self.controls = [_control(cfg.name, entry) for entry in sb.get("control_input", ())]
        self.states = [_state(cfg.name, state, model_dir) for state in cfg.sequence_states()]
        self.active: dict[Any, Sequence] = {}

    @property
    def state_outputs(self) -> list[str]:
        return [s.spec.output_name for s in self.states]

    def waiting(self) -> int:
        return sum(len(s.waiting) for s in self.active.values())

    def arrive(self, req: InferRequest) -> bool:
        """True when the request may start now; False: it waits its turn."""
        seq = self.active.get(req.sequence.corrid)
        if seq is not None and (seq.running is not None or seq.waiting):
            seq.waiting.append(req)
            return False
        return True

    def begin(self, req: InferRequest, now: float) -> list[tuple[str, str, list[int], bytes]]:
        """Make `req` its sequence's running request; the control and state
        tensors to add to its inputs: [(name, datatype, shape, bytes)].
        Raises TorchpoolError when the request may not run (no such open
        sequence and no START, a correlation ID the model cannot take); the
        caller fails it and moves on with `after_failure`."""
        flags = req.sequence
        seq = self.active.get(flags.corrid)
        if not flags.start and (seq is None or not seq.open):
            raise TorchpoolError(errors.INVALID_ARG,
                                 f"inference request for sequence {flags.corrid} to model '{self.model}' "
                                 f"must specify the START flag on the first request of the sequence")
        tensors = [self._control_tensor(c, flags) for c in self.controls]
        if flags.start:
            if seq is None:
                seq = self.active[flags.corrid] = Sequence(flags.corrid)
            seq.open = True
            seq.state = {s.spec.input_name: (self._shape(s.spec.dims), s.initial) for s in self.states}
        for s in self.states:
            shape, data = seq.state[s.spec.input_name]
            tensors.append((s.spec.input_name, s.datatype, shape, data))
        seq.running = req
        seq.last_used = now
        return tensors

    def capture(self, req: InferRequest, descriptors: list, read: Callable[[Any, int, int], Any]) -> None:
        """Keep the state outputs of the sequence's finished request."""
        seq = self.active.get(req.sequence.corrid)
        if seq is None or seq.running is not req:
            return
        by_name = {d[0]: d for d in descriptors}
        for s in self.states:
            d = by_name.get(s.spec.output_name)
            if d is not None:
                _name, _datatype, shape, segment, offset, nbytes = d
                seq.state[s.spec.input_name] = (list(shape), bytes(read(segment, offset, nbytes)))

    def finished(self, req: InferRequest, now: float) -> Optional[InferRequest]:
        """The sequence's running request got its answer: the next request of
        the sequence to begin, if one waits. END closes the sequence."""
        seq = self.active.get(req.sequence.corrid)
        if seq is None or seq.running is not req:
            return None
        seq.running = None
        seq.last_used = now
        if req.sequence.end:
            seq.open = False
            seq.state = {}
        return self._next(seq)

    def after_failure(self, req: InferRequest) -> Optional[InferRequest]:
        """`begin` refused `req`: the next request of its sequence, if one
        waits and nothing of the sequence is running."""
        seq = self.active.get(req.sequence.corrid)
        if seq is None or seq.running is not None:
            return None
        return self._next(seq)

    def _next(self, seq: Sequence) -> Optional[InferRequest]:
        if seq.waiting:
            return seq.waiting.popleft()
        if not seq.open:
            del self.active[seq.corrid]
        return None

    def expire(self, now: float) -> list[Any]:
        """Drop sequences idle for longer than max_sequence_idle_microseconds."""
        idle = [c for c, s in self.active.items()
                if s.running is None and not s.waiting and now - s.last_used > self.idle_s]
        for corrid in idle:
            del self.active[corrid]
        return idle

    def drain(self) -> list[InferRequest]:
        """Every waiting request (to be failed); the sequences are dropped."""
        out = [req for s in self.active.values() for req in s.waiting]
        self.active.clear()
        return out

    # --- tensors
    def _shape(self, dims: tuple[int, ...]) -> list[int]:
        return ([1] if self.batched else []) + list(dims)

    def _control_tensor(self, c: _Control, flags: SequenceFlags) -> tuple[str, str, list[int], bytes]:
        if c.kind == CORRID:
            corrid = flags.corrid
            if not isinstance(corrid, int):
                raise TorchpoolError(errors.INVALID_ARG,
                                     f"model '{self.model}' takes the correlation ID as {c.datatype} in "
                                     f"'{c.name}': it must be an integer, got {corrid!r}")
            try:
                data = struct.pack(c.pack, corrid)
            except struct.error:
                raise TorchpoolError(errors.INVALID_ARG,
                                     f"correlation ID {corrid} does not fit {c.datatype} ('{c.name}' of "
                                     f"model '{self.model}')") from None
        else:
            on = {START: flags.start, END: flags.end, READY: True}[c.kind]
            data = struct.pack(c.pack, c.values[1] if on else c.values[0])
        return c.name, c.datatype, self._shape((1,)), data


def _control(model: str, entry: dict) -> _Control:
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
        return _Control(name, kind, datatype, _CORRID_FORMATS[datatype])
    for key, (datatype, pack) in _PAIRS.items():
        pair = control.get(key)
        if pair:
            if len(pair) != 2:
                raise TorchpoolError(errors.INVALID_ARG, f"model '{model}': control '{name}' {key} "
                                                         f"needs two values (false, true)")
            values = tuple(bool(v) for v in pair) if datatype == "BOOL" else tuple(pair)
            return _Control(name, kind, datatype, pack, values)
    raise TorchpoolError(errors.INVALID_ARG, f"model '{model}': control '{name}' ({kind}) sets none of "
                                             f"int32_false_true, fp32_false_true, bool_false_true")


def _state(model: str, spec: SequenceState, model_dir: Path) -> _State:
    """The broker's view of a state: wire datatype and initial bytes."""
    datatype = datatypes.config_to_wire(spec.data_type)
    name = spec.input_name
    if datatype == "BYTES" or any(d < 0 for d in spec.dims):
        raise TorchpoolError(errors.UNSUPPORTED, f"model '{model}': state '{name}' must have a fixed "
                                                 f"shape and a fixed-size datatype")
    nbytes = math.prod(spec.dims) * datatypes.element_size(datatype)
    initial = bytes(nbytes)
    init = spec.initial_state
    if init and init.get("data_file"):
        path = model_dir / "initial_state" / str(init["data_file"])
        try:
            initial = path.read_bytes()
        except OSError as exc:
            raise TorchpoolError(errors.INVALID_ARG, f"model '{model}': initial state of '{name}': "
                                                     f"cannot read {path}: {exc.strerror}") from None
        if len(initial) != nbytes:
            raise TorchpoolError(errors.INVALID_ARG, f"model '{model}': initial state file {path} has "
                                                     f"{len(initial)} bytes, state '{name}' needs {nbytes}")
    return _State(spec, datatype, initial)
