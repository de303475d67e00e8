"""Triton-style registered regions, for `ClientState` (flows.py).

Registering proves access: the client writes a fresh token into the segment
at the region's offset, the daemon reads it back, and the saved bytes are
restored afterwards.
"""
from __future__ import annotations

import os
import secrets
from typing import Any, Iterable, Mapping, Optional

from ..protocol import errors
from ..protocol.errors import InferenceError
from ..protocol.messages import OP_REGISTER, OP_SHM_STATUS, OP_UNREGISTER, REGION_TOKEN_BYTES
from .types import Flow, OutputRef, SharedMemoryRef


def _shm_key(key: str) -> str:
    return "/" + key.lstrip("/")


def needs_session(inputs: Mapping[str, Any], outputs: Optional[Iterable[Any]]) -> bool:
    """Does this request name registered regions (so it cannot run without a session)?"""
    if any(isinstance(v, SharedMemoryRef) for v in inputs.values()):
        return True
    return outputs is not None and any(isinstance(o, OutputRef) for o in outputs)


class RegionFlows:
    """Mixed into ClientState: uses its `exchange`, `control_flow` and `regions`."""

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
            if offset + max(byte_size, REGION_TOKEN_BYTES) > size:
                raise InferenceError(errors.INVALID_ARG,
                                     f"region '{name}': offset {offset} + byte size {byte_size} does "
                                     f"not fit the segment's {size} bytes")
            saved = os.pread(fd, REGION_TOKEN_BYTES, offset)
            token = secrets.token_bytes(REGION_TOKEN_BYTES)
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
