"""Large outputs converted a chunk per turn of the event loop.

An output of millions of elements asked for as JSON (or a BYTES output,
whose length prefixes are written element by element) is a second of work
in Python. Done in one go, it would stop the loop that serves every other
caller for that long; done `CHUNK_ELEMENTS` at a time with a turn of the
loop between chunks (about a millisecond each), other callers' requests
are served between the chunks. One large conversion runs at a time, so
several at once do not each put a chunk between two turns of another
caller's request.
"""
from __future__ import annotations

import asyncio
import json
import weakref
from typing import Callable, Union

import numpy as np

from ..protocol import datatypes
from .backend import OutputTensor, bf16_to_float

# an output's bytes, or a piece of them, as written out
Chunk = Union[bytes, memoryview]

CHUNK_ELEMENTS = 4096

_TURNS: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Lock]" = weakref.WeakKeyDictionary()


def _one_at_a_time() -> asyncio.Lock:
    loop = asyncio.get_running_loop()
    lock = _TURNS.get(loop)
    if lock is None:
        lock = _TURNS[loop] = asyncio.Lock()
    return lock


async def _by_chunks(flat: np.ndarray, convert: Callable[[np.ndarray], bytes]) -> list[bytes]:
    async with _one_at_a_time():
        parts = []
        for start in range(0, flat.size, CHUNK_ELEMENTS):
            parts.append(convert(flat[start:start + CHUNK_ELEMENTS]))
            await asyncio.sleep(0)
        return parts


async def tensor_bytes(t: OutputTensor) -> Chunk:
    """`t.raw()`: a view for fixed-size datatypes; BYTES written a chunk at a time."""
    array = t.data()
    if t.datatype != "BYTES" or array.size <= CHUNK_ELEMENTS:
        return t.raw()
    parts = await _by_chunks(array.reshape(-1), lambda c: datatypes.encode_bytes(c.tolist()))
    return b"".join(parts)


def _json_chunk(datatype: str) -> Callable[[np.ndarray], bytes]:
    def text(values: list) -> bytes:
        return json.dumps(values, separators=(",", ":")).encode()[1:-1]

    if datatype == "BYTES":
        return lambda c: text([v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v) for v in c])
    if datatype == "BF16":
        return lambda c: text(bf16_to_float(c).tolist())
    return lambda c: text(c.tolist())


async def json_values(t: OutputTensor) -> bytes:
    """The JSON array of `t.values()`, as bytes."""
    array = t.data()
    if array.size <= CHUNK_ELEMENTS:
        return json.dumps(t.values(), separators=(",", ":")).encode()
    parts = await _by_chunks(array.reshape(-1), _json_chunk(t.datatype))
    return b"[" + b",".join(p for p in parts if p) + b"]"
