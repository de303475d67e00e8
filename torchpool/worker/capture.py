"""Outputs made where they are sent: large tensors a model allocates while it
runs are placed in a shared-memory region the broker reads, so an output
tensor `forward` returns is answered in place, with no copy by the worker.

    forward runs (capturing on) ──► torch allocates >= 256 KiB ──► the region
    output tensor in the region ──► DONE names (region, offset): nothing copied
                                    the worker holds the tensor ...
    broker releases the block   ──► ... and drops it: torch's free puts the
                                    block back in the region

The region is one more output segment of the worker: a sealed memfd, handed
to the broker (and lent to local clients) like its arena's segments. The C
extension `_outcapture` (its comment says how and why) redirects libc10's
posix_memalign / free: while capturing, torch's large CPU allocations come
from the region; when it is full, from the heap as before, and the output
is copied into the arena as it always was. Intermediates freed during
`forward` go back to the region. Capturing is on only around the model call,
never while outputs are copied.

An output is answered in place only when nothing else can change it while
it is read: a tensor that the model keeps (an attribute it assigns in
`forward`, a view it holds) is copied, as is one that shares its memory with
another output already answered. The region's pages stay resident once
touched (shared memory is not given back to the kernel when a block is
freed): the region costs at most its size, and only as much as outputs and
intermediates ever used at once.

The daemon's --output-capture-mib (WorkerSpec.output_capture_mib; its default
from TORCHPOOL_OUTPUT_CAPTURE_MIB, capture_size.py) sizes the region; 0 turns
capture off. Without the extension (no C compiler at install), workers copy
every output, as before.
"""
from __future__ import annotations

import logging
from typing import Callable, Optional, Protocol

import torch
from typing_extensions import Buffer

from ..shm.segment import Segment


class _Extension(Protocol):
    """What is used of the C extension _outcapture (its types: _outcapture.pyi)."""

    def add_region(self, buffer: Buffer, min_block: int, /) -> int: ...
    def remove_region(self, index: int, /) -> bool: ...
    def install(self, threshold: int, /) -> int: ...
    def capture(self, index: int, /) -> None: ...
    def alloc(self, index: int, n: int, /) -> Optional[int]: ...
    def release(self, index: int, offset: int, /) -> bool: ...
    def base(self, index: int, /) -> int: ...
    def stats(self, index: int, /) -> tuple[int, int, int]: ...


def _load_extension() -> Optional[_Extension]:
    try:
        from . import _outcapture
    except ImportError:   # built optionally (setup.py): outputs are then copied
        return None
    return _outcapture


# the extension, or None (tests set it so, as on an install without a C compiler)
_outcapture: Optional[_Extension] = _load_extension()

log = logging.getLogger("torchpool.worker")

# Smaller allocations stay on the heap: glibc serves them without page
# faults, copying them costs microseconds, and most are intermediates.
MIN_CAPTURED = 256 << 10

# (private, and not in every torch: looked up, None without it)
_storage_use_count: Optional[Callable[[int], int]] = getattr(torch._C, "_storage_Use_Count", None)


def _use_counts(value: torch.Tensor) -> tuple[int, int]:
    """How many references hold the tensor, and its memory."""
    count = _storage_use_count
    assert count is not None    # OutputCapture.create makes no region without it
    # torch's stubs lack Tensor._use_count (a C method of every torch the count above exists in)
    return value._use_count(), count(value.untyped_storage()._cdata)  # type: ignore[attr-defined]


class CaptureRegion:
    """One region of the capture table (_outcapture.c): a sealed memfd that
    torch's large allocations come from while it is the target, and that
    Python allocates in for outputs it copies there. It keeps the tensors
    lent from it (until the broker releases them) and the blocks written."""

    def __init__(self, segment: Segment, min_block: int = MIN_CAPTURED) -> None:
        ext = _outcapture
        # regions are made only where the extension is (OutputCapture.create, LendingAreas.available)
        assert ext is not None
        self.ext = ext
        self.segment = segment
        self.name = segment.name
        self.index = ext.add_region(segment.buf, min_block)
        self.base = ext.base(self.index)
        self.size = segment.size
        self.held: dict[int, torch.Tensor] = {}   # offset -> tensor the broker still reads
        self.written: set[int] = set()            # offsets of blocks Python wrote outputs into
        # what a tensor that nobody else holds looks like (measured, not assumed:
        # the counts include the references made to read them)
        self._alone = _use_counts(torch.empty(1))

    def lend(self, value: torch.Tensor) -> Optional[tuple[str, int, int]]:
        """(segment, offset, nbytes) of `value` in the region when it can be
        answered in place (it is then held until `release`); None: copy it."""
        nbytes = value.nbytes
        offset = value.data_ptr() - self.base
        if not (0 <= offset and offset + nbytes <= self.size) or nbytes == 0 or offset in self.held \
                or not value.is_contiguous() or _use_counts(value) != self._alone:
            return None
        self.held[offset] = value
        return self.name, offset, nbytes

    def alloc(self, nbytes: int) -> Optional[int]:
        """The offset of a new block for an output copied here (None: full)."""
        offset = self.ext.alloc(self.index, nbytes)
        if offset is not None:
            self.written.add(offset)
        return offset

    def release(self, offset: int) -> bool:
        """The broker is done reading the output at `offset`: a lent tensor is
        dropped (torch's free gives its block back), a written block freed.
        False: nothing of ours started there."""
        if self.held.pop(offset, None) is not None:
            return True
        if offset in self.written:
            self.written.discard(offset)
            return self.ext.release(self.index, offset)
        return False

    def blocks(self) -> int:
        """Blocks in use: lent, written, or still held by someone else (the model)."""
        return self.ext.stats(self.index)[1]

    def close(self) -> bool:
        """Leave the table and unmap, once no block is in use (False: not yet)."""
        if self.held or self.written or not self.ext.remove_region(self.index):
            return False
        self.segment.close()
        return True


class OutputCapture:
    """The worker's own capture region and the hooks that fill it; the
    regions of lending.py are captured into through it too."""

    def __init__(self, region: CaptureRegion) -> None:
        self.region = region
        self.ext = region.ext
        self.name = region.name
        self.base = region.base
        self.size = region.size
        self.held = region.held

    @classmethod
    def create(cls, name: str, announce: Callable[[Segment], None], size: int) -> Optional["OutputCapture"]:
        """A region of `size` bytes for this worker, or None: capture turned
        off (0), the extension not built, or libc10 not hookable (the reason
        is logged)."""
        if size == 0:
            return None
        if _outcapture is None or _storage_use_count is None:
            log.debug("output capture unavailable (extension not built, or this torch lacks "
                      "reference counts); outputs are copied")
            return None
        segment = Segment.create(name, size, prefault=False)
        try:
            region = CaptureRegion(segment)
            try:
                region.ext.install(MIN_CAPTURED)
            except (OSError, RuntimeError, ValueError):
                region.close()
                raise
        except (OSError, RuntimeError, ValueError) as exc:
            log.warning("output capture unavailable (%s); outputs are copied", exc)
            segment.close()
            return None
        announce(segment)          # the broker maps it before any answer names it
        return cls(region)

    def on(self, region: Optional[CaptureRegion] = None) -> None:
        """Large allocations come from `region` (this worker's own by
        default) until `off`, on every thread."""
        self.ext.capture((region or self.region).index)

    def off(self) -> None:
        self.ext.capture(-1)

    def lend(self, value: torch.Tensor) -> Optional[tuple[str, int, int]]:
        return self.region.lend(value)

    def release(self, offset: int) -> None:
        """The broker is done reading the output at `offset` of the own region."""
        if not self.region.release(offset):
            log.warning("the broker released a block of the capture region that is not lent "
                        "(offset %d); ignored", offset)

    def close(self) -> None:
        """The worker is done: its fd goes. The mapping stays until the
        process exits (the extension holds it: tensors may still be freed)."""
        self.region.segment.close()

    def stats(self) -> tuple[int, int, int]:
        """(bytes in use, blocks, large allocations that did not fit) of the own region."""
        return self.ext.stats(self.region.index)


# Outputs that lie where they are sent already, without capture: views of an input.

def reuse_input(value: object, reusable: list) -> Optional[tuple]:
    """(segment, offset, nbytes) when the output tensor `value` lies inside an
    input block its client handed over for reuse: the answer then points
    there and the output is not copied (an identity, or a model that works
    in place). `reusable` holds (address, nbytes, segment, offset) per such
    input. Only contiguous CPU tensors qualify; anything else is written out."""
    if not isinstance(value, torch.Tensor) or value.layout != torch.strided \
            or not value.is_cpu or not value.is_contiguous():
        return None
    nbytes = value.nbytes
    if nbytes == 0:
        return None
    address = value.data_ptr()
    for base, size, segment, offset in reusable:
        if base <= address and address + nbytes <= base + size:
            return segment, offset + (address - base), nbytes
    return None
