"""Datatypes: KServe v2 wire names, Triton config names, numpy and torch.

Wire names are Triton's (`FP32`, `BYTES`, ...); config names are `TYPE_FP32`,
`TYPE_STRING`, ... This module must not import torch at import time: the
client library uses it in processes that never load torch.
"""
from __future__ import annotations

import itertools
import struct
from typing import TYPE_CHECKING, Iterable, Optional

import numpy as np

if TYPE_CHECKING:
    import torch
    from typing_extensions import Buffer

# wire name -> (element size in bytes, numpy dtype or None)
_WIRE: dict[str, tuple[int, Optional[np.dtype]]] = {
    "BOOL": (1, np.dtype(np.bool_)),
    "UINT8": (1, np.dtype(np.uint8)),
    "UINT16": (2, np.dtype(np.uint16)),
    "UINT32": (4, np.dtype(np.uint32)),
    "UINT64": (8, np.dtype(np.uint64)),
    "INT8": (1, np.dtype(np.int8)),
    "INT16": (2, np.dtype(np.int16)),
    "INT32": (4, np.dtype(np.int32)),
    "INT64": (8, np.dtype(np.int64)),
    "FP16": (2, np.dtype(np.float16)),
    "BF16": (2, None),              # numpy has no bfloat16: carried as raw uint16
    "FP32": (4, np.dtype(np.float32)),
    "FP64": (8, np.dtype(np.float64)),
    "BYTES": (0, np.dtype(object)),
}
WIRE_DATATYPES = frozenset(_WIRE)

_NUMPY_TO_WIRE = {dt: name for name, (_, dt) in _WIRE.items() if dt is not None and name != "BYTES"}


def config_to_wire(data_type: str) -> str:
    """`TYPE_FP32` -> `FP32`; `TYPE_STRING` -> `BYTES`."""
    if data_type == "TYPE_STRING":
        return "BYTES"
    return data_type[len("TYPE_"):] if data_type.startswith("TYPE_") else data_type


def wire_to_config(datatype: str) -> str:
    return "TYPE_STRING" if datatype == "BYTES" else "TYPE_" + datatype


def element_size(datatype: str) -> int:
    """Bytes per element; 0 for BYTES (variable length)."""
    return _WIRE[datatype][0]


def numpy_dtype(datatype: str) -> np.dtype:
    """The numpy dtype that carries a wire datatype (BF16 travels as uint16)."""
    dt = _WIRE[datatype][1]
    return np.dtype(np.uint16) if dt is None else dt


def wire_from_numpy(dtype: np.dtype) -> str:
    dtype = np.dtype(dtype)
    if dtype.kind in ("O", "S", "U"):
        return "BYTES"
    try:
        return _NUMPY_TO_WIRE[dtype.newbyteorder("=") if dtype.byteorder not in "=|" else dtype]
    except KeyError:
        raise TypeError(f"numpy dtype {dtype} has no torchpool datatype") from None


# --- torch (imported lazily) -------------------------------------------------

_TORCH_BY_WIRE: dict[str, "torch.dtype"] = {}
_WIRE_BY_TORCH: dict[object, str] = {}     # any key: a dtype of no wire datatype is a KeyError


def _torch_tables() -> None:
    import torch

    pairs = {
        "BOOL": torch.bool, "UINT8": torch.uint8, "UINT16": torch.uint16,
        "UINT32": torch.uint32, "UINT64": torch.uint64, "INT8": torch.int8,
        "INT16": torch.int16, "INT32": torch.int32, "INT64": torch.int64,
        "FP16": torch.float16, "BF16": torch.bfloat16, "FP32": torch.float32,
        "FP64": torch.float64,
    }
    _TORCH_BY_WIRE.update(pairs)
    _WIRE_BY_TORCH.update({v: k for k, v in pairs.items()})


def torch_dtype(datatype: str) -> torch.dtype:
    """The torch dtype of a wire datatype (KeyError for BYTES)."""
    if not _TORCH_BY_WIRE:
        _torch_tables()
    return _TORCH_BY_WIRE[datatype]


def wire_from_torch(dtype: object) -> str:
    if not _WIRE_BY_TORCH:
        _torch_tables()
    return _WIRE_BY_TORCH[dtype]


# --- BYTES elements: 4-byte little-endian length + bytes, as in Triton -------
#
# The walks over the length prefixes are in C (`_bytescan.c`, optional): a
# Python loop per element kept the broker's thread busy for seconds on one
# tensor of millions of short strings. The pure-Python walks below are the
# fallback without a compiler and give the same answers and messages.

try:
    from . import _bytescan
except ImportError:          # pragma: no cover - built on every supported install
    _bytescan = None  # type: ignore[assignment]

_LEN = struct.Struct("<I")


def encode_bytes(items: Iterable[object]) -> bytes:
    """Serialise str/bytes elements into Triton's length-prefixed layout."""
    parts = []
    for item in items:
        if isinstance(item, str):
            item = item.encode("utf-8")
        elif not isinstance(item, (bytes, bytearray, memoryview, np.bytes_)):
            item = str(item).encode("utf-8")
        parts.append(_LEN.pack(len(item)))
        parts.append(bytes(item))
    return b"".join(parts)


def _walk(view: memoryview, pos: int, count: int, items: Optional[list[bytes]] = None) -> tuple[int, int]:
    """Python fallback: walk `count` elements (-1: to the end) from `pos`,
    appending them to `items` if given; returns (end, elements walked).
    ValueError worded as in _bytescan.c."""
    end, unpack = len(view), _LEN.unpack_from
    for n in range(count) if count >= 0 else itertools.count():
        if pos + 4 > end:
            if pos == end:
                if count < 0:
                    return pos, n
                raise ValueError(f"{count} elements expected but the data ends after {n}")
            raise ValueError(f"element {n}: its 4-byte length prefix is cut off "
                             f"({end - pos} bytes remain at byte {pos})")
        claim = unpack(view, pos)[0]
        if pos + 4 + claim > end:
            raise ValueError(f"element {n} claims {claim} bytes but only {end - pos - 4} remain")
        if items is not None:
            items.append(bytes(view[pos + 4:pos + 4 + claim]))
        pos += 4 + claim
    return pos, count


def _fill_exactly(view: memoryview, end: int, count: int) -> None:
    if end != len(view):
        raise ValueError(f"{len(view) - end} bytes follow the last of the {count} elements")


def check_bytes(buf: Buffer, count: int, max_bytes: Optional[int] = None) -> int:
    """Check that exactly `count` BYTES elements fill `buf`, without making
    them: returns the sum of their lengths. ValueError, naming the element and
    what is wrong, when the layout is broken or the elements hold more than
    `max_bytes` bytes."""
    view = memoryview(buf).cast("B")
    limit = len(view) if max_bytes is None else max_bytes
    if _bytescan is not None:
        return _bytescan.scan(view, count, limit)
    if count < 0:
        raise ValueError(f"scan: count must be >= 0, not {count}")
    if count > len(view) // 4:
        raise ValueError(f"{count} elements expected but {len(view)} bytes hold at most "
                         f"{len(view) // 4}")
    end, _ = _walk(view, 0, count)
    _fill_exactly(view, end, count)
    total = len(view) - 4 * count
    if total > limit:
        raise ValueError(f"the {count} elements hold {total} bytes, more than {limit}")
    return total


def bytes_boundaries(data: Buffer, counts: Iterable[int]) -> list[int]:
    """Byte offsets of groups of BYTES elements: `counts[i]` elements after
    the previous group; returns [0, end of group 0, end of group 1, ...].
    ValueError when `data` ends inside an element."""
    view = memoryview(data).cast("B")
    bounds, pos = [0], 0
    for count in counts:
        pos = _bytescan.skip(view, pos, count) if _bytescan is not None else _walk(view, pos, count)[0]
        bounds.append(pos)
    return bounds


def decode_bytes(buf: Buffer, count: Optional[int] = None) -> list[bytes]:
    """Parse length-prefixed elements (exactly `count` of them, when given,
    filling `buf`); ValueError when the layout is broken."""
    view = memoryview(buf).cast("B")
    want = -1 if count is None else count
    if _bytescan is not None:
        return _bytescan.split(view, want)
    items: list[bytes] = []
    end, n = _walk(view, 0, want, items)
    _fill_exactly(view, end, n)
    return items
