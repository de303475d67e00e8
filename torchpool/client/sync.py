"""The synchronous client: calls from any number of threads over one DEALER
socket (channel.py routes each reply to the thread that waits for it)."""
from __future__ import annotations

import json
import time
from typing import Callable, Optional, Sequence, cast

import numpy as np
import zmq

from ..protocol import messages
from ..protocol.errors import InferenceError
from .api import SessionCalls
from .arena import DEFAULT_ARENA_CAP
from .channel import SharedSocket
from .direct import DirectRequest, DirectSocket
from .lane import LaneSocket
from .common import DEFAULT_TIMEOUT, GOODBYE_WAIT, ClientBase, ClientKey, ServerKey, encode_control, error_of
from .flows import ClientState, is_session_error, run_sync, sequence_field
from .regions import needs_session
from .types import Call, Flow, Frames, NoAnswer, Reply, SessionLost, T
from .types import InferResult, Inputs, JSONDocument, ModelConfig, RequestedOutput, SequenceId, Version


# What Client([url, ...]) makes: multi.MultiClient, which registers itself
# when the package loads (multi.py imports this module, so not the reverse).
_several_daemons: Optional[Callable[..., object]] = None


def register_several_daemons(factory: Callable[..., object]) -> None:
    global _several_daemons
    _several_daemons = factory


def _late_answers(state: ClientState) -> Callable[[object], None]:
    """What the channel does with an answer nobody waits for any more."""
    def late(header: object) -> None:
        with state.lock:
            state.late_reply(header)
    return late


class Client(ClientBase, SessionCalls):
    """A synchronous client, safe to share between threads.

    `url`: the daemon's address (ipc://PATH or tcp://HOST:PORT). A list of
    addresses makes a `MultiClient` instead (multi.py): requests spread over
    those daemons and move off one that stops answering; it also takes
    `retries` and `health_interval`.

    `timeout`: seconds a call waits for its answer (each call may pass its
    own). When it passes, the call raises `NoAnswer`: DEADLINE_EXCEEDED if
    the daemon is connected (it is slow; the request may still run),
    UNAVAILABLE if no daemon was reached. A call fails at once, without
    waiting, when the ipc:// socket file does not exist or nothing accepts
    on it, and when the connection drops while it waits.

    Threads: any number may call at once. Their requests are in flight
    together on the one socket; whichever thread is waiting reads the
    replies and hands each to its caller, so a slow call holds no one else
    up, and every call's own timeout fires. The shared-memory session (the
    arena, lent outputs) is one per client; its bookkeeping runs under a
    lock, never held while waiting. The cost: a call alone pays a few
    uncontended lock round trips and a poll of three descriptors instead of
    one, measured at +6 to +12 us of client CPU per call on the 2-core
    development machine (about 1 % of a round trip; docs/client.md); calls
    that overlap take turns for the socket and their encoding and decoding
    (copies into the arena included) run one at a time. For throughput
    from many threads with large tensors, one client per thread still
    scales best.

    `local`: None (default) uses the shared-memory path when the daemon is on
    this host (unless TORCHPOOL_LOCAL=0); False never does. `arena_cap`: the
    most arena memory this client asks the daemon for.

    For a daemon whose tcp:// address uses CURVE (`torchpool keygen`):
    `server_key` is the daemon's public key (40 Z85 characters, or the path
    of its NAME.key file) and `client_key` this client's key pair (the path
    of its NAME.key_secret file, or a (public, secret) pair), whose public
    key must be in the daemon's --curve-authorized-keys directory. A refused
    client gets no answer: its calls fail after `timeout` saying why.
    ipc:// connections are plain whatever the keys.
    """

    def __new__(cls, *args: object, **kwargs: object) -> Client:
        url = args[0] if args else kwargs.get("url")
        if cls is Client and isinstance(url, (list, tuple)) and _several_daemons is not None:
            # a multi.MultiClient: not a subclass, it answers the same calls
            return cast(Client, _several_daemons(*args, **kwargs))
        return super().__new__(cls)

    def __init__(self, url: str, timeout: float = DEFAULT_TIMEOUT, local: Optional[bool] = None,
                 arena_cap: int = DEFAULT_ARENA_CAP, server_key: Optional[ServerKey] = None,
                 client_key: Optional[ClientKey] = None) -> None:
        self._open(url, timeout, local, arena_cap, zmq.Context.instance(), server_key, client_key)
        self._channel = SharedSocket(self._sock, self._watch, _late_answers(self._state))
        self._state.lane_factory = lambda link, state=self._state: LaneSocket(link, url, _late_answers(state))
        self._state.direct_factory = lambda sock, model, state=self._state: DirectSocket(
            sock, model, url, _late_answers(state))

    # -- transport
    def _call(self, frames: Frames, request_id: int, timeout: Optional[float]) -> Reply:
        limit = self.timeout if timeout is None else timeout
        header, payload = self._channel.request(frames, request_id, limit)
        if not header.get("ok"):
            raise error_of(header)
        return header, payload

    def _send(self, call: Call) -> Reply:
        # _call, written out: every request passes here
        limit = self.timeout if call.timeout is None else call.timeout
        if call.channel is None:
            header, payload = self._channel.request(call.frames, call.rid, limit)
        else:
            channel = cast("LaneSocket", call.channel)    # what this client's factories made
            try:
                header, payload = channel.request(call.frames, call.rid, limit)
            except NoAnswer as exc:
                if exc.sent or not channel.lost or not channel.zmq_fallback:
                    raise
                # the lane was closed before it was sent: the daemon ended the session
                # (or stopped), which it says over ZeroMQ; the flow then says hello again
                header, payload = self._channel.request(call.frames, call.rid, limit)
        if not header.get("ok"):
            raise error_of(header)
        return header, payload

    def _perform(self, make_flow: Callable[[], Flow[T]], timeout: Optional[float], session: bool = False) -> T:
        """Run a flow; say hello first when due; once more after a lost session."""
        st = self._state
        for attempt in range(2):
            if st.session is None and st.needs_hello(session):
                with st.hello_lock:                  # one hello for every thread
                    if st.needs_hello(session):
                        run_sync(st.hello_flow(timeout), self._send, st.lock)
            if session:
                st.require_session()
            try:
                return run_sync(make_flow(), self._send, st.lock)
            except SessionLost as lost:
                with st.lock:
                    st.session_lost(lost.token)
                if attempt:
                    raise lost.error from None
        raise AssertionError("unreachable: the second attempt returns or raises")

    def _control(self, op: str, timeout: Optional[float] = None, **fields: object) -> object:
        if self._state.session is None:     # the plain path: as before sessions existed
            rid = next(self._ids)
            header, _ = self._call(encode_control(rid, op, **fields), rid, timeout)
            return header.get("result")
        return self._perform(self._control_flow(op, timeout, fields), timeout)

    # -- control calls
    def server_live(self, timeout: Optional[float] = None) -> bool:
        return bool(self._control(messages.OP_SERVER_LIVE, timeout))

    def server_ready(self, timeout: Optional[float] = None) -> bool:
        return bool(self._control(messages.OP_SERVER_READY, timeout))

    def model_ready(self, name: str, version: Version = None) -> bool:
        return bool(self._control(messages.OP_MODEL_READY, model=name, version=self._version_field(version)))

    def model_metadata(self, name: str, version: Version = None) -> JSONDocument:
        return cast(JSONDocument, self._control(messages.OP_MODEL_METADATA, model=name,
                                                version=self._version_field(version)))

    def model_config(self, name: str, version: Version = None) -> JSONDocument:
        return cast(JSONDocument, self._control(messages.OP_MODEL_CONFIG, model=name,
                                                version=self._version_field(version)))

    def repository_index(self) -> list[JSONDocument]:
        return cast("list[JSONDocument]", self._control(messages.OP_REPOSITORY_INDEX))

    def server_metadata(self) -> JSONDocument:
        return cast(JSONDocument, self._control(messages.OP_SERVER_METADATA))

    def statistics(self, model: Optional[str] = None, version: Version = None) -> JSONDocument:
        return cast(JSONDocument, self._control(messages.OP_STATISTICS, model=model or "",
                                        version=self._version_field(version)))

    def load(self, name: str, config: ModelConfig = None, timeout: Optional[float] = None) -> None:
        self._control(messages.OP_LOAD, timeout, model=name,
                      config=json.dumps(config) if isinstance(config, dict) else config)

    def unload(self, name: str, timeout: Optional[float] = None) -> None:
        self._control(messages.OP_UNLOAD, timeout, model=name)

    # -- inference
    def infer(self, model: str, inputs: Inputs, outputs: Optional[Sequence[RequestedOutput]] = None,
              version: Version = None, timeout: Optional[float] = None, copy: bool = False,
              priority: int = 0, sequence_id: SequenceId = 0, sequence_start: bool = False,
              sequence_end: bool = False) -> InferResult:
        """Run `model` on `inputs`; returns {output name: numpy array}.

        `inputs` values: numpy arrays, torch tensors, lists of str/bytes
        (BYTES), arrays from `empty()` (sent with no copy), `RawTensor`s
        (bytes in the wire layout) or `SharedMemoryRef`s. `outputs`: names,
        `OutputRef`s to have an output written into a registered region, or
        `Classification(name, k)` for Triton's top-k "score:index:label"
        strings instead of the tensor. `timeout` (seconds) bounds
        the whole call; the server also drops the request if it could not
        start within it. `copy=True` returns ordinary arrays instead of views
        of the daemon's shared memory. `priority` (1 = highest) picks the
        dynamic batcher's priority level; 0 = the model's default.
        `sequence_id` (a non-zero int or a non-empty str), `sequence_start`
        and `sequence_end` are for models with `sequence_batching`, as in
        Triton's client: the first request of a sequence sets START, the last
        END; the server feeds the model's control and state tensors.
        """
        seq = sequence_field(sequence_id, sequence_start, sequence_end)
        if not priority and seq is None:
            st = self._state
            with st.lock:
                short = st.shortcut.request(model, inputs, outputs, version, timeout)
            if short is not None:
                result = self._direct_infer(short, copy, timeout)
                if result is not None:
                    return result
        return self._perform(
            lambda: self._state.infer_flow(model, inputs, outputs, version, timeout, copy, priority, seq),
            timeout, needs_session(inputs, outputs))

    def _direct_infer(self, short: DirectRequest, copy: bool, timeout: Optional[float]) -> Optional[InferResult]:
        """A plain request on its model's open direct path, the short way:
        `infer_flow`'s direct case without the flow (~15 us less per call on
        the development VM). None when the session was lost: then the flow
        says hello again and sends it."""
        st = self._state
        path, rid, frames, enc, token = short
        answered = False
        try:
            try:
                header, payload = cast(DirectSocket, path).request(   # (this client's direct_factory makes them)
                    frames, rid, self.timeout if timeout is None else timeout)
            except NoAnswer as exc:
                if exc.sent and not path.lost:
                    raise                  # maybe still running: finish() keeps its id
                if exc.sent:               # the path closed with it: the daemon says why
                    raise run_sync(st.direct.ended_flow(st, path, None), self._send, st.lock) from None
                # it closed before it took the request: the lane takes it (as in infer_flow)
                header, payload = self._send(Call(rid, frames, timeout, st.open_lane()))
            answered = True
            if not header.get("ok"):
                raise error_of(header)
            with st.lock:
                return st.shortcut.answered(header, payload, copy, token, enc)
        except InferenceError as exc:
            if isinstance(exc, NoAnswer) and not answered:
                raise
            answered = True
            if not is_session_error(exc):
                raise
            with st.lock:
                st.session_lost(token)
            return None
        finally:
            if not answered:
                with st.lock:
                    st.encoder.finish(enc, st.arena, False, rid, token)

    def empty(self, shape: Sequence[int], datatype: str = "FP32") -> np.ndarray:
        return self._perform(lambda: self._state.empty_flow(shape, datatype, None), None)

    # -- registered regions (Triton's system shared memory)
    def register_system_shared_memory(self, name: str, key: str, byte_size: int, offset: int = 0) -> None:
        self._perform(lambda: self._state.regions.register_flow(name, key, byte_size, offset, None), None, True)

    def unregister_system_shared_memory(self, name: Optional[str] = None) -> None:
        self._perform(lambda: self._state.regions.unregister_flow(name, None), None, True)

    def get_system_shared_memory_status(self, name: Optional[str] = None) -> list[JSONDocument]:
        regions = self._state.regions
        return cast("list[JSONDocument]", self._perform(lambda: regions.status_flow(name, None), None, True))

    # -- registered GPU memory (Triton's CUDA shared memory)
    def register_cuda_shared_memory(self, name: str, raw_handle: bytes, device_id: int, byte_size: int) -> None:
        self._perform(lambda: self._state.regions.register_cuda_flow(name, raw_handle, device_id, byte_size, None),
                      None, True)

    def unregister_cuda_shared_memory(self, name: Optional[str] = None) -> None:
        self._perform(lambda: self._state.regions.unregister_flow(name, None, cuda=True), None, True)

    def get_cuda_shared_memory_status(self, name: Optional[str] = None) -> list[JSONDocument]:
        regions = self._state.regions
        return cast("list[JSONDocument]", self._perform(lambda: regions.status_flow(name, None, cuda=True),
                                                        None, True))

    # -- lifetime
    def close(self, wait: float = GOODBYE_WAIT) -> None:
        """Say goodbye (returning everything lent to us) and close the socket.
        Calls other threads still have in flight fail with CANCELLED.
        Outputs of a local session must not be used after this."""
        if not self._closer.detach():
            return                                   # closed already
        self._channel.close(GOODBYE_WAIT)            # from here this thread owns the socket
        link = self._state.link
        if link is not None and link.lane is not None:
            link.lane.close(GOODBYE_WAIT)
        with self._state.lock:
            call = self._state.goodbye_call(None)
            self._state.close()
        linger = 0
        if call is not None:
            try:
                self._sock.send_multipart(call.frames, flags=zmq.NOBLOCK)
                linger = int(GOODBYE_WAIT * 1000)    # let ZeroMQ deliver it if we do not wait
                deadline = time.monotonic() + wait
                while (remaining := deadline - time.monotonic()) > 0 and \
                        self._sock.poll(max(1, int(remaining * 1000)), zmq.POLLIN):
                    header = messages.unpack(self._sock.recv_multipart()[0])
                    if isinstance(header, dict) and header.get("id") == call.rid:
                        linger = 0
                        break
            except zmq.ZMQError:
                pass
        self._watch.close(self._sock)
        self._sock.close(linger=linger)

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
