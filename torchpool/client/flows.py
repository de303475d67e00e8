"""The client's protocol logic, free of I/O: sessions, the arena, the flows.

The sync and the asyncio client both run the same *flows*: generators that
yield `Call`s (frames to send, an id to wait for) and receive the answer
`(header, payload frames)`, or have the error answer thrown in. Only the few
lines that send and wait differ between `Client` (sync.py) and `AsyncClient`
(aio.py); `run_sync` and `run_async` drive a flow with either.

`ClientState` is one client's session (hello, lease, goodbye), its arena
(arena.py; inputs are encoded into it by inputs.py), the outputs lent to
it, its registered regions, its transfer counts, and the flows: infer, empty, arena_grow, register / unregister /
status, control calls. A session the daemon no longer knows is answered with
the code SESSION_LOST: the flow raises `SessionLost`, and the driver says
hello again and retries once.

Nothing here imports torch or zmq.
"""
from __future__ import annotations

import collections
import contextlib
import itertools
import math
import socket
import threading
import time
from typing import TYPE_CHECKING, Awaitable, Callable, Optional, Sequence, Union, cast

import numpy as np

from ..protocol import datatypes, errors, messages, tensors
from ..protocol import lane as lane_protocol
from ..protocol.errors import InferenceError
from ..protocol.messages import OP_ARENA_GROW, OP_GOODBYE, OP_HELLO, Header
from .arena import DEFAULT_ARENA_CAP, ClientArena, OutputMaps, block_size, local_wanted
from .inputs import InputEncoder, NeedRoom
from ..rules.request import InferCall, infer_header
from .direct import DirectPaths, DirectRequests, takes_direct
from .local import LocalLink
from .outputs import OutputDecoder, Release, Quarantined, EncodedInputs
from .regions import RegionFlows
from .types import (
    Call, Classification, DirectPath, Flow, Frames, InferResult, Inputs, Lane, NoAnswer, OutputRef, Reply,
    RequestedOutput, SequenceId, SessionLost, T, Version,
)

if TYPE_CHECKING:
    from typing_extensions import Buffer


def result_of(header: Header) -> Header:
    """An answer's "result" object ({} when it has none)."""
    result = header.get("result")
    return result if isinstance(result, dict) else {}

def is_session_error(exc: InferenceError) -> bool:
    """The daemon forgot the session we named (it says so with SESSION_LOST)."""
    return exc.code == errors.SESSION_LOST


# --- the client state and its flows ----------------------------------------------------

class ClientState:
    """A client's session, arena, lent outputs and transfer counts, and its
    parts: the input encoder (inputs.py), the output decoder (outputs.py),
    the registered regions (regions.py) and the direct paths' short way
    (direct.py)."""

    def __init__(self, url: str, local: Optional[bool] = None,
                 arena_cap: int = DEFAULT_ARENA_CAP) -> None:
        self.url = url
        self.ids = itertools.count(1)
        self.want_local = local_wanted(local)
        self.arena_cap = arena_cap
        self.session: Optional[str] = None
        self.local = False                      # the daemon agreed: arena + outputs in place
        self.lease_s: Optional[float] = None
        self.unsupported = False                # the daemon does not speak sessions
        self.hello_error: Optional[InferenceError] = None
        self.used_session = False               # a session existed once: re-hello when lost
        self.arena: Optional[ClientArena] = None
        self.link: Optional[LocalLink] = None    # the side channel of a local session
        # makes a local session's request lane (client/lane.py); None: no lane
        self.lane_factory: Optional[Callable[[LocalLink], Lane]] = None
        # makes a direct path's socket (client/direct.py); None: none are asked for
        self.direct_factory: Optional[Callable[[socket.socket, str], DirectPath]] = None
        # a caller with many calls in flight asks for a path to each of a
        # model's instances and holds them as one (aio_lane.AsyncPaths); it
        # asks beside its calls, not in one's flow: the calls sent meanwhile
        # would overtake that one (aio.py)
        self.direct_group: Optional[Callable[[list[DirectPath]], DirectPath]] = None
        self.direct = DirectPaths()
        self.local_socket: Optional[str] = None  # where it is (regions attach without an arena)
        self.outputs = OutputMaps()
        self.releases: collections.deque[Release] = collections.deque()   # (session, [seg, off, gen])
        # requests we stopped waiting for: id -> (session, arena, copy blocks, empty() blocks)
        self.quarantine: dict[object, Quarantined] = {}
        self.encoder = InputEncoder(self.quarantine)
        self.decoder = OutputDecoder(self.outputs, self.releases, self.quarantine)
        self.regions = RegionFlows(self)
        self.shortcut = DirectRequests(self)
        self.stats = {"bytes_copied": 0, "bytes_zero_copy": 0, "bytes_inline": 0}
        self.closed = False
        # A sync client may be shared by threads: the steps of its flows (and
        # whatever else touches this state) run under `lock`, never a wait for
        # an answer; `hello_lock` lets one thread say hello for all of them.
        # (Finalizers of lent outputs and empty() arrays only append to deques.)
        self.lock = threading.Lock()
        self.hello_lock = threading.Lock()

    # -- plumbing
    def call(self, op: str, timeout: Optional[float], **fields: object) -> Call:
        rid = next(self.ids)
        header = {"v": messages.PROTOCOL_VERSION, "op": op, "id": rid, **fields}
        return Call(rid, [messages.pack(header)], timeout)

    def session_fields(self) -> Header:
        """`session` and queued releases for the next request header."""
        fields: Header = {}
        self.add_session(fields)
        return fields

    def add_session(self, header: Header) -> Optional[str]:
        """Put `session` and queued releases into `header`; the session token."""
        token = self.session
        if token is None:
            if self.releases:
                self.releases.clear()
            return None
        header["session"] = token
        if self.releases:
            rel = self._take_releases()
            if rel:
                header["release"] = rel
        return token

    def _take_releases(self) -> list[list[Union[str, int]]]:
        out: list[list[Union[str, int]]] = []
        q, token = self.releases, self.session
        while q:
            owner, item = q.popleft()
            if owner == token:
                out.append(item)
        return out

    def needs_hello(self, required: bool = False) -> bool:
        if self.session is not None or self.unsupported or self.closed:
            return False
        return required or self.want_local or self.used_session

    def require_session(self) -> None:
        if self.session is None:
            if self.unsupported:
                raise InferenceError(errors.UNSUPPORTED, f"torchpool at {self.url} does not support "
                                                         f"shared-memory sessions (hello refused)")
            raise self.hello_error or InferenceError(errors.UNAVAILABLE,
                                                     f"no session with torchpool at {self.url}")

    def session_lost(self, token: Optional[str]) -> None:
        """Forget a session the daemon no longer knows (if it is still ours)."""
        if token is not None and token == self.session:
            self._drop_session()

    def _drop_session(self) -> None:
        self.session = None
        self.local = False
        self.releases.clear()
        self.quarantine.clear()
        self.outputs.clear()
        self.direct.close()
        if self.arena is not None:
            self.arena.close()
            self.arena = None
        if self.link is not None:
            if self.link.lane is not None:
                self.link.lane.close(0)  # calls still on it fail with CANCELLED
            self.link.close()           # the daemon ends the session when it sees this
            self.link = None

    # -- hello / goodbye
    def hello_flow(self, timeout: Optional[float]) -> Flow[bool]:
        local = self.want_local
        for _attempt in range(2):
            try:
                header, _ = yield self.call(OP_HELLO, timeout, local=local)
            except NoAnswer:
                raise
            except InferenceError as exc:
                if exc.code == errors.CANCELLED:      # the client was closed meanwhile
                    raise
                # an older daemon (UNSUPPORTED) or one that refuses: inline, silently
                self.hello_error = exc
                if exc.code in (errors.UNSUPPORTED, errors.INVALID_ARG, errors.NOT_FOUND):
                    self.unsupported = True
                return False
            res = result_of(header)
            token = res.get("session")
            if not isinstance(token, str):
                self.unsupported = True
                return False
            self.session, self.used_session, self.hello_error = token, True, None
            lease = res.get("lease_s")
            self.lease_s = float(lease) if isinstance(lease, (int, float)) else None
            self.outputs.clear()
            path = res.get("local_socket")
            self.local_socket = path if isinstance(path, str) else None
            if not (local and isinstance(path, str)):
                self.local = False
                break
            arena, link = ClientArena(self.arena_cap), None
            lane_factory = self.lane_factory
            try:
                if res.get("block_header", tensors.BLOCK_HEADER_BYTES) != tensors.BLOCK_HEADER_BYTES:
                    raise ValueError(f"block header of {res.get('block_header')} bytes")
                # the side channel: only a client on the daemon's host reaches it
                link = LocalLink.attach(path, token, timeout, lane=lane_factory is not None)
                if link.lane_ok and lane_factory is not None:     # (lane_ok only when asked for)
                    link.lane = lane_factory(link)
                while link.arena:
                    name, fd = link.arena.pop(0)
                    arena.map_segment(name, fd)     # takes the fd
            except Exception:
                # Not on the daemon's host (or in another container), or refused:
                # give the session back and say hello as a remote client.
                arena.close()
                if link is not None:
                    link.close()
                yield from self._quiet(self.call(OP_GOODBYE, timeout, session=token))
                self.session, local = None, False
                continue
            self.arena, self.link, self.local = arena, link, True
            self.outputs.link = link
            break
        # a session that replaced a lost one gets the caller's regions back
        yield from self.regions.restore_flow(timeout)
        return True

    def _quiet(self, call: Call) -> Flow[None]:
        try:
            yield call
        except InferenceError:
            pass

    def goodbye_call(self, timeout: Optional[float]) -> Optional[Call]:
        """The goodbye (with queued releases) that closes our session, if any."""
        if self.session is None:
            return None
        fields = self.session_fields()
        return self.call(OP_GOODBYE, timeout, **fields)

    def close(self) -> None:
        self.closed = True
        self._drop_session()

    # -- generic requests on the session
    def exchange(self, op: str, timeout: Optional[float], fields: dict[str, object], lane: bool = False) -> Flow[Reply]:
        """One request with `session` and releases (over the session's lane
        when `lane` and it has one); session errors become SessionLost."""
        extra = self.session_fields()
        session = extra.get("session")
        token = session if isinstance(session, str) else None
        call = self.call(op, timeout, **fields, **extra)
        if lane:
            call.channel = self.open_lane()
        try:
            return (yield call)
        except InferenceError as exc:
            if token is not None and is_session_error(exc):
                raise SessionLost(token, exc) from None
            raise

    def control_flow(self, op: str, timeout: Optional[float], fields: dict[str, object]) -> Flow[object]:
        header, _ = yield from self.exchange(op, timeout, fields)
        return header.get("result")

    # -- infer
    def _encode_after_growing(self, inputs: Inputs, arena: ClientArena, need: int,
                              timeout: Optional[float]) -> Flow[tuple[EncodedInputs, Optional[ClientArena]]]:
        """The inputs did not fit the arena (`need` bytes more): grow it once
        and encode into it; inline if it cannot grow or they still do not fit."""
        if (yield from self._grow(arena, need, timeout)):
            try:
                return self.encoder.encode(inputs, arena, self.session), arena
            except NeedRoom:
                pass
        return self.encoder.encode_inline(inputs, self.session), None      # this request goes inline

    def _grow(self, arena: ClientArena, need: int, timeout: Optional[float]) -> Flow[bool]:
        """Add an arena segment of at least `need` bytes; False if not now.
        One grow at a time: concurrent requests (asyncio) that find no room
        while one is in flight go inline instead of each adding a segment."""
        if arena.growing or arena.grow_refused or arena.mapped_bytes + need > arena.cap:
            return False
        arena.growing = True
        try:
            # on the lane when there is one: its answer names a segment handed over there
            header, _ = yield from self.exchange(OP_ARENA_GROW, timeout, {"size": need}, lane=True)
            name = cast(str, result_of(header)["segment"])
            link = self.link
            assert link is not None         # an arena comes with its session's side channel
            arena.map_segment(name, link.take(name))
        except (NoAnswer, SessionLost):
            raise
        except (InferenceError, KeyError, TypeError, OSError, ValueError):
            arena.grow_refused = True
            return False
        finally:
            arena.growing = False
        return True

    def infer_flow(self, model: str, inputs: Inputs, outputs: Optional[Sequence[RequestedOutput]],
                   version: Version, timeout: Optional[float], copy: bool, priority: int = 0,
                   sequence: Optional[Header] = None) -> Flow[InferResult]:
        arena = self.arena if self.local else None
        if arena is None:
            enc = self.encoder.encode_inline(inputs, self.session)
        else:
            try:
                enc = self.encoder.encode(inputs, arena, self.session)
            except NeedRoom as room:
                enc, arena = yield from self._encode_after_growing(inputs, arena, room.nbytes, timeout)
        call = self.infer_call(model, version, enc, outputs, timeout, priority, sequence)
        header = infer_header(call)
        direct = None
        if self.shortcut.allowed() and takes_direct(call):
            direct = yield from self.direct.path_flow(self, model, "" if version is None else str(version), timeout,
                                                      ask=self.direct_group is None)
        if direct is not None:
            token = header["session"] = self.session    # releases wait for a request to the daemon
        else:
            token = self.add_session(header)
        frames = [messages.pack(header), *enc.frames]
        lane = self.open_lane() if self.local else None
        if lane is not None and not lane_protocol.fits(frames):
            # over ZeroMQ, and nothing lent: the segments lent outputs need are
            # handed over on the lane, which only its reader reads
            lane = direct = None
            del header["output_shm"]
            frames[0] = messages.pack(header)
        rid, answered = cast(int, call.request_id), False     # (infer_call's id)
        try:
            try:
                reply_header, payload = yield from self._send_infer(rid, frames, timeout, direct, lane)
            except NoAnswer:
                raise                  # maybe still running: finish() keeps its blocks
            except InferenceError as exc:
                answered = True
                if token is not None and is_session_error(exc):
                    raise SessionLost(token, exc) from None
                raise
            answered = True
            return self.answered(reply_header, payload, copy, token, enc, arena)
        finally:
            self.encoder.finish(enc, arena, answered, rid, token)

    def infer_call(self, model: str, version: Version, enc: EncodedInputs,
                    outputs: Optional[Sequence[RequestedOutput]],
                    timeout: Optional[float], priority: int, sequence: Optional[Header]) -> InferCall:
        wanted = None
        if outputs is not None:
            wanted = [o.wire() if isinstance(o, (OutputRef, Classification)) else o for o in outputs]
        # sent_ns: when it left, on the host's monotonic clock: a worker that
        # takes it on a direct path counts its deadline from here (the daemon
        # counts from when it received it and ignores this)
        return InferCall(next(self.ids), model, "" if version is None else str(version), enc.entries, wanted,
                         int(timeout * 1e6) if timeout else 0, time.monotonic_ns() if timeout else None,
                         int(priority) if priority else 0, sequence or None, self.local)

    def answered(self, header: Header, payload: Sequence[Buffer], copy: bool, token: Optional[str], enc: EncodedInputs,
                 arena: Optional[ClientArena]) -> InferResult:
        s = self.stats
        s["bytes_copied"] += enc.stats[0]
        s["bytes_zero_copy"] += enc.stats[1]
        s["bytes_inline"] += enc.stats[2]
        # before finish(): outputs that point into our input blocks keep them
        return self.decoder.decode(header, payload, copy, token, enc, arena)

    def late_reply(self, header: object) -> None:
        """The answer of a request we stopped waiting for (outputs.py)."""
        self.decoder.late_reply(header, self.arena)

    def _send_infer(self, rid: int, frames: Frames, timeout: Optional[float], direct: Optional[DirectPath],
                    lane: Optional[Lane]) -> Flow[Reply]:
        if direct is not None:
            try:
                return (yield Call(rid, frames, timeout, direct, request=True))
            except NoAnswer as exc:
                path = exc.path or direct       # (one of several standing as one)
                if exc.sent and not path.lost:
                    raise
                if exc.sent:      # the path closed with it: the daemon says why
                    raise (yield from self.direct.ended_flow(self, path, timeout)) from None
                # the path closed before it took the request: the lane takes it
        return (yield Call(rid, frames, timeout, lane, request=True))

    def open_lane(self) -> Optional[Lane]:
        """The session's request lane, while it is open; else None."""
        lane = self.link.lane if self.link is not None else None
        return lane if lane is not None and not lane.lost else None

    # -- empty()
    def empty_flow(self, shape: Sequence[int], datatype: str, timeout: Optional[float]) -> Flow[np.ndarray]:
        if datatype == "BYTES" or datatype not in datatypes.WIRE_DATATYPES:
            raise InferenceError(errors.INVALID_ARG, f"empty(): datatype must be a fixed-size "
                                                     f"datatype, got {datatype!r}")
        dtype = datatypes.numpy_dtype(datatype)
        shape = tuple(int(d) for d in shape)
        if any(d < 0 for d in shape):
            raise InferenceError(errors.INVALID_ARG, f"empty(): negative dimension in {list(shape)}")
        arena = self.arena if self.local else None
        if arena is None:
            return np.empty(shape, dtype)
        arr = arena.empty(shape, dtype)
        if arr is None:
            need = block_size(math.prod(shape) * dtype.itemsize)
            if (yield from self._grow(arena, need, timeout)):
                arr = arena.empty(shape, dtype)
        return np.empty(shape, dtype) if arr is None else arr

    def transfer_stats(self) -> dict[str, int]:
        return dict(self.stats)


def sequence_field(sequence_id: SequenceId, start: bool, end: bool) -> Optional[Header]:
    """The `sequence` header field of a request (None when it names no sequence)."""
    if not sequence_id and not start and not end:
        return None
    return {"id": sequence_id, "start": bool(start), "end": bool(end)}


_NO_LOCK = contextlib.nullcontext()


def run_sync(flow: Flow[T], send: Callable[[Call], Reply], lock: Optional[threading.Lock] = None) -> T:
    """Drive a flow with a blocking `send(call) -> (header, frames)`. With
    `lock` (the state's, for a client shared by threads) each step of the
    flow runs under it, and the waits for answers do not."""
    guard = _NO_LOCK if lock is None else lock
    try:
        with guard:
            call = next(flow)
        while True:
            try:
                reply = send(call)
            except BaseException as exc:
                with guard:
                    call = flow.throw(exc)
            else:
                with guard:
                    call = flow.send(reply)
    except StopIteration as stop:
        return cast(T, stop.value)      # a Flow[T] returns a T (StopIteration's value is untyped)


async def run_async(flow: Flow[T], send: Callable[[Call], Awaitable[Reply]]) -> T:
    """Drive a flow with an awaitable `send(call) -> (header, frames)`."""
    try:
        call = next(flow)
        while True:
            try:
                reply = await send(call)
            except BaseException as exc:
                call = flow.throw(exc)
            else:
                call = flow.send(reply)
    except StopIteration as stop:
        return cast(T, stop.value)      # (as run_sync)
