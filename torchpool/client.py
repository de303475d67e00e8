"""The torchpool client library (synchronous and asyncio).

    from torchpool import Client
    with Client("ipc:///tmp/torchpool.sock") as c:
        out = c.infer("addsub", {"INPUT0": a, "INPUT1": b})

Both clients speak the same wire format (docs/protocol.md); the encoding,
decoding, session and shared-memory logic is shared (torchpool/client_shm.py),
only the transport differs. This module never imports torch: torch tensors
given as inputs are viewed through `Tensor.numpy()`.

Local clients (same host): at the first `infer` the client says `hello`; when
the daemon agrees it is local, inputs are copied once into the client's
shared-memory arena and only descriptors cross the socket, and outputs come
back as read-only numpy views of the worker's shared memory (no copy at all),
released to the daemon once the last view is garbage. Turn it off with
`Client(url, local=False)` or `TORCHPOOL_LOCAL=0`. A daemon that does not
speak sessions is used inline, as before.

- `c.empty(shape, datatype)` allocates an input in the arena: fill it and pass
  it (or a torch view, `torch.from_numpy(buf)`) to `infer` and nothing is
  copied. For BF16 it is a uint16 array: `torch.from_numpy(buf).view(torch.bfloat16)`.
- `c.infer(..., copy=True)` returns ordinary (writable) arrays and hands the
  daemon's memory back at once. Without it, outputs of a local session view
  the daemon's memory: they stay valid while referenced, until `close()` (or
  until the session's lease expires after `lease_s` seconds without any
  request). Copy what must outlive the client.
- The dict `infer` returns is a context manager: `with c.infer(...) as out:`.
- `c.transfer_stats()`: bytes copied into shared memory, sent zero-copy
  (descriptors of `empty()` buffers, registered regions) and sent inline.
- Triton's system shared-memory API: `register_system_shared_memory`,
  `unregister_system_shared_memory`, `get_system_shared_memory_status`;
  inputs `SharedMemoryRef(region, byte_size, offset, datatype, shape)`, and
  `outputs=[OutputRef(name, region, byte_size, offset)]` (answered as a
  `RegionOutput`: name, region, offset, nbytes, datatype, shape).
"""
from __future__ import annotations

import asyncio
import json
import time
from typing import Any, Callable, Mapping, Optional, Sequence

import numpy as np
import zmq
import zmq.asyncio

from .client_shm import (DEFAULT_ARENA_CAP, Call, ClientState, InferResult, NoAnswer, OutputRef,
                         RegionOutput, SessionLost, SharedMemoryRef, inline_buffer, needs_session,
                         output_array, prepare_input, run_async, run_sync, sequence_field)
from .protocol import errors, messages
from .protocol.errors import InferenceError

DEFAULT_TIMEOUT = 60.0   # seconds a call waits for the server before giving up
GOODBYE_WAIT = 1.0       # seconds close() waits for the daemon to acknowledge goodbye

__all__ = ["AsyncClient", "Client", "InferResult", "OutputRef", "RegionOutput", "SharedMemoryRef",
           "decode_infer", "encode_control", "encode_infer"]


# ----------------------------------------------------------------- encoding

def encode_infer(request_id: int, model: str, inputs: Mapping[str, Any],
                 outputs: Optional[Sequence[str]], version: Any, timeout: Optional[float]) -> list:
    """The frames of an inline infer request: header first, then large tensors."""
    entries, frames = [], []
    for name, value in inputs.items():
        datatype, shape, src = prepare_input(name, value)
        data = inline_buffer(src)
        if data.nbytes <= messages.INLINE_LIMIT:
            payload: Any = bytes(data)
        else:
            frames.append(data)
            payload = len(frames)
        entries.append({"name": name, "datatype": datatype, "shape": shape, "data": payload})
    header = {"v": messages.PROTOCOL_VERSION, "op": messages.OP_INFER, "id": request_id,
              "model": model, "version": "" if version is None else str(version),
              "inputs": entries, "outputs": list(outputs) if outputs is not None else None,
              "timeout_us": int(timeout * 1e6) if timeout else 0}
    return [messages.pack(header), *frames]


def encode_control(request_id: int, op: str, **fields: Any) -> list:
    return [messages.pack({"v": messages.PROTOCOL_VERSION, "op": op, "id": request_id, **fields})]


def decode_infer(header: dict, frames: Sequence[Any]) -> dict[str, Any]:
    """Outputs that came as bytes (inline or payload frames)."""
    return {e["name"]: output_array(e, frames) for e in header.get("outputs", [])}


def _timeout_error(url: str, timeout: float) -> InferenceError:
    return NoAnswer(errors.UNAVAILABLE,
                    f"no answer from torchpool at {url} within {timeout:g} s "
                    f"(is the server running and listening there?)")


def _error_of(header: dict) -> InferenceError:
    err = header.get("error") or {}
    return InferenceError(err.get("code", errors.UNKNOWN), err.get("message", "unknown error"))


class _Calls:
    """What both clients share: the state (session, arena, stats) and helpers."""

    _state: ClientState

    def _open(self, url: str, timeout: float, local: Optional[bool], arena_cap: int,
              ctx: zmq.Context) -> None:
        """What both clients set up: the shared state and a DEALER socket."""
        self.url = url
        self.timeout = timeout
        self._state = ClientState(url, local, arena_cap)
        self._ids = self._state.ids
        self._ctx = ctx
        self._sock = ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)

    @staticmethod
    def _version_field(version: Any) -> str:
        return "" if version is None else str(version)

    def transfer_stats(self) -> dict:
        """{"bytes_copied", "bytes_zero_copy", "bytes_inline"} since the client was made:
        input bytes copied into shared memory, sent as descriptors with no copy
        (`empty()` buffers, registered regions), and sent over the socket."""
        return self._state.transfer_stats()

    @property
    def session(self) -> Optional[str]:
        """The session token, once the client has one."""
        return self._state.session

    @property
    def is_local(self) -> bool:
        """True once the daemon agreed this client shares its host (arena in use)."""
        return self._state.local

    def _control_flow(self, op: str, timeout: Optional[float], fields: dict) -> Callable:
        return lambda: self._state.control_flow(op, timeout, fields)


# --------------------------------------------------------------- sync client

class Client(_Calls):
    """A synchronous client. One call at a time per client; thread-confined.

    `local`: None (default) uses the shared-memory path when the daemon is on
    this host (unless TORCHPOOL_LOCAL=0); False never does. `arena_cap`: the
    most arena memory this client asks the daemon for.
    """

    def __init__(self, url: str, timeout: float = DEFAULT_TIMEOUT, local: Optional[bool] = None,
                 arena_cap: int = DEFAULT_ARENA_CAP) -> None:
        self._open(url, timeout, local, arena_cap, zmq.Context.instance())
        self._sock.connect(url)

    # -- transport
    def _call(self, frames: list, request_id: int, timeout: Optional[float]) -> tuple[dict, list]:
        limit = self.timeout if timeout is None else timeout
        if self._sock.closed:
            raise InferenceError(errors.CANCELLED, "client closed")
        self._sock.send_multipart(frames, copy=len(frames) == 1)
        deadline = time.monotonic() + limit
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not self._sock.poll(max(1, int(remaining * 1000)), zmq.POLLIN):
                raise _timeout_error(self.url, limit)
            reply = self._sock.recv_multipart(copy=False)
            header = messages.unpack(reply[0].buffer)
            if not isinstance(header, dict) or header.get("id") != request_id:
                self._state.late_reply(header)   # the late answer of a call that timed out
                continue
            if not header.get("ok"):
                raise _error_of(header)
            return header, [f.buffer for f in reply[1:]]

    def _send(self, call: Call) -> tuple[dict, list]:
        return self._call(call.frames, call.rid, call.timeout)

    def _perform(self, make_flow: Callable, timeout: Optional[float], session: bool = False) -> Any:
        """Run a flow; say hello first when due; once more after a lost session."""
        st = self._state
        for attempt in range(2):
            if st.needs_hello(session):
                run_sync(st.hello_flow(timeout), self._send)
            if session:
                st.require_session()
            try:
                return run_sync(make_flow(), self._send)
            except SessionLost as lost:
                st.session_lost(lost.token)
                if attempt:
                    raise lost.error from None

    def _control(self, op: str, timeout: Optional[float] = None, **fields: Any) -> Any:
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

    def model_ready(self, name: str, version: Any = None) -> bool:
        return bool(self._control(messages.OP_MODEL_READY, model=name, version=self._version_field(version)))

    def model_metadata(self, name: str, version: Any = None) -> dict:
        return self._control(messages.OP_MODEL_METADATA, model=name, version=self._version_field(version))

    def model_config(self, name: str, version: Any = None) -> dict:
        return self._control(messages.OP_MODEL_CONFIG, model=name, version=self._version_field(version))

    def repository_index(self) -> list[dict]:
        return self._control(messages.OP_REPOSITORY_INDEX)

    def server_metadata(self) -> dict:
        return self._control(messages.OP_SERVER_METADATA)

    def statistics(self, model: Optional[str] = None, version: Any = None) -> dict:
        """Triton's statistics: {"model_stats": [{name, version, inference_count,
        execution_count, inference_stats: {success, fail, queue, compute_*}, batch_stats}]}."""
        return self._control(messages.OP_STATISTICS, model=model or "", version=self._version_field(version))

    def load(self, name: str, config: Any = None, timeout: Optional[float] = None) -> None:
        """Load or reload a model (--model-control-mode explicit); returns once
        it serves. `config` (dict or JSON text) overrides its config file."""
        self._control(messages.OP_LOAD, timeout, model=name,
                      config=json.dumps(config) if isinstance(config, dict) else config)

    def unload(self, name: str, timeout: Optional[float] = None) -> None:
        """Unload a model; returns once its in-flight requests have finished."""
        self._control(messages.OP_UNLOAD, timeout, model=name)

    # -- inference
    def infer(self, model: str, inputs: Mapping[str, Any], outputs: Optional[Sequence[Any]] = None,
              version: Any = None, timeout: Optional[float] = None, copy: bool = False,
              priority: int = 0, sequence_id: Any = 0, sequence_start: bool = False,
              sequence_end: bool = False) -> InferResult:
        """Run `model` on `inputs`; returns {output name: numpy array}.

        `inputs` values: numpy arrays, torch tensors, lists of str/bytes
        (BYTES), arrays from `empty()` (sent with no copy) or
        `SharedMemoryRef`s. `outputs`: names, or `OutputRef`s to have an
        output written into a registered region. `timeout` (seconds) bounds
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
        return self._perform(
            lambda: self._state.infer_flow(model, inputs, outputs, version, timeout, copy, priority, seq),
            timeout, needs_session(inputs, outputs))

    def empty(self, shape: Sequence[int], datatype: str = "FP32") -> np.ndarray:
        """A writable array in this client's shared-memory arena: fill it and
        pass it to `infer` and its bytes are not copied (see module doc).
        Without a local session it is an ordinary array."""
        return self._perform(lambda: self._state.empty_flow(shape, datatype, None), None)

    # -- registered regions (Triton's system shared memory)
    def register_system_shared_memory(self, name: str, key: str, byte_size: int, offset: int = 0) -> None:
        """Register `byte_size` bytes at `offset` of the POSIX shm segment `key`
        (which this client must be able to open and write) under `name`."""
        self._perform(lambda: self._state.register_flow(name, key, byte_size, offset, None), None, True)

    def unregister_system_shared_memory(self, name: Optional[str] = None) -> None:
        """Unregister `name` (None: every region of this client)."""
        self._perform(lambda: self._state.unregister_flow(name, None), None, True)

    def get_system_shared_memory_status(self, name: Optional[str] = None) -> list[dict]:
        """[{name, key, offset, byte_size, in_use}] of this client's regions."""
        return self._perform(lambda: self._state.status_flow(name, None), None, True)

    # -- lifetime
    def close(self, wait: float = GOODBYE_WAIT) -> None:
        """Say goodbye (returning everything lent to us) and close the socket.
        Outputs of a local session must not be used after this."""
        if self._sock.closed:
            return
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
        self._sock.close(linger=linger)

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:  # a forgotten client must not leak its socket
        try:
            self.close(wait=0)
        except Exception:
            pass


def decode_response_checked(reply: list, request_id: int) -> Optional[dict]:
    """The reply's header if it answers `request_id`; None for a stale one."""
    header = messages.unpack(reply[0].buffer if hasattr(reply[0], "buffer") else reply[0])
    if header.get("id") != request_id:
        return None     # the late answer of a call that already timed out
    if not header.get("ok"):
        raise _error_of(header)
    return header


# -------------------------------------------------------------- async client

class AsyncClient(_Calls):
    """An asyncio client: many concurrent calls over one socket. The same
    features as `Client`; `empty()` and the region calls are coroutines."""

    def __init__(self, url: str, timeout: float = DEFAULT_TIMEOUT, local: Optional[bool] = None,
                 arena_cap: int = DEFAULT_ARENA_CAP) -> None:
        self._open(url, timeout, local, arena_cap, zmq.asyncio.Context.instance())
        self._sock.connect(url)
        self._pending: dict[int, asyncio.Future] = {}
        self._reader: Optional[asyncio.Task] = None
        self._hello_lock: Optional[asyncio.Lock] = None

    async def _read_replies(self) -> None:
        while True:
            reply = await self._sock.recv_multipart(copy=False)
            header = messages.unpack(reply[0].buffer)
            fut = self._pending.pop(header.get("id"), None) if isinstance(header, dict) else None
            if fut is not None and not fut.done():
                fut.set_result((header, [f.buffer for f in reply[1:]]))
            else:
                self._state.late_reply(header)

    async def _call(self, frames: list, request_id: int, timeout: Optional[float]) -> tuple[dict, list]:
        if self._sock.closed:
            raise InferenceError(errors.CANCELLED, "client closed")
        if self._reader is None or self._reader.done():
            self._reader = asyncio.ensure_future(self._read_replies())
        fut = asyncio.get_running_loop().create_future()
        self._pending[request_id] = fut
        limit = self.timeout if timeout is None else timeout
        try:
            await self._sock.send_multipart(frames, copy=len(frames) == 1)
            header, payload = await asyncio.wait_for(fut, limit)
        except asyncio.TimeoutError:
            raise _timeout_error(self.url, limit) from None
        finally:
            self._pending.pop(request_id, None)
        if not header.get("ok"):
            raise _error_of(header)
        return header, payload

    def _send(self, call: Call) -> Any:
        return self._call(call.frames, call.rid, call.timeout)

    async def _perform(self, make_flow: Callable, timeout: Optional[float], session: bool = False) -> Any:
        st = self._state
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
                return await run_async(make_flow(), self._send)
            except SessionLost as lost:
                st.session_lost(lost.token)
                if attempt:
                    raise lost.error from None

    async def _control(self, op: str, timeout: Optional[float] = None, **fields: Any) -> Any:
        if self._state.session is None:
            rid = next(self._ids)
            header, _ = await self._call(encode_control(rid, op, **fields), rid, timeout)
            return header.get("result")
        return await self._perform(self._control_flow(op, timeout, fields), timeout)

    async def server_live(self, timeout: Optional[float] = None) -> bool:
        return bool(await self._control(messages.OP_SERVER_LIVE, timeout))

    async def server_ready(self, timeout: Optional[float] = None) -> bool:
        return bool(await self._control(messages.OP_SERVER_READY, timeout))

    async def model_ready(self, name: str, version: Any = None) -> bool:
        return bool(await self._control(messages.OP_MODEL_READY, model=name,
                                        version=self._version_field(version)))

    async def model_metadata(self, name: str, version: Any = None) -> dict:
        return await self._control(messages.OP_MODEL_METADATA, model=name,
                                   version=self._version_field(version))

    async def model_config(self, name: str, version: Any = None) -> dict:
        return await self._control(messages.OP_MODEL_CONFIG, model=name,
                                   version=self._version_field(version))

    async def repository_index(self) -> list[dict]:
        return await self._control(messages.OP_REPOSITORY_INDEX)

    async def server_metadata(self) -> dict:
        return await self._control(messages.OP_SERVER_METADATA)

    async def statistics(self, model: Optional[str] = None, version: Any = None) -> dict:
        return await self._control(messages.OP_STATISTICS, model=model or "",
                                   version=self._version_field(version))

    async def load(self, name: str, config: Any = None, timeout: Optional[float] = None) -> None:
        await self._control(messages.OP_LOAD, timeout, model=name,
                            config=json.dumps(config) if isinstance(config, dict) else config)

    async def unload(self, name: str, timeout: Optional[float] = None) -> None:
        await self._control(messages.OP_UNLOAD, timeout, model=name)

    async def infer(self, model: str, inputs: Mapping[str, Any], outputs: Optional[Sequence[Any]] = None,
                    version: Any = None, timeout: Optional[float] = None, copy: bool = False,
                    priority: int = 0, sequence_id: Any = 0, sequence_start: bool = False,
                    sequence_end: bool = False) -> InferResult:
        """As `Client.infer`."""
        seq = sequence_field(sequence_id, sequence_start, sequence_end)
        return await self._perform(
            lambda: self._state.infer_flow(model, inputs, outputs, version, timeout, copy, priority, seq),
            timeout, needs_session(inputs, outputs))

    async def empty(self, shape: Sequence[int], datatype: str = "FP32") -> np.ndarray:
        """As `Client.empty` (a coroutine: the first call may say hello)."""
        return await self._perform(lambda: self._state.empty_flow(shape, datatype, None), None)

    async def register_system_shared_memory(self, name: str, key: str, byte_size: int,
                                            offset: int = 0) -> None:
        await self._perform(lambda: self._state.register_flow(name, key, byte_size, offset, None),
                            None, True)

    async def unregister_system_shared_memory(self, name: Optional[str] = None) -> None:
        await self._perform(lambda: self._state.unregister_flow(name, None), None, True)

    async def get_system_shared_memory_status(self, name: Optional[str] = None) -> list[dict]:
        return await self._perform(lambda: self._state.status_flow(name, None), None, True)

    def _stop(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            self._reader = None
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(InferenceError(errors.CANCELLED, "client closed"))
        self._pending.clear()

    async def aclose(self, wait: float = GOODBYE_WAIT) -> None:
        """Say goodbye, wait (briefly) for the daemon to acknowledge, close."""
        if self._sock.closed:
            return
        call = self._state.goodbye_call(None)
        if call is not None and wait > 0:
            try:
                await self._call(call.frames, call.rid, wait)
            except (InferenceError, zmq.ZMQError):
                pass
            call = None
        self._state.close()
        self._finish_close(call)

    def close(self) -> None:
        """Close now; a goodbye is sent without waiting for its answer."""
        if self._sock.closed:
            return
        call = self._state.goodbye_call(None)
        self._state.close()
        self._finish_close(call)

    def _finish_close(self, call: Optional[Call]) -> None:
        self._stop()
        linger = 0
        if call is not None:
            try:   # the plain socket under the asyncio one: send now, without a loop
                zmq.Socket.shadow(self._sock.underlying).send_multipart(call.frames, flags=zmq.NOBLOCK)
                linger = int(GOODBYE_WAIT * 1000)
            except zmq.ZMQError:
                pass
        self._sock.close(linger=linger)

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()
