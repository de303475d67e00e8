"""What the sync and the asyncio client share: the socket and state they own,
how an error answer becomes an exception, and the inline request helpers."""
from __future__ import annotations

import weakref
from typing import Any, Callable, Mapping, Optional, Sequence

import zmq

from ..protocol import errors, messages, tensors
from ..protocol.errors import InferenceError
from .flows import Call, ClientState
from .types import NoAnswer
from .values import output_array, prepare_input

DEFAULT_TIMEOUT = 60.0   # seconds a call waits for the server before giving up
GOODBYE_WAIT = 1.0       # seconds close() waits for the daemon to acknowledge goodbye


# --- inline requests, with no session (kept for callers that build frames) ---------

def encode_infer(request_id: int, model: str, inputs: Mapping[str, Any],
                 outputs: Optional[Sequence[str]], version: Any, timeout: Optional[float]) -> list:
    """The frames of an inline infer request: header first, then large tensors."""
    entries: list[dict] = []
    frames: list = []
    for name, value in inputs.items():
        datatype, shape, src = prepare_input(name, value)
        entry = tensors.tensor_entry(name, datatype, shape)
        tensors.put_data(entry, src, frames)
        entries.append(entry)
    header = {"v": messages.PROTOCOL_VERSION, "op": messages.OP_INFER, "id": request_id,
              "model": model, "version": "" if version is None else str(version),
              "inputs": entries, "outputs": list(outputs) if outputs is not None else None,
              "timeout_us": int(timeout * 1e6) if timeout else 0}
    return [messages.pack(header), *frames]


def encode_control(request_id: int, op: str, **fields: Any) -> list:
    return [messages.pack({"v": messages.PROTOCOL_VERSION, "op": op, "id": request_id, **fields})]


def decode_infer(header: dict, frames: Sequence[Any]) -> dict[str, Any]:
    """Outputs that came as bytes (inline or payload frames)."""
    return {e[tensors.NAME]: output_array(e, frames) for e in header.get("outputs", [])}


# --- answers ---------------------------------------------------------------------------

def timeout_error(url: str, timeout: float) -> InferenceError:
    return NoAnswer(errors.UNAVAILABLE,
                    f"no answer from torchpool at {url} within {timeout:g} s "
                    f"(is the server running and listening there?)")


def error_of(header: dict) -> InferenceError:
    err = header.get("error") or {}
    return InferenceError(err.get("code", errors.UNKNOWN), err.get("message", "unknown error"))


def send_goodbye_and_close(sock: zmq.Socket, state: ClientState) -> None:
    """Close a client's session and socket without waiting: the goodbye (if
    there is a session) is handed to ZeroMQ, which gets GOODBYE_WAIT to
    deliver it. What `AsyncClient.close()` and a forgotten client's finalizer
    run; `sock` may be an asyncio socket (the goodbye then goes through a plain
    shadow of it: no event loop needed)."""
    call = state.goodbye_call(None)
    state.close()
    linger = 0
    if call is not None and not sock.closed:
        try:
            plain = sock if type(sock) is zmq.Socket else zmq.Socket.shadow(sock.underlying)
            plain.send_multipart(call.frames, flags=zmq.NOBLOCK)
            linger = int(GOODBYE_WAIT * 1000)
        except zmq.ZMQError:
            pass
    sock.close(linger=linger)


class ClientBase:
    """The state (session, arena, stats), the DEALER socket, and helpers.

    The socket and the state are owned through a `weakref.finalize`: a client
    that is garbage (or still open at exit) says goodbye and closes its socket,
    and so does one whose constructor failed half-way."""

    _state: ClientState

    def _open(self, url: str, timeout: float, local: Optional[bool], arena_cap: int,
              ctx: zmq.Context) -> None:
        self.url = url
        self.timeout = timeout
        self._state = ClientState(url, local, arena_cap)
        self._ids = self._state.ids
        self._sock = ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._closer = weakref.finalize(self, send_goodbye_and_close, self._sock, self._state)
        self._sock.connect(url)

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

    def _check_open(self) -> None:
        if self._sock.closed:
            raise InferenceError(errors.CANCELLED, "client closed")


__all__ = ["Call", "ClientBase", "DEFAULT_TIMEOUT", "GOODBYE_WAIT", "decode_infer", "encode_control",
           "encode_infer", "error_of", "send_goodbye_and_close", "timeout_error"]
