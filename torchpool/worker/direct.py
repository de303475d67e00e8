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
no timeout, priority or sequence. It is checked here by the broker's own
rules (protocol/validation.py, their one owner), with the limits
the broker sent; anything else gets a clear error and nothing runs. Its
outputs travel back inline (in pieces when large).

The worker serves its broker first, then each direct client one request in
turn. A client that does not read its answer keeps that one answer waiting
here, and nothing more is read from it until it does; after STALL_S it is
closed. Each request answered is reported to the broker (SERVED) before its
answer goes, so statistics read after an answer count it.
"""
from __future__ import annotations

import logging
import os
import select
import socket
import time
from typing import Any, NamedTuple

import torch

from ..config import ModelConfig
from ..protocol import datatypes, errors, internal, lane, messages, tensors
from ..protocol.errors import TorchpoolError
from ..protocol.validation import TensorLimits, validate_infer
from ..shm.fdpass import close_all

log = logging.getLogger("torchpool.worker")

STALL_S = 10.0          # a client that leaves an answer unread this long is closed

_POLLIN = select.POLLIN
_POLLOUT = select.POLLOUT
_GONE = select.POLLHUP | select.POLLERR
_DONTWAIT = int(socket.MSG_DONTWAIT)


class _Model(NamedTuple):
    """What `validate_infer` reads of a model version."""
    name: str
    config: ModelConfig


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

    def __init__(self, worker: Any) -> None:
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

    # ------------------------------------------------------------ clients

    def adopt(self, msg: internal.Adopt, fds: list[int]) -> None:
        if len(fds) != 1:
            close_all(fds)
            log.error("%s: a direct client came with %d fds; ignored", self.worker.label, len(fds))
            return
        sock = socket.socket(fileno=fds[0])
        sock.setblocking(False)
        self.limits = TensorLimits(msg.max_bytes_elements, msg.max_bytes_tensor_bytes)
        self.clients[sock.fileno()] = _Client(msg.name, msg.session, sock)
        self.poller.register(sock.fileno(), _POLLIN)

    def forget(self, name: str) -> None:
        """The broker closed the client's session (FORGET)."""
        for c in list(self.clients.values()):
            if c.name == name:
                self._drop(c)

    def _drop(self, c: _Client) -> None:
        fd = c.sock.fileno()
        if self.clients.pop(fd, None) is not None:
            self.poller.unregister(fd)
        c.sock.close()

    def close(self) -> None:
        for c in list(self.clients.values()):
            self._drop(c)

    # ------------------------------------------------------------ the loop

    def turn(self) -> bool:
        """Wait for the broker or a client, then serve what is ready: one
        broker message, one request of each client. False: the worker stops."""
        worker = self.worker
        for fd, events in self._wait():
            if fd == self.broker_fd:
                try:
                    raw, fds = worker.receiver.recv(worker.sock, _DONTWAIT)
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
        return True

    def _wait(self) -> list:
        poll = self.poller.poll
        ready = poll(0)
        busy_ns = self.worker.busy_poll_ns
        if not ready and busy_ns:        # as Worker.receive: a short poll before sleeping
            end = time.perf_counter_ns() + busy_ns
            while not ready and time.perf_counter_ns() < end:
                os.sched_yield()
                ready = poll(0)
        stalled = [c for c in self.clients.values() if c.outbox]
        if not ready:
            ready = poll(1000 if stalled else None)
        if stalled:
            now = time.monotonic()
            for c in stalled:
                if c.outbox and now - c.stalled_at > STALL_S:
                    log.warning("%s: closing direct client %s: it left an answer unread for %g s",
                                self.worker.label, c.name, STALL_S)
                    self._drop(c)
        return ready

    # ------------------------------------------------------------ requests

    def _serve(self, c: _Client) -> None:
        try:
            n = c.sock.recv_into(self._buffer, 0, _DONTWAIT)   # fds sent along are closed by the kernel
        except BlockingIOError:
            return
        except OSError:
            n = 0
        if n == 0:                       # the client closed it
            self._drop(c)
            return
        t0 = time.perf_counter_ns()
        request_id = None
        try:
            try:
                header, payload = self._request(memoryview(self._buffer)[:n])
            except messages.HeaderError as exc:
                request_id = exc.request_id
                raise
            request_id = header.get("id")
            self._check_plain(header)
            staged, requested, batch_size, _, _ = validate_infer(header, payload, self.model, limits=self.limits)
        except TorchpoolError as exc:    # not accepted: nothing ran, nothing to count
            self._answer(c, [messages.pack(messages.error_response(request_id, exc))])
            return
        except Exception as exc:         # a malformed request must never take the worker down
            self._answer(c, [messages.pack(messages.error_response(request_id, TorchpoolError(
                errors.INVALID_ARG, f"malformed request for model '{self.model.name}': {exc!r}")))])
            return
        self._run(c, request_id, staged, requested, batch_size, t0)

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

    def _check_plain(self, header: dict) -> None:
        """TorchpoolError unless the request is one this path takes."""
        model = self.model.name
        if header.get("op") != messages.OP_INFER:
            raise TorchpoolError(errors.UNSUPPORTED, f"the direct path of model '{model}' takes only "
                                                     f"infer, not {header.get('op')!r}")
        if header.get("model") != model or header.get("version") not in ("", self.version):
            raise TorchpoolError(errors.INVALID_ARG, f"this direct path serves model '{model}' version "
                                                     f"{self.version}, not {header.get('model')!r} "
                                                     f"version {header.get('version')!r}")
        if header.get("timeout_us") or header.get("priority") or header.get("sequence"):
            raise TorchpoolError(errors.UNSUPPORTED, f"a request for model '{model}' with a timeout, "
                                                     f"priority or sequence goes to the daemon, not "
                                                     f"the direct path")
        outputs = header.get("outputs")
        if outputs is not None and (outputs.__class__ is not list or
                                    not all(o.__class__ is str for o in outputs)):
            raise TorchpoolError(errors.UNSUPPORTED, f"the direct path of model '{model}' takes "
                                                     f"outputs by name only")
        entries = header.get("inputs")
        if entries.__class__ is list:
            for e in entries:
                if e.__class__ is dict and tensors.location(e) != tensors.DATA:
                    raise TorchpoolError(errors.UNSUPPORTED, f"input '{e.get('name')}' for model "
                                                             f"'{model}': the direct path takes "
                                                             f"inline inputs only")

    def _run(self, c: _Client, request_id: Any, staged: list, requested: list, batch_size: int,
             t0: int) -> None:
        worker = self.worker
        try:
            inputs = {}
            for spec, _shape, model_shape, payload, _location in staged:
                # a copy of its own: the receive buffer is reused, a model may write its inputs
                inputs[spec.name] = worker.tensor(spec.name, spec.datatype, model_shape,
                                                  bytearray(payload), 0, len(payload))
            t1 = time.perf_counter_ns()
            results = worker.execute(inputs, requested)
            t2 = time.perf_counter_ns()
            entries, frames = [], []
            for name, value in results.items():
                entries.append(_output(name, value, frames))
        except Exception as exc:         # the model failed: counted, answered, the worker goes on
            failed = worker.failed(0, exc, f"direct request {request_id!r}")
            worker.send(internal.Served([[0, batch_size, time.perf_counter_ns() - t0, 0, 0, 0, c.session]]))
            self._answer(c, [messages.pack(messages.error_response(
                request_id, TorchpoolError(failed.code, failed.message)))])
            return
        t3 = time.perf_counter_ns()
        worker.send(internal.Served([[1, batch_size, t3 - t0, t1 - t0, t2 - t1, t3 - t2, c.session]]))
        header = messages.ok_response(request_id, model_name=self.model.name, model_version=self.version,
                                      outputs=entries)
        self._answer(c, [messages.pack(header), *frames])

    def _answer(self, c: _Client, frames: list) -> None:
        c.outbox = lane.datagrams(frames)
        self._flush(c)

    def _flush(self, c: _Client) -> None:
        """Send what the client's socket takes now; wait for room for the rest."""
        outbox = c.outbox
        while outbox:
            try:
                c.sock.sendmsg(outbox[0], (), _DONTWAIT)
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


def _output(name: str, value: Any, frames: list) -> dict:
    """One output's entry, its bytes inline (or a payload frame when large)."""
    if isinstance(value, list):          # List[str]: BYTES
        entry = tensors.tensor_entry(name, "BYTES", [len(value)])
        tensors.put_data(entry, datatypes.encode_bytes(value), frames)
        return entry
    if not (value.is_cpu and value.is_contiguous()):
        value = value.cpu().contiguous()
    entry = tensors.tensor_entry(name, datatypes.wire_from_torch(value.dtype), list(value.shape))
    tensors.put_data(entry, value.reshape(-1).view(torch.uint8).numpy(), frames)
    return entry
