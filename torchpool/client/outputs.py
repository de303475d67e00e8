"""Decoding an answer's outputs: one part of `ClientState` (flows.py).

An output arrives inline or as a payload frame (an array view of the
bytes), lent in place in a worker's memory (a read-only view released to the
daemon once garbage), back in one of the request's own input blocks (`own`),
or written into a registered region. The late answer of a request we stopped
waiting for only gives back what it held.
"""
from __future__ import annotations

import collections
import weakref
from typing import TYPE_CHECKING, Optional, Sequence, Union, cast

import numpy as np

from ..protocol import datatypes, errors, tensors
from ..protocol.errors import InferenceError, TorchpoolError
from ..protocol.messages import Header
from .arena import ArenaBlock, ClientArena, OutputMaps
from .types import Frames, InferResult, OutputValue, RegionOutput, Tensor
from .values import as_value

if TYPE_CHECKING:
    from typing_extensions import Buffer


# an output lent to session `token`, to give back: (token, [segment, offset, generation])
Release = tuple[Optional[str], list[Union[str, int]]]
# what a request we stopped waiting for still holds: (session, arena, copy blocks, empty() blocks)
Quarantined = tuple[Optional[str], Optional[ClientArena], list[ArenaBlock], list[ArenaBlock]]


class EncodedInputs:
    __slots__ = ("entries", "frames", "blocks", "lent", "stats")

    def __init__(self) -> None:
        self.entries: list[tensors.Entry] = []
        self.frames: Frames = []
        self.blocks: list[ArenaBlock] = []      # copy blocks: freed when answered
        self.lent: list[ArenaBlock] = []        # empty() blocks in flight
        self.stats = [0, 0, 0]                  # copied, zero-copy, inline


class OutputDecoder:
    """Turns an answer's output entries into values; gives back to the daemon
    (by `releases`) what it lent once those values are garbage."""

    def __init__(self, outputs: OutputMaps, releases: collections.deque[Release],
                 quarantine: dict[object, Quarantined]) -> None:
        # the state's own: the workers' memory mapped here, the releases its
        # next request to the daemon carries, the requests it stopped waiting for
        self.outputs = outputs
        self.releases = releases
        self.quarantine = quarantine

    def decode(self, header: Header, frames: Sequence[Buffer], copy: bool, token: Optional[str],
               enc: Optional[EncodedInputs] = None, arena: Optional[ClientArena] = None) -> InferResult:
        """The outputs of an answer to a request sent in session `token`
        (with the input blocks `enc` holds in `arena`)."""
        result = InferResult()
        # the daemon's own answer: a list of output entries
        entries = cast("list[tensors.Entry]", header.get("outputs") or [])
        error: Optional[BaseException] = None
        kept: dict[ArenaBlock, np.ndarray] = {}
        value: OutputValue
        for e in entries:
            try:
                where = tensors.location(e)
                if where == tensors.DATA:          # bytes in the answer: the common case first
                    datatype, shape = _datatype_shape(e)
                    value = as_value(datatype, shape, tensors.tensor_payload(e, frames))
                    if copy and isinstance(value, np.ndarray):
                        value = np.array(value)
                elif where == tensors.SHM:
                    value = self._lent_output(e, copy, token)
                elif where == tensors.OWN:
                    value = _reused_output(e, copy, enc, arena, kept)
                else:
                    region, nbytes, offset = tensors.region_ref(e)
                    datatype, shape = _datatype_shape(e)
                    value = RegionOutput(cast(str, e[tensors.NAME]), region, offset, nbytes, datatype, tuple(shape))
                result[cast(str, e[tensors.NAME])] = value
            except BaseException as exc:   # keep going: every lent block must be released
                error = error or exc
        if error is not None:
            raise error
        return result

    def _lent_output(self, e: tensors.Entry, copy: bool, token: Optional[str]) -> Tensor:
        """An output lent in the worker's memory: a read-only view of it,
        released to the daemon once the view is garbage (at once with
        `copy`, or for BYTES and BF16, which are converted)."""
        segment, offset, nbytes, generation = tensors.shm_ref(e)
        rel: Release = (token, [segment, offset, generation])
        datatype, shape = _datatype_shape(e)
        keep = False
        try:
            mm = self.outputs.get(segment, offset + nbytes)
            data = memoryview(mm)[offset:offset + nbytes]
            if datatype == "BYTES" or datatype == "BF16":
                return as_value(datatype, shape, data)
            base: np.ndarray = np.frombuffer(data, dtype=datatypes.numpy_dtype(datatype))
            arr: np.ndarray = base.reshape(shape)
            if copy:
                copied: np.ndarray = arr.copy()
                return copied
            fin = weakref.finalize(base, self.releases.append, rel)
            fin.atexit = False
            keep = True
            return arr
        finally:
            if not keep:
                self.releases.append(rel)

    def late_reply(self, header: object, current: Optional[ClientArena]) -> None:
        """The answer of a request we stopped waiting for: free its blocks (if
        they are of the `current` arena) and hand back any outputs it was lent."""
        if not isinstance(header, dict):
            return
        held = self.quarantine.pop(header.get("id"), None)
        if held is None:
            return            # not ours, or of a session that is gone
        token, arena, blocks, lent = held
        if arena is not None and arena is current:
            for block in blocks:
                arena.free(block)
            for block in lent:
                arena.flight_done(block)
        for e in header.get("outputs") or []:
            if isinstance(e, dict) and tensors.location(e) == tensors.SHM:
                try:
                    seg, off, _n, gen = tensors.shm_ref(e)
                except TorchpoolError:
                    continue
                self.releases.append((token, [seg, off, gen]))


def _datatype_shape(e: tensors.Entry) -> tuple[str, list[int]]:
    """An output entry's datatype and shape: the daemon's own answer (its
    worker wrote a datatype string and a list of ints)."""
    return cast(str, e[tensors.DATATYPE]), cast("list[int]", e[tensors.SHAPE])


def _reused_output(e: tensors.Entry, copy: bool, enc: Optional[EncodedInputs], arena: Optional[ClientArena],
                   kept: dict[ArenaBlock, np.ndarray]) -> Tensor:
    """An output that is a view of one of this request's input blocks (the
    model returned its input, or a part of it): a read-only array on that
    block, which stays ours until the array goes. `kept` maps the blocks
    this answer already took to their whole-block arrays."""
    segment, offset, nbytes = tensors.own_ref(e)
    name = e.get(tensors.NAME)
    for block in [*kept, *(enc.blocks if enc is not None else ())]:
        if block.segment == segment and block.data_offset <= offset \
                and offset + nbytes <= block.data_offset + block.capacity:
            break
    else:
        raise InferenceError(errors.INTERNAL, f"output '{name}' points into an input block this "
                                              f"request did not send")
    base = kept.get(block)
    if base is None:
        # not kept yet: one of enc.blocks (kept starts empty), which `arena` gave out
        assert enc is not None and arena is not None
        base = kept[block] = arena.keep(block)
        enc.blocks.remove(block)          # no longer freed with the request
    start = offset - block.data_offset
    data = base[start:start + nbytes]
    datatype, shape = _datatype_shape(e)
    if datatype == "BYTES" or datatype == "BF16":
        return as_value(datatype, shape, data.tobytes())
    arr = data.view(datatypes.numpy_dtype(datatype)).reshape(shape)
    return arr.copy() if copy else arr
