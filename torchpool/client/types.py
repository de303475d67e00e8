"""The client's public value types: region references, requested outputs
(into a region, or as classes), results, errors."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generator, cast, Mapping, Optional, Protocol, Sequence, TypeVar, Union

import numpy as np

from ..protocol import datatypes, tensors
from ..protocol.errors import InferenceError
from ..protocol.messages import Header

if TYPE_CHECKING:
    import torch
    from typing_extensions import Buffer



@dataclass(frozen=True)
class SharedMemoryRef:
    """An input whose bytes are in a registered region:
    `SharedMemoryRef(region, byte_size, offset=0, datatype="FP32", shape=(1, 16))`.

    `region` is the name given to `register_system_shared_memory`; `offset`
    is relative to the region's own offset; `byte_size` bytes starting there
    hold the tensor (C order; BYTES in Triton's length-prefixed layout).
    """

    region: str
    byte_size: int
    offset: int = 0
    datatype: str = ""
    shape: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        if self.datatype not in datatypes.WIRE_DATATYPES:
            raise ValueError(f"SharedMemoryRef for region '{self.region}': datatype must be one of "
                             f"{sorted(datatypes.WIRE_DATATYPES)}, got {self.datatype!r}")
        if self.byte_size < 0 or self.offset < 0:
            raise ValueError(f"SharedMemoryRef for region '{self.region}': byte_size and offset "
                             f"must be non-negative")

    def wire(self) -> list[object]:
        """The `region` reference as it travels: [region, byte_size, offset]."""
        return cast("list[object]", self.entry("")[tensors.REGION])

    def entry(self, name: str) -> tensors.Entry:
        """The tensor entry of input `name` read from this region."""
        entry = tensors.tensor_entry(name, self.datatype, self.shape)
        tensors.put_region(entry, self.region, self.byte_size, self.offset)
        return entry


@dataclass(frozen=True)
class RawTensor:
    """An input given as its bytes in the wire layout: `RawTensor("FP32",
    (1, 16), buf)`. For callers that already hold tensor bytes (the HTTP and
    gRPC gateways: a request body, Triton's length-prefixed BYTES, FP16 or
    BF16 bits) and must not convert them; the daemon checks the size."""

    datatype: str
    shape: tuple[int, ...]
    data: Buffer

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        if self.datatype not in datatypes.WIRE_DATATYPES:
            raise ValueError(f"RawTensor: datatype must be one of {sorted(datatypes.WIRE_DATATYPES)}, "
                             f"got {self.datatype!r}")


@dataclass(frozen=True)
class OutputRef:
    """Ask for output `name` to be written straight into a registered region:
    `infer(..., outputs=["OUT0", OutputRef("OUT1", "my_region", 4096)])`.
    The result then holds a `RegionOutput` for it."""

    name: str
    region: str
    byte_size: int
    offset: int = 0

    def wire(self) -> tensors.Entry:
        return tensors.output_request(self.name, self.region, self.byte_size, self.offset)


@dataclass(frozen=True)
class Classification:
    """Ask for output `name` as its top `count` classes (Triton's
    classification extension): `infer(..., outputs=[Classification("PROBS", 3)])`.
    The result holds, instead of the tensor, a BYTES object array of
    b"score:index:label" (b"score:index" where the output's label file has
    no label for that index), highest score first: shape [batch, k] for a
    batching model, [k] otherwise, k = min(count, elements per item)."""

    name: str
    count: int

    def __post_init__(self) -> None:
        if not isinstance(self.count, int) or isinstance(self.count, bool) or self.count < 1:
            raise ValueError(f"Classification of output '{self.name}': count must be a positive "
                             f"integer, got {self.count!r}")

    def wire(self) -> tensors.Entry:
        return tensors.classification_request(self.name, self.count)


@dataclass(frozen=True)
class RegionOutput:
    """An output the worker wrote into the caller's region: `nbytes` bytes at
    `offset` (relative to the region's offset) of region `region`, a tensor of
    `datatype` and `shape`. The bytes are in the caller's memory;
    `as_array(buf)` views them as numpy given the caller's mapping of the
    region (`buf` = the region's bytes, i.e. the segment starting at the
    registered offset)."""

    name: str
    region: str
    offset: int
    nbytes: int
    datatype: str
    shape: tuple[int, ...]

    def as_array(self, buf: Buffer) -> np.ndarray:
        data = memoryview(buf).cast("B")[self.offset:self.offset + self.nbytes]
        return tensors.decode_array(self.datatype, self.shape, data)


class InferResult(dict[str, "OutputValue"]):
    """{output name: array} — also a context manager:

        with client.infer(model, inputs) as out:
            use(out["OUTPUT0"])

    On exit it drops its own references. Outputs lent in place by the daemon
    are released when the last view of them is garbage, never earlier: a
    view kept beyond the `with` stays valid (until `close()`).
    """

    def release(self) -> None:
        self.clear()

    def __enter__(self) -> "InferResult":
        return self

    def __exit__(self, *exc: object) -> None:
        self.clear()


class NoAnswer(InferenceError):
    """No answer came. `code` says why: DEADLINE_EXCEEDED (the daemon is
    reachable but did not answer within the time limit: the request may
    still be running) or UNAVAILABLE (no daemon reached, or the connection
    was lost while waiting). `sent` is False when the request never left
    this process (nothing was there to take it), so sending it elsewhere
    cannot run it twice. `path`: the direct path it was sent on, where
    several stand as one (aio_lane.AsyncPaths), for the daemon to say why
    that one closed."""

    def __init__(self, code: str, message: str, sent: bool = True) -> None:
        super().__init__(code, message)
        self.sent = sent
        self.path: Optional[DirectPath] = None


class SessionLost(Exception):
    """The daemon no longer knows our session (lease expired, daemon restarted)."""

    def __init__(self, token: Optional[str], error: InferenceError) -> None:
        super().__init__(str(error))
        self.token = token
        self.error = error


class Path(Protocol):
    """The channel a `Call` goes on, other than ZeroMQ: a session's lane or a
    direct path. The sync client's are lane.LaneSocket and direct.DirectSocket,
    the asyncio client's aio_lane.AsyncLane, AsyncDirect and AsyncPaths: the
    driver that made one (through `ClientState.lane_factory` /
    `direct_factory`) sends on it."""

    @property
    def lost(self) -> bool: ...

    @property
    def zmq_fallback(self) -> bool: ...


class Lane(Path, Protocol):
    """A session's request lane (lane.LaneSocket, aio_lane.AsyncLane)."""

    def close(self, wait: float) -> None: ...


class DirectPath(Path, Protocol):
    """A direct path to a model's instance (or several standing as one)."""

    model: str
    name: str               # the daemon's name of the path (for ended_flow)
    version: object         # the model version it serves (as the daemon said)

    def spin(self, window_us: int) -> None: ...

    def shut(self) -> None: ...

    def lost_error(self) -> InferenceError: ...


Frames = list["Buffer"]
"""A message's frames as sent: the packed header, then its payload."""


class Call:
    """One request a flow wants sent: the driver sends `frames` and answers
    with the reply to `rid` (or throws the error / NoAnswer in)."""

    __slots__ = ("rid", "frames", "timeout", "channel", "request")

    def __init__(self, rid: int, frames: Frames, timeout: Optional[float], channel: Optional[Path] = None,
                 request: bool = False) -> None:
        self.rid, self.frames, self.timeout = rid, frames, timeout
        self.channel = channel       # the session's lane (client/lane.py) when it goes there
        self.request = request       # the inference request itself (not a hello, a grow, ...)



Reply = tuple[Header, Sequence["Buffer"]]
"""An answer: its header and its payload frames."""

T = TypeVar("T")

# a flow yields the calls it wants sent and is sent each one's answer; it returns a T
Flow = Generator[Call, Reply, T]

if TYPE_CHECKING:
    Tensor = Union[np.ndarray, torch.Tensor]
else:
    Tensor = np.ndarray
"""An output's value: a numpy array, or a torch tensor for BF16 (values.py)."""

JSONDocument = dict[str, Any]
"""A JSON document the daemon answers with (model metadata and configuration,
statistics, the repository index): Triton's shapes, as tritonclient returns
them (docs/client.md), not re-checked here."""

OutputValue = Union[Tensor, RegionOutput]
"""What an `InferResult` holds: a tensor, or where one was written into a region."""

InputValue = Union[Tensor, RawTensor, SharedMemoryRef, Sequence[str], Sequence[bytes]]
"""What `infer` takes as an input: a numpy array or torch tensor, a list of
str or bytes (BYTES), a `RawTensor` or a `SharedMemoryRef`."""

Inputs = Mapping[str, InputValue]
"""The inputs of a request, by name."""

RequestedOutput = Union[str, OutputRef, Classification]
"""An output asked for: its name, an `OutputRef` or a `Classification`."""

Version = Optional[Union[int, str]]
"""A model version as callers name it: its number (as int or text); None (or
"") for the version the model's policy picks."""

SequenceId = Union[int, str]
"""A sequence's id: a non-zero int or a non-empty str (0 / "": no sequence)."""

ModelConfig = Union[dict[str, object], str, None]
"""A configuration given to `load`: a dict, or its JSON text; None: the model's file."""
