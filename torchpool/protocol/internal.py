"""Broker <-> worker messages (internal; over a SOCK_SEQPACKET socket pair).

Each message is one msgpack array; the first element says what it is. In
Python each message is a NamedTuple (a tuple, so building and packing one
costs next to nothing, and indexing still works):

    raw = internal.encode(internal.Run(batch_id, inputs, outputs, releases))
    msg = internal.decode(raw)          # -> Run | Release | Forget | Stop | Segments |
                                        #    Adopt | Ready | LoadFailed | Done | Failed | Served
    if type(msg) is internal.Done: ... msg.outputs[0].segment ...
    match msg:
        case internal.Failed(batch_id, code, message): ...

`decode` raises `ProtocolViolation` (a ValueError) for anything that is not a
message of this module. Descriptors decode into NamedTuples: `Run.inputs`
into `InputDescriptor` (`reuse` is False when the wire has 7 elements),
`Run.outputs` into `str | OutputTarget | Classify`, `Done.outputs` into
`OutputDescriptor`. Released blocks (`Run.releases`, `Release.blocks`) and
`Done.timings` stay plain lists with the fields of `Block` and `Timings`
(`segment, offset, size = block` reads either): wrapping each costs ~0.15 us
per item on the hot path, and nobody reads them by name. Shapes stay lists.
Encoding takes lists or tuples anywhere (a NamedTuple packs as an array).
Decoding a RUN with two inputs costs about 1 us more than `msgpack.unpackb`
alone on the 2-core development VM, a DONE with two outputs about 0.8 us,
any other message about 0.2 us (`tests/unit/test_internal.py` measures it).

The wire format (what each array holds) is:

A tensor descriptor is `[name, datatype, shape, segment, offset, nbytes, generation]`:
the bytes live in shared memory, only the descriptor crosses the socket.
`segment` names a daemon segment, or is `[key, inode]` for a client's
registered region; a non-zero `generation` is checked against the client
block header in front of `offset`. An input descriptor may carry an eighth
element, `true`, when the answer may point into its block: a client's copy
of the input (`reuse`, see docs/protocol.md), or the broker's own copy of an
inline input, which the broker keeps until the answer is sent
(`InputDescriptor` always encodes it, `false` by default; a decoder takes 7
or 8 elements). A requested output is a name, or
`[name, [key, inode], offset, capacity]` to be written into a region, or
`[name, count]` to be answered as its top `count` classes (Triton's
classification extension: a BYTES tensor of "score:index[:label]").

either way
    [SEGMENTS, [[name, size], ...]]   with one fd per segment attached (SCM_RIGHTS):
                                      the daemon's memory has no names, so a segment
                                      is handed over before any descriptor names it;
                                      a worker's [name, size, lend_id] is a lending
                                      area of that session (worker/lending.py)
broker -> worker
    [RUN, batch_id, [descriptor, ...], [requested output, ...], [released block, ...], lend_to]
                                      lend_to: the lending id of the one local session
                                      the batch's outputs may be lent to (0: none)
    [RELEASE, [released block, ...]]
    [FORGET, [segment name | [key, inode] | direct name | "lend-<id>", ...]]   unmap
                                      (close): a client session or region is gone
    [STOP]
    [ADOPT, name, session, max_bytes_elements, max_bytes_tensor_bytes]   with one fd
                                      attached: a local client's direct socket (worker/direct.py);
                                      the worker's first also has its report ring's (reports.py)
A released block is `[segment, offset, size]` of an output block the broker
no longer reads: the worker may reuse it.
worker -> broker
    [READY, pid, device]
    [FORGET, [area name]]             a lending area is closed: the broker unmaps it
    [LOAD_FAILED, code, message]
    [DONE, batch_id, [descriptor, ...], [input_ns, infer_ns, output_ns], [reused output, ...]]
    [FAILED, batch_id, code, message]
    [SERVED, [[ok, request_ns, queue_ns, session, execution], ...], closed]
                                      direct requests answered that the report ring had no room
                                      for (none: "read my ring", it is half full) (ok 0: the
                                      model failed; session: its client's, which they renew;
                                      execution: [batch_size, requests, input_ns, infer_ns,
                                      output_ns] on the first request of each execution, else nil);
                                      closed: the paths a FORGET named are closed
An output descriptor is `[name, datatype, shape, segment, offset, nbytes]`;
a reused output's descriptor points into the input block it is a view of
(nothing to release), every other one into the worker's arena or a region.
A FAILED message's text is meant for the client: it names the model and
instance and carries no traceback (the worker logs that itself).
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple, Sequence, Union

import msgpack

from .reports import Record

RUN = 1
STOP = 2
RELEASE = 3
FORGET = 4
SEGMENTS = 5
ADOPT = 6
READY = 10
LOAD_FAILED = 11
DONE = 12
FAILED = 13
SERVED = 14

# A message is far smaller than this; sized for descriptors of many outputs.
MAX_MESSAGE = 1 << 20


class ProtocolViolation(ValueError):
    """Bytes that are not a message of this protocol."""


# ------------------------------------------------------------ nested values

# A segment on the wire: a daemon segment's name, or [key, inode] of a client's region.
SegmentRef = Union[str, Sequence[Union[str, int, bytes]]]
# [DEVICE_REF, CUDA IPC handle, device id]: a client's GPU memory (Triton's CUDA
# shared memory), which the worker opens from its handle (worker/cuda_ipc.py)
DEVICE_REF = "cuda"


def is_device_ref(ref: object) -> bool:
    """Does a location name a client's GPU memory (a DEVICE_REF)?"""
    return isinstance(ref, list) and len(ref) == 3 and ref[0] == DEVICE_REF


# A released block, `Block` or the plain [segment, offset, size] it decodes into.
BlockRef = Union["Block", Sequence[Union[str, int]]]

class InputDescriptor(NamedTuple):
    name: str
    datatype: str               # wire name: FP32, BYTES, ...
    shape: Sequence[int]
    segment: SegmentRef         # daemon segment name, [key, inode] of a client region, or a DEVICE_REF
    offset: int
    nbytes: int
    generation: int = 0         # non-zero: checked against the client block header
    reuse: bool = False         # the answer may point into this input's block


class OutputDescriptor(NamedTuple):
    name: str
    datatype: str
    shape: Sequence[int]
    segment: SegmentRef         # the worker's arena segment, an input's segment (reused), or a region
    offset: int
    nbytes: int


class OutputTarget(NamedTuple):
    """A requested output the client wants written into its region."""
    name: str
    region: Sequence[Union[str, int]]   # [key, inode]
    offset: int
    capacity: int


class Classify(NamedTuple):
    """A requested output answered as its top `count` classes (worker/classify.py)."""
    name: str
    count: int  # type: ignore[assignment]  # shadows tuple.count; the wire's name for it


class Block(NamedTuple):
    """An output block of the worker's arena that the broker is done with."""
    segment: str
    offset: int
    size: int


class Timings(NamedTuple):
    input_ns: int
    infer_ns: int
    output_ns: int


# ------------------------------------------------------------ messages
# A message's kind is not a field: `encode` puts KIND_OF[type(msg)] first.

class Run(NamedTuple):
    batch_id: int
    inputs: Sequence[InputDescriptor]
    outputs: Sequence[Union[str, OutputTarget, Classify]]   # empty: every output
    releases: Sequence[BlockRef] = ()     # piggybacked frees
    lend_to: int = 0            # the session whose area the outputs go into (worker/lending.py)


class Release(NamedTuple):
    blocks: Sequence[BlockRef]


class Forget(NamedTuple):
    refs: Sequence[SegmentRef]  # also a direct path's name, or "lend-<id>"


class Stop(NamedTuple):
    """No fields: the worker finishes its batch and exits."""


class Segments(NamedTuple):
    """Segments handed over: their fds travel with the message, in this order."""
    # [[name, size], ...]; a worker's lending area: [name, size, lend_id]
    segments: Sequence[Sequence[Union[str, int]]]


DIRECT_PREFIX = "direct-"          # names a direct path (ADOPT, FORGET)
LEND_PREFIX = "lend-"              # FORGET "lend-<id>": that session's lending areas go


def lend_ref(lend_id: int) -> str:
    """How a FORGET names the lending areas of the session with this lending id."""
    return f"{LEND_PREFIX}{lend_id}"


class Adopt(NamedTuple):
    """A local client's direct socket: its fd travels with the message."""
    name: str                   # "direct-N": a later FORGET names it to close it
    session: str                # the client's session token: its requests renew the session
    max_bytes_elements: int     # the broker's TensorLimits, which the worker's checks apply
    max_bytes_tensor_bytes: int
    spin_us: int                # how long the worker may poll without sleeping (rules/spin.py)


class Ready(NamedTuple):
    pid: int
    device: str


class LoadFailed(NamedTuple):
    code: str
    message: str


class Done(NamedTuple):
    batch_id: int
    outputs: Sequence[OutputDescriptor]
    timings: Sequence[int]      # Timings | [input_ns, infer_ns, output_ns]
    reused: Sequence[str] = ()  # names of outputs that are views of a reusable input


class Failed(NamedTuple):
    batch_id: int
    code: str
    message: str


class Served(NamedTuple):
    """Direct requests answered since the last report, for the statistics."""
    records: Sequence[Record]   # [[ok, request_ns, queue_ns, session, execution], ...] (lists on the wire)
    closed: bool = False        # sent after closing the direct paths a FORGET named


Message = Union[Run, Release, Forget, Stop, Segments, Adopt, Ready, LoadFailed, Done, Failed, Served]

# The first element of each message's array.
KIND_OF: dict[type[Message], int] = {
    Run: RUN, Release: RELEASE, Forget: FORGET, Stop: STOP, Segments: SEGMENTS, Adopt: ADOPT,
    Ready: READY, LoadFailed: LOAD_FAILED, Done: DONE, Failed: FAILED, Served: SERVED,
}


def encode(msg: Message) -> bytes:
    """The msgpack array for a message: its kind, then its fields."""
    raw: bytes = msgpack.packb((KIND_OF[msg.__class__], *msg), use_bin_type=True)
    return raw


# ------------------------------------------------------------ decoding
# This is the hot path (one RUN and one DONE per batch): tuple.__new__ builds
# a NamedTuple from the decoded list without the constructor's argument
# handling, and the nested values are built in comprehensions, not per-item
# calls. The peer is the daemon itself, not a client: the values are taken
# as they come, and only an input descriptor's length (7 or 8) and the first
# output descriptor's are checked; a wrong value fails that batch, not the
# process (the worker catches everything a batch raises).

_new = tuple.__new__

# A decoded message: msgpack's array, its elements taken as they come (the
# peer is the daemon; no per-element checks on this path), left untyped once,
# here: the decoders index into it by position, the wire's layout of each kind.
Decoded = list[Any]


def _run(m: Decoded) -> Run:
    inputs = [_new(InputDescriptor, d) if len(d) == 8 else _input7(d) for d in m[2]]
    requested = m[3]
    for r in requested:
        if r.__class__ is not str:      # rare: an output into a client's region, or classified
            requested = [r if r.__class__ is str else _requested(r) for r in requested]
            break
    return _new(Run, (m[1], inputs, requested, m[4] if len(m) > 4 else [], m[5] if len(m) > 5 else 0))


def _done(m: Decoded) -> Done:
    outputs = [_new(OutputDescriptor, d) for d in m[2]]
    if outputs and len(outputs[0]) != 6:
        _bad("an output descriptor", outputs[0])
    return _new(Done, (m[1], outputs, m[3], m[4] if len(m) > 4 else []))


def _requested(r: Decoded) -> Union[OutputTarget, Classify]:
    if len(r) == 4:
        return _new(OutputTarget, r)
    if len(r) == 2:
        return _new(Classify, r)
    _bad("a requested output", r)
    raise AssertionError("unreachable")


def _input7(d: Decoded) -> InputDescriptor:
    if len(d) != 7:
        _bad("an input descriptor", d)
    d.append(False)
    return _new(InputDescriptor, d)


def _bad(what: str, value: Sequence[object]) -> bool:
    raise ProtocolViolation(f"{what} of {len(value)} elements: {value!r}")


_STOP = Stop()

_DECODERS: dict[int, Callable[[Decoded], Message]] = {
    RUN: _run,
    RELEASE: lambda m: _new(Release, (m[1],)),
    FORGET: lambda m: _new(Forget, (m[1],)),
    STOP: lambda m: _STOP,
    SEGMENTS: lambda m: _new(Segments, (m[1],)),
    ADOPT: lambda m: _new(Adopt, (m[1], m[2], m[3], m[4], m[5])),
    READY: lambda m: _new(Ready, (m[1], m[2])),
    LOAD_FAILED: lambda m: _new(LoadFailed, (m[1], m[2])),
    DONE: _done,
    FAILED: lambda m: _new(Failed, (m[1], m[2], m[3])),
    SERVED: lambda m: _new(Served, (m[1], len(m) > 2 and m[2] is True)),
}


def decode(raw: Union[bytes, memoryview]) -> Message:
    """The message in `raw` (one msgpack array); raises ProtocolViolation.
    Trailing elements a newer peer may add are ignored."""
    try:
        m: Decoded = msgpack.unpackb(raw, raw=False)
        return _DECODERS[m[0]](m)
    except ProtocolViolation:
        raise
    except Exception as exc:   # not msgpack, not an array, unknown kind, too short
        raise ProtocolViolation(f"not a worker-protocol message: {exc!r}") from None


__all__ = [
    "ADOPT", "Adopt", "Block", "BlockRef", "DIRECT_PREFIX", "LEND_PREFIX", "lend_ref", "Classify", "DONE", "Done",
    "DEVICE_REF", "FAILED", "FORGET", "Failed", "Forget", "is_device_ref", "InputDescriptor", "KIND_OF", "SegmentRef",
    "LOAD_FAILED", "LoadFailed", "MAX_MESSAGE", "Message", "OutputDescriptor", "OutputTarget",
    "ProtocolViolation", "READY", "RELEASE", "RUN", "Ready", "Release", "Run", "SEGMENTS",
    "SERVED", "STOP", "Segments", "Served", "Stop",
    "Timings", "decode", "encode",
]
