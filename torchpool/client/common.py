"""What the sync and the asyncio client share: the socket and state they own,
how an error answer becomes an exception, and the inline request helpers."""
from __future__ import annotations

import os
import weakref
from typing import TYPE_CHECKING, Callable, Optional, Sequence, Union, cast

import zmq
from zmq.utils import z85

from ..protocol import errors, messages, tensors
from ..protocol.errors import InferenceError
from ..protocol.messages import Header
from .flows import ClientState
from .types import Call, Flow, Frames, Inputs, Tensor, Version
from .values import output_array, prepare_input
from .watch import ConnectionWatch, timeout_error

if TYPE_CHECKING:
    from typing_extensions import Buffer

DEFAULT_TIMEOUT = 60.0   # seconds a call waits for the server before giving up
GOODBYE_WAIT = 1.0       # seconds close() waits for the daemon to acknowledge goodbye
RECONNECT_MAX_MS = 1000  # the longest wait between two attempts to reach a daemon that is gone
# tcp:// only. A daemon cut off by the network (its host down, a partition)
# closes nothing: without a heartbeat a call waits for its whole timeout and
# cannot tell a dead connection from a slow daemon. ZeroMQ pings every
# HEARTBEAT_IVL_MS and drops a connection from which nothing came within
# HEARTBEAT_TIMEOUT_MS of a ping (the daemon's ZeroMQ I/O thread answers
# however busy the daemon is); its calls then fail UNAVAILABLE, as when a
# daemon stops. A connect attempt that the network swallows is given up after
# CONNECT_TIMEOUT_MS and tried again, instead of waiting out TCP's backoff.
HEARTBEAT_IVL_MS = 1000
HEARTBEAT_TIMEOUT_MS = 5000
CONNECT_TIMEOUT_MS = 2000


# --- inline requests, with no session (kept for callers that build frames) ---------

def encode_infer(request_id: int, model: str, inputs: Inputs,
                 outputs: Optional[Sequence[str]], version: Version, timeout: Optional[float]) -> Frames:
    """The frames of an inline infer request: header first, then large tensors."""
    entries: list[tensors.Entry] = []
    frames: Frames = []
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


def encode_control(request_id: int, op: str, **fields: object) -> Frames:
    return [messages.pack({"v": messages.PROTOCOL_VERSION, "op": op, "id": request_id, **fields})]


def decode_infer(header: Header, frames: Sequence[Buffer]) -> dict[str, Tensor]:
    """Outputs that came as bytes (inline or payload frames)."""
    # the daemon's own answer: a list of output entries, each named
    entries = cast("list[tensors.Entry]", header.get("outputs", []))
    return {cast(str, e[tensors.NAME]): output_array(e, frames) for e in entries}


# --- CURVE keys (tcp://) ---------------------------------------------------------------

# server_key: the daemon's public key, z85 (str or bytes) or a path to its .key file;
# client_key: a path to this client's .key_secret file, or a (public, secret) z85 pair
ServerKey = Union[str, bytes, "os.PathLike[str]"]
ClientKey = Union[str, "os.PathLike[str]", tuple[Union[str, bytes], Union[str, bytes]], list[Union[str, bytes]]]

def _z85_key(value: object) -> Optional[bytes]:
    """`value` as a z85 CURVE key (40 characters, 32 bytes), or None."""
    key = value.encode("ascii", "replace") if isinstance(value, str) else value
    if not isinstance(key, bytes) or len(key) != 40:
        return None
    try:
        return key if len(z85.decode(key)) == 32 else None
    except (ValueError, KeyError, TypeError):
        return None


def _certificate(path: Union[str, os.PathLike[str]], what: str) -> tuple[bytes, Optional[bytes]]:
    import zmq.auth

    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{what}: cannot read a CURVE key from {os.fspath(path)!r}: {exc}") from None
    if _z85_key(public) is None:
        raise ValueError(f"{what}: {os.fspath(path)!r} holds no valid public key")
    return public, secret


def curve_keys(server_key: Optional[ServerKey],
               client_key: Optional[ClientKey]) -> Optional[tuple[bytes, bytes, bytes]]:
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
        server = _certificate(os.fsdecode(server_key), "server_key")[0]
    if isinstance(client_key, (tuple, list)):
        if len(client_key) != 2:
            raise ValueError("client_key: expected a (public, secret) pair of Z85 keys")
        public, secret = (_z85_key(k) for k in client_key)
        if public is None or secret is None:
            raise ValueError("client_key: expected a (public, secret) pair of 40-character Z85 keys")
    else:
        public, secret = _certificate(client_key, "client_key")
        if secret is None or _z85_key(secret) is None:
            raise ValueError(f"client_key: {os.fspath(client_key)!r} holds no secret key (give the "
                             f"NAME.key_secret file, not NAME.key)")
    if zmq.curve_public(secret) != public:
        raise ValueError("client_key: the public key is not the one of the secret key")
    return server, public, secret


# --- answers ---------------------------------------------------------------------------

def error_of(header: Header) -> InferenceError:
    err = header.get("error")
    if not isinstance(err, dict):
        err = {}
    return InferenceError(str(err.get("code", errors.UNKNOWN)), str(err.get("message", "unknown error")))


def send_goodbye_and_close(sock: zmq.Socket[bytes], state: ClientState, watch: ConnectionWatch) -> None:
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
    watch.close(sock)              # first: see watch.stop_monitor
    sock.close(linger=linger)


class ClientBase:
    """The state (session, arena, stats), the DEALER socket, and helpers.

    The socket and the state are owned through a `weakref.finalize`: a client
    that is garbage (or still open at exit) says goodbye and closes its socket,
    and so does one whose constructor failed half-way."""

    _state: ClientState

    def _open(self, url: str, timeout: float, local: Optional[bool], arena_cap: int,
              ctx: Union[zmq.Context[zmq.Socket[bytes]], zmq.asyncio.Context], server_key: Optional[ServerKey] = None,
              client_key: Optional[ClientKey] = None) -> None:
        """The DEALER socket, connected, and its monitor (watch.py: why a call
        got no answer). Over tcp:// with `server_key` and `client_key` it is
        a CURVE client (encrypted, and authenticated by the server's
        allow-list); ipc:// is always plain (the daemon does not use CURVE
        there: the socket file's permissions guard it)."""
        if not isinstance(url, str) or "://" not in url:
            raise ValueError(f"url: expected a ZeroMQ address such as ipc:///run/torchpool.sock or "
                             f"tcp://host:port, got {url!r}")
        self.url = url
        self.timeout = timeout
        keys = curve_keys(server_key, client_key)     # a bad key fails here, before any socket
        self._state = ClientState(url, local, arena_cap)
        self._ids = self._state.ids
        # (an asyncio context's socket for AsyncClient, which awaits its calls: aio.py)
        self._sock = cast("zmq.Socket[bytes]", ctx.socket(zmq.DEALER))
        try:
            self._sock.setsockopt(zmq.LINGER, 0)
            # retry a missing daemon at 0.1, 0.2, 0.4, 0.8 s, then every second:
            # each attempt is a monitor event that waits here until a call reads it
            self._sock.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_MAX_MS)
            if url.startswith("tcp://"):
                self._sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
                self._sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
                self._sock.setsockopt(zmq.CONNECT_TIMEOUT, CONNECT_TIMEOUT_MS)
            if url.startswith("tcp://") and keys is not None:
                self._sock.curve_serverkey, self._sock.curve_publickey, self._sock.curve_secretkey = keys
            self._watch = ConnectionWatch(ctx, self._sock, url, keys is not None)   # before connect
        except BaseException:
            self._sock.close(linger=0)
            raise
        self._closer = weakref.finalize(self, send_goodbye_and_close, self._sock, self._state, self._watch)
        self._sock.connect(url)

    def _no_answer(self, timeout: float) -> InferenceError:
        """The error of a call that got no answer (for the thread or loop
        that owns the socket: it reads the monitor)."""
        self._watch.drain()
        return self._watch.no_answer(timeout)

    @staticmethod
    def _version_field(version: Version) -> str:
        return "" if version is None else str(version)

    def transfer_stats(self) -> dict[str, int]:
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

    def _control_flow(self, op: str, timeout: Optional[float], fields: dict[str, object]) -> Callable[[], Flow[object]]:
        return lambda: self._state.control_flow(op, timeout, fields)

    def _check_open(self) -> None:
        if self._sock.closed:
            raise InferenceError(errors.CANCELLED, "client closed")


__all__ = ["Call", "ClientBase", "ClientKey", "DEFAULT_TIMEOUT", "GOODBYE_WAIT", "ServerKey", "curve_keys",
           "decode_infer", "encode_control", "encode_infer", "error_of", "send_goodbye_and_close",
           "timeout_error"]
