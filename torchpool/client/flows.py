"""The client's protocol logic, free of I/O: sessions, the arena, the flows.

The sync and the asyncio client both run the same *flows*: generators that
yield `Call`s (frames to send, an id to wait for) and receive the answer
`(header, payload frames)`, or have the error answer thrown in. Only the few
lines that send and wait differ between `Client` (sync.py) and `AsyncClient`
(aio.py); `run_sync` and `run_async` drive a flow with either.

`ClientState` is one client's session (hello, lease, goodbye), its arena
(arena.py), the outputs lent to it, its registered regions, its transfer
counts, and the flows: infer, empty, arena_grow, register / unregister /
status, control calls. A session the daemon no longer knows is answered with
the code SESSION_LOST: the flow raises `SessionLost`, and the driver says
hello again and retries once.

Nothing here imports torch or zmq.
"""
from __future__ import annotations

import collections
import itertools
import math
import os
import secrets
import weakref
from typing import Any, Callable, Generator, Iterable, Mapping, Optional, Sequence

import numpy as np

from ..protocol import datatypes, errors, messages, tensors
from ..protocol.errors import InferenceError, TorchpoolError
from ..protocol.messages import (OP_ARENA_GROW, OP_GOODBYE, OP_HELLO, OP_REGISTER, OP_SHM_STATUS,
                                 OP_UNREGISTER)
from ..shm.naming import boot_id
from .arena import DEFAULT_ARENA_CAP, ArenaBlock, ClientArena, OutputMaps, block_size, local_wanted
from .types import InferResult, NoAnswer, OutputRef, RegionOutput, SharedMemoryRef
from .values import as_value, nbytes_of, output_array, prepare_input

TOKEN_BYTES = 16                       # the ownership proof of a registered region


def _shm_key(key: str) -> str:
    return "/" + key.lstrip("/")


class SessionLost(Exception):
    """The daemon no longer knows our session (lease expired, daemon restarted)."""

    def __init__(self, token: Optional[str], error: InferenceError) -> None:
        super().__init__(str(error))
        self.token = token
        self.error = error


def is_session_error(exc: InferenceError) -> bool:
    """The daemon forgot the session we named (it says so with SESSION_LOST)."""
    return exc.code == errors.SESSION_LOST


class Call:
    """One request a flow wants sent: the driver sends `frames` and answers
    with the reply to `rid` (or throws the error / NoAnswer in)."""

    __slots__ = ("rid", "frames", "timeout")

    def __init__(self, rid: int, frames: list, timeout: Optional[float]) -> None:
        self.rid, self.frames, self.timeout = rid, frames, timeout


Flow = Generator[Call, Any, Any]


class _NeedRoom(Exception):
    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes


class _Encoded:
    __slots__ = ("entries", "frames", "blocks", "lent", "stats")

    def __init__(self) -> None:
        self.entries: list[dict] = []
        self.frames: list = []
        self.blocks: list[ArenaBlock] = []      # copy blocks: freed when answered
        self.lent: list[ArenaBlock] = []        # empty() blocks in flight
        self.stats = [0, 0, 0]                  # copied, zero-copy, inline


# --- the client state and its flows ----------------------------------------------------

class ClientState:
    """A client's session, arena, lent outputs, regions and transfer counts."""

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
        self.outputs = OutputMaps()
        self.releases: collections.deque = collections.deque()   # (session, [seg, off, gen])
        self.regions: dict[str, tuple[str, int, int]] = {}      # name -> (key, byte_size, offset)
        # requests we stopped waiting for: id -> (session, arena, copy blocks, empty() blocks)
        self.quarantine: dict[Any, tuple[Optional[str], Optional[ClientArena], list, list]] = {}
        self.stats = {"bytes_copied": 0, "bytes_zero_copy": 0, "bytes_inline": 0}
        self.closed = False

    # -- plumbing
    def call(self, op: str, timeout: Optional[float], **fields: Any) -> Call:
        rid = next(self.ids)
        header = {"v": messages.PROTOCOL_VERSION, "op": op, "id": rid, **fields}
        return Call(rid, [messages.pack(header)], timeout)

    def session_fields(self) -> dict:
        """`session` and queued releases for the next request header."""
        if self.session is None:
            self.releases.clear()
            return {}
        fields: dict = {"session": self.session}
        rel = self._take_releases()
        if rel:
            fields["release"] = rel
        return fields

    def _take_releases(self) -> list:
        out, q, token = [], self.releases, self.session
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
        if self.arena is not None:
            self.arena.close()
            self.arena = None

    # -- hello / goodbye
    def hello_flow(self, timeout: Optional[float]) -> Flow:
        local = self.want_local
        for attempt in range(2):
            try:
                header, _ = yield self.call(OP_HELLO, timeout, boot_id=boot_id(), local=local)
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
            res = header.get("result") or {}
            token = res.get("session")
            if not isinstance(token, str):
                self.unsupported = True
                return False
            self.session, self.used_session, self.hello_error = token, True, None
            self.lease_s = res.get("lease_s")
            self.outputs.clear()
            if not (local and res.get("local")):
                self.local = False
                break
            arena = ClientArena(self.arena_cap)
            try:
                if res.get("block_header", tensors.BLOCK_HEADER_BYTES) != tensors.BLOCK_HEADER_BYTES:
                    raise ValueError(f"block header of {res.get('block_header')} bytes")
                for seg in res.get("arena") or []:
                    arena.map_segment(seg["segment"])
            except Exception:
                # Same boot id but not the same /dev/shm (e.g. another container):
                # give the session back and say hello as a remote client.
                arena.close()
                yield from self._quiet(self.call(OP_GOODBYE, timeout, session=token))
                self.session, local = None, False
                continue
            self.arena, self.local = arena, True
            break
        # a session that replaced a lost one gets the caller's regions back
        for name, (key, byte_size, offset) in list(self.regions.items()):
            try:
                yield from self.register_flow(name, key, byte_size, offset, timeout)
            except SessionLost:
                raise
            except InferenceError:
                self.regions.pop(name, None)
        return True

    def _quiet(self, call: Call) -> Flow:
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
    def exchange(self, op: str, timeout: Optional[float], fields: dict) -> Flow:
        """One request with `session` and releases; session errors become SessionLost."""
        extra = self.session_fields()
        token = extra.get("session")
        try:
            return (yield self.call(op, timeout, **fields, **extra))
        except InferenceError as exc:
            if token is not None and is_session_error(exc):
                raise SessionLost(token, exc) from None
            raise

    def control_flow(self, op: str, timeout: Optional[float], fields: dict) -> Flow:
        header, _ = yield from self.exchange(op, timeout, fields)
        return header.get("result")

    # -- infer
    def encode_inputs(self, inputs: Mapping[str, Any], arena: Optional[ClientArena]) -> _Encoded:
        """Entries and payload frames; inputs go to the arena when there is one.
        Raises _NeedRoom (having freed what it took) when the arena is full."""
        enc = _Encoded()
        need = 0
        try:
            for name, value in inputs.items():
                if isinstance(value, SharedMemoryRef):
                    if self.session is None:
                        raise InferenceError(errors.INVALID_ARG, f"input '{name}': a region needs a "
                                                                 f"session (register the region first)")
                    enc.entries.append(value.entry(name))
                    enc.stats[1] += value.byte_size
                    continue
                datatype, shape, src = prepare_input(name, value)
                entry = tensors.tensor_entry(name, datatype, shape)
                enc.entries.append(entry)
                nbytes = nbytes_of(src)
                if arena is not None and nbytes > 0:
                    if isinstance(src, np.ndarray):   # built in place with empty(): never copied
                        block = arena.lookup(src)
                        if block is not None and block.in_flight == 0:
                            tensors.put_shm(entry, *arena.hand_out(block, nbytes))
                            block.in_flight += 1
                            enc.lent.append(block)
                            enc.stats[1] += nbytes
                            continue
                if arena is not None and tensors.worth_descriptor(nbytes):
                    block = arena.alloc(nbytes) if need == 0 else None
                    if block is None:
                        need += block_size(nbytes)
                        continue
                    enc.blocks.append(block)
                    arena.write(block, src, nbytes)
                    # our own copy: an output that is a view of it (an identity,
                    # an in-place model) may come back pointing into it
                    tensors.put_shm(entry, *arena.hand_out(block, nbytes), reuse=True)
                    enc.stats[0] += nbytes
                    continue
                tensors.put_data(entry, src, enc.frames)
                enc.stats[2] += nbytes
        except BaseException:
            self.finish(enc, arena, answered=True)
            raise
        if need:
            self.finish(enc, arena, answered=True)
            raise _NeedRoom(need)
        return enc

    def finish(self, enc: _Encoded, arena: Optional[ClientArena], answered: bool,
               rid: Any = None, token: Optional[str] = None) -> None:
        """The request is over (answered) or lost (no answer: keep its blocks
        until a late answer arrives, or the session ends)."""
        if not answered:
            if rid is not None and (token is not None or enc.blocks or enc.lent):
                self.quarantine[rid] = (token, arena, enc.blocks, enc.lent)
        elif arena is not None:
            for block in enc.blocks:
                arena.free(block)
            for block in enc.lent:
                arena.flight_done(block)
        enc.blocks, enc.lent = [], []

    def _encode(self, inputs: Mapping[str, Any], timeout: Optional[float]) -> Flow:
        """Encode into the arena, growing it once if needed; inline otherwise."""
        arena = self.arena if self.local else None
        if arena is None:
            return self.encode_inputs(inputs, None), None
        try:
            return self.encode_inputs(inputs, arena), arena
        except _NeedRoom as room:
            need = room.nbytes
        if (yield from self._grow(arena, need, timeout)):
            try:
                return self.encode_inputs(inputs, arena), arena
            except _NeedRoom:
                pass
        return self.encode_inputs(inputs, None), None      # this request goes inline

    def _grow(self, arena: ClientArena, need: int, timeout: Optional[float]) -> Flow:
        """Add an arena segment of at least `need` bytes; False if not now.
        One grow at a time: concurrent requests (asyncio) that find no room
        while one is in flight go inline instead of each adding a segment."""
        if arena.growing or arena.grow_refused or arena.mapped_bytes + need > arena.cap:
            return False
        arena.growing = True
        try:
            header, _ = yield from self.exchange(OP_ARENA_GROW, timeout, {"size": need})
            arena.map_segment((header.get("result") or {})["segment"])
        except (NoAnswer, SessionLost):
            raise
        except (InferenceError, KeyError, TypeError, OSError, ValueError):
            arena.grow_refused = True
            return False
        finally:
            arena.growing = False
        return True

    def infer_flow(self, model: str, inputs: Mapping[str, Any], outputs: Optional[Sequence[Any]],
                   version: Any, timeout: Optional[float], copy: bool, priority: int = 0,
                   sequence: Optional[dict] = None) -> Flow:
        enc, arena = yield from self._encode(inputs, timeout)
        wanted = None
        if outputs is not None:
            wanted = [o.wire() if isinstance(o, OutputRef) else o for o in outputs]
        header = {"v": messages.PROTOCOL_VERSION, "op": messages.OP_INFER, "id": next(self.ids),
                  "model": model, "version": "" if version is None else str(version),
                  "inputs": enc.entries, "outputs": wanted,
                  "timeout_us": int(timeout * 1e6) if timeout else 0}
        if priority:
            header["priority"] = int(priority)
        if sequence:
            header["sequence"] = sequence
        if self.local:
            header["output_shm"] = True
        extra = self.session_fields()
        header.update(extra)
        token = extra.get("session")
        rid, answered = header["id"], False
        try:
            try:
                reply_header, payload = yield Call(rid, [messages.pack(header), *enc.frames], timeout)
            except NoAnswer:
                raise                  # maybe still running: finish() keeps its blocks
            except InferenceError as exc:
                answered = True
                if token is not None and is_session_error(exc):
                    raise SessionLost(token, exc) from None
                raise
            answered = True
            s = self.stats
            s["bytes_copied"] += enc.stats[0]
            s["bytes_zero_copy"] += enc.stats[1]
            s["bytes_inline"] += enc.stats[2]
            # before finish(): outputs that point into our input blocks keep them
            return self.decode_outputs(reply_header, payload, copy, token, enc, arena)
        finally:
            self.finish(enc, arena, answered, rid, token)

    # -- outputs
    def decode_outputs(self, header: dict, frames: Sequence[Any], copy: bool,
                       token: Optional[str] = None, enc: Optional[_Encoded] = None,
                       arena: Optional[ClientArena] = None) -> InferResult:
        """The outputs of an answer to a request sent in session `token`
        (with the input blocks `enc` holds in `arena`)."""
        token = self.session if token is None else token
        result = InferResult()
        entries = header.get("outputs") or []
        error: Optional[BaseException] = None
        kept: dict[ArenaBlock, np.ndarray] = {}
        for e in entries:
            try:
                where = tensors.location(e)
                if where == tensors.SHM:
                    value = self._lent_output(e, copy, token)
                elif where == tensors.OWN:
                    value = _reused_output(e, copy, enc, arena, kept)
                elif where == tensors.REGION:
                    region, nbytes, offset = tensors.region_ref(e)
                    value = RegionOutput(e[tensors.NAME], region, offset, nbytes,
                                         e[tensors.DATATYPE], tuple(e[tensors.SHAPE]))
                else:
                    value = output_array(e, frames)
                    if copy and isinstance(value, np.ndarray):
                        value = np.array(value)
                result[e[tensors.NAME]] = value
            except BaseException as exc:   # keep going: every lent block must be released
                error = error or exc
        if error is not None:
            raise error
        return result

    def _lent_output(self, e: dict, copy: bool, token: Optional[str]) -> Any:
        """An output lent in the worker's memory: a read-only view of it,
        released to the daemon once the view is garbage (at once with
        `copy`, or for BYTES and BF16, which are converted)."""
        segment, offset, nbytes, generation = tensors.shm_ref(e)
        rel = (token, [segment, offset, generation])
        datatype, shape = e[tensors.DATATYPE], e[tensors.SHAPE]
        keep = False
        try:
            mm = self.outputs.get(segment, offset + nbytes)
            data = memoryview(mm)[offset:offset + nbytes]
            if datatype == "BYTES" or datatype == "BF16":
                return as_value(datatype, shape, data)
            base = np.frombuffer(data, dtype=datatypes.numpy_dtype(datatype))
            if copy:
                return base.reshape(shape).copy()
            arr = base.reshape(shape)
            fin = weakref.finalize(base, self.releases.append, rel)
            fin.atexit = False
            keep = True
            return arr
        finally:
            if not keep:
                self.releases.append(rel)

    def late_reply(self, header: Any) -> None:
        """The answer of a request we stopped waiting for: free its blocks and
        hand back any outputs it was lent."""
        if not isinstance(header, dict):
            return
        held = self.quarantine.pop(header.get("id"), None)
        if held is None:
            return            # not ours, or of a session that is gone
        token, arena, blocks, lent = held
        if arena is not None and arena is self.arena:
            for block in blocks:
                arena.free(block)
            for block in lent:
                arena.flight_done(block)
        for e in header.get("outputs") or []:
            if isinstance(e, dict) and tensors.location(e) == tensors.SHM:
                try:
                    seg, off, _n, gen = tensors.shm_ref(e)
                except TorchpoolError:
                    continue
                self.releases.append((token, [seg, off, gen]))

    # -- empty()
    def empty_flow(self, shape: Sequence[int], datatype: str, timeout: Optional[float]) -> Flow:
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

    # -- registered regions
    def register_flow(self, name: str, key: str, byte_size: int, offset: int,
                      timeout: Optional[float]) -> Flow:
        """Register a region after proving we can write it (a token at `offset`)."""
        import posix_ipc

        if not isinstance(key, str) or not key.strip("/"):
            raise InferenceError(errors.INVALID_ARG, f"region '{name}': key must be a shared-memory name")
        if not isinstance(offset, int) or not isinstance(byte_size, int) or offset < 0 or byte_size < 0:
            raise InferenceError(errors.INVALID_ARG, f"region '{name}': offset and byte_size must be "
                                                     f"non-negative integers")
        try:
            shm = posix_ipc.SharedMemory(_shm_key(key))
        except (posix_ipc.Error, ValueError, OSError) as exc:
            raise InferenceError(errors.INVALID_ARG, f"region '{name}': this client cannot open "
                                                     f"its shared-memory segment ({exc})") from None
        fd = shm.fd
        try:
            size = os.fstat(fd).st_size
            if offset + max(byte_size, TOKEN_BYTES) > size:
                raise InferenceError(errors.INVALID_ARG,
                                     f"region '{name}': offset {offset} + byte size {byte_size} does "
                                     f"not fit the segment's {size} bytes")
            saved = os.pread(fd, TOKEN_BYTES, offset)
            token = secrets.token_bytes(TOKEN_BYTES)
            os.pwrite(fd, token, offset)
            try:
                yield from self.exchange(OP_REGISTER, timeout,
                                         {"name": name, "key": key, "byte_size": byte_size,
                                          "offset": offset, "token": token})
            finally:
                os.pwrite(fd, saved, offset)
        finally:
            os.close(fd)
        self.regions[name] = (key, byte_size, offset)
        return True

    def unregister_flow(self, name: Optional[str], timeout: Optional[float]) -> Flow:
        result = yield from self.control_flow(OP_UNREGISTER, timeout, {"name": name})
        if name is None:
            self.regions.clear()
        else:
            self.regions.pop(name, None)
        return result

    def status_flow(self, name: Optional[str], timeout: Optional[float]) -> Flow:
        return (yield from self.control_flow(OP_SHM_STATUS, timeout, {"name": name}))

    def transfer_stats(self) -> dict:
        return dict(self.stats)


def _reused_output(e: dict, copy: bool, enc: Optional[_Encoded], arena: Optional[ClientArena],
                   kept: dict[ArenaBlock, np.ndarray]) -> Any:
    """An output that is a view of one of this request's input blocks (the
    model returned its input, or a part of it): a read-only array on that
    block, which stays ours until the array goes. `kept` maps the blocks
    this answer already took to their whole-block arrays."""
    segment, offset, nbytes = tensors.own_ref(e)
    name = e.get(tensors.NAME)
    for block in [*kept, *(enc.blocks if enc is not None else ())]:
        if block.segment == segment and block.data_offset <= offset \
                and offset + nbytes <= block.data_offset + block.capacity:
            break
    else:
        raise InferenceError(errors.INTERNAL, f"output '{name}' points into an input block this "
                                              f"request did not send")
    base = kept.get(block)
    if base is None:
        base = kept[block] = arena.keep(block)
        enc.blocks.remove(block)          # no longer freed with the request
    start = offset - block.data_offset
    data = base[start:start + nbytes]
    datatype, shape = e[tensors.DATATYPE], e[tensors.SHAPE]
    if datatype == "BYTES" or datatype == "BF16":
        return as_value(datatype, shape, data.tobytes())
    arr = data.view(datatypes.numpy_dtype(datatype)).reshape(shape)
    return arr.copy() if copy else arr


def sequence_field(sequence_id: Any, start: bool, end: bool) -> Optional[dict]:
    """The `sequence` header field of a request (None when it names no sequence)."""
    if not sequence_id and not start and not end:
        return None
    return {"id": sequence_id, "start": bool(start), "end": bool(end)}


def needs_session(inputs: Mapping[str, Any], outputs: Optional[Iterable[Any]]) -> bool:
    """Does this request name registered regions (so it cannot run without a session)?"""
    if any(isinstance(v, SharedMemoryRef) for v in inputs.values()):
        return True
    return outputs is not None and any(isinstance(o, OutputRef) for o in outputs)


def run_sync(flow: Flow, send: Callable[[Call], Any]) -> Any:
    """Drive a flow with a blocking `send(call) -> (header, frames)`."""
    try:
        call = next(flow)
        while True:
            try:
                reply = send(call)
            except BaseException as exc:
                call = flow.throw(exc)
            else:
                call = flow.send(reply)
    except StopIteration as stop:
        return stop.value


async def run_async(flow: Flow, send: Callable[[Call], Any]) -> Any:
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
        return stop.value
