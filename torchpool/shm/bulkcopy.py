"""Copies of tensor bytes into shared memory, the fastest way for their size.

Copies are ordinary ones (a memoryview assignment is one memcpy): what they
write is still in the CPU caches when the next process reads it. The
`_streamcopy` extension can instead store around the caches, four pages at a
time (`_streamcopy.c` says why), for copies from a threshold up (0, the
default: never): the daemon's --stream-copy-bytes, which it and its workers
apply with `set_stream_threshold`; a process told none (a client) reads
TORCHPOOL_STREAM_COPY_BYTES, also the daemon's default for compatibility.
Whether that pays depends on the machine: on the VM this was first measured
on, a 16 MiB copy between processes took 3.4 ms
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
from typing import TYPE_CHECKING, Mapping, Optional

if TYPE_CHECKING:
    from ..protocol.tensors import Source

try:
    from . import _streamcopy
except ImportError:          # pragma: no cover - built on every supported install
    _streamcopy = None  # type: ignore[assignment]

DEFAULT_STREAM_BYTES = 0     # off; 12 << 20 where streaming pays (see above)
ENV = "TORCHPOOL_STREAM_COPY_BYTES"


def stream_bytes_from_environment(environ: Optional[Mapping[str, str]] = None) -> int:
    """TORCHPOOL_STREAM_COPY_BYTES, else DEFAULT_STREAM_BYTES; 0 (never) for
    anything but a positive whole number."""
    raw = (os.environ if environ is None else environ).get(ENV, "")
    try:
        value = int(raw) if raw else DEFAULT_STREAM_BYTES
    except ValueError:
        value = DEFAULT_STREAM_BYTES
    return value if value > 0 else 0


STREAM_BYTES = stream_bytes_from_environment()
STREAMING = _streamcopy is not None and STREAM_BYTES > 0


def set_stream_threshold(nbytes: int) -> None:
    """Copies of `nbytes` and more stream from now on, in this process (0:
    none). Set once at start, before any copy (a process-wide policy, as
    the environment variable was)."""
    global STREAM_BYTES, STREAMING
    STREAM_BYTES = max(0, nbytes)
    STREAMING = _streamcopy is not None and STREAM_BYTES > 0


def streams(nbytes: int) -> bool:
    """Whether a copy of `nbytes` goes through the streaming stores."""
    return STREAMING and nbytes >= STREAM_BYTES


def copy_into(dst: memoryview, src: Source) -> None:
    """Copy every byte of `src` (a C-contiguous buffer: bytes, memoryview,
    numpy array) into the start of `dst` (a writable byte memoryview at
    least as long)."""
    view = src if isinstance(src, memoryview) else memoryview(src)  # type: ignore[arg-type]  # (see contiguous_bytes)
    nbytes = view.nbytes
    if nbytes == 0:
        return
    if streams(nbytes):
        _streamcopy.copy(dst, view)
    elif view.ndim == 1 and view.format == "B":
        dst[:nbytes] = view
    else:
        dst[:nbytes] = view.cast("B")
