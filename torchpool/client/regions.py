"""Triton-style registered regions, for `ClientState` (flows.py).

Registering proves access with a challenge: the daemon opens the segment and
answers a fresh nonce; the client writes it at the region's offset and asks
again; the daemon reads it back. The bytes the nonce covered are restored
afterwards. Regions need a local session (the daemon must know who we are).
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Iterable, Optional

from ..protocol import errors
from ..protocol.errors import InferenceError, TorchpoolError
from ..protocol.messages import (OP_REGISTER, OP_SHM_STATUS, OP_UNREGISTER, REGION_TOKEN_BYTES,
                                 REGION_TOKEN_MIN_BYTES)
from ..protocol.names import check_shm_key
from .local import LocalLink
from .types import Flow, Inputs, OutputRef, Reply, RequestedOutput, SharedMemoryRef


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


class RegionFlows:
    """Mixed into ClientState: uses its `exchange`, `control_flow` and `regions`."""

    # ClientState's (set in its __init__, defined in flows.py); declared for the checker only
    link: Optional[LocalLink]
    local_socket: Optional[str]
    session: Optional[str]
    regions: dict[str, tuple[str, int, int]]     # name -> (key, byte_size, offset)

    if TYPE_CHECKING:
        def exchange(self, op: str, timeout: Optional[float], fields: dict[str, object],
                     lane: bool = False) -> Flow[Reply]: ...

        def control_flow(self, op: str, timeout: Optional[float], fields: dict[str, object]) -> Flow[object]: ...

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
            if self.link is None and self.local_socket is not None and self.session is not None:
                # the daemon must know who we are: attach without an arena
                try:
                    self.link = LocalLink.attach(self.local_socket, self.session, timeout, arena=False)
                except OSError as exc:
                    raise InferenceError(errors.UNAVAILABLE, f"region '{name}': registered regions need "
                                                             f"a client on the daemon's host (its side "
                                                             f"channel cannot be reached: {exc.strerror})"
                                         ) from None
            fields = {"name": name, "key": key, "byte_size": byte_size, "offset": offset}
            header, _ = yield from self.exchange(OP_REGISTER, timeout, fields)
            result = header.get("result")
            nonce = result.get("challenge") if isinstance(result, dict) else None
            if not isinstance(nonce, bytes) or not REGION_TOKEN_MIN_BYTES <= len(nonce) <= REGION_TOKEN_BYTES:
                raise InferenceError(errors.INTERNAL, f"region '{name}': the daemon sent no challenge")
            saved = os.pread(fd, len(nonce), offset)
            os.pwrite(fd, nonce, offset)
            try:
                yield from self.exchange(OP_REGISTER, timeout, {**fields, "challenge": nonce})
            finally:
                os.pwrite(fd, saved, offset)
        finally:
            os.close(fd)
        self.regions[name] = (key, byte_size, offset)
        return True

    def unregister_flow(self, name: Optional[str], timeout: Optional[float]) -> Flow[object]:
        result = yield from self.control_flow(OP_UNREGISTER, timeout, {"name": name})
        if name is None:
            self.regions.clear()
        else:
            self.regions.pop(name, None)
        return result

    def status_flow(self, name: Optional[str], timeout: Optional[float]) -> Flow[object]:
        return (yield from self.control_flow(OP_SHM_STATUS, timeout, {"name": name}))
