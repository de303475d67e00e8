"""Direct paths: a local session's small, plain requests, sent to the model's worker.

A sync `Client` with a request lane (lane.py) asks the daemon once per model
for a direct path (broker/direct.py): a socket to one of the model's
instances, handed over on the side channel. Requests the daemon's scheduler
would only pass on, run alone and answer (inputs inline, outputs by name, no
priority or sequence; a per-call timeout goes along) then go there, and their answers come back
there, in the lane's form: two process hops where the daemon makes four.
Everything else keeps the lane. Once a model's path is open, `Client.infer`
sends such a request the short way (DirectRequests, below): encoded by the
flow's own code, without the flow's generator machinery.

A model that takes no direct requests (batched, sequenced, ...) is asked
again after RETRY_S. A path whose instance stopped (it crashed or was
unloaded, or the session ended) fails the calls it had taken with
UNAVAILABLE; a call it had not taken goes over the lane, and the next one
asks again.
"""
from __future__ import annotations

import collections
import socket
import time
from typing import TYPE_CHECKING, Callable, NamedTuple, Optional, Protocol, Sequence, Union, cast

import numpy as np

from ..protocol import errors, lane, messages, tensors
from ..protocol.errors import InferenceError
from ..protocol.messages import Header
from ..shm.fdpass import DONTWAIT, FdReceiver, close_all
from ..rules.direct import plain_refusal
from ..rules.request import InferCall, infer_header
from .lane import LaneSocket
from .types import DirectPath, Flow, Frames, Inputs, Lane, NoAnswer, RawTensor, Reply, RequestedOutput

if TYPE_CHECKING:
    from typing_extensions import Buffer

    from .arena import ClientArena
    from .inputs import InputEncoder
    from .local import LocalLink
    from .outputs import Release, EncodedInputs
    from .types import InferResult, Version

RETRY_S = 30.0          # a model that refused is asked again after this long
ASK_S = 60.0            # while one thread asks for a path, the others take the lane


def path_closed(model: str, url: str, sent: bool) -> NoAnswer:
    """The error of a call on a direct path that closed (sync or asyncio)."""
    return NoAnswer(errors.UNAVAILABLE, f"the instance of model '{model}' that torchpool at {url} serves "
                                        f"this client directly closed its path (it stopped, crashed or "
                                        f"was unloaded, or the session ended)", sent=sent)


class DirectLink:
    """What a LaneSocket reads through: the socket, and no segments (a
    worker hands none over)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._receiver = FdReceiver(lane.MAX_DATAGRAM)

    def recv(self) -> tuple[memoryview, list[int]]:
        return self._receiver.recv(self.sock, DONTWAIT)

    def keep(self, data: memoryview, fds: list[int]) -> None:
        close_all(fds)


class DirectSocket(LaneSocket):
    zmq_fallback = False        # a call it did not take goes over the lane (flows.py)

    def __init__(self, sock: socket.socket, model: str, url: str, on_late: Callable[[object], None]) -> None:
        sock.setblocking(False)
        self.model = model
        self.name = ""                  # the daemon's name of the path (for ended_flow)
        self.version: object = None     # the model version it serves (as the daemon said)
        super().__init__(DirectLink(sock), url, on_late)

    def lost_error(self) -> InferenceError:
        return InferenceError(errors.UNAVAILABLE, self._lost_error(True).message)

    def _lost_error(self, sent: bool) -> NoAnswer:
        return path_closed(self.model, self._url, sent)

    def shut(self) -> None:
        self.close(0)            # calls still on it fail with CANCELLED
        self._link.sock.close()


def takes_direct(call: InferCall) -> bool:
    """Is this infer request one a direct path takes? The rule the worker
    checks (rules/direct.py), and its inputs' bytes in the header itself: a
    payload frame means a tensor too large for a path. (A per-call timeout
    travels with it.)"""
    if plain_refusal(call, cast(str, call.model)) is not None:        # (the client's own call)
        return False
    for e in cast("list[tensors.Entry]", call.inputs):
        if e[tensors.DATA].__class__ is not bytes:
            return False
    return True


class DirectRequest(NamedTuple):
    """A plain request encoded for its model's open direct path."""

    path: DirectPath
    rid: int
    frames: Frames
    enc: EncodedInputs
    token: Optional[str]          # the session it was sent in


class PathAsker(Protocol):
    """What `DirectPaths`' flows use of the session (flows.ClientState)."""

    link: Optional[LocalLink]
    direct_factory: Optional[Callable[[socket.socket, str], DirectPath]]
    direct_group: Optional[Callable[[list[DirectPath]], DirectPath]]

    def exchange(self, op: str, timeout: Optional[float], fields: dict[str, object],
                 lane: bool = False) -> Flow[Reply]: ...


class DirectPaths:
    """A session's direct paths, by (model, version as sent)."""

    def __init__(self) -> None:
        # (model, version) -> its DirectSocket, or when to ask again after a refusal
        self._paths: dict[tuple[str, str], Union[DirectPath, float]] = {}
        self._asking: set[tuple[str, str]] = set()      # keys whose path is being asked for
        self.wanted: set[tuple[str, str]] = set()       # keys to ask for, not asked in a flow

    def open_path(self, model: str, version: str) -> Optional[DirectPath]:
        """The path to `model` if one is open and not lost (asks nothing)."""
        path = self._paths.get((model, version))
        return None if path is None or isinstance(path, float) or path.lost else path

    def due(self, model: str, version: str) -> bool:
        """Would `path_flow` ask the daemon now? (no path open, none being
        asked for, no refusal still standing)"""
        path = self._paths.get((model, version))
        if path is None:
            return True
        if isinstance(path, float):
            return time.monotonic() >= path
        return bool(path.lost)

    def path_flow(self, state: PathAsker, model: str, version: str, timeout: Optional[float],
                  ask: bool = True) -> Flow[Optional[DirectPath]]:
        """The open path to `model`, asking the daemon for one when due
        (unless not `ask`); None when there is none. (A flow: `yield from` it.)"""
        key = (model, version)
        if not ask:
            path = self.open_path(model, version)
            if path is None and self.due(model, version):
                self.wanted.add(key)     # the caller asks beside its calls (aio.py)
            return path
        known = self._paths.get(key)
        if isinstance(known, float):
            if time.monotonic() < known:
                return None
        elif known is not None:
            if not known.lost:
                return known
            known.shut()                 # its instance stopped: ask for another
        # The daemon keeps one path per session and model version: asking
        # again replaces (closes) the one open, failing the calls on it. An
        # unversioned key may name the same version as a numbered one, so
        # while one of them has a path (or asks for one) the other shares it
        # when it is the same version, or takes the lane when that is unknown.
        for (m, v), other in self._paths.items():
            if m != model or v == version or (v and version):
                continue
            if (m, v) in self._asking:
                return None
            if not isinstance(other, float) and not other.lost:
                if version and str(other.version) == version:
                    self._paths[key] = other
                    return other
                if not version:
                    return None
        # asked once: the calls of other threads meanwhile take the lane
        self._paths[key] = time.monotonic() + ASK_S
        self._asking.add(key)
        fields: dict[str, object] = {"model": model, "version": version}
        if state.direct_group is not None:
            fields["all"] = True             # a path to each instance (broker/direct.py)
        fds: list[int] = []
        link, make = state.link, state.direct_factory
        assert link is not None and make is not None    # DirectRequests.allowed(): a lane and a factory
        try:
            header, _ = yield from state.exchange(messages.OP_DIRECT, timeout, fields, lane=True)
            result = header["result"]
            if not isinstance(result, dict):
                raise TypeError("no paths in the answer")
            names: list[str] = result.get("paths") or [result["direct"]]
            for name in names:
                fds.append(link.take(name))
        except (InferenceError, KeyError, TypeError, AttributeError):
            close_all(fds)
            # not for this model (or not now): the lane takes its requests, and says
            # what is wrong with them if anything is
            self._paths[key] = time.monotonic() + RETRY_S
            return None
        except BaseException:            # no answer, the session lost: ask again next time
            self._paths.pop(key, None)
            raise
        finally:
            self._asking.discard(key)
        spin_us = result.get("spin_us")
        members = []
        for name, fd in zip(names, fds):
            member = make(socket.socket(fileno=fd), model)
            member.name = name
            member.version = result.get("version")     # the version it serves
            member.spin(spin_us if spin_us.__class__ is int else 0)
            members.append(member)
        path = self._paths[key] = members[0] if state.direct_group is None else state.direct_group(members)
        return path

    def ended_flow(self, state: PathAsker, path: DirectPath, timeout: Optional[float]) -> Flow[InferenceError]:
        """The error of a call `path` had taken when it closed: the daemon
        knows why (the instance crashed, the model is unloading, ...). (A flow.)"""
        try:
            yield from state.exchange(messages.OP_DIRECT, timeout, {"model": path.model, "ended": path.name},
                                      lane=True)
        except InferenceError as exc:
            return exc
        return path.lost_error()

    def close(self) -> None:
        for path in self._paths.values():
            if not isinstance(path, float):
                path.shut()              # (a path two keys share: twice, harmlessly)
        self._paths.clear()
        self._asking.clear()
        self.wanted.clear()


class DirectOwner(Protocol):
    """What the short way uses of the client's state (flows.ClientState)."""

    local: bool
    arena: Optional[ClientArena]
    direct: DirectPaths
    session: Optional[str]
    direct_factory: Optional[Callable[[socket.socket, str], DirectPath]]
    link: Optional[LocalLink]
    releases: collections.deque[Release]
    encoder: InputEncoder

    def infer_call(self, model: str, version: Version, enc: EncodedInputs,
                   outputs: Optional[Sequence[RequestedOutput]],
                   timeout: Optional[float], priority: int, sequence: Optional[Header]) -> InferCall: ...

    def open_lane(self) -> Optional[Lane]: ...

    def answered(self, header: Header, payload: Sequence[Buffer], copy: bool, token: Optional[str],
                 enc: EncodedInputs, arena: Optional[ClientArena]) -> InferResult: ...


class DirectRequests:
    """A direct path's short way (Client.infer): the requests that need no
    flow. One part of `ClientState` (flows.py), whose arena, lane, paths,
    encoding and decoding it uses."""

    def __init__(self, owner: DirectOwner) -> None:
        self.owner = owner

    def request(self, model: str, inputs: Inputs, outputs: Optional[Sequence[RequestedOutput]],
                version: Version, timeout: Optional[float] = None) -> Optional[DirectRequest]:
        """The request, encoded for the open direct path of its model
        as `infer_flow` encodes it; None when it needs the flow (no path open yet, inputs that go by
        shared memory, lent outputs to give back, ...). Under `lock`."""
        owner = self.owner
        if not owner.local or not self.allowed() or not self.inline_inputs(inputs):
            return None
        arena = owner.arena
        path = owner.direct.open_path(model, "" if version is None else str(version))
        if path is None:
            return None
        token = owner.session
        encoder = owner.encoder
        enc = encoder.encode_inline(inputs, token)    # what encode() makes of these: nothing in the arena
        call = owner.infer_call(model, version, enc, outputs, timeout, 0, None)
        if not takes_direct(call):
            encoder.finish(enc, arena, answered=True)
            return None
        header = infer_header(call)
        header["session"] = token
        frames: Frames = [messages.pack(header)]
        if not lane.fits(frames):           # (many inputs) over ZeroMQ: the flow's
            encoder.finish(enc, arena, answered=True)
            return None
        return DirectRequest(path, cast(int, call.request_id), frames, enc, token)

    def inline_inputs(self, inputs: Inputs) -> bool:
        """Do these inputs go inline for sure, as a direct path takes them?
        (small arrays not built by empty(), and small RawTensors: the
        gateways' inputs; False without an arena)"""
        arena = self.owner.arena
        if arena is None:
            return False
        for value in inputs.values():
            if type(value) is np.ndarray:
                if tensors.worth_descriptor(value.nbytes) or \
                        (arena.user_blocks and arena.lookup(value) is not None):
                    return False
            elif type(value) is not RawTensor or tensors.worth_descriptor(memoryview(value.data).nbytes):
                return False
        return True

    def allowed(self) -> bool:
        """May this session's requests go on direct paths now? (a lane is open,
        the daemon offers paths, and no lent outputs wait to be given back:
        those go with a request to the daemon)"""
        owner = self.owner
        link = owner.link        # (not None when a lane is open)
        return owner.direct_factory is not None and owner.open_lane() is not None and \
            link is not None and link.direct_ok and not owner.releases

    def answered(self, header: Header, payload: Sequence[Buffer], copy: bool, token: Optional[str],
                 enc: EncodedInputs) -> InferResult:
        """The outputs of a `request`'s answer. Under `lock`."""
        return self.owner.answered(header, payload, copy, token, enc, None)
