"""The client API, declared once: what each client offers, as Protocols.

`DaemonCalls` is what every synchronous client answers: `Client` (sync.py,
one daemon) and `MultiClient` (multi.py, several). `SessionCalls` adds what
needs one daemon's session (statistics, Triton's system shared-memory
calls): `Client`. `AsyncSessionCalls` is `SessionCalls` awaited:
`AsyncClient` (aio.py), and what the HTTP/gRPC gateways call (their
backend, gateway/backend.py, holds one).

The clients name these as their bases, so the type checker holds each one
to these signatures; tests/unit/test_client_api.py holds the asyncio API
to the synchronous one (the same names, parameters and defaults) and each
client's methods to these, defaults included.
"""
from __future__ import annotations

from typing import Optional, Protocol, Sequence

import numpy as np

from .types import InferResult, Inputs, JSONDocument, ModelConfig, RequestedOutput, SequenceId, Version


class DaemonCalls(Protocol):
    """Inference and the control calls a Triton user expects."""

    def server_live(self, timeout: Optional[float] = None) -> bool:
        """Is the daemon up (answering)?"""
        ...

    def server_ready(self, timeout: Optional[float] = None) -> bool:
        """Is the daemon ready to serve (its models loaded)?"""
        ...

    def model_ready(self, name: str, version: Version = None) -> bool:
        """Is this model (version) ready to serve?"""
        ...

    def model_metadata(self, name: str, version: Version = None) -> JSONDocument:
        """KServe v2 model metadata: name, versions, platform, inputs, outputs."""
        ...

    def model_config(self, name: str, version: Version = None) -> JSONDocument:
        """The model's configuration, as Triton's JSON form of config.pbtxt."""
        ...

    def repository_index(self) -> list[JSONDocument]:
        """[{name, version, state, reason}] of every model in the repository."""
        ...

    def server_metadata(self) -> JSONDocument:
        """The daemon's metadata (KServe v2: name, version, extensions)."""
        ...

    def load(self, name: str, config: ModelConfig = None, timeout: Optional[float] = None) -> None:
        """Load or reload a model (--model-control-mode explicit); returns once
        it serves. `config` (dict or JSON text) overrides its config file."""
        ...

    def unload(self, name: str, timeout: Optional[float] = None) -> None:
        """Unload a model; returns once its in-flight requests have finished."""
        ...

    def infer(self, model: str, inputs: Inputs, outputs: Optional[Sequence[RequestedOutput]] = None,
              version: Version = None, timeout: Optional[float] = None, copy: bool = False,
              priority: int = 0, sequence_id: SequenceId = 0, sequence_start: bool = False,
              sequence_end: bool = False) -> InferResult:
        """Run `model` on `inputs`; returns {output name: numpy array} (docs/client.md)."""
        ...

    def empty(self, shape: Sequence[int], datatype: str = "FP32") -> np.ndarray:
        """A writable array to fill and pass to `infer`: in the client's
        shared-memory arena when it has one, so that its bytes are not copied;
        else an ordinary array."""
        ...


class SessionCalls(DaemonCalls, Protocol):
    """What needs one daemon: its statistics and its registered regions."""

    def statistics(self, model: Optional[str] = None, version: Version = None) -> JSONDocument:
        """Triton's statistics: {"model_stats": [{name, version, inference_count,
        execution_count, inference_stats: {success, fail, queue, compute_*}, batch_stats}]}."""
        ...

    def register_system_shared_memory(self, name: str, key: str, byte_size: int, offset: int = 0) -> None:
        """Register `byte_size` bytes at `offset` of the POSIX shm segment `key`
        under `name` (Triton's call): this client must be able to open and
        write it, and proves so; then inputs and outputs may name it."""
        ...

    def unregister_system_shared_memory(self, name: Optional[str] = None) -> None:
        """Unregister `name` (None: every region of this client)."""
        ...

    def get_system_shared_memory_status(self, name: Optional[str] = None) -> list[JSONDocument]:
        """[{name, key, offset, byte_size, in_use}] of this client's regions."""
        ...

    def register_cuda_shared_memory(self, name: str, raw_handle: bytes, device_id: int, byte_size: int) -> None:
        """Register `byte_size` bytes of GPU memory on `device_id` under `name`
        (Triton's call): `raw_handle` is its cudaIpcMemHandle_t, base64 as
        tritonclient.utils.cuda_shared_memory.get_raw_handle gives it, or its
        64 raw bytes. The daemon's workers open it; inputs and outputs may
        then name it as they name system regions."""
        ...

    def unregister_cuda_shared_memory(self, name: Optional[str] = None) -> None:
        """Unregister CUDA region `name` (None: every CUDA region of this client)."""
        ...

    def get_cuda_shared_memory_status(self, name: Optional[str] = None) -> list[JSONDocument]:
        """[{name, device_id, byte_size, in_use}] of this client's CUDA regions."""
        ...


class AsyncSessionCalls(Protocol):
    """`SessionCalls`, awaited (the same names, parameters and defaults)."""

    async def server_live(self, timeout: Optional[float] = None) -> bool: ...

    async def server_ready(self, timeout: Optional[float] = None) -> bool: ...

    async def model_ready(self, name: str, version: Version = None) -> bool: ...

    async def model_metadata(self, name: str, version: Version = None) -> JSONDocument: ...

    async def model_config(self, name: str, version: Version = None) -> JSONDocument: ...

    async def repository_index(self) -> list[JSONDocument]: ...

    async def server_metadata(self) -> JSONDocument: ...

    async def load(self, name: str, config: ModelConfig = None, timeout: Optional[float] = None) -> None: ...

    async def unload(self, name: str, timeout: Optional[float] = None) -> None: ...

    async def infer(self, model: str, inputs: Inputs, outputs: Optional[Sequence[RequestedOutput]] = None,
                    version: Version = None, timeout: Optional[float] = None, copy: bool = False,
                    priority: int = 0, sequence_id: SequenceId = 0, sequence_start: bool = False,
                    sequence_end: bool = False) -> InferResult: ...

    async def empty(self, shape: Sequence[int], datatype: str = "FP32") -> np.ndarray: ...

    async def statistics(self, model: Optional[str] = None, version: Version = None) -> JSONDocument: ...

    async def register_system_shared_memory(self, name: str, key: str, byte_size: int,
                                            offset: int = 0) -> None: ...

    async def unregister_system_shared_memory(self, name: Optional[str] = None) -> None: ...

    async def get_system_shared_memory_status(self, name: Optional[str] = None) -> list[JSONDocument]: ...

    async def register_cuda_shared_memory(self, name: str, raw_handle: bytes, device_id: int,
                                          byte_size: int) -> None: ...

    async def unregister_cuda_shared_memory(self, name: Optional[str] = None) -> None: ...

    async def get_cuda_shared_memory_status(self, name: Optional[str] = None) -> list[JSONDocument]: ...
