"""A batch: one model execution, and the tensors the broker computes for it.

Schedulers hand the loop `Batch`es; the answer path splits their outputs
back per request. `batch_input` tensors (Triton's BATCH_ELEMENT_COUNT and
friends) and the tensors the broker makes itself (sequence controls and
state) are written into the broker's arena here.
"""
from __future__ import annotations

import itertools
import math
from array import array
from dataclasses import dataclass, field
from typing import NamedTuple, Optional, Protocol, Sequence, Union

from ..config import ModelConfig
from ..protocol import errors
from ..protocol import internal
from ..protocol.internal import InputDescriptor
from ..protocol.errors import TorchpoolError
from ..rules.validation import Staged, WorkerOutput
from ..shm.arena import Arena, ArenaFull, Block
from .requests import InferRequest

# a tensor the broker makes itself: (name, datatype, shape, bytes)
BrokerTensor = tuple[str, str, list[int], bytes]


class Row(Protocol):
    """A batch's rows of one request as its inputs are laid out (InferRequest),
    or a direct sequence batch's empty slot (schedulers/sequence_tensors.EmptyRow)."""

    @property
    def staged(self) -> list[Staged]: ...
    @property
    def rows(self) -> int: ...
    @property
    def batch_size(self) -> int: ...
    @property
    def shapes(self) -> dict[str, list[int]]: ...


class CopiedOutput:
    """Output bytes copied out of a worker that died before they were sent."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data


# where a batch output's bytes are (ReadOutput's first argument): a worker segment's
# name, or bytes copied out of a worker that died (answers/)
SegmentRef = Union[str, CopiedOutput]


class CopiedDescriptor(NamedTuple):
    """An output descriptor (internal.OutputDescriptor's fields) of bytes copied
    out of a worker that died (answers/: Answers._rescue_held)."""
    name: str
    datatype: str
    shape: Sequence[int]
    segment: CopiedOutput
    offset: int
    nbytes: int


# an output a batch's worker answered: where it wrote it, or the bytes copied out of it
OutputEntry = Union[internal.OutputDescriptor, CopiedDescriptor]
# one request's part of such an output: (name, datatype, client shape, segment, offset, nbytes)
OutputPiece = tuple[str, str, Sequence[int], Union[internal.SegmentRef, CopiedOutput], int, int]


@dataclass(eq=False)
class Batch:
    """One model execution: its requests, and where the worker finds the inputs."""

    requests: list[InferRequest]
    items: int                        # batch size (Triton counts a 0-row request as 1)
    rows: int                         # rows along dim 0, summed over the requests
    inputs: list[InputDescriptor]     # worker descriptors
    outputs: list[WorkerOutput]       # outputs the worker is asked for (none: every one)
    blocks: list[Block] = field(default_factory=list)   # broker arena blocks, freed when it finished
    seq: Optional[int] = None         # answer order, set by the answer path (preserve_ordering)
    error: Optional[TorchpoolError] = None   # could not be formed: fail its requests
    context: object = None            # the scheduler's own bookkeeping (a sequence batch's slots)
    # The first row of each request, when the batch also holds rows that
    # belong to no request (a direct sequence batch's empty slots); None: the
    # requests' rows follow one another from row 0, in order.
    row_starts: Optional[list[int]] = None
    # Those rows (one per empty slot): Triton's batch statistics count them in
    # the batch size, its inference count does not.
    padding: int = 0

    def starts(self) -> list[int]:
        """The first row of each request."""
        if self.row_starts is not None:
            return self.row_starts
        out, row = [], 0
        for r in self.requests:
            out.append(row)
            row += r.rows
        return out

    def lend_to(self) -> int:
        """The lending id of the one local session all the batch's requests
        belong to, when one of them asked for its outputs in place: the
        worker puts the outputs in that session's area (worker/lending.py),
        the only memory lent to it. 0: nothing of this batch is lent."""
        session, wanted = None, False
        for req in self.requests:
            if req.session is None or (session is not None and req.session is not session) \
                    or req.hidden_outputs:
                return 0
            session, wanted = req.session, wanted or req.output_shm
        return session.lend_id if wanted and session is not None and session.local else 0

    @classmethod
    def single(cls, req: InferRequest) -> "Batch":
        """A request run on its own, staged already (its blocks stay its own:
        an answer may be sent from one of them)."""
        return cls([req], req.batch_size, req.rows, req.inputs, req.outputs)


# ------------------------------------------------------------ batch inputs

def _accumulate(values: list[int]) -> list[int]:
    return list(itertools.accumulate(values))


def batch_input_values(cfg: ModelConfig, requests: Sequence[Row]) -> list[BrokerTensor]:
    """The `batch_input` tensors of a batch: [(target name, datatype, shape, bytes)].

    Each kind reads its source input's shape in every request, as Triton does:
    BATCH_ELEMENT_COUNT [requests] element counts; BATCH_ACCUMULATED_ELEMENT_COUNT
    [requests] running sums (end offsets); ..._WITH_ZERO [requests + 1] with a
    leading 0; BATCH_MAX_ELEMENT_COUNT_AS_SHAPE [largest count] (zeros: only
    the shape carries information); BATCH_ITEM_SHAPE [batch items, rank - 1]
    each item's shape without the batch dimension; BATCH_ITEM_SHAPE_FLATTEN
    the same, flattened.
    """
    out = []
    for entry in cfg.batch_inputs:
        kind = entry["kind"]
        source = entry["source_input"][0]
        wire = "INT32" if entry["data_type"] == "TYPE_INT32" else "FP32"
        shapes = [r.shapes[source] for r in requests]
        counts = [math.prod(s) for s in shapes]
        if kind == "BATCH_ELEMENT_COUNT":
            values, shape = counts, [len(counts)]
        elif kind == "BATCH_ACCUMULATED_ELEMENT_COUNT":
            values, shape = _accumulate(counts), [len(counts)]
        elif kind == "BATCH_ACCUMULATED_ELEMENT_COUNT_WITH_ZERO":
            values, shape = [0] + _accumulate(counts), [len(counts) + 1]
        elif kind == "BATCH_MAX_ELEMENT_COUNT_AS_SHAPE":
            biggest = max(counts, default=0)
            values, shape = [0] * biggest, [biggest]
        elif kind in ("BATCH_ITEM_SHAPE", "BATCH_ITEM_SHAPE_FLATTEN"):
            rank = max((len(s) - 1 for s in shapes), default=0)
            values = [d for s in shapes for _ in range(s[0] if s else 0) for d in s[1:]]
            items = sum(s[0] for s in shapes if s)
            shape = [items, rank] if kind == "BATCH_ITEM_SHAPE" else [len(values)]
        else:  # the config parser accepts only the kinds above
            raise TorchpoolError(errors.UNSUPPORTED, f"model '{cfg.name}': batch input kind "
                                                     f"'{kind}' is not supported")
        data = array("i" if wire == "INT32" else "f", values).tobytes()
        for target in entry["target_name"]:
            out.append((str(target), wire, shape, data))
    return out


def write_tensors(tensors: list[BrokerTensor], arena: Arena
                  ) -> tuple[list[InputDescriptor], list[Block]]:
    """Tensors the broker makes itself ([(name, datatype, shape, bytes)]:
    batch inputs, sequence controls and state) written into the arena:
    worker descriptors and the blocks used. Raises ArenaFull (having freed
    what it took)."""
    descriptors: list[InputDescriptor] = []
    blocks: list[Block] = []
    try:
        for name, datatype, shape, data in tensors:
            block = arena.alloc(len(data))
            blocks.append(block)
            if data:
                arena.view(block)[:] = data
            descriptors.append(InputDescriptor(name, datatype, shape, block.segment, block.offset, len(data)))
    except ArenaFull:
        for block in blocks:
            arena.free(block)
        raise
    return descriptors, blocks


def stage_batch_inputs(cfg: ModelConfig, requests: list[InferRequest], arena: Arena,
                       ) -> tuple[list[InputDescriptor], list[Block]]:
    """Compute a batch's `batch_input` tensors and write them into the arena."""
    return write_tensors(batch_input_values(cfg, requests), arena)
