"""Copies of tensor bytes into shared memory, the fastest way for their size.

Copies are ordinary ones (a memoryview assignment is one memcpy): what they
write is still in the CPU caches when the next process reads it. The
`_streamcopy` extension can instead store around the caches, four pages at a
time (`_streamcopy.c` says why), for copies from TORCHPOOL_STREAM_COPY_BYTES
up (0, the default: never). Whether that pays depends on the machine: on the
VM this was first measured on, a 16 MiB copy between processes took 3.4 ms
streamed against 6.0 ms ordinary (each destination line was read from memory
first) and 12 MiB was where streaming started to win; on today's development
VM (AMD EPYC, 2 vCPUs) streaming is the slow one: a 12 MiB `x*1` over the
local path took 11.6 ms p50 with streaming copies against 5.3 ms with
ordinary ones (the ZeroMQ-control + POSIX-shm floor: 4.9 ms), alternating in
one run. Where the extension could not be built (no compiler at install
time) every copy is an ordinary one.
"""
from __future__ import annotations

import os
from typing import Any

try:
    from . import _streamcopy
except ImportError:          # pragma: no cover - built on every supported install
    _streamcopy = None

DEFAULT_STREAM_BYTES = 0     # off; 12 << 20 where streaming pays (see above)


def _stream_threshold() -> int:
    raw = os.environ.get("TORCHPOOL_STREAM_COPY_BYTES", "")
    try:
        value = int(raw) if raw else DEFAULT_STREAM_BYTES
    except ValueError:
        value = DEFAULT_STREAM_BYTES
    return value if value > 0 else 0


STREAM_BYTES = _stream_threshold()
STREAMING = _streamcopy is not None and STREAM_BYTES > 0


def streams(nbytes: int) -> bool:
    """Whether a copy of `nbytes` goes through the streaming stores."""
    return STREAMING and nbytes >= STREAM_BYTES


def copy_into(dst: memoryview, src: Any) -> None:
    """Copy every byte of `src` (a C-contiguous buffer: bytes, memoryview,
    numpy array) into the start of `dst` (a writable byte memoryview at
    least as long)."""
    view = src if isinstance(src, memoryview) else memoryview(src)
    nbytes = view.nbytes
    if nbytes == 0:
        return
    if streams(nbytes):
        _streamcopy.copy(dst, view)
    elif view.ndim == 1 and view.format == "B":
        dst[:nbytes] = view
    else:
        dst[:nbytes] = view.cast("B")
