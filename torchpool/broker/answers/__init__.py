"""Answers: the broker's outbound half.

A finished batch becomes exactly one answer per request. Each output goes
into the caller's region when it asked for one; back into the client's own
input block when the model returned a view of it; lent in place to a local
client; inline when small; or as zero-copy frames from the worker's shared
memory. A worker output block goes back to its worker (piggybacked on its
next RUN) once every send and every lend of it is done; with
preserve_ordering, batches that finish early wait for their turn here.

    finished batch ─► complete(mv, batch, Executed | TorchpoolError)
                        └─ its turn (preserve_ordering) ─► split per request
                           (split.py) ─► one answer each: region / own block /
                           lent / inline / zero-copy frames ─► blocks back
                           to the worker once sent and released
"""
from __future__ import annotations

import itertools
import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Optional, Sequence, Union, cast

import zmq

from ...protocol import errors, messages, tensors
from ...protocol.errors import TorchpoolError
from ...shm import Arena, MappedSegments
from ...shm.fdpass import close_all
from ...shm.arena import Block
from ...shm.segment import Segment
from ..batch import Batch, CopiedDescriptor, CopiedOutput, OutputEntry, OutputPiece, SegmentRef
from ..frontend import Frontend
from ..registry import ModelVersion
from ..requests import InferRequest
from ...rules.validation import TIMEOUT
from ..stats import BACKEND, OTHER, REJECTED
from ..supervisor import DEAD, WorkerHandle
from .split import check_reused_outputs, split_outputs

if TYPE_CHECKING:
    from typing_extensions import Buffer

    from ..sessions import Session, SessionManager

log = logging.getLogger("torchpool.broker")


@dataclass(eq=False)
class Executed:
    """A batch the worker ran: its output descriptors
    `[name, datatype, shape, segment, offset, nbytes]`."""

    outputs: Sequence[OutputEntry]
    worker: Optional[WorkerHandle]    # None: the bytes were copied out of a worker that died
    reused: frozenset[str] = frozenset()   # outputs that are views of an input block


# how a batch ended: ran, or failed with the error its requests get
Outcome = Union[Executed, TorchpoolError]


def failure_reason(err: TorchpoolError) -> str:
    """Triton's failure reason of an error the broker made up itself: a
    request whose timeout passed while it waited in the queue is REJECTED
    (Triton's "Request timeout expired"); anything else (shutdown, unload,
    a full arena, ...) is OTHER. Failures of the model are marked BACKEND
    where they are answered."""
    if err.code == errors.UNAVAILABLE and err.message == TIMEOUT:
        return REJECTED
    return OTHER


@dataclass(eq=False)
class _Order:
    """preserve_ordering: a version's batches are answered in the order they
    were sent; one that finished early waits here for its turn."""

    sent: itertools.count[int] = field(default_factory=itertools.count)
    next_answer: int = 0
    held: dict[int, tuple[Batch, Outcome]] = field(default_factory=dict)


@dataclass(eq=False)
class _OutBlock:
    """A worker output block that answers read from (several, for a batch):
    it goes back to the worker once every send and every lend of it is done."""

    worker: WorkerHandle
    block: list[Union[str, int]]      # [segment, offset, size]
    refs: int = 1                     # 1 while the answers are being sent


@dataclass(eq=False)
class _Loan:
    """An output sub-range lent in place to a local client's session."""

    session: Session
    generation: int                   # the client names it when it releases the range
    owner: _OutBlock



class Answers:
    """Answers requests, and keeps the shared memory their zero-copy sends and
    lends still read (worker output blocks, broker input blocks) until done."""

    def __init__(self, frontend: Frontend, arena: Arena, transfer: Counter[str], sessions: SessionManager,
                 close_segment: Callable[[Segment], None] = Segment.close) -> None:
        self.frontend = frontend
        self.arena = arena                    # the broker's input arena (requests' blocks)
        self.transfer = transfer              # bytes copied / lent / sent, for benchmarks and tests
        self.sessions = sessions              # local clients: regions to release, outputs to lend
        self._orders: dict[ModelVersion, _Order] = {}
        # each worker's output segments (fds kept); a dead worker's are closed by
        # `close_segment` (the server's reaper: the last close frees their pages)
        self.worker_segments = MappedSegments(close_segment)
        # zero-copy sends of worker output blocks still being written by ZeroMQ
        self._sending: list[tuple[list[zmq.MessageTracker], WorkerHandle, list[_OutBlock]]] = []
        # the one map of output sub-ranges lent to local clients: (segment, offset) -> loan
        self._lent: dict[tuple[str, int], _Loan] = {}
        # the workers' lending areas: segment -> the lending id of the one session
        # whose outputs it holds, the only session it is lent to (worker/lending.py)
        self.area_owner: dict[str, int] = {}
        self._generations = itertools.count(1)
        # zero-copy sends of outputs that are views of inputs in the broker's
        # arena: those input blocks are freed once the sends are done
        self._sending_inputs: list[tuple[list[zmq.MessageTracker], list[Block]]] = []

    def worker_gone(self, h: WorkerHandle) -> None:
        """A worker died: forget its blocks, copy out what waits for its turn."""
        self._sending = [s for s in self._sending if s[1] is not h]
        if self._lent:     # a dead worker's lent blocks need no release: its memory is gone
            for key in [k for k, loan in self._lent.items() if loan.owner.worker is h]:
                self._lent.pop(key).session.loans -= 1
        order = self._orders.get(h.mv)
        if order is not None:
            self._rescue_held(order, h)
        prefix = h.spec.segment_prefix
        self.worker_segments.drop(lambda name: name.startswith(prefix))
        for name in [n for n in self.area_owner if n.startswith(prefix)]:
            del self.area_owner[name]

    def map_worker_segments(self, h: WorkerHandle, segments: Sequence[Sequence[Union[str, int]]],
                            fds: list[int]) -> None:
        """A worker's new output segments: mapped to read answers from, their
        fds kept (to lend a lending area's outputs to its session, and to
        hand sequence state to the next worker)."""
        if len(segments) != len(fds) or not all(
                isinstance(s, list) and len(s) in (2, 3) and isinstance(s[0], str)
                and s[0].startswith(h.spec.segment_prefix) for s in segments):
            close_all(fds)
            log.error("%s handed over segments the broker cannot take: %r", h.label, segments)
            return
        # checked above: [name, size], or a lending area's [name, size, lend_id] (protocol/internal.py)
        checked = cast("Sequence[Union[tuple[str, int], tuple[str, int, int]]]", segments)
        for segment, fd in zip(checked, fds):
            self.worker_segments.add(segment[0], fd, writable=False, keep_fd=True)
            if len(segment) == 3:       # a lending area
                self.area_owner[segment[0]] = segment[2]

    def worker_areas_closed(self, h: WorkerHandle, names: Sequence[object]) -> None:
        """A worker closed lending areas (their session went, their blocks are back)."""
        for name in names:
            if isinstance(name, str) and name.startswith(h.spec.segment_prefix) \
                    and self.area_owner.pop(name, None) is not None:
                self.worker_segments.drop(name.__eq__)

    def close(self) -> None:
        self.worker_segments.close()

    def _lend(self, session: Session, owner: _OutBlock, segment: str, offset: int) -> int:
        generation = next(self._generations)
        self._lent[segment, offset] = _Loan(session, generation, owner)
        owner.refs += 1
        session.loans += 1
        return generation

    def release_lent(self, session: Session, releases: object) -> int:
        """Give back the lent outputs a client names `[segment, offset,
        generation]`. One that matches no range lent to this session with
        that generation (a worker that died since, a duplicate) frees nothing
        and is ignored: it can never free a block someone else reads.
        Returns how many were ignored."""
        if not isinstance(releases, list):
            raise TorchpoolError(errors.INVALID_ARG, "'release' must be a list of [segment, offset, generation]")
        ignored = 0
        for item in releases:
            if not (isinstance(item, list) and len(item) == 3):
                raise TorchpoolError(errors.INVALID_ARG,
                                     "'release' must be a list of [segment, offset, generation]")
            if not (isinstance(item[0], str) and isinstance(item[1], int)):
                ignored += 1
                continue
            key = (item[0], item[1])
            loan = self._lent.get(key)
            if loan is None or loan.session is not session or loan.generation != item[2]:
                ignored += 1
                continue
            del self._lent[key]
            session.loans -= 1
            self._unref(loan.owner)
        return ignored

    def end_loans(self, session: Session) -> None:
        """The session closed: everything lent to it goes back."""
        if session.loans:
            for key in [k for k, loan in self._lent.items() if loan.session is session]:
                self._unref(self._lent.pop(key).owner)
        session.loans = 0

    def release(self, req: InferRequest) -> None:
        """Free what the request held, once: arena blocks, regions, its session."""
        self.frontend.in_flight.done(req)   # its final answer goes out now: no longer in flight
        for block in req.blocks:
            self.arena.free(block)
        req.blocks = []
        req.staged = []
        if req.session is not None:
            for region in req.regions:
                self.sessions.region_done(req.session, region)
            req.session.in_flight -= 1
            req.session, req.regions = None, []

    def fail(self, req: InferRequest, err: TorchpoolError, reason: Optional[str] = None) -> None:
        """Answer `req` with `err`. `reason` is Triton's failure reason for the
        metrics; None: read from the error (failure_reason)."""
        req.version.stats.record_failure(int((time.monotonic() - req.received) * 1e9),
                                         reason or failure_reason(err))
        self.release(req)
        self.frontend.send(req.socket, req.identity, messages.error_response(req.request_id, err))

    def fail_batch(self, batch: Batch, err: TorchpoolError, reason: Optional[str] = None) -> None:
        for req in batch.requests:
            self.fail(req, err, reason)

    def free_batch(self, batch: Batch) -> None:
        """The worker is done with the batch's inputs."""
        for block in batch.blocks:
            self.arena.free(block)
        batch.blocks = []

    def dispatched(self, mv: ModelVersion, batch: Batch) -> None:
        """`batch` goes to a worker now: with preserve_ordering it takes its
        place in the order of answers."""
        if mv.config.dynamic_batching and mv.config.dynamic_batching.get("preserve_ordering"):
            order = self._orders.get(mv)
            if order is None:
                order = self._orders[mv] = _Order()
            batch.seq = next(order.sent)

    def complete(self, mv: ModelVersion, batch: Batch, outcome: Outcome) -> None:
        """Answer a finished batch. With preserve_ordering, batches are
        answered in the order they were sent; one that finished early waits."""
        seq = batch.seq
        order = self._orders.get(mv) if seq is not None else None
        if order is None or seq is None:
            self._settle(batch, outcome)
            return
        order.held[seq] = (batch, outcome)
        while order.next_answer in order.held:
            held_batch, held_outcome = order.held.pop(order.next_answer)
            order.next_answer += 1
            self._settle(held_batch, held_outcome)

    def flush_held(self, mv: ModelVersion) -> None:
        """Answer every finished batch of `mv` still waiting for its turn
        (shutdown, or the version is gone)."""
        order = self._orders.pop(mv, None)
        if order is not None:
            for seq in sorted(order.held):
                self._settle(*order.held.pop(seq))

    def _settle(self, batch: Batch, outcome: Outcome) -> None:
        if isinstance(outcome, TorchpoolError):
            self.fail_batch(batch, outcome, BACKEND)     # the worker failed it, or died running it
            return
        descriptors, worker, reused = outcome.outputs, outcome.worker, outcome.reused
        mv = batch.requests[0].version
        try:
            if reused:
                check_reused_outputs(batch, descriptors, reused, mv.label)
            parts = split_outputs(mv.config, batch, descriptors, self.read_output)
        except Exception as exc:
            if not isinstance(exc, TorchpoolError):
                log.exception("splitting the outputs of a batch of %s failed", mv.label)
                exc = TorchpoolError(errors.INTERNAL, f"{mv.label}: {exc}")
                self.fail_batch(batch, exc, OTHER)        # ours, not the model's
            else:
                self.fail_batch(batch, exc, BACKEND)      # the model's outputs are not what it declares
            parts = None
        blocks = {}
        for d in descriptors:
            if isinstance(d.segment, str) and worker is not None and d.name not in reused:
                blocks[d.segment, d.offset] = _OutBlock(worker, [d.segment, d.offset, d.nbytes])
        if parts is not None:
            owner_of = {d.name: blocks.get((d.segment, d.offset)) if isinstance(d.segment, str) else None
                        for d in descriptors}
            for req, pieces in zip(batch.requests, parts):
                broken = [r.name for r in req.regions if r.broken]
                if broken:
                    # the client shrank its region while we or the model read it: what was
                    # read is zeros (shm/guard.py), so the answer would be wrong
                    self.fail(req, TorchpoolError(errors.INVALID_ARG, f"{mv.label}: region "
                                                  f"'{broken[0]}' shrank while the request used "
                                                  f"it; unregister and register it again"))
                    continue
                try:
                    self._answer(req, pieces, owner_of, reused)
                except Exception as exc:  # never lose the request
                    log.exception("answering a request of %s failed", mv.label)
                    self.fail(req, TorchpoolError(errors.INTERNAL, f"{mv.label}: {exc}"))
        for shared in blocks.values():
            self._unref(shared)

    def read_output(self, segment: SegmentRef, offset: int, nbytes: int) -> memoryview:
        if isinstance(segment, CopiedOutput):
            return memoryview(segment.data)[offset:offset + nbytes]
        return memoryview(self.worker_segments.get(segment).buf)[offset:offset + nbytes]

    def _unref(self, shared: _OutBlock) -> None:
        shared.refs -= 1
        if shared.refs == 0 and shared.worker.state != DEAD:
            shared.worker.releases.append(shared.block)

    def _answer(self, req: InferRequest, pieces: list[OutputPiece], owner_of: dict[str, Optional[_OutBlock]],
                reused: frozenset[str]) -> None:
        """Send one request's outputs (its own byte ranges of the worker's
        output blocks, or of its inputs when outputs are views of them): into
        the caller's region when it asked; from the input they are a view of;
        lent in place to a local client; small ones inline; large ones
        zero-copy from the worker's shared memory (the block goes back to the
        worker once every answer that reads it has been sent and every lend
        released)."""
        session, lend = req.session, req.output_shm
        if session is not None and session.token not in self.sessions.sessions:
            lend = False
        now = time.monotonic()
        stats = req.version.stats
        ns = int((now - req.received) * 1e9)
        stats.success.add(ns)
        if stats.windows is not None:
            stats.windows.request.observe(ns // 1000, now)
        # input blocks of ours that outputs are views of outlive the request
        held = _take_viewed_blocks(req, pieces, reused)
        self.release(req)
        outputs: list[tensors.Entry] = []
        frames: list[Union[zmq.Frame, Buffer]] = []
        trackers: list[zmq.MessageTracker] = []
        sending: list[_OutBlock] = []
        held_trackers: list[zmq.MessageTracker] = []
        try:
            for name, datatype, shape, segment, offset, nbytes in pieces:
                if name in req.hidden_outputs:
                    continue                     # sequence state: kept by the broker, never sent
                entry = tensors.tensor_entry(name, datatype, shape)
                outputs.append(entry)
                if name in req.region_outputs:
                    region_name, region_offset = req.region_outputs[name]
                    tensors.put_region(entry, region_name, nbytes, region_offset)
                    continue
                if name in reused and isinstance(segment, str):
                    self._answer_view(entry, segment, offset, nbytes, held, frames, held_trackers)
                elif not isinstance(segment, (str, CopiedOutput)):   # a region's [key, inode]
                    raise TorchpoolError(errors.INTERNAL, f"output '{name}' was written into a region it "
                                                          f"was not asked into")
                else:
                    self._answer_output(entry, segment, offset, nbytes, owner_of.get(name),
                                        session if lend else None, frames, trackers, sending)
            self.frontend.send(req.socket, req.identity,
                               messages.ok_response(req.request_id, model_name=req.version.name,
                                                    model_version=str(req.version.version),
                                                    outputs=outputs), frames)
        finally:
            if held_trackers:
                self._sending_inputs.append((held_trackers, held))
            else:
                for block in held:
                    self.arena.free(block)
            if trackers:
                self._sending.append((trackers, sending[0].worker, sending))

    def _answer_view(self, entry: tensors.Entry, segment: str, offset: int, nbytes: int, held: list[Block],
                     frames: list[Union[zmq.Frame, Buffer]], trackers: list[zmq.MessageTracker]) -> None:
        """Fill in an output that is a view of one of the request's inputs:
        in the client's own block (it keeps the block for the output), or in
        one the broker staged (`held`), sent from there."""
        self.transfer["output_bytes_reused"] += nbytes
        if not _within(held, segment, offset, nbytes):
            tensors.put_own(entry, segment, offset, nbytes)
            return
        self.transfer["output_bytes_sent"] += nbytes
        data = memoryview(self.arena.segments[segment].buf)[offset:offset + nbytes]
        frame = tensors.put_data(entry, data, frames, _tracked)
        if isinstance(frame, zmq.Frame):      # (else inline: None)
            trackers.append(frame.tracker)

    def _answer_output(self, entry: tensors.Entry, segment: SegmentRef, offset: int, nbytes: int,
                       owner: Optional[_OutBlock], lend_to: Optional[Session],
                       frames: list[Union[zmq.Frame, Buffer]], trackers: list[zmq.MessageTracker],
                       sending: list[_OutBlock]) -> None:
        """Fill in one output of the worker's: lent in place to a local client
        (`lend_to`: its session, else None); small ones inline; large ones as
        zero-copy frames of the worker's shared memory (`owner`: its block;
        None for bytes copied out of a worker that died)."""
        if lend_to is not None and owner is not None and isinstance(segment, str) \
                and tensors.worth_descriptor(nbytes) \
                and self.area_owner.get(segment) == lend_to.lend_id \
                and self.sessions.offer(lend_to, self.worker_segments.get(segment)):
            tensors.put_shm(entry, segment, offset, nbytes, self._lend(lend_to, owner, segment, offset))
            self.transfer["output_bytes_lent"] += nbytes
            return
        self.transfer["output_bytes_sent"] += nbytes
        data = self.read_output(segment, offset, nbytes)
        frame = tensors.put_data(entry, data, frames, None if owner is None else _tracked)
        if isinstance(frame, zmq.Frame) and owner is not None:    # (made by _tracked: an owner's)
            trackers.append(frame.tracker)
            if owner not in sending:
                owner.refs += 1
                sending.append(owner)

    def collect_finished_sends(self) -> None:
        """Blocks whose zero-copy sends ZeroMQ has finished go back: worker
        output blocks to their worker, input blocks to the broker's arena."""
        if self._sending:
            still = []
            for trackers, worker, shared in self._sending:
                if all(t.done for t in trackers):
                    for s in shared:
                        self._unref(s)
                else:
                    still.append((trackers, worker, shared))
            self._sending = still
        if self._sending_inputs:
            waiting = []
            for trackers, blocks in self._sending_inputs:
                if all(t.done for t in trackers):
                    for block in blocks:
                        self.arena.free(block)
                else:
                    waiting.append((trackers, blocks))
            self._sending_inputs = waiting

    def _rescue_held(self, order: _Order, h: WorkerHandle) -> None:
        """Answers of `h` waiting for their turn (preserve_ordering) keep their
        outputs: copied out before the worker's memory goes."""
        for seq, (batch, outcome) in list(order.held.items()):
            if isinstance(outcome, Executed) and outcome.worker is h:
                reused = outcome.reused
                copied = [CopiedDescriptor(name, datatype, shape,
                                           CopiedOutput(bytes(self.read_output(seg, off, n))), 0, n)
                          if isinstance(seg, str) and name not in reused else d
                          for d in outcome.outputs for name, datatype, shape, seg, off, n in [d]]
                order.held[seq] = (batch, Executed(copied, None, reused))


def _tracked(data: memoryview) -> zmq.Frame:
    """A zero-copy frame whose send we can see finish (the block is then freed)."""
    return zmq.Frame(data, copy=False, track=True)


def _take_viewed_blocks(req: InferRequest, pieces: list[OutputPiece], reused: frozenset[str]) -> list[Block]:
    """The request's blocks in the broker's arena that reused outputs are
    views of, taken out of `req.blocks` so that releasing the request does
    not free them before the answer is sent from them."""
    if not reused or not req.blocks:
        return []
    held = [b for b in req.blocks
            if any(name in reused and _within([b], segment, offset, nbytes)
                   for name, _datatype, _shape, segment, offset, nbytes in pieces)]
    if held:
        req.blocks = [b for b in req.blocks if b not in held]
    return held


def _within(blocks: list[Block], segment: object, offset: int, nbytes: int) -> bool:
    return any(b.segment == segment and b.offset <= offset and offset + nbytes <= b.offset + b.size
               for b in blocks)
