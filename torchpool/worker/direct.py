"""Direct requests: a local client's small, plain requests, sent to this worker.

A request over the broker crosses four process hops (client, broker,
worker, broker, client); the broker's half of them was most of its latency
and CPU (measured on the development VM: ~450 of ~930 µs of CPU per tiny
request). A local client whose session has a request lane may ask the broker
for a direct path to a model (broker/direct.py): the broker hands this worker
one end of a socket pair (ADOPT) and the client the other, and the client
then sends its plain requests here, in the lane's form (protocol/lane.py),
and gets its answers here.

A direct request is one the broker's scheduler would have run alone, at
once, exactly as sent: inputs inline in its one datagram, outputs by name,
no priority or sequence. A per-call timeout comes along: a request whose
deadline (counted from when the client sent it) passed before it could
start is answered "Request timeout expired" and counted as rejected,
as the daemon's scheduler does. It is checked here by the broker's own
rules (rules/validation.py, their one owner), with the limits
the broker sent; anything else gets a clear error and nothing runs. Its
outputs travel back inline (in pieces when large).

The worker serves its broker first, then each direct client one request in
turn; between turns it waits on all their sockets, polling a while first
while they answer sooner than a window (rules/spin.py: the broker sends
the window with each path). A client that does not read its answer keeps
that one answer waiting here, and nothing more is read from it until it
does; after STALL_S it is closed. Each request answered is reported to the broker before its answer
goes, so statistics read after an answer count it: in the report ring the
broker shares with the worker (protocol/reports.py), or as a SERVED
message when the ring is full.

Every direct request runs through direct_batch.DirectRunner on the
worker's engine (engine.py): alone, or, for a model with dynamic batching,
with the others of its batch (what a turn reads waits for its batch by the
broker's batching rules).
"""
from __future__ import annotations

import functools
import logging
import os
import select
import socket
import time
from typing import TYPE_CHECKING, NamedTuple, Optional, Protocol, cast

from typing_extensions import Buffer

from ..config import ModelConfig
from ..protocol import errors, internal, lane, messages
from ..protocol.errors import TorchpoolError
from ..protocol import reports
from ..protocol.reports import ReportRing, open_ring
from ..rules.spin import WORKER_SPIN_SHARE, SpinWait
from ..rules.direct import plain_refusal
from ..rules.request import InferCall, read_infer
from ..rules.batching import batch_key, batch_rows
from ..rules.validation import (TIMEOUT, CheckedInfer, SessionRegion, TensorLimits, start_deadline,
                                validate_infer)
from ..shm.fdpass import DONTWAIT, close_all
from .direct_batch import DirectBatcher, DirectRunner, Waiting, poll_timeout_ms
from .engine import Part, StagedInput

if TYPE_CHECKING:
    from ..shm.fdpass import FdReceiver
    from .engine import Engine
    from .spec import WorkerSpec

log = logging.getLogger("torchpool.worker")

STALL_S = 10.0          # a client that leaves an answer unread this long is closed

_POLLIN = select.POLLIN
_POLLOUT = select.POLLOUT
_GONE = select.POLLHUP | select.POLLERR


class _Model(NamedTuple):
    """What `validate_infer` reads of a model version."""
    name: str
    config: ModelConfig


class Host(Protocol):
    """What the direct clients use of their worker (process.Worker)."""

    spec: WorkerSpec
    sock: socket.socket
    receiver: FdReceiver
    engine: Engine
    busy_poll_ns: int
    label: str

    def send(self, msg: internal.Message) -> None: ...
    def handle(self, raw: memoryview, fds: list[int]) -> bool: ...
    def failed(self, batch_id: int, exc: Exception, what: str = "") -> internal.Failed: ...


class _Client:
    __slots__ = ("name", "session", "sock", "outbox", "stalled_at")

    def __init__(self, name: str, session: str, sock: socket.socket) -> None:
        self.name = name
        self.session = session          # reported with its requests: they renew its lease
        self.sock = sock
        self.outbox: list = []          # datagrams of the answer not sent yet
        self.stalled_at = 0.0           # when its socket was first found full


class DirectClients:
    """The direct clients of one worker, served between the broker's messages."""

    def __init__(self, worker: Host) -> None:
        self.worker = worker
        spec = worker.spec
        self.model = _Model(spec.model, spec.config)
        self.version = str(spec.version)
        self.limits = TensorLimits()
        self.clients: dict[int, _Client] = {}
        self.poller = select.poll()
        self.broker_fd = worker.sock.fileno()
        self.poller.register(self.broker_fd, _POLLIN)
        self._buffer = bytearray(lane.MAX_DATAGRAM + 1)
        self.ring: Optional[ReportRing] = None     # where answered requests are reported
        # the broker widens the window with a path; the worker spins only while requests
        # come well within it (spin.py: it waits for what may not come)
        self.spin = SpinWait(worker.busy_poll_ns // 1000, share=WORKER_SPIN_SHARE)
        self.batching = spec.config.max_batch_size > 0
        self.runner: Optional[DirectRunner] = None
        self.batcher: Optional[DirectBatcher[_Client]] = None

    def start(self) -> None:
        """The instance is loaded: its direct requests run on its engine."""
        worker, cfg = self.worker, self.worker.spec.config
        self.runner = DirectRunner(worker.engine, cfg, self.version, functools.partial(worker.failed, 0))
        if self.batching and cfg.dynamic_batching is not None:
            self.batcher = DirectBatcher(self.runner)

    # ------------------------------------------------------------ clients

    def adopt(self, msg: internal.Adopt, fds: list[int]) -> None:
        """A direct client's socket; with the first, the report ring."""
        if len(fds) == 2 and self.ring is None:
            self.ring = open_ring(fds[1])
            os.close(fds.pop())
            self.worker.send(internal.Served([]))     # the broker reads it from now on
        if len(fds) != 1:
            close_all(fds)
            log.error("%s: a direct client came with %d fds; ignored", self.worker.label, len(fds))
            return
        sock = socket.socket(fileno=fds[0])
        sock.setblocking(False)
        self.limits = TensorLimits(msg.max_bytes_elements, msg.max_bytes_tensor_bytes)
        if msg.spin_us * 1000 > self.spin.window_ns:
            self.spin.widen(msg.spin_us)
        self.clients[sock.fileno()] = _Client(msg.name, msg.session, sock)
        self.poller.register(sock.fileno(), _POLLIN)

    def forget(self, name: str) -> None:
        """The broker closed the client's session (FORGET): what it sent is answered first."""
        if self.batcher is not None and self.batcher.waiting:
            self.batcher.run_due(self._answer_batch, force=True)
        for c in list(self.clients.values()):
            if c.name == name:
                self._drop(c)

    def _drop(self, c: _Client) -> None:
        if self.batcher is not None:
            self.batcher.drop(c)
        fd = c.sock.fileno()
        if self.clients.pop(fd, None) is not None:
            self.poller.unregister(fd)
        c.sock.close()

    def close(self) -> None:
        for c in list(self.clients.values()):
            self._drop(c)
        if self.ring is not None:
            self.ring.close()
            self.ring = None

    # ------------------------------------------------------------ the loop

    def turn(self) -> bool:
        """Wait for the broker or a client, then serve what is ready: one
        broker message, one request of each client (as many as a batch takes,
        for a model that batches). False: the worker stops."""
        worker = self.worker
        for fd, events in self._wait():
            if fd == self.broker_fd:
                try:
                    raw, fds = worker.receiver.recv(worker.sock, DONTWAIT)
                except BlockingIOError:
                    continue
                if not worker.handle(raw, fds):
                    return False
                continue
            c = self.clients.get(fd)
            if c is None:
                continue                 # dropped during this turn
            if not c.outbox:
                self._serve(c)           # (POLLHUP, POLLERR: its recv says so)
            elif events & _POLLOUT:
                self._flush(c)
            elif events & _GONE:
                self._drop(c)
        if self.batcher is not None and self.batcher.waiting:
            self._fill_batch(self.batcher)
            self.batcher.run_due(self._answer_batch)
        return True

    def _fill_batch(self, batcher: DirectBatcher[_Client]) -> None:
        """Read more of what the clients already sent, one request of each in
        turn, until the batch is full: the threads of one client share its
        path, and their requests are batched as the broker batches them."""
        more = list({id(w.client): w.client for w in batcher.waiting}.values())
        for _ in range(batcher.max_preferred):       # (bounded: refused requests fill nothing)
            more = [c for c in more if not c.outbox and self._serve(c)]
            if not more or batcher.items() >= batcher.max_preferred:
                return

    def _wait(self) -> list:
        poll = self.poller.poll
        ready = poll(0)
        stalled = [c for c in self.clients.values() if c.outbox]
        if not ready:
            timeout = poll_timeout_ms(self.batcher.wake_at) if self.batcher is not None else None
            if stalled:
                timeout = 1000 if timeout is None else min(timeout, 1000)
            ready = self.spin.wait(poll, timeout)
        if stalled:
            now = time.monotonic()
            for c in stalled:
                if c.outbox and now - c.stalled_at > STALL_S:
                    log.warning("%s: closing direct client %s: it left an answer unread for %g s",
                                self.worker.label, c.name, STALL_S)
                    self._drop(c)
        return ready

    # ------------------------------------------------------------ requests

    def _serve(self, c: _Client) -> bool:
        """Read and serve (or batch) one request of `c`; False when it had none."""
        try:
            n = c.sock.recv_into(self._buffer, 0, DONTWAIT)   # fds sent along are closed by the kernel
        except BlockingIOError:
            return False
        except OSError:
            n = 0
        if n == 0:                       # the client closed it
            self._drop(c)
            return False
        t0 = time.perf_counter_ns()
        request_id = None
        try:
            try:
                header, payload = self._request(memoryview(self._buffer)[:n])
            except messages.HeaderError as exc:
                request_id = exc.request_id
                raise
            call = read_infer(header)
            request_id = call.request_id
            self._check_plain(header.get("op"), call)
            deadline = start_deadline(call)
            checked: CheckedInfer[SessionRegion] = validate_infer(call, payload, self.model, limits=self.limits)
        except TorchpoolError as exc:    # not accepted: nothing ran, nothing to count
            self._answer(c, [messages.pack(messages.error_response(request_id, exc))])
            return True
        except Exception as exc:         # a malformed request must never take the worker down
            self._answer(c, [messages.pack(messages.error_response(request_id, TorchpoolError(
                errors.INVALID_ARG, f"malformed request for model '{self.model.name}': {exc!r}")))])
            return True
        batching = self.batcher is not None
        # _check_plain (rules/direct.py's plain_refusal) refused any output asked otherwise
        # than by name: what validate_infer gives back is names only
        names = cast("list[str]", checked.outputs)
        staged = checked.staged
        request = Waiting(c, request_id, _part(staged, self.batching), names, checked.batch_size,
                          batch_key(staged) if batching else None, t0)
        if self.batcher is not None:
            # a model that batches ignores a request's own timeout, as the
            # daemon's batcher does (a queue policy that honours it keeps the
            # model off direct paths: DynamicScheduler.direct_refusal)
            self.batcher.add(request)
        elif deadline is not None and time.monotonic_ns() > deadline:
            self._expired(c, request_id, t0)
        else:
            self.runner.run([request], self._answer_batch)   # type: ignore[union-attr]
        return True

    def _expired(self, c: _Client, request_id: object, t0: int) -> None:
        """A request whose deadline passed before it could start: not run,
        answered and counted as the daemon's scheduler does (Triton's
        "Request timeout expired", a REJECTED failure)."""
        self._report([[reports.TIMED_OUT, time.perf_counter_ns() - t0, 0, c.session, None]])
        self._answer(c, [messages.pack(messages.error_response(request_id, TorchpoolError(
            errors.UNAVAILABLE, TIMEOUT)))])

    def _request(self, data: memoryview) -> tuple[dict, list]:
        """The header and payload frames of one direct request; TorchpoolError
        when it does not parse."""
        model = self.model.name
        if len(data) > lane.MAX_DATAGRAM or data[0] != lane.LAST:
            raise TorchpoolError(errors.INVALID_ARG, f"a direct request for model '{model}' is one "
                                                     f"datagram of at most {lane.MAX_DATAGRAM} bytes")
        try:
            frames = lane.decode(data[1:])
        except lane.LaneError as exc:
            raise TorchpoolError(errors.INVALID_ARG, f"malformed direct request for model "
                                                     f"'{model}': {exc}") from None
        return messages.decode_header(frames[0]), frames[1:]

    def _check_plain(self, op: object, call: InferCall) -> None:
        """TorchpoolError unless the request is one this path takes."""
        model = self.model.name
        if op != messages.OP_INFER:
            raise TorchpoolError(errors.UNSUPPORTED, f"the direct path of model '{model}' takes only "
                                                     f"infer, not {op!r}")
        if call.model != model or call.version not in ("", self.version):
            raise TorchpoolError(errors.INVALID_ARG, f"this direct path serves model '{model}' version "
                                                     f"{self.version}, not {call.model!r} "
                                                     f"version {call.version!r}")
        refusal = plain_refusal(call, model)
        if refusal is not None:
            raise refusal

    def _answer_batch(self, records: list, answers: list[tuple[_Client, list[Buffer]]]) -> None:
        """A batch's report, then its answers (a client gone meanwhile gets none)."""
        self._report(records)
        for c, frames in answers:
            if self.clients.get(c.sock.fileno()) is c:
                self._answer(c, frames)

    def _report(self, records: list) -> None:
        """Report answered requests to the broker before answering them: in
        the report ring (protocol/reports.py), as SERVED when it is full."""
        ring = self.ring
        if ring is not None:
            records = [r for r in records if not ring.put(r)]
            if ring.half_full() and not records:
                self.worker.send(internal.Served([]))      # the broker reads the ring now
        if records:
            self.worker.send(internal.Served(records))

    def _answer(self, c: _Client, frames: list) -> None:
        c.outbox += lane.datagrams(frames)     # (a batch may answer two of its requests)
        self._flush(c)

    def _flush(self, c: _Client) -> None:
        """Send what the client's socket takes now; wait for room for the rest."""
        outbox = c.outbox
        while outbox:
            try:
                c.sock.sendmsg(outbox[0], (), DONTWAIT)
            except BlockingIOError:
                if not c.stalled_at:     # its requests wait until it reads: no POLLIN
                    c.stalled_at = time.monotonic()
                    self.poller.modify(c.sock.fileno(), _POLLOUT)
                return
            except OSError:              # the client is gone
                self._drop(c)
                return
            del outbox[0]
        if c.stalled_at:
            c.stalled_at = 0.0
            self.poller.modify(c.sock.fileno(), _POLLIN)



def _part(staged: list, batching: bool) -> Part:
    """A validated request's inputs as a part of a batch: a copy of their bytes
    (the receive buffer is reused, and a model may write its inputs)."""
    return Part({spec.name: StagedInput(spec.datatype, model_shape, bytearray(payload))
                 for spec, _shape, model_shape, payload, _location in staged},
                batch_rows(staged, batching))
