"""Client requests: routed, answered or accepted.

A frontend message is one of: a control call (answered at once from the
registry, the sessions or model control; load and unload are answered when
they finish), or an inference, which is validated against its model's
config (requests.py), admitted and queued by its version's scheduler, and
dispatched. A burst of messages read together is dispatched once, so that
batching schedulers see all of it. Nothing a client sends may take the
daemon down: anything unexpected is answered as a malformed request. A
header over --max-header-bytes is refused before it is decoded: decoding
runs on the broker's one thread, and one client's 12 MiB headers stalled
everyone's for seconds.
"""
from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Callable, Optional, Union, cast

import zmq

from ..protocol import errors, messages
from ..protocol import lane as lane_protocol
from ..protocol.errors import TorchpoolError
from .answers import Answers
from .direct import DirectPaths
from .frontend import Frontend
from .lane import ClientKey, Lane, ReplySocket, lane_session
from .model_control import ModelControl
from .registry import ModelVersion, Registry
from ..rules.request import InferCall, read_infer
from ..rules.validation import DEFAULT_LIMITS, TensorLimits, validate_infer
from .requests import InferRequest, batch_layout
from .sessions import Session, SessionManager

log = logging.getLogger("torchpool.broker")


class Intake:
    def __init__(self, frontend: Frontend, registry: Registry, sessions: SessionManager,
                 control: ModelControl, answers: Answers, transfer: Counter[str],
                 dispatch: Callable[[ModelVersion], None], stopping: Callable[[], bool],
                 remote_model_control: bool = False, limits: TensorLimits = DEFAULT_LIMITS,
                 direct: Optional[DirectPaths] = None, catch_up: Callable[[], None] = lambda: None,
                 max_header_bytes: int = messages.MAX_HEADER_BYTES) -> None:
        self.frontend = frontend
        self.max_header_bytes = max_header_bytes            # refused unread past it (0: no limit)
        self.direct = direct                                # direct paths to workers (local clients)
        self.catch_up = catch_up                            # reads the workers' reports of them
        self.limits = limits                                # what one BYTES tensor may hold
        self.remote_model_control = remote_model_control   # load/unload over tcp:// too
        self.registry = registry
        self.sessions = sessions
        self.control = control
        self.answers = answers
        self.transfer = transfer
        self.dispatch = dispatch
        self.stopping = stopping
        self._burst: Optional[set[ModelVersion]] = None    # versions with requests accepted in this burst

    def on_readable(self, sock: zmq.Socket[bytes]) -> None:
        # Drain what is there now, but give the workers' answers a turn too.
        # Batching schedulers see the whole burst before a batch goes out:
        # what is already waiting is batched together.
        self._burst = set()
        try:
            for i in range(64):
                # One request at a time is the common case: asking whether
                # another waits costs less than pyzmq's Again exception
                # (ZMQ_EVENTS is an int option: pyzmq's get is typed int | bytes for every one)
                if i == 1 and not cast(int, sock.get(_EVENTS)) & _POLLIN:
                    return
                try:
                    frames = _recv_frames(sock)
                except zmq.Again:
                    return
                self._handle_request(sock, frames)
        finally:
            burst, self._burst = self._burst, None
            for mv in burst:
                self.dispatch(mv)

    def on_lane(self, ln: Lane, burst: list[bytes]) -> None:
        """Requests a local client sent over its lane (local_channel.py), dispatched as one burst."""
        self._burst = set()
        self.transfer["requests_on_lane"] += len(burst)
        try:
            for data in burst:
                try:
                    if len(data) > lane_protocol.MAX_DATAGRAM or data[0] != lane_protocol.LAST:
                        raise TorchpoolError(errors.INVALID_ARG, "a lane request is one datagram of at most "
                                                                 f"{lane_protocol.MAX_DATAGRAM} bytes")
                    frames = lane_protocol.decode(memoryview(data)[1:])
                except (TorchpoolError, lane_protocol.LaneError) as exc:
                    err = exc if isinstance(exc, TorchpoolError) else TorchpoolError(
                        errors.INVALID_ARG, f"malformed lane request: {exc}")
                    ln.send(messages.error_response(None, err))
                    continue
                self._handle(ln, ln.identity, frames[0], frames[1:], ln)
        finally:
            burst_versions, self._burst = self._burst, None
            for mv in burst_versions:
                self.dispatch(mv)

    def _handle_request(self, sock: zmq.Socket[bytes], frames: list[zmq.Frame]) -> None:
        identity = frames[0].bytes
        if len(frames) == 2 and len(frames[1]) == 0 and self.frontend.notifies_disconnect:
            # ROUTER_NOTIFY: the peer disconnected (closed, crashed, killed)
            self.frontend.forget(sock, identity)
            self.sessions.disconnected(identity)
            return
        if len(frames) < 2:
            self.frontend.send(sock, identity, messages.error_response(None, TorchpoolError(
                errors.INVALID_ARG, "empty request: expected a header frame")))
            return
        first = frames[1]
        self._handle(sock, identity, first.buffer, [f.buffer for f in frames[2:]], first)

    def _handle(self, sock: ReplySocket, identity: bytes, header_buf: Union[bytes, bytearray, memoryview],
                payload: list[memoryview], came_by: Union[zmq.Frame, Lane]) -> None:
        """One request, answered or accepted: from a frontend socket (`came_by`:
        its header frame, which knows the peer) or a lane (`came_by`: the lane)."""
        ln = came_by if came_by.__class__ is Lane else None
        request_id = op = None
        try:
            try:
                header = messages.decode_header(header_buf, self.max_header_bytes)
            except messages.HeaderError as exc:
                request_id = exc.request_id          # a readable header's id is echoed
                raise
            request_id = header.get("id")
            if self.frontend.stalled(sock, identity):
                # its replies are being dropped: refuse at once, do nothing for it (the
                # refusal is delivered, and the mark cleared, once it reads again)
                raise TorchpoolError(errors.RESOURCE_EXHAUSTED,
                                     "this connection did not read its replies (more than "
                                     f"{self.frontend.max_unread_replies} were queued: "
                                     "--max-unread-replies); they were dropped and its requests "
                                     "refused until it reads")
            op = header.get("op")
            session: Optional[Session]
            if ln is not None:
                if op not in _LANE_OPS:
                    raise TorchpoolError(errors.UNSUPPORTED, f"operation {op!r} is not sent over the "
                                                             "local side channel: only infer, arena_grow "
                                                             "and direct")
                session = lane_session(ln, header, self.sessions)
                self._release_lent(session, header)
            else:
                session = self._session_of(header, identity)
            if op == messages.OP_INFER:
                client = came_by.client if isinstance(came_by, Lane) else self.frontend.in_flight.client_of(
                    sock, identity, came_by, not self.frontend.is_remote(sock))
                self._accept_infer(sock, identity, read_infer(header), payload, session, client)
                return
            if op == messages.OP_DIRECT:
                if self.direct is None:
                    raise TorchpoolError(errors.UNSUPPORTED, "this daemon hands out no direct paths "
                                                             "(--no-direct-paths)")
                if header.get("ended") is not None:         # why a path closed with a call on it
                    raise self.direct.why_ended(session, header["ended"])
                if ln is None:
                    raise TorchpoolError(errors.UNSUPPORTED, "a direct path is asked for over the local "
                                                             "side channel of a session with a lane")
                assert session is not None      # the lane's own (lane_session)
                self.frontend.send(sock, identity, messages.ok_response(
                    request_id, result=self.direct.open(session, header)))
                return
            if not isinstance(op, str) or op not in messages.CONTROL_OPS:
                raise TorchpoolError(errors.UNSUPPORTED, f"unknown operation {op!r}")
            if op in (messages.OP_LOAD, messages.OP_UNLOAD):
                self.control.check_explicit(op)
                if not self.remote_model_control and self.frontend.is_remote(sock):
                    raise TorchpoolError(errors.UNSUPPORTED,
                                         "model control (load/unload) is accepted only over ipc:// on "
                                         "this server (--remote-model-control allows tcp)")
                waiter = self._deferred_reply(sock, identity, request_id)
                if op == messages.OP_LOAD:
                    self.control.load(header.get("model"), header.get("config"), waiter)
                else:
                    self.control.unload(header.get("model"), waiter)
                return
            if op in messages.SESSION_OPS:
                result = self._session_control(op, header, session, identity)
            else:
                result = self._control(op, header)
        except TorchpoolError as exc:
            if op in (messages.OP_LOAD, messages.OP_UNLOAD):   # the client's copy hides paths: the log has them
                log.warning("%s refused: %s", op, exc.message)
            self.frontend.send(sock, identity, messages.error_response(request_id, self._public(exc)))
            return
        except Exception as exc:  # a malformed request must never take the daemon down
            log.exception("request %r could not be handled", request_id)
            self.frontend.send(sock, identity, messages.error_response(
                request_id, TorchpoolError(errors.INVALID_ARG, f"malformed request: {exc!r}")))
            return
        self.frontend.send(sock, identity, messages.ok_response(request_id, result=result))

    def _session_of(self, header: messages.Header, identity: bytes) -> Optional[Session]:
        """The request's client session (lease renewed), after it hands back
        the output blocks it has finished reading."""
        session = self.sessions.get(header.get("session"), identity)
        self._release_lent(session, header)
        return session

    def _release_lent(self, session: Optional[Session], header: messages.Header) -> None:
        if session is not None and header.get("release"):
            self.answers.release_lent(session, header["release"])

    def _session_control(self, op: str, header: messages.Header, session: Optional[Session], identity: bytes) -> object:
        sessions = self.sessions
        if op == messages.OP_HELLO:
            return sessions.hello(header, identity)
        if session is None:
            raise TorchpoolError(errors.INVALID_ARG, f"'{op}' needs a session: say hello first")
        if op == messages.OP_GOODBYE:
            sessions.close(session)
            return True
        if op == messages.OP_ARENA_GROW:
            return sessions.grow(session, header)
        if op == messages.OP_REGISTER:
            return sessions.register(session, header)
        if op == messages.OP_UNREGISTER:
            return sessions.unregister(session, header.get("name"))
        if op == messages.OP_CUDA_REGISTER:
            return sessions.register_cuda(session, header)
        if op == messages.OP_CUDA_UNREGISTER:
            return sessions.unregister(session, header.get("name"), cuda=True)
        if op == messages.OP_CUDA_STATUS:
            return sessions.cuda_status(session, header.get("name"))
        return sessions.status(session, header.get("name"))

    def _control(self, op: str, header: messages.Header) -> object:
        reg = self.registry
        name, version = header.get("model"), header.get("version")
        if op == messages.OP_SERVER_LIVE:
            return not self.stopping()
        if op == messages.OP_SERVER_READY:
            return not self.stopping() and reg.server_ready()
        if op == messages.OP_MODEL_READY:
            return not self.stopping() and reg.model_ready(name, version)
        if op == messages.OP_MODEL_METADATA:
            return reg.metadata(name, version)
        if op == messages.OP_MODEL_CONFIG:
            return reg.config(name, version)
        if op == messages.OP_REPOSITORY_INDEX:
            return [{**row, "reason": messages.hide_paths(row["reason"], str(self.control.root))}
                    if "reason" in row else row for row in self.control.repository_index()]
        if op == messages.OP_STATISTICS:
            self.catch_up()
            return reg.statistics(name, version)
        if op == messages.OP_SERVER_METADATA:
            from .. import __version__
            self.catch_up()                   # its transfer counters count direct requests
            gpus = ["cuda_shared_memory"] if self.sessions.gpus() else []     # where a region may be
            return {"name": "torchpool", "version": __version__,
                    "extensions": ["system_shared_memory", *gpus, "local_shared_memory"],
                    "transfer": dict(self.transfer)}
        raise TorchpoolError(errors.UNSUPPORTED, f"unknown operation {op!r}")

    def _public(self, err: TorchpoolError) -> TorchpoolError:
        """`err` as the client sees it: a path in the model repository shown
        relative to it (a load error's "addsub/config.pbtxt:3: ..."); every
        other path is cut down by error_response. The log keeps the full text."""
        message = messages.hide_paths(err.message, str(self.control.root))
        return err if message == err.message else TorchpoolError(err.code, message)

    def _deferred_reply(self, sock: ReplySocket, identity: bytes, request_id: object
                        ) -> Callable[[Optional[TorchpoolError]], None]:
        """Answer a request later (load / unload finish after the call returns)."""
        def reply(err: Optional[TorchpoolError]) -> None:
            header = messages.error_response(request_id, self._public(err)) if err else \
                messages.ok_response(request_id, result=True)
            self.frontend.send(sock, identity, header)
        return reply

    def _accept_infer(self, sock: ReplySocket, identity: bytes, call: InferCall,
                      payload: list[memoryview], session: Optional[Session], client: ClientKey) -> None:
        if self.stopping():
            raise TorchpoolError(errors.UNAVAILABLE, "server is shutting down")
        in_flight = self.frontend.in_flight
        in_flight.check(client)                 # refused before any work is done for it
        mv = self.registry.resolve(call.model, call.version)
        scheduler = mv.scheduler
        checked = validate_infer(call, payload, mv, session, self.sessions, limits=self.limits)
        regions = checked.regions
        req = InferRequest(sock, identity, call.request_id, mv, [], checked.outputs, [], None,
                           batch_size=checked.batch_size, session=session, client=client, regions=regions,
                           region_outputs=checked.region_outputs, timeout_us=call.timeout_us,
                           output_shm=call.output_shm and session is not None and session.local)
        if scheduler.hidden_outputs:
            hidden = [name for name in scheduler.hidden_outputs if name not in req.outputs]
            req.outputs = req.outputs + hidden      # the worker returns them; the client never sees them
            req.hidden_outputs = frozenset(hidden)
        batch_layout(req, checked.staged, mv.config)
        req.staged = checked.staged
        # counted from here until its one final answer goes out (Answers.release);
        # counted before push, which may answer it at once
        in_flight.add(req)
        try:
            scheduler.admit(req, call)
            self.answers.collect_finished_sends()   # input blocks answers were sent from come back
            scheduler.push(req, time.monotonic())
        except BaseException:
            in_flight.done(req)                  # refused: _handle_request answers it
            raise
        # held until the request is answered: regions cannot go, the session cannot expire
        for region in regions:
            region.in_use += 1
        if session is not None:
            session.in_flight += 1
        if self._burst is not None:
            self._burst.add(mv)              # dispatched once the burst is read
        else:
            self.dispatch(mv)


_LANE_OPS = frozenset({messages.OP_INFER, messages.OP_ARENA_GROW, messages.OP_DIRECT})
_NOBLOCK = int(zmq.NOBLOCK)
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)


def _recv_frames(sock: zmq.Socket[bytes]) -> list[zmq.Frame]:
    """One message's frames (zmq.Frame, not copied), or zmq.Again. pyzmq's
    recv_multipart asks getsockopt(RCVMORE) after every frame, through its
    enum layer; the frame itself knows."""
    frame = sock.recv(_NOBLOCK, copy=False)
    frames = [frame]
    while frame.more:
        frame = sock.recv(_NOBLOCK, copy=False)
        frames.append(frame)
    return frames
