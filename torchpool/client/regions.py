"""Triton-style registered regions: one part of `ClientState` (flows.py).

Registering proves access with a challenge: the daemon opens the segment and
answers a fresh nonce; the client writes it at the region's offset and asks
again; the daemon reads it back. The bytes the nonce covered are restored
afterwards. Regions need a local session (the daemon must know who we are).
"""
from __future__ import annotations

import base64
import binascii
import os
from typing import Iterable, Optional, Protocol

from ..protocol import errors
from ..protocol.errors import InferenceError, TorchpoolError
from ..protocol.messages import (CUDA_IPC_HANDLE_BYTES, OP_CUDA_REGISTER, OP_CUDA_STATUS, OP_CUDA_UNREGISTER,
                                 OP_REGISTER, OP_SHM_STATUS, OP_UNREGISTER, REGION_TOKEN_BYTES,
                                 REGION_TOKEN_MIN_BYTES)
from ..protocol.names import check_shm_key
from .local import LocalLink
from .types import Flow, Inputs, OutputRef, Reply, RequestedOutput, SessionLost, SharedMemoryRef


def _shm_key(key: str) -> str:
    return "/" + key.lstrip("/")


def needs_session(inputs: Inputs, outputs: Optional[Iterable[RequestedOutput]]) -> bool:
    """Does this request name registered regions (so it cannot run without a session)?"""
    for value in inputs.values():          # a loop, not any(): no generator per call
        if isinstance(value, SharedMemoryRef):
            return True
    if outputs is not None:
        for o in outputs:
            if isinstance(o, OutputRef):
                return True
    return False


class SegmentUnusable(InferenceError):
    """This client could not open the region's segment or fit the region in
    it; the message says why (the OS's reason, the segment's size). A client
    that registers on another's behalf (the gateway) answers that caller with
    one text for all of these instead, so nobody probes the host's
    /dev/shm through it."""


class RegionSession(Protocol):
    """What the regions use of the client's session (flows.ClientState)."""

    link: Optional[LocalLink]            # its side channel: attached here when it has none
    local_socket: Optional[str]
    session: Optional[str]

    def exchange(self, op: str, timeout: Optional[float], fields: dict[str, object],
                 lane: bool = False) -> Flow[Reply]: ...

    def control_flow(self, op: str, timeout: Optional[float], fields: dict[str, object]) -> Flow[object]: ...


class RegionFlows:
    """The regions a client registered, and the flows that (un)register them."""

    def __init__(self, owner: RegionSession) -> None:
        self.owner = owner
        self.known: dict[str, tuple[str, int, int]] = {}     # name -> (key, byte_size, offset)
        self.known_cuda: dict[str, tuple[bytes, int, int]] = {}  # name -> (raw handle, device_id, byte_size)

    def register_flow(self, name: str, key: str, byte_size: int, offset: int,
                      timeout: Optional[float]) -> Flow[bool]:
        """Register a region after proving we can write it (the daemon's nonce at `offset`)."""
        import posix_ipc

        try:
            check_shm_key(name, key)         # Triton's key rules, in its words, before the OS sees it
        except TorchpoolError as exc:        # posix_ipc would crash this process on a NUL
            raise InferenceError(exc.code, exc.message) from None
        if not isinstance(offset, int) or not isinstance(byte_size, int) or offset < 0 or byte_size < 0:
            raise InferenceError(errors.INVALID_ARG, f"region '{name}': offset and byte_size must be "
                                                     f"non-negative integers")
        try:
            shm = posix_ipc.SharedMemory(_shm_key(key))
        except (posix_ipc.Error, ValueError, OSError) as exc:
            raise SegmentUnusable(errors.INVALID_ARG, f"region '{name}': this client cannot open "
                                                      f"its shared-memory segment ({exc})") from None
        fd = shm.fd
        try:
            size = os.fstat(fd).st_size
            if offset + byte_size > size:
                raise SegmentUnusable(errors.INVALID_ARG,
                                      f"region '{name}': offset {offset} + byte size {byte_size} does "
                                      f"not fit the segment's {size} bytes")
            owner = self.owner
            self._attach(name, timeout)
            fields = {"name": name, "key": key, "byte_size": byte_size, "offset": offset}
            header, _ = yield from owner.exchange(OP_REGISTER, timeout, fields)
            result = header.get("result")
            nonce = result.get("challenge") if isinstance(result, dict) else None
            if not isinstance(nonce, bytes) or not REGION_TOKEN_MIN_BYTES <= len(nonce) <= REGION_TOKEN_BYTES:
                raise InferenceError(errors.INTERNAL, f"region '{name}': the daemon sent no challenge")
            saved = os.pread(fd, len(nonce), offset)
            os.pwrite(fd, nonce, offset)
            try:
                yield from owner.exchange(OP_REGISTER, timeout, {**fields, "challenge": nonce})
            finally:
                os.pwrite(fd, saved, offset)
        finally:
            os.close(fd)
        self.known[name] = (key, byte_size, offset)
        return True

    def _attach(self, name: str, timeout: Optional[float]) -> None:
        """The daemon must know who registers (its uid): attach over the side
        channel, without an arena, when this client has not."""
        owner = self.owner
        if owner.link is None and owner.local_socket is not None and owner.session is not None:
            try:
                owner.link = LocalLink.attach(owner.local_socket, owner.session, timeout, arena=False)
            except OSError as exc:
                raise InferenceError(errors.UNAVAILABLE, f"region '{name}': registered regions need "
                                                         f"a client on the daemon's host (its side "
                                                         f"channel cannot be reached: {exc.strerror})"
                                     ) from None

    def register_cuda_flow(self, name: str, raw_handle: bytes, device_id: int, byte_size: int,
                           timeout: Optional[float]) -> Flow[bool]:
        """Register GPU memory by its CUDA IPC handle (base64, as tritonclient
        gives it, or its 64 raw bytes); the daemon's workers open it."""
        handle = raw_handle
        if isinstance(handle, (bytes, str)) and len(handle) != CUDA_IPC_HANDLE_BYTES:
            try:
                handle = base64.b64decode(handle, validate=True)
            except (binascii.Error, ValueError):
                pass          # the daemon says what is wrong with it
        if not isinstance(handle, bytes):
            raise InferenceError(errors.INVALID_ARG, f"region '{name}': 'raw_handle' must be bytes (a "
                                                     f"cudaIpcMemHandle_t, raw or base64)")
        self._attach(name, timeout)
        fields = {"name": name, "raw_handle": handle, "device_id": device_id, "byte_size": byte_size}
        yield from self.owner.exchange(OP_CUDA_REGISTER, timeout, fields)
        self.known_cuda[name] = (handle, device_id, byte_size)
        return True

    def restore_flow(self, timeout: Optional[float]) -> Flow[None]:
        """A session that replaced a lost one gets the caller's regions back
        (one that can no longer be registered is forgotten)."""
        for name, (key, byte_size, offset) in list(self.known.items()):
            try:
                yield from self.register_flow(name, key, byte_size, offset, timeout)
            except SessionLost:
                raise
            except InferenceError:
                self.known.pop(name, None)
        for name, (handle, device_id, size) in list(self.known_cuda.items()):
            try:
                yield from self.register_cuda_flow(name, handle, device_id, size, timeout)
            except SessionLost:
                raise
            except InferenceError:
                self.known_cuda.pop(name, None)

    def unregister_flow(self, name: Optional[str], timeout: Optional[float], cuda: bool = False) -> Flow[object]:
        op = OP_CUDA_UNREGISTER if cuda else OP_UNREGISTER
        result = yield from self.owner.control_flow(op, timeout, {"name": name})
        for known in ((self.known_cuda,) if cuda else (self.known,)):
            if name is None:
                known.clear()
            else:
                known.pop(name, None)
        return result

    def status_flow(self, name: Optional[str], timeout: Optional[float], cuda: bool = False) -> Flow[object]:
        return (yield from self.owner.control_flow(OP_CUDA_STATUS if cuda else OP_SHM_STATUS, timeout,
                                                   {"name": name}))
