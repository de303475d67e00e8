"""Copies of tensor bytes into shared memory, the fastest way for their size.

Small and medium copies are ordinary ones (a memoryview assignment is one
memcpy): what they write is still in the CPU caches when the next process
reads it. Large ones go through the `_streamcopy` extension, which stores
around the caches, four pages at a time; see `_streamcopy.c` for why and
for the figures. Where the extension could not be built (no compiler at
install time) every copy is an ordinary one: slower for large tensors, never
wrong.

TORCHPOOL_STREAM_COPY_BYTES sets the size from which copies stream (0: never).
The default, 12 MiB, is where streaming started to win when one process
copied a tensor into shared memory and another copied it on, on the
development VM: at 8 MiB ordinary copies were still faster (1.6 vs 1.9 ms for
both), at 16 MiB streaming took 3.4 ms against 6.0 ms.
"""
from __future__ import annotations

import os
from typing import Any

try:
    from . import _streamcopy
except ImportError:          # pragma: no cover - built on every supported install
    _streamcopy = None

DEFAULT_STREAM_BYTES = 12 << 20


def _stream_threshold() -> int:
    raw = os.environ.get("TORCHPOOL_STREAM_COPY_BYTES", "")
    try:
        value = int(raw) if raw else DEFAULT_STREAM_BYTES
    except ValueError:
        value = DEFAULT_STREAM_BYTES
    return value if value > 0 else 0


STREAM_BYTES = _stream_threshold()
STREAMING = _streamcopy is not None and STREAM_BYTES > 0


def copy_into(dst: memoryview, src: Any) -> None:
    """Copy every byte of `src` (a C-contiguous buffer: bytes, memoryview,
    numpy array) into the start of `dst` (a writable byte memoryview at
    least as long)."""
    view = src if isinstance(src, memoryview) else memoryview(src)
    nbytes = view.nbytes
    if nbytes == 0:
        return
    if STREAMING and nbytes >= STREAM_BYTES:
        _streamcopy.copy(dst, view)
    elif view.ndim == 1 and view.format == "B":
        dst[:nbytes] = view
    else:
        dst[:nbytes] = view.cast("B")
