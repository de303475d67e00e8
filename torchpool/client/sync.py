"""The synchronous client: one call at a time over a DEALER socket."""
from __future__ import annotations

import json
import time
from typing import Any, Callable, Mapping, Optional, Sequence

import numpy as np
import zmq

from ..protocol import messages
from .arena import DEFAULT_ARENA_CAP
from .common import DEFAULT_TIMEOUT, GOODBYE_WAIT, ClientBase, ClientKey, ServerKey, encode_control, error_of
from .flows import SessionLost, run_sync, sequence_field
from .regions import needs_session
from .types import Call
from .types import InferResult


class Client(ClientBase):
    """A synchronous client. One call at a time per client; thread-confined.

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

    def __init__(self, url: str, timeout: float = DEFAULT_TIMEOUT, local: Optional[bool] = None,
                 arena_cap: int = DEFAULT_ARENA_CAP, server_key: Optional[ServerKey] = None,
                 client_key: Optional[ClientKey] = None) -> None:
        self._open(url, timeout, local, arena_cap, zmq.Context.instance(), server_key, client_key)

    # -- transport
    def _call(self, frames: list, request_id: int, timeout: Optional[float]) -> tuple[dict, list]:
        limit = self.timeout if timeout is None else timeout
        self._check_open()
        self._sock.send_multipart(frames, copy=len(frames) == 1)
        deadline = time.monotonic() + limit
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not self._sock.poll(max(1, int(remaining * 1000)), zmq.POLLIN):
                raise self._no_answer(limit)
            reply = self._sock.recv_multipart(copy=False)
            header = messages.unpack(reply[0].buffer)
            if not isinstance(header, dict) or header.get("id") != request_id:
                self._state.late_reply(header)   # the late answer of a call that timed out
                continue
            if not header.get("ok"):
                raise error_of(header)
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
        if not self._closer.detach():
            return                                   # closed already
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
        if self._monitor is not None:
            self._monitor.close(linger=0)

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
