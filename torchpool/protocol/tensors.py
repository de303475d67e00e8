"""The tensor entry of the wire protocol: its one encoder and decoder.

A tensor entry (docs/protocol.md, "Tensor map") is a msgpack map
`{"name", "datatype", "shape"}` plus exactly one of these, which say where
the bytes are:

    "data":   bin           the bytes, inline in the header frame
              int           1-based index of the payload frame holding them
    "shm":    [segment, offset, nbytes, generation]
                            an arena block (input: the client's arena; output:
                            lent in the worker's memory); data at `offset`, its
                            64-byte block header at `offset - 64`
    "own":    [segment, offset, nbytes]
                            output only: a range of one of the request's own
                            `"reuse": true` input blocks
    "region": [name, byte_size, offset]
                            a registered region (input, and region output)

Everyone who writes or reads one of these uses this module, so each of those
facts (key names, list layouts, the inline limits, the block header) is
written down once. It imports numpy only (never torch, never zmq): the client
library uses it in processes without either.

What each function is for:

- `tensor_entry(name, datatype, shape)`: the map, without its bytes.
- `put_data(entry, src, frames, make_frame=None)`: the one "inline if small,
  else a separate frame" rule, for a request (client) or an answer (broker).
  `src` is bytes or an array (made C-contiguous/native here). Returns the
  frame it appended (`make_frame(data)` if given, e.g. a tracked zero-copy
  `zmq.Frame`, else the memoryview itself), or None when it went inline.
- `worth_descriptor(nbytes)`: a local session sends this tensor (input or
  lent output) as a shared-memory descriptor, not inline bytes.
- `put_shm`, `put_own`, `put_region`: fill in the other three forms.
- `output_request(name, region, byte_size, offset)`: a requested output to be
  written into a region (`"outputs": [..., {"name", "region"}]`).
- `classification_request(name, count)`: a requested output answered as its
  top `count` classes (Triton's classification extension:
  `"outputs": [..., {"name", "classification": count}]`).
- `location(entry)`: which form an entry carries (`SHM`, `OWN`, `REGION`,
  `DATA`; checked in that order).
- `shm_ref`, `own_ref`, `region_ref`: the descriptor of an entry, unpacked
  into a named tuple; INVALID_ARG when it is not the documented list.
- `tensor_payload(entry, frames)`: the bytes of a `"data"` entry (inline, or
  the frame it names); INVALID_ARG when it has none or names a missing frame.
- `decode_array(datatype, shape, data)`: bytes -> numpy (a read-only view, no
  copy; BYTES as an object array of bytes; BF16 as raw uint16).
- `contiguous_bytes(src)`: the C-contiguous, native-order bytes of an array.
- `write_block_header`, `read_block_header` and `BLOCK_HEADER_BYTES`,
  `BLOCK_MAGIC`, `BLOCK_HEADER_LAYOUT`: the header in front of every client
  arena block (`u32 magic "TPB1", u32 0, u64 generation, u64 nbytes`, LE).
"""
from __future__ import annotations

import struct
from typing import TYPE_CHECKING, Callable, NamedTuple, Optional, Protocol, Sequence, TypeVar, Union

import numpy as np

if TYPE_CHECKING:
    import numpy.typing as npt
    from typing_extensions import Buffer

from . import datatypes
from .errors import INVALID_ARG, TorchpoolError

# A tensor entry (or any map of the wire): msgpack values, told apart by their keys.
Entry = dict[str, object]
# Tensor bytes: bytes, a memoryview, a frame, or a numpy array (made contiguous here).
Source = Union["Buffer", "npt.NDArray[np.generic]"]

# --- key names ---------------------------------------------------------------
NAME, DATATYPE, SHAPE = "name", "datatype", "shape"
DATA = "data"        # bin (inline) or int (1-based payload frame index)
SHM = "shm"          # [segment, offset, nbytes, generation]
OWN = "own"          # [segment, offset, nbytes]
REGION = "region"    # [name, byte_size, offset]
REUSE = "reuse"      # true beside an input "shm": the client's own copy; outputs may view it
CLASSIFICATION = "classification"   # in a requested output: answer its top-k classes

# --- size rules ----------------------------------------------------------------
# Tensors up to this size ride inside the header frame; larger ones go as
# separate payload frames, so nobody copies them into the msgpack buffer.
INLINE_LIMIT = 64 * 1024

# A local session sends tensors larger than this as shared-memory descriptors
# (both ways); up to it they travel inline: a descriptor and its bookkeeping
# cost more than copying a few kilobytes. Buffers from `Client.empty()` are
# already in shared memory and go as descriptors whatever their size.
LOCAL_MIN_BYTES = 16 * 1024

# --- the client arena block header -----------------------------------------------
BLOCK_HEADER_BYTES = 64                          # in front of every arena block's data
BLOCK_MAGIC = 0x31425054                         # "TPB1"
BLOCK_HEADER_LAYOUT = struct.Struct("<IIQQ")     # magic, reserved (0), generation, nbytes


def write_block_header(buf: Buffer, start: int, generation: int, nbytes: int) -> None:
    """Write a block header at `start` (data at start + BLOCK_HEADER_BYTES)."""
    BLOCK_HEADER_LAYOUT.pack_into(buf, start, BLOCK_MAGIC, 0, generation, nbytes)


def clear_block_header(buf: Buffer, start: int) -> None:
    """Zero a block header: no descriptor can match the block any more."""
    BLOCK_HEADER_LAYOUT.pack_into(buf, start, 0, 0, 0, 0)


def read_block_header(buf: Buffer, start: int) -> tuple[int, int, int]:
    """(magic, generation, nbytes) of the block header at `start`."""
    magic, _, generation, nbytes = BLOCK_HEADER_LAYOUT.unpack_from(buf, start)
    return magic, generation, nbytes


# --- descriptors -----------------------------------------------------------------

class ShmRef(NamedTuple):
    segment: str
    offset: int
    nbytes: int
    generation: int


class OwnRef(NamedTuple):
    segment: str
    offset: int
    nbytes: int


class RegionRef(NamedTuple):
    name: str
    byte_size: int
    offset: int


def _ints(value: Sequence[object]) -> bool:
    return all(isinstance(v, int) and not isinstance(v, bool) for v in value)


def shm_ref(entry: Entry) -> ShmRef:
    v = entry.get(SHM)
    if not (isinstance(v, list) and len(v) == 4 and _ints(v[1:])):
        raise TorchpoolError(INVALID_ARG, f"tensor '{entry.get(NAME)}': '{SHM}' must be "
                                          f"[segment, offset, nbytes, generation]")
    return ShmRef(*v)


def own_ref(entry: Entry) -> OwnRef:
    v = entry.get(OWN)
    if not (isinstance(v, list) and len(v) == 3 and _ints(v[1:])):
        raise TorchpoolError(INVALID_ARG, f"tensor '{entry.get(NAME)}': '{OWN}' must be "
                                          f"[segment, offset, nbytes]")
    return OwnRef(*v)


def region_ref(entry: Entry) -> RegionRef:
    v = entry.get(REGION)
    if not (isinstance(v, list) and len(v) == 3 and _ints(v[1:])):
        raise TorchpoolError(INVALID_ARG, f"tensor '{entry.get(NAME)}': '{REGION}' must be "
                                          f"[name, byte_size, offset]")
    return RegionRef(*v)


def location(entry: Entry) -> str:
    """Which form the entry's bytes take: SHM, OWN, REGION or DATA (checked
    in that order)."""
    if SHM in entry:
        return SHM
    if OWN in entry:
        return OWN
    if REGION in entry:
        return REGION
    return DATA


# --- encoding ----------------------------------------------------------------------

def tensor_entry(name: str, datatype: str, shape: Sequence[int]) -> Entry:
    return {NAME: name, DATATYPE: datatype, SHAPE: list(shape)}


def contiguous_bytes(src: Source) -> memoryview:
    """The C-contiguous, native-order bytes of an array (bytes pass as they are)."""
    if isinstance(src, np.ndarray):
        if not src.dtype.isnative:
            src = src.astype(src.dtype.newbyteorder("="))
        src = np.ascontiguousarray(src).reshape(-1)   # memoryview cannot cast a 0 in a shape
    # (numpy declares an ndarray a buffer, __buffer__, for Python 3.12 and later only)
    return memoryview(src).cast("B")  # type: ignore[arg-type]


_F = TypeVar("_F")
_T_contra = TypeVar("_T_contra", contravariant=True)


class Frames(Protocol[_T_contra]):
    """Where put_data appends a frame (a list of frames, or of anything wider)."""

    def append(self, frame: _T_contra, /) -> None: ...
    def __len__(self) -> int: ...


def put_data(entry: Entry, src: Source, frames: Frames[Union[_F, memoryview]],
             make_frame: Optional[Callable[[memoryview], _F]] = None,
             inline: bool = True) -> Union[_F, memoryview, None]:
    """Put the bytes of `src` into `entry`: inline when at most INLINE_LIMIT
    (and `inline`), else appended to `frames` (as `make_frame(data)` when
    given) and named by its 1-based index. Returns the appended frame, or
    None when inline."""
    if not inline:
        data = contiguous_bytes(src)
        frame = data if make_frame is None else make_frame(data)
        frames.append(frame)
        entry[DATA] = len(frames)
        return frame
    if type(src) is np.ndarray and src.nbytes <= INLINE_LIMIT:
        dtype = src.dtype
        if dtype.isnative and not dtype.hasobject:
            entry[DATA] = src.tobytes()     # C order, one copy: what the general path makes
            return None
    data = contiguous_bytes(src)
    if data.nbytes <= INLINE_LIMIT:
        entry[DATA] = bytes(data)
        return None
    frame = data if make_frame is None else make_frame(data)
    frames.append(frame)
    entry[DATA] = len(frames)
    return frame


def worth_descriptor(nbytes: int) -> bool:
    """Should a local session send `nbytes` as a descriptor (not inline)?"""
    return nbytes > LOCAL_MIN_BYTES


def put_shm(entry: Entry, segment: str, offset: int, nbytes: int, generation: int,
            reuse: bool = False) -> None:
    entry[SHM] = [segment, offset, nbytes, generation]
    if reuse:
        entry[REUSE] = True


def put_own(entry: Entry, segment: str, offset: int, nbytes: int) -> None:
    entry[OWN] = [segment, offset, nbytes]


def put_region(entry: Entry, region: str, byte_size: int, offset: int) -> None:
    entry[REGION] = [region, int(byte_size), int(offset)]


def output_request(name: str, region: str, byte_size: int, offset: int) -> Entry:
    """A requested output the worker writes into a registered region."""
    return {NAME: name, REGION: [region, int(byte_size), int(offset)]}


def classification_request(name: str, count: int) -> Entry:
    """A requested output answered as its top `count` classes: a BYTES tensor
    of "score:index[:label]" strings, [batch, k] for a batching model, else [k]."""
    return {NAME: name, CLASSIFICATION: int(count)}


# --- decoding ----------------------------------------------------------------------

# datatypes.numpy_dtype of every wire datatype, looked up once (KeyError for
# any other name, as numpy_dtype raises)
_NUMPY_DTYPES = {name: datatypes.numpy_dtype(name) for name in datatypes.WIRE_DATATYPES}


def tensor_payload(entry: Entry, frames: Sequence[Buffer]) -> Buffer:
    """The bytes of a tensor entry: inline bytes, or the payload frame it names."""
    data = entry.get(DATA)
    if type(data) is bytes:             # inline: the common case first
        return data
    if isinstance(data, int) and not isinstance(data, bool):
        if not 1 <= data < len(frames) + 1:
            raise TorchpoolError(INVALID_ARG, f"tensor '{entry.get(NAME)}' refers to payload "
                                              f"frame {data}, but the message has {len(frames)}")
        return frames[data - 1]
    if isinstance(data, (bytes, bytearray, memoryview)):
        return data
    raise TorchpoolError(INVALID_ARG, f"tensor '{entry.get(NAME)}' has no data")


def decode_array(datatype: str, shape: Sequence[int], data: Buffer) -> np.ndarray:
    """Tensor bytes as numpy: a read-only view that keeps `data` alive (no
    copy); BYTES as an object array of bytes; BF16 as its raw uint16 bits."""
    if datatype == "BYTES":
        items = datatypes.decode_bytes(data)
        arr = np.empty(len(items), dtype=object)
        arr[:] = items
        return arr.reshape(shape)
    # (numpy's stubs list the buffer types they know; any buffer does)
    out: np.ndarray = np.frombuffer(data, dtype=_NUMPY_DTYPES[datatype]).reshape(shape)  # type: ignore[call-overload]
    return out
