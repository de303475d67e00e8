"""A GPU instance's copies between shared memory and its device (issue 30,
items 2 and 3).

The worker reads its inputs from segments the broker and the clients map
into it, and the model runs on the instance's GPU. Copies from pageable
memory go through a driver bounce buffer and block the host; from
page-locked memory they are DMA, asynchronous on a stream. Page-locking is
`cudaHostRegister` of the mapping (through `torch.cuda.cudart()`): about
1-2 GB/s, dearer than the copy itself, so each segment is registered once,
when its first input is read, and unregistered when it is unmapped (before:
the driver must not keep a registration of memory that is gone), never per
request (`HostPinning`, plain bookkeeping over the two driver calls).

Each instance has its own CUDA stream (`DeviceCopies`): its inputs' copies
and the model's kernels are queued on it in order, and the worker
synchronises once per batch, after the model ran, before it reads the
outputs (which then come back with ordinary copies). Nothing here runs for
a CPU instance.
"""
from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING, Callable, Iterator

if TYPE_CHECKING:
    import torch

log = logging.getLogger("torchpool.worker")


class HostPinning:
    """Which mappings are registered with the CUDA driver: each at most once.

    `register(address, size)` says whether the driver took it; one it
    refused is not asked again (its copies stay pageable: slower, still
    right), and is said once in the log."""

    def __init__(self, register: Callable[[int, int], bool], unregister: Callable[[int], None],
                 label: str) -> None:
        self._register = register
        self._unregister = unregister
        self.label = label
        self.pinned: dict[str, tuple[int, int]] = {}     # name -> (address, size)
        self.refused: set[str] = set()

    def pin(self, name: str, address: int, size: int) -> bool:
        """Is mapping `name` page-locked (registered now if it was not)?"""
        if name in self.pinned:
            return True
        if name in self.refused or size <= 0:
            return False
        if self._register(address, size):
            self.pinned[name] = (address, size)
            return True
        self.refused.add(name)
        log.warning("%s: the CUDA driver did not page-lock segment %s (%d bytes): its inputs are "
                    "copied to the GPU from pageable memory", self.label, name, size)
        return False

    def unpin(self, name: str) -> None:
        """Mapping `name` is about to be unmapped."""
        self.refused.discard(name)
        held = self.pinned.pop(name, None)
        if held is not None:
            self._unregister(held[0])

    def unpin_all(self) -> None:
        for name in list(self.pinned):
            self.unpin(name)


def cuda_pinning(label: str) -> HostPinning:
    """HostPinning through the CUDA runtime torch links (no other binding needed)."""
    import torch

    cudart = torch.cuda.cudart()

    def register(address: int, size: int) -> bool:
        return int(cudart.cudaHostRegister(address, size, 0)) == 0     # 0: cudaSuccess

    def unregister(address: int) -> None:
        cudart.cudaHostUnregister(address)

    return HostPinning(register, unregister, label)


class DeviceCopies:
    """An instance's CUDA stream: its inputs' copies and its model's kernels in
    order on it, one synchronisation per batch."""

    def __init__(self, device: torch.device) -> None:
        import torch

        self._torch = torch
        self.device = device
        self.stream = torch.cuda.Stream(device)

    @contextlib.contextmanager
    def on_stream(self) -> Iterator[None]:
        with self._torch.cuda.stream(self.stream):
            yield

    def to_device(self, tensor: torch.Tensor, pinned: bool) -> torch.Tensor:
        """`tensor` (a view of host memory) on the device; asynchronous when the
        memory is page-locked (its bytes must stay until `finish`: a batch's
        inputs do)."""
        with self.on_stream():
            return tensor.to(self.device, non_blocking=pinned)

    def finish(self) -> None:
        """Wait for what was queued on the stream: the batch's outputs are ready."""
        self.stream.synchronize()


# CUDA errors after which the process's CUDA context is unusable: every later
# call fails, so the worker must be replaced (an out-of-memory error is not one:
# the next batch may fit)
_STICKY_CUDA_ERRORS = ("device-side assert", "illegal memory access", "illegal instruction",
                       "misaligned address", "unspecified launch failure", "launch timed out",
                       "uncorrectable ecc", "hardware stack error", "an illegal")


def out_of_gpu_memory(exc: BaseException) -> bool:
    """Did `exc` (or what it was raised from) say the GPU ran out of memory?
    (torch's OutOfMemoryError, or its text inside a TorchScript error.) The
    caller's error, in Triton's terms a resource exhausted: the worker goes on."""
    seen: set[int] = set()
    e: "BaseException | None" = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if type(e).__name__ == "OutOfMemoryError" or "CUDA out of memory" in str(e):
            return True
        e = e.__cause__ or e.__context__
    return False


def lost_cuda_context(exc: BaseException) -> bool:
    """Did `exc` (or what it was raised from) come from a CUDA error that
    leaves the context unusable?"""
    seen: set[int] = set()
    e: "BaseException | None" = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        text = str(e).lower()
        if "cuda" in text and any(sticky in text for sticky in _STICKY_CUDA_ERRORS):
            return True
        e = e.__cause__ or e.__context__
    return False
