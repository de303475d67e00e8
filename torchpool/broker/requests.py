"""Inference requests, accepted: what the broker keeps of each, staged in shm.

A request is checked against its model's config before it is accepted
(rules/validation.py, the one owner of those rules), so a bad request
never reaches a worker; then its batch layout is worked out and its inline
inputs are copied once into the broker's arena.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional, Union

from ..config import ModelConfig
from ..protocol import errors
from ..rules.batching import batch_key, batch_rows
from ..rules.validation import Staged, WorkerOutput
from ..protocol.errors import TorchpoolError
from ..protocol.internal import InputDescriptor, is_device_ref
from ..shm.arena import Arena, ArenaFull, Block
from ..shm.bulkcopy import copy_into
from .registry import ModelVersion

if TYPE_CHECKING:
    from .lane import ClientKey, ReplySocket
    from .regions import CudaRegion, Region
    from .sessions import Session


# a sequence's correlation id: a positive integer below 2^64, or a non-empty string
CorrId = Union[int, str]


@dataclass(frozen=True)
class SequenceFlags:
    """A request's `sequence` field, checked (schedulers/sequence_tensors.parse_flags)."""
    corrid: CorrId
    start: bool
    end: bool


@dataclass(eq=False)
class InferRequest:
    """An accepted request: it will get exactly one final answer."""

    socket: ReplySocket               # the frontend socket (or lane) it came in on
    identity: bytes                   # ZeroMQ routing id of the client
    request_id: object                # the client's id, echoed as it came
    version: ModelVersion
    inputs: list[InputDescriptor]     # worker descriptors
    outputs: list[WorkerOutput]       # requested outputs for the worker: names, or
                                      # [name, region ref, offset, capacity] to write into a region
    blocks: list[Block] = field(default_factory=list)
    deadline: Optional[float] = None  # time.monotonic() after which it may not start
    received: float = field(default_factory=time.monotonic)
    batch_size: int = 1
    session: Optional[Session] = None  # the client session, if the request named one
    client: Optional[ClientKey] = None  # whom it counts against in flight (InFlight.client_of)
    regions: list[Union[Region, CudaRegion]] = field(default_factory=list)   # regions it uses (released when answered)
    region_outputs: dict[str, tuple[str, int]] = field(default_factory=dict)  # output name -> (region name, offset)
    output_shm: bool = False          # lend outputs in place instead of sending bytes
    sequence: Optional[SequenceFlags] = None  # for a model with sequence_batching
    hidden_outputs: frozenset[str] = frozenset()   # asked of the worker, never sent (sequence state)
    # --- batching (see broker/batcher.py) ---
    rows: int = 1                     # rows along dim 0 (batch_size counts a 0-row request as 1)
    shapes: dict[str, list[int]] = field(default_factory=dict)   # input name -> shape as sent
    staged: list[Staged] = field(default_factory=list)   # its checked inputs, until batched
    key: Optional[tuple[object, ...]] = None  # requests with equal keys may share a batch
    exclusive: bool = False           # runs alone (outputs into regions, or no batch dimension)
    level: int = 1                    # priority level (1 = highest)
    timeout_us: int = 0               # the client's timeout, for the queue policy
    enqueued: float = 0.0
    arrival: int = 0
    queued: bool = False
    delayed: bool = False             # timed out with DELAY: behind its level's other requests


def batch_layout(req: "InferRequest", staged: list[Staged], cfg: ModelConfig) -> None:
    """Fill in what batching needs to know about an accepted request: its
    input shapes, its rows, and the key of the requests it may share a batch
    with (the same inputs, with the same shapes beyond the batch dimension,
    except ragged inputs)."""
    batching = cfg.max_batch_size > 0
    req.shapes = {s.spec.name: s.shape for s in staged}
    req.rows = batch_rows(staged, batching)
    # A request with an output into a region or a classified output (both
    # are the only requested outputs that are not plain names) runs alone:
    # a batch of several requests asks the worker for plain names
    # (schedulers/*.py `_outputs`), and a classification replaces the
    # tensor with per-item top-k strings, which requests that want the
    # tensor itself, or another k, cannot share. Computing it per request
    # after the split would put torch work in the broker's loop.
    # So does a request with an input in a client's GPU memory (a CUDA
    # region): the broker cannot copy it into a batch, so it runs in place.
    plain = True
    for o in req.outputs:
        if o.__class__ is not str:
            plain = False
            break
    for s in staged:
        if s.location is not None and is_device_ref(s.location[0]):
            plain = False
            break
    req.exclusive = not batching or not plain
    if req.exclusive:
        req.key = ("alone", id(req))
    else:
        req.key = batch_key(staged)


def stage_inputs(staged: list[Staged], arena: Arena, model: str
                 ) -> tuple[list[InputDescriptor], list[Block]]:
    """Copy inline inputs once into the arena; inputs already in shared memory
    are passed by descriptor. Returns worker descriptors and the blocks used."""
    descriptors: list[InputDescriptor] = []
    blocks: list[Block] = []
    try:
        for spec, _shape, model_shape, payload, location in staged:
            if location is not None:
                # the location is the descriptor's segment, offset, nbytes[, generation[, reuse]]
                descriptors.append(InputDescriptor(spec.name, spec.datatype, model_shape,
                                                   *location))  # type: ignore[arg-type]
                continue
            block = arena.alloc(len(payload))
            blocks.append(block)
            if len(payload):
                copy_into(arena.view(block), payload)
            # True: the answer may be sent from this block when an output is
            # a view of it (the broker keeps the block until it is sent)
            descriptors.append(InputDescriptor(spec.name, spec.datatype, model_shape, block.segment,
                                               block.offset, block.size, 0, True))
    except ArenaFull as exc:
        for block in blocks:
            arena.free(block)
        raise TorchpoolError(errors.UNAVAILABLE, f"model '{model}': {exc}; retry later or raise "
                                                 f"--shm-limit") from None
    return descriptors, blocks
