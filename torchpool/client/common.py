"""What the sync and the asyncio client share: the socket and state they own,
how an error answer becomes an exception, and the inline request helpers."""
from __future__ import annotations

import itertools
import os
import weakref
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import zmq
from zmq.utils import z85
from zmq.utils.monitor import parse_monitor_message

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


# --- CURVE keys (tcp://) ---------------------------------------------------------------

# server_key: the daemon's public key, z85 (str or bytes) or a path to its .key file;
# client_key: a path to this client's .key_secret file, or a (public, secret) z85 pair
ServerKey = Union[str, bytes, "os.PathLike[str]"]
ClientKey = Union[str, "os.PathLike[str]", tuple, list]

_monitor_ids = itertools.count()     # inproc names are never reused, even after a client is gone
_HANDSHAKE_EVENTS = (zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                     | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH)


def _z85_key(value: Any) -> Optional[bytes]:
    """`value` as a z85 CURVE key (40 characters, 32 bytes), or None."""
    key = value.encode("ascii", "replace") if isinstance(value, str) else value
    if not isinstance(key, bytes) or len(key) != 40:
        return None
    try:
        return key if len(z85.decode(key)) == 32 else None
    except (ValueError, KeyError, TypeError):
        return None


def _certificate(path: Any, what: str) -> tuple[bytes, Optional[bytes]]:
    import zmq.auth

    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{what}: cannot read a CURVE key from {os.fspath(path)!r}: {exc}") from None
    if _z85_key(public) is None:
        raise ValueError(f"{what}: {os.fspath(path)!r} holds no valid public key")
    return public, secret


def curve_keys(server_key: Optional[ServerKey], client_key: Optional[ClientKey]) -> Optional[tuple]:
    """(server public, client public, client secret) z85 keys, or None without
    keys; ValueError naming the argument when a key is unusable."""
    if server_key is None and client_key is None:
        return None
    if server_key is None or client_key is None:
        raise ValueError("server_key and client_key go together: the server's public key, and this "
                         "client's key pair (its public key must be in the server's authorized keys)")
    server = _z85_key(server_key)
    if server is None:
        if not isinstance(server_key, (str, bytes, os.PathLike)) or not os.path.isfile(server_key):
            raise ValueError("server_key: expected the server's public key (40 Z85 characters) or the "
                             f"path of its .key file, got {server_key!r}")
        server = _certificate(server_key, "server_key")[0]
    if isinstance(client_key, (tuple, list)):
        if len(client_key) != 2:
            raise ValueError("client_key: expected a (public, secret) pair of Z85 keys")
        public, secret = (_z85_key(k) for k in client_key)
        if public is None or secret is None:
            raise ValueError("client_key: expected a (public, secret) pair of 40-character Z85 keys")
    else:
        public, secret = _certificate(client_key, "client_key")
        if _z85_key(secret) is None:
            raise ValueError(f"client_key: {os.fspath(client_key)!r} holds no secret key (give the "
                             f"NAME.key_secret file, not NAME.key)")
    if zmq.curve_public(secret) != public:
        raise ValueError("client_key: the public key is not the one of the secret key")
    return server, public, secret


_NO_KEYS = ("the security handshake failed: the server uses CURVE and this client has no "
            "server_key/client_key")
_MISMATCH = "the security handshake failed: this client uses CURVE and the server does not"
_NO_DETAIL = "the CURVE handshake failed: check server_key (it must be the server's public key)"


def _handshake_problem(event: int, value: int, has_keys: bool) -> Optional[str]:
    """What a failed handshake (a socket monitor event) says, in the user's terms."""
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        if value == 400:
            return ("the server refused this client's CURVE key: client_key's public key is not "
                    "in the server's authorized keys (--curve-authorized-keys)")
        return f"the server refused the connection (ZAP status {value})"
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
        return _NO_KEYS if not has_keys else _MISMATCH
    if event in (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL):
        # without keys the handshake is NULL, which only fails against a CURVE
        # server; the mismatch event itself may be lost to a retried connection
        return _NO_DETAIL if has_keys else _NO_KEYS
    return None


# --- answers ---------------------------------------------------------------------------

def timeout_error(url: str, timeout: float, why: Optional[str] = None) -> InferenceError:
    """No answer within `timeout`; `why` when the connection says why (a
    refused handshake). Over tcp:// a server using CURVE answers nothing to
    a client it refuses, so the message says where to look."""
    if why:
        hint = why
    elif url.startswith("tcp://"):
        hint = ("is the server running and listening there? if the server uses CURVE, "
                "check server_key/client_key")
    else:
        hint = "is the server running and listening there?"
    return NoAnswer(errors.UNAVAILABLE, f"no answer from torchpool at {url} within {timeout:g} s ({hint})")


def error_of(header: dict) -> InferenceError:
    err = header.get("error") or {}
    return InferenceError(err.get("code", errors.UNKNOWN), err.get("message", "unknown error"))


def send_goodbye_and_close(sock: zmq.Socket, state: ClientState,
                           monitor: Optional[zmq.Socket] = None) -> None:
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
    if monitor is not None:
        monitor.close(linger=0)


class ClientBase:
    """The state (session, arena, stats), the DEALER socket, and helpers.

    The socket and the state are owned through a `weakref.finalize`: a client
    that is garbage (or still open at exit) says goodbye and closes its socket,
    and so does one whose constructor failed half-way."""

    _state: ClientState

    def _open(self, url: str, timeout: float, local: Optional[bool], arena_cap: int,
              ctx: zmq.Context, server_key: Optional[ServerKey] = None,
              client_key: Optional[ClientKey] = None) -> None:
        """The DEALER socket, connected. Over tcp:// with `server_key` and
        `client_key` it is a CURVE client (encrypted, and authenticated by the
        server's allow-list); ipc:// is always plain (the daemon does not use
        CURVE there: the socket file's permissions guard it)."""
        self.url = url
        self.timeout = timeout
        keys = curve_keys(server_key, client_key)     # a bad key fails here, before any socket
        self._state = ClientState(url, local, arena_cap)
        self._ids = self._state.ids
        self._sock = ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._monitor: Optional[zmq.Socket] = None
        self._handshake: Optional[str] = None     # why the last handshake failed, if it did
        self._has_keys = keys is not None
        if url.startswith("tcp://"):
            if keys is not None:
                self._sock.curve_serverkey, self._sock.curve_publickey, self._sock.curve_secretkey = keys
            # a refused handshake is silent at the socket level: its monitor tells why a
            # call got no answer
            endpoint = f"inproc://torchpool.client.monitor.{next(_monitor_ids)}"
            self._sock.monitor(endpoint, _HANDSHAKE_EVENTS)
            self._monitor = ctx.socket(zmq.PAIR, socket_class=zmq.Socket)
            self._monitor.connect(endpoint)
        self._closer = weakref.finalize(self, send_goodbye_and_close, self._sock, self._state, self._monitor)
        self._sock.connect(url)

    def _no_answer(self, timeout: float) -> InferenceError:
        """The error of a call that got no answer, saying why when the
        connection's handshake failed."""
        if self._monitor is not None and not self._monitor.closed:
            while True:
                try:
                    event = parse_monitor_message(self._monitor.recv_multipart(zmq.NOBLOCK))
                except zmq.ZMQError:
                    break
                if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    self._handshake = None
                else:
                    problem = _handshake_problem(event["event"], event["value"], self._has_keys)
                    # a retried connection may fail with no detail after one that said
                    # why: the reason is kept
                    if problem and (problem != _NO_DETAIL or self._handshake is None):
                        self._handshake = problem
        return timeout_error(self.url, timeout, self._handshake)

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


__all__ = ["Call", "ClientBase", "ClientKey", "DEFAULT_TIMEOUT", "GOODBYE_WAIT", "ServerKey", "curve_keys",
           "decode_infer", "encode_control", "encode_infer", "error_of", "send_goodbye_and_close",
           "timeout_error"]
