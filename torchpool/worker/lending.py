"""Memory a worker lends to one local session, and to nobody else.

A local client is lent its large outputs in place: it is handed the fd of
the memory they lie in and maps it read-only. An fd shows the whole memfd,
not a range of it, so whatever else that memory holds, the client can read.
So a worker never lends from its own capture region or arena (they hold
other clients' outputs and the model's intermediates); it lends from an
area of the session the batch belongs to:

    broker: RUN lend_to=S (every request of the batch is session S's, and
            one asked for its outputs in place)
    worker: the model runs capturing into S's area (capture.py): its
            outputs, and the intermediates of S's own request, land there;
            outputs that were not captured, and are large enough to be lent,
            are copied there; DONE names them. (S's area is made when its
            first such output is copied: a session of small requests has none.)
    broker: lends them to S only (the segment's owner must be the session
            the answer goes to); any other output goes back as bytes

An area is a sealed memfd (shrink, grow, and F_SEAL_FUTURE_WRITE once the
worker has mapped it: nobody, the client through /proc included, can write
it), announced to the broker with its session's lending id, at most
MAX_AREAS per worker (a session past that gets its outputs as bytes). It
goes when its session does (FORGET "lend-S"), once its last block is back;
the worker then tells the broker (FORGET of the area's name).

A model that keeps a tensor it made in `forward` (an attribute it assigns,
a cache) would keep it in S's area, where S could later watch requests of
other sessions change it in place. After each batch the worker counts the
area's blocks: one that is neither lent nor written is the model's. The
batch's outputs are then copied out of the area (they go back as bytes), the
area is never used again, and from then on this instance captures into its
own region and copies outputs into areas. An area S already holds cannot be
taken back: what S may see there is what the model kept from S's request,
and that tensor's later changes (docs/security.md).
"""
from __future__ import annotations

import logging
from typing import Callable, Optional

from ..shm.segment import Segment
from .capture import CaptureRegion, _outcapture
from .capture_size import DEFAULT_MIB

log = logging.getLogger("torchpool.worker")

MAX_AREAS = 16            # per worker; each is virtual memory until outputs touch it


class LendingAreas:
    """A worker's areas, by the lending id of their session."""

    def __init__(self, prefix: str, announce: Callable[[Segment, int], None],
                 closed: Callable[[str], None], label: str, capture_bytes: int = DEFAULT_MIB << 20) -> None:
        self.prefix = prefix                  # the worker's segment prefix
        self.announce = announce              # (segment, lend id): the broker maps it
        self.closed = closed                  # (name): the broker unmaps it
        self.label = label
        # as large as the capture region (--output-capture-mib); with capture off, its default
        self.size = capture_bytes or DEFAULT_MIB << 20
        self.available = _outcapture is not None
        self.areas: dict[int, CaptureRegion] = {}
        self.by_name: dict[str, CaptureRegion] = {}     # live and retiring areas
        self.retiring: list[CaptureRegion] = []         # waiting for their last block
        self.capture_into_areas = True        # until the model keeps what it makes
        self._serial = 0

    def capture_region(self, lend_id: int) -> Optional[CaptureRegion]:
        """Where the model captures into for a batch of this session: its area,
        once it has one and while this instance captures into areas."""
        return self.areas.get(lend_id) if self.capture_into_areas else None

    def area(self, lend_id: int) -> Optional[CaptureRegion]:
        """The session's area, made when its first output large enough to be
        lent is copied there (later batches capture into it); None: none can
        be made."""
        area = self.areas.get(lend_id)
        if area is not None or not self.available or len(self.areas) >= MAX_AREAS:
            return area
        self._serial += 1
        name = f"{self.prefix}l{self._serial}"
        segment = Segment.create(name, self.size, prefault=False, only_we_write=True)
        try:
            area = CaptureRegion(segment)
        except (RuntimeError, ValueError, OSError) as exc:     # the extension's table is full
            segment.close()
            log.warning("%s: cannot make a lending area (%s); outputs go back as bytes", self.label, exc)
            self.available = False
            return None
        self.announce(segment, lend_id)
        self.areas[lend_id] = self.by_name[name] = area
        return area

    def release(self, segment: str, offset: int) -> bool:
        """A block of an area the broker is done with; False: not an area's."""
        area = self.by_name.get(segment)
        if area is None:
            return False
        if not area.release(offset):
            log.warning("%s: the broker released a block of %s that is not lent (offset %d); ignored",
                        self.label, segment, offset)
        if self.retiring:
            self.sweep()
        return True

    def kept_by_the_model(self, area: CaptureRegion) -> bool:
        """Whether the model holds a block of the area (after its batch's
        outputs were placed): every block in use is lent or written, or not
        ours. Such an area is retired and this instance no longer captures
        into areas."""
        if area.blocks() == len(area.held) + len(area.written):
            return False
        if self.capture_into_areas:
            log.warning("%s keeps tensors it makes in forward; its outputs are now copied before "
                        "they are lent, so that no client can see what the model keeps", self.label)
        self.capture_into_areas = False
        self._retire(area)
        return True

    def forget(self, lend_id: int) -> None:
        """The session is gone: its area goes once its last block is back."""
        area = self.areas.get(lend_id)
        if area is not None:
            self._retire(area)

    def _retire(self, area: CaptureRegion) -> None:
        for lend_id, a in list(self.areas.items()):
            if a is area:
                del self.areas[lend_id]
        if area not in self.retiring:
            self.retiring.append(area)
        self.sweep()

    def sweep(self) -> None:
        """Close the retiring areas whose blocks are all back."""
        still = []
        for area in self.retiring:
            if area.close():
                del self.by_name[area.name]
                self.closed(area.name)
            else:
                still.append(area)
        self.retiring = still

    def close(self) -> None:
        """The worker is done: the fds go (mappings stay: tensors may still be freed)."""
        for area in self.by_name.values():
            area.segment.close()
        self.areas.clear()
        self.by_name.clear()
        self.retiring = []
