"""The torchpool client library (synchronous and asyncio).

    from torchpool import Client
    with Client("ipc:///tmp/torchpool.sock") as c:
        out = c.infer("addsub", {"INPUT0": a, "INPUT1": b})

Both clients speak the same wire format (docs/protocol.md); the encoding and
decoding below is shared, only the transport differs. This module never
imports torch: torch tensors given as inputs are converted through
`Tensor.numpy()`.
"""
from __future__ import annotations

import asyncio
import itertools
import time
from typing import Any, Mapping, Optional, Sequence

import numpy as np
import zmq
import zmq.asyncio

from .protocol import datatypes, errors, messages
from .protocol.errors import InferenceError

DEFAULT_TIMEOUT = 60.0   # seconds a call waits for the server before giving up


# ----------------------------------------------------------------- encoding

def _as_array(name: str, value: Any) -> tuple[str, list[int], Any]:
    """(datatype, shape, contiguous buffer) for one input value."""
    if type(value).__module__.startswith("torch"):
        import torch  # the caller already has torch loaded

        t = value.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        t = t.contiguous()
        if t.dtype == torch.bfloat16:
            return "BF16", list(t.shape), t.view(torch.int16).numpy()
        value = t.numpy()
    if isinstance(value, (list, tuple)):
        if value and all(isinstance(v, (str, bytes, bytearray)) for v in value):
            return "BYTES", [len(value)], datatypes.encode_bytes(value)
        value = np.asarray(value)
    if not isinstance(value, np.ndarray):
        value = np.asarray(value)
    if value.dtype.kind in ("O", "S", "U"):
        flat = value.reshape(-1)
        return "BYTES", list(value.shape), datatypes.encode_bytes(flat.tolist())
    try:
        datatype = datatypes.wire_from_numpy(value.dtype)
    except TypeError:
        raise InferenceError(errors.INVALID_ARG,
                             f"input '{name}': numpy dtype {value.dtype} is not supported") from None
    if not value.dtype.isnative:
        value = value.astype(value.dtype.newbyteorder("="))
    return datatype, list(value.shape), np.ascontiguousarray(value)


def encode_infer(request_id: int, model: str, inputs: Mapping[str, Any],
                 outputs: Optional[Sequence[str]], version: Any, timeout: Optional[float]) -> list:
    """The frames of an infer request: header first, then large tensors."""
    entries, frames = [], []
    for name, value in inputs.items():
        datatype, shape, buf = _as_array(name, value)
        if isinstance(buf, np.ndarray):
            buf = buf.reshape(-1)   # memoryview cannot cast a view with a 0 in its shape
        data = memoryview(buf).cast("B")
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


def _output_array(entry: dict, frames: Sequence[Any]) -> Any:
    data = messages.tensor_payload(entry, frames)
    datatype, shape = entry["datatype"], entry["shape"]
    if datatype == "BYTES":
        items = datatypes.decode_bytes(data)
        arr = np.empty(len(items), dtype=object)
        arr[:] = items
        return arr.reshape(shape)
    if datatype == "BF16":
        import torch

        raw = np.frombuffer(data, dtype=np.int16).copy()
        return torch.from_numpy(raw).view(torch.bfloat16).reshape(shape)
    # A read-only view, no copy: it keeps the ZeroMQ frame (or bytes) alive.
    return np.frombuffer(data, dtype=datatypes.numpy_dtype(datatype)).reshape(shape)


def decode_infer(header: dict, frames: Sequence[Any]) -> dict[str, Any]:
    return {e["name"]: _output_array(e, frames) for e in header.get("outputs", [])}


def _timeout_error(url: str, timeout: float) -> InferenceError:
    return InferenceError(errors.UNAVAILABLE,
                          f"no answer from torchpool at {url} within {timeout:g} s "
                          f"(is the server running and listening there?)")


class _Calls:
    """The public calls, written once over a `_call(op_frames, timeout)` transport."""

    def _control(self, op: str, timeout: Optional[float] = None, **fields: Any) -> Any:
        raise NotImplementedError

    @staticmethod
    def _version_field(version: Any) -> str:
        return "" if version is None else str(version)


# --------------------------------------------------------------- sync client

class Client(_Calls):
    """A synchronous client. One call at a time per client; thread-confined."""

    def __init__(self, url: str, timeout: float = DEFAULT_TIMEOUT) -> None:
        self.url = url
        self.timeout = timeout
        self._ids = itertools.count(1)
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(url)

    def _call(self, frames: list, request_id: int, timeout: Optional[float]) -> tuple[dict, list]:
        limit = self.timeout if timeout is None else timeout
        self._sock.send_multipart(frames, copy=len(frames) == 1)
        deadline = time.monotonic() + limit
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not self._sock.poll(max(1, int(remaining * 1000)), zmq.POLLIN):
                raise _timeout_error(self.url, limit)
            reply = self._sock.recv_multipart(copy=False)
            header = decode_response_checked(reply, request_id)
            if header is not None:
                return header, [f.buffer for f in reply[1:]]

    def _control(self, op: str, timeout: Optional[float] = None, **fields: Any) -> Any:
        rid = next(self._ids)
        header, _ = self._call(encode_control(rid, op, **fields), rid, timeout)
        return header.get("result")

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

    def infer(self, model: str, inputs: Mapping[str, Any], outputs: Optional[Sequence[str]] = None,
              version: Any = None, timeout: Optional[float] = None) -> dict[str, Any]:
        """Run `model` on `inputs`; returns {output name: numpy array}.

        `timeout` (seconds) bounds the whole call; the server also drops the
        request if it could not start within it.
        """
        rid = next(self._ids)
        frames = encode_infer(rid, model, inputs, outputs, version, timeout)
        header, payload = self._call(frames, rid, timeout)
        return decode_infer(header, payload)

    def close(self) -> None:
        if not self._sock.closed:
            self._sock.close(linger=0)

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:  # a forgotten client must not leak its socket
        try:
            self.close()
        except Exception:
            pass


def decode_response_checked(reply: list, request_id: int) -> Optional[dict]:
    """The reply's header if it answers `request_id`; None for a stale one."""
    header = messages.unpack(reply[0].buffer if hasattr(reply[0], "buffer") else reply[0])
    if header.get("id") != request_id:
        return None     # the late answer of a call that already timed out
    if not header.get("ok"):
        err = header.get("error") or {}
        raise InferenceError(err.get("code", errors.UNKNOWN), err.get("message", "unknown error"))
    return header


# -------------------------------------------------------------- async client

class AsyncClient(_Calls):
    """An asyncio client: many concurrent calls over one socket."""

    def __init__(self, url: str, timeout: float = DEFAULT_TIMEOUT) -> None:
        self.url = url
        self.timeout = timeout
        self._ids = itertools.count(1)
        self._ctx = zmq.asyncio.Context.instance()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(url)
        self._pending: dict[int, asyncio.Future] = {}
        self._reader: Optional[asyncio.Task] = None

    async def _read_replies(self) -> None:
        while True:
            reply = await self._sock.recv_multipart(copy=False)
            header = messages.unpack(reply[0].buffer)
            fut = self._pending.pop(header.get("id"), None)
            if fut is not None and not fut.done():
                fut.set_result((header, [f.buffer for f in reply[1:]]))

    async def _call(self, frames: list, request_id: int, timeout: Optional[float]) -> tuple[dict, list]:
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
            err = header.get("error") or {}
            raise InferenceError(err.get("code", errors.UNKNOWN), err.get("message", "unknown error"))
        return header, payload

    async def _control(self, op: str, timeout: Optional[float] = None, **fields: Any) -> Any:
        rid = next(self._ids)
        header, _ = await self._call(encode_control(rid, op, **fields), rid, timeout)
        return header.get("result")

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

    async def infer(self, model: str, inputs: Mapping[str, Any], outputs: Optional[Sequence[str]] = None,
                    version: Any = None, timeout: Optional[float] = None) -> dict[str, Any]:
        rid = next(self._ids)
        frames = encode_infer(rid, model, inputs, outputs, version, timeout)
        header, payload = await self._call(frames, rid, timeout)
        return decode_infer(header, payload)

    def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            self._reader = None
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(InferenceError(errors.CANCELLED, "client closed"))
        self._pending.clear()
        if not self._sock.closed:
            self._sock.close(linger=0)

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self.close()
