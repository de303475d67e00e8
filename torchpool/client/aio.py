"""The asyncio client: many concurrent calls over one DEALER socket."""
from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING, Awaitable, Callable, Hashable, Optional, Protocol, Sequence, Union, cast

import numpy as np
import zmq
import zmq.asyncio

from ..protocol import errors, messages
from ..protocol.errors import InferenceError
from .api import AsyncSessionCalls
from .arena import DEFAULT_ARENA_CAP
from .common import (DEFAULT_TIMEOUT, GOODBYE_WAIT, ClientBase, ClientKey, ServerKey, encode_control,
                     error_of, send_goodbye_and_close)
from .aio_lane import AsyncDirect, AsyncLane, AsyncPaths
from .direct import DirectRequest
from .flows import is_session_error, run_async, sequence_field
from .regions import needs_session
from .types import Call, Flow, Frames, NoAnswer, Reply, SessionLost, T
from .types import InferResult, Inputs, JSONDocument, ModelConfig, RequestedOutput, SequenceId, Version
from .watch import Mark

if TYPE_CHECKING:
    from typing_extensions import Buffer


class _AsyncSocket(Protocol):
    """The calls AsyncClient awaits on its zmq.asyncio socket."""

    def recv_multipart(self, copy: bool) -> Awaitable[list[zmq.Frame]]: ...

    def send_multipart(self, msg_parts: Sequence[Buffer], copy: bool) -> Awaitable[None]: ...


def _expire(fut: asyncio.Future[Reply]) -> None:
    if not fut.done():
        fut.set_exception(asyncio.TimeoutError())


class AsyncClient(ClientBase, AsyncSessionCalls):
    """An asyncio client: many concurrent calls over one socket. The same
    features as `Client`; `empty()` and the region calls are coroutines.
    `server_key` / `client_key`: CURVE over tcp://, as for `Client`; the
    same errors when no answer comes (DEADLINE_EXCEEDED, UNAVAILABLE, at
    once for a missing ipc:// socket file or a lost connection). One event
    loop at a time: use it from that loop's thread.

    On the daemon's host, as a sync `Client` does, it sends its requests on
    the session's request lane and its small, plain ones on direct paths
    to the models' workers (aio_lane.py: read by the event loop, any number
    of calls in flight on each)."""

    def __init__(self, url: str, timeout: float = DEFAULT_TIMEOUT, local: Optional[bool] = None,
                 arena_cap: int = DEFAULT_ARENA_CAP, server_key: Optional[ServerKey] = None,
                 client_key: Optional[ClientKey] = None) -> None:
        self._open(url, timeout, local, arena_cap, zmq.asyncio.Context.instance(), server_key, client_key)
        # the socket _open made from the asyncio context (pyzmq's types do not say its calls are awaitable)
        self._async_sock = cast(_AsyncSocket, self._sock)
        self._pending: dict[object, asyncio.Future[Reply]] = {}    # by request id (as the answer says it)
        self._marks: dict[int, Mark] = {}        # the connection's story when each was sent
        self._reader: Optional[asyncio.Task[None]] = None
        self._watcher: Optional[asyncio.Task[None]] = None
        self._watched: Optional[tuple[asyncio.AbstractEventLoop, int]] = None       # (loop, fd) the watcher waits on
        self._hello_lock: Optional[asyncio.Lock] = None
        self._asking: dict[tuple[str, str], asyncio.Future[None]] = {}    # direct paths asked for
        state = self._state
        state.lane_factory = lambda link: AsyncLane(link, url, state.late_reply)
        state.direct_factory = lambda sock, model: AsyncDirect(sock, model, url, state.late_reply)
        # many calls in flight: a path to each instance (the paths are this client's AsyncDirects)
        state.direct_group = lambda members: AsyncPaths(cast("list[AsyncDirect]", members))

    async def _read_replies(self) -> None:
        while True:
            reply = await self._async_sock.recv_multipart(copy=False)
            header = messages.unpack(reply[0].buffer)
            fut = self._pending.pop(header.get("id"), None) if isinstance(header, dict) else None
            if fut is not None and not fut.done():
                fut.set_result((header, [f.buffer for f in reply[1:]]))
            else:
                self._state.late_reply(header)

    async def _watch_connection(self) -> None:
        """Fail the calls in flight as soon as the monitor says no answer
        will come (the connection dropped; nobody accepts on the ipc file).
        It waits on the monitor's fd, registered with the loop until _stop:
        a zmq.asyncio shadow of the monitor stayed registered after the
        monitor closed, and a socket of a later client given the same fd
        number was then never woken (its replies went unread)."""
        watch = self._watch
        loop = asyncio.get_running_loop()
        news = asyncio.Event()
        loop.add_reader(watch.fd, news.set)
        self._watched = (loop, watch.fd)
        while True:
            await news.wait()
            news.clear()
            watch.drain()
            for rid, mark in list(self._marks.items()):
                error = watch.failure(mark)
                fut = self._pending.get(rid)
                if error is not None and fut is not None and not fut.done():
                    fut.set_exception(error)

    async def _call(self, frames: Frames, request_id: int, timeout: Optional[float],
                    sent: Optional[Callable[[], None]] = None) -> Reply:
        self._check_open()
        if self._reader is None or self._reader.done():
            self._reader = asyncio.ensure_future(self._read_replies())
        if self._watcher is None or self._watcher.done():
            self._watcher = asyncio.ensure_future(self._watch_connection())
        watch = self._watch
        watch.drain()
        refused = watch.before_send()         # no socket file: fail now, not after the timeout
        if refused is not None:
            raise refused
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._pending[request_id] = fut
        self._marks[request_id] = watch.mark()
        limit = self.timeout if timeout is None else timeout
        # a timer on the future itself: asyncio.wait_for adds a waiter future
        # and callbacks to every call (measurable at ~500 us per request)
        timer = loop.call_later(limit, _expire, fut)
        try:
            await self._async_sock.send_multipart(frames, copy=len(frames) == 1)
            if sent is not None:
                sent()
            header, payload = await fut
        except asyncio.TimeoutError:
            raise self._no_answer(limit) from None
        finally:
            timer.cancel()
            self._pending.pop(request_id, None)
            self._marks.pop(request_id, None)
        if not header.get("ok"):
            raise error_of(header)
        return header, payload

    async def _send(self, call: Call, sent: Optional[Callable[[], None]] = None) -> Reply:
        """One call of a flow: on its channel (the lane, a direct path) if it
        has one, else over ZeroMQ (as sync.py's Client._send)."""
        if self._state.direct.wanted:
            self._ask_for_paths()
        if call.channel is None:
            return await self._call(call.frames, call.rid, call.timeout, sent)
        # what this client's factories made
        channel = cast("Union[AsyncLane, AsyncPaths]", call.channel)
        limit = self.timeout if call.timeout is None else call.timeout
        try:
            header, payload = await channel.request(call.frames, call.rid, limit, sent)
        except NoAnswer as exc:
            if exc.sent or not channel.lost or not channel.zmq_fallback:
                raise
            # the lane was closed before it was sent: the daemon ended the session
            # (or stopped), which it says over ZeroMQ; the flow then says hello again
            return await self._call(call.frames, call.rid, call.timeout, sent)
        if not header.get("ok"):
            raise error_of(header)
        return header, payload

    async def _perform(self, make_flow: Callable[[], Flow[T]], timeout: Optional[float], session: bool = False,
                       sent: Optional[Callable[[], None]] = None) -> T:
        st = self._state
        send: Callable[[Call], Awaitable[Reply]] = self._send
        if sent is not None:
            def send_marked(call: Call) -> Awaitable[Reply]:
                return self._send(call, sent if call.request else None)
            send = send_marked
        for attempt in range(2):
            if st.needs_hello(session):
                if self._hello_lock is None:
                    self._hello_lock = asyncio.Lock()
                async with self._hello_lock:       # one hello for many concurrent calls
                    if st.needs_hello(session):
                        await run_async(st.hello_flow(timeout), self._send)
            if session:
                st.require_session()
            try:
                return await run_async(make_flow(), send)
            except SessionLost as lost:
                st.session_lost(lost.token)
                if attempt:
                    raise lost.error from None
        raise AssertionError("unreachable: the second attempt returns or raises")

    async def _control(self, op: str, timeout: Optional[float] = None, **fields: object) -> object:
        if self._state.session is None:
            rid = next(self._ids)
            header, _ = await self._call(encode_control(rid, op, **fields), rid, timeout)
            return header.get("result")
        return await self._perform(self._control_flow(op, timeout, fields), timeout)

    async def server_live(self, timeout: Optional[float] = None) -> bool:
        return bool(await self._control(messages.OP_SERVER_LIVE, timeout))

    async def server_ready(self, timeout: Optional[float] = None) -> bool:
        return bool(await self._control(messages.OP_SERVER_READY, timeout))

    async def model_ready(self, name: str, version: Version = None) -> bool:
        return bool(await self._control(messages.OP_MODEL_READY, model=name,
                                        version=self._version_field(version)))

    async def model_metadata(self, name: str, version: Version = None) -> JSONDocument:
        return cast(JSONDocument, await self._control(messages.OP_MODEL_METADATA, model=name,
                                   version=self._version_field(version)))

    async def model_config(self, name: str, version: Version = None) -> JSONDocument:
        return cast(JSONDocument, await self._control(messages.OP_MODEL_CONFIG, model=name,
                                   version=self._version_field(version)))

    async def repository_index(self) -> list[JSONDocument]:
        return cast("list[JSONDocument]", await self._control(messages.OP_REPOSITORY_INDEX))

    async def server_metadata(self) -> JSONDocument:
        return cast(JSONDocument, await self._control(messages.OP_SERVER_METADATA))

    async def statistics(self, model: Optional[str] = None, version: Version = None) -> JSONDocument:
        return cast(JSONDocument, await self._control(messages.OP_STATISTICS, model=model or "",
                                   version=self._version_field(version)))

    async def load(self, name: str, config: ModelConfig = None, timeout: Optional[float] = None) -> None:
        await self._control(messages.OP_LOAD, timeout, model=name,
                            config=json.dumps(config) if isinstance(config, dict) else config)

    async def unload(self, name: str, timeout: Optional[float] = None) -> None:
        await self._control(messages.OP_UNLOAD, timeout, model=name)

    async def infer(self, model: str, inputs: Inputs, outputs: Optional[Sequence[RequestedOutput]] = None,
                    version: Version = None, timeout: Optional[float] = None, copy: bool = False,
                    priority: int = 0, sequence_id: SequenceId = 0, sequence_start: bool = False,
                    sequence_end: bool = False, sent: Optional[Callable[[], None]] = None,
                    caller: Hashable = None) -> InferResult:
        """As `Client.infer`. `sent()`, when given, is called once the request
        is on its way to the daemon, before its answer: a caller that must
        keep its requests in order (a gRPC stream's) sends the next then.
        `caller`: whom the call is made for, where this client serves many
        (a gateway's connections, a service's tenants): calls waiting here
        for a free instance of their model take turns by caller, so one
        caller's many calls do not all go before another's one."""
        seq = sequence_field(sequence_id, sequence_start, sequence_end)
        if not priority and seq is None:
            short = self._state.shortcut.request(model, inputs, outputs, version, timeout)
            if short is not None:
                result = await self._direct_infer(short, copy, timeout, sent, caller)
                if result is not None:
                    return result
        return await self._perform(
            lambda: self._state.infer_flow(model, inputs, outputs, version, timeout, copy, priority, seq),
            timeout, needs_session(inputs, outputs), sent)

    def _ask_for_paths(self) -> None:
        """Ask the daemon for the direct paths the flows wanted (client/direct.py),
        beside the calls: a call and those made meanwhile take the lane, in the
        order they were made (asked in a call's flow, the others would overtake it)."""
        st = self._state
        wanted = st.direct.wanted
        while wanted:
            model, version = key = wanted.pop()
            if key in self._asking or not st.shortcut.allowed() or not st.direct.due(model, version):
                continue

            async def ask(model: str = model, version: str = version, key: tuple[str, str] = key) -> None:
                try:
                    await run_async(st.direct.path_flow(st, model, version, None), self._send)
                except InferenceError:
                    pass                     # no session now: a later call asks again
                finally:
                    self._asking.pop(key, None)

            self._asking[key] = asyncio.ensure_future(ask())

    async def _direct_infer(self, short: DirectRequest, copy: bool, timeout: Optional[float],
                            sent: Optional[Callable[[], None]], caller: Hashable) -> Optional[InferResult]:
        """A plain request on its model's open direct path, without the flow
        (sync.py's Client._direct_infer, awaited). None when the session was
        lost: then the flow says hello again and sends it."""
        st = self._state
        path, rid, frames, enc, token = short
        answered = False
        try:
            try:
                # (this client's direct_factory and direct_group make them)
                header, payload = await cast("Union[AsyncDirect, AsyncPaths]", path).request(
                    frames, rid, self.timeout if timeout is None else timeout, sent, caller)
            except NoAnswer as exc:
                lost = exc.path or path    # (one of the model's paths)
                if exc.sent and not lost.lost:
                    raise                  # maybe still running: finish() keeps its id
                if exc.sent:               # the path closed with it: the daemon says why
                    raise (await run_async(st.direct.ended_flow(st, lost, None), self._send)) from None
                # it closed before it took the request: the lane takes it (as in infer_flow)
                header, payload = await self._send(Call(rid, frames, timeout, st.open_lane()), sent)
            answered = True
            if not header.get("ok"):
                raise error_of(header)
            return st.shortcut.answered(header, payload, copy, token, enc)
        except InferenceError as exc:
            if isinstance(exc, NoAnswer) and not answered:
                raise
            answered = True
            if not is_session_error(exc):
                raise
            st.session_lost(token)
            return None
        finally:
            if not answered:
                st.encoder.finish(enc, st.arena, False, rid, token)

    async def empty(self, shape: Sequence[int], datatype: str = "FP32") -> np.ndarray:
        """As `Client.empty` (a coroutine: the first call may say hello)."""
        return await self._perform(lambda: self._state.empty_flow(shape, datatype, None), None)

    @property
    def lease_s(self) -> Optional[float]:
        """How long the daemon keeps this client's session without a request
        (its hello said; None before one): any call renews it."""
        return self._state.lease_s

    async def register_system_shared_memory(self, name: str, key: str, byte_size: int,
                                            offset: int = 0) -> None:
        await self._perform(lambda: self._state.regions.register_flow(name, key, byte_size, offset, None),
                            None, True)

    async def unregister_system_shared_memory(self, name: Optional[str] = None) -> None:
        await self._perform(lambda: self._state.regions.unregister_flow(name, None), None, True)

    async def get_system_shared_memory_status(self, name: Optional[str] = None) -> list[JSONDocument]:
        regions = self._state.regions
        return cast("list[JSONDocument]", await self._perform(lambda: regions.status_flow(name, None), None, True))

    async def register_cuda_shared_memory(self, name: str, raw_handle: bytes, device_id: int,
                                          byte_size: int) -> None:
        regions = self._state.regions
        await self._perform(lambda: regions.register_cuda_flow(name, raw_handle, device_id, byte_size, None),
                            None, True)

    async def unregister_cuda_shared_memory(self, name: Optional[str] = None) -> None:
        await self._perform(lambda: self._state.regions.unregister_flow(name, None, cuda=True), None, True)

    async def get_cuda_shared_memory_status(self, name: Optional[str] = None) -> list[JSONDocument]:
        regions = self._state.regions
        return cast("list[JSONDocument]", await self._perform(lambda: regions.status_flow(name, None, cuda=True),
                                                              None, True))

    def _stop(self) -> None:
        for task in (self._reader, self._watcher, *self._asking.values()):
            if task is not None:
                task.cancel()
        self._reader = self._watcher = None
        self._asking.clear()
        if self._watched is not None:       # now: the fd closes with the watch, before the task ends
            loop, fd = self._watched
            self._watched = None
            if not loop.is_closed():
                loop.remove_reader(fd)
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(InferenceError(errors.CANCELLED, "client closed"))
        self._pending.clear()

    async def aclose(self, wait: float = GOODBYE_WAIT) -> None:
        """Say goodbye, wait (briefly) for the daemon to acknowledge, close."""
        if not self._closer.alive:
            return
        call = self._state.goodbye_call(None) if wait > 0 else None     # None: no session
        if call is not None:
            try:
                await self._call(call.frames, call.rid, wait)
            except (InferenceError, zmq.ZMQError):
                pass
            self._state.close()           # goodbye said (or given up on): nothing left to send
        self.close()

    def close(self) -> None:
        """Close now; a goodbye is sent without waiting for its answer."""
        if not self._closer.detach():
            return                        # closed already
        self._stop()
        send_goodbye_and_close(self._sock, self._state, self._watch)

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
