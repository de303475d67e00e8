"""Client GPU memory in the worker: Triton's CUDA shared memory (issue 30,
item 6).

A client registers a region as a CUDA IPC handle (cudaIpcMemHandle_t, 64
bytes), a device id and a size (broker/regions.py CudaRegion). The broker
never touches CUDA, so the worker opens the handle, the first time a request
names the region, with the driver API (`libcuda.so.1`, which comes with the
driver, through ctypes: no CUDA toolkit or cuda-python needed):
cuIpcOpenMemHandle in the device's primary context, the one torch uses. It
checks the registered size against the allocation the handle names
(cuMemGetAddressRange: a client claiming more than it allocated gets a clear
error, never a read past the end, which would be an illegal address and end
the worker), and keeps the mapping open until the broker says the region is
gone (FORGET), then closes it.

`DeviceRegions` is the bookkeeping (one mapping per handle and device) over a
`Driver`'s two calls; `CudaDriver` makes those calls; `device_bytes` makes a
torch uint8 tensor over the mapped memory (`__cuda_array_interface__`), from
which the engine views an input and into which an output is copied.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional, Protocol, Sequence, Union

from ..protocol import errors
from ..protocol.messages import CUDA_IPC_HANDLE_BYTES
from .settings import ExecutionError

if TYPE_CHECKING:
    import torch

LIBRARY = "libcuda.so.1"
_LAZY_ENABLE_PEER_ACCESS = 1       # CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS


class Mapped(Protocol):
    """What the driver gives for an opened handle."""

    @property
    def address(self) -> int: ...
    @property
    def available(self) -> int: ...     # bytes from `address` to the end of the allocation


class Driver(Protocol):
    def open(self, handle: bytes, device: int) -> Mapped: ...
    def close(self, mapped: Mapped, device: int) -> None: ...


@dataclass(frozen=True)
class Mapping:
    address: int
    available: int


class _IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * CUDA_IPC_HANDLE_BYTES)]


class CudaDriver:
    """cuIpcOpenMemHandle / cuIpcCloseMemHandle in a device's primary context."""

    def __init__(self, path: str = LIBRARY) -> None:
        try:
            lib = ctypes.CDLL(path)
        except OSError as exc:
            raise OSError(f"the NVIDIA driver's {path} cannot be loaded ({exc})") from None
        self._lib = lib
        c_uint64, c_void_p = ctypes.c_uint64, ctypes.c_void_p
        lib.cuIpcOpenMemHandle_v2.argtypes = [ctypes.POINTER(c_uint64), _IpcHandle, ctypes.c_uint]
        lib.cuIpcCloseMemHandle.argtypes = [c_uint64]
        lib.cuMemGetAddressRange_v2.argtypes = [ctypes.POINTER(c_uint64), ctypes.POINTER(ctypes.c_size_t), c_uint64]
        lib.cuDevicePrimaryCtxRetain.argtypes = [ctypes.POINTER(c_void_p), ctypes.c_int]
        lib.cuDevicePrimaryCtxRelease_v2.argtypes = [ctypes.c_int]
        lib.cuCtxPushCurrent_v2.argtypes = [c_void_p]
        lib.cuCtxPopCurrent_v2.argtypes = [ctypes.POINTER(c_void_p)]
        lib.cuDeviceGet.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int]
        lib.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        self._check("cuInit", lib.cuInit(0))

    def _check(self, call: str, code: int) -> None:
        if code:
            text = ctypes.c_char_p()
            self._lib.cuGetErrorString(code, ctypes.byref(text))
            reason = text.value.decode(errors="replace") if text.value else f"CUDA error {code}"
            raise OSError(f"{call}: {reason}")

    def _in_context(self, device: int, work: Callable[[], object]) -> object:
        lib = self._lib
        dev = ctypes.c_int()
        self._check("cuDeviceGet", lib.cuDeviceGet(ctypes.byref(dev), device))
        ctx = ctypes.c_void_p()
        self._check("cuDevicePrimaryCtxRetain", lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev))
        try:
            self._check("cuCtxPushCurrent", lib.cuCtxPushCurrent_v2(ctx))
            try:
                return work()
            finally:
                lib.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))
        finally:
            lib.cuDevicePrimaryCtxRelease_v2(dev)

    def open(self, handle: bytes, device: int) -> Mapped:
        lib = self._lib

        raw = _IpcHandle()
        ctypes.memmove(ctypes.addressof(raw), handle, CUDA_IPC_HANDLE_BYTES)    # every byte, NULs too

        def work() -> Mapping:
            pointer = ctypes.c_uint64()
            self._check("cuIpcOpenMemHandle", lib.cuIpcOpenMemHandle_v2(
                ctypes.byref(pointer), raw, _LAZY_ENABLE_PEER_ACCESS))
            base, size = ctypes.c_uint64(), ctypes.c_size_t()
            try:
                self._check("cuMemGetAddressRange", lib.cuMemGetAddressRange_v2(
                    ctypes.byref(base), ctypes.byref(size), pointer))
            except OSError:
                lib.cuIpcCloseMemHandle(pointer)
                raise
            return Mapping(pointer.value, base.value + size.value - pointer.value)

        mapped = self._in_context(device, work)
        assert isinstance(mapped, Mapping)
        return mapped

    def close(self, mapped: Mapped, device: int) -> None:
        self._in_context(device, lambda: self._lib.cuIpcCloseMemHandle(mapped.address))


class DeviceRegions:
    """The clients' GPU regions this worker has open: one mapping per
    (handle, device), opened at first use, closed when dropped."""

    def __init__(self, driver: Optional[Callable[[], Driver]] = None) -> None:
        self._make_driver = driver or CudaDriver
        self._driver: Optional[Driver] = None
        self._open: dict[tuple[bytes, int], Mapped] = {}

    def mapped(self, ref: Sequence[Union[str, int, bytes]], end: int, what: str) -> tuple[Mapped, int]:
        """The mapping of a DEVICE_REF ([tag, handle, device]) that holds at
        least `end` bytes, and its device."""
        _, handle, device = ref
        if not isinstance(handle, bytes) or not isinstance(device, int):
            raise ExecutionError(f"{what}: a malformed CUDA region reference", errors.INTERNAL)
        m = self._open.get((handle, device))
        if m is None:
            m = self._open_handle(handle, device, what)
        if end > m.available:
            raise ExecutionError(f"{what}: the CUDA region's allocation holds {m.available} bytes from "
                                 f"its handle's address, fewer than the {end} asked for (it was "
                                 f"registered larger than it is)", errors.INVALID_ARG)
        return m, device

    def _open_handle(self, handle: bytes, device: int, what: str) -> Mapped:
        try:
            if self._driver is None:
                self._driver = self._make_driver()
            m = self._driver.open(handle, device)
        except OSError as exc:
            raise ExecutionError(f"{what}: the CUDA region cannot be opened on device {device}: {exc}",
                                 errors.INVALID_ARG) from None
        self._open[(handle, device)] = m
        return m

    def drop(self, ref: Sequence[Union[str, int, bytes]]) -> None:
        _, handle, device = ref
        if isinstance(handle, bytes) and isinstance(device, int):
            m = self._open.pop((handle, device), None)
            if m is not None:
                self._close(m, device)

    def close(self) -> None:
        for (_handle, device), m in list(self._open.items()):
            self._close(m, device)
        self._open.clear()

    def _close(self, m: Mapped, device: int) -> None:
        assert self._driver is not None
        try:
            self._driver.close(m, device)
        except OSError:
            pass               # the context may be lost already: the process ends soon


class _CudaArray:
    """Bytes on a GPU as `__cuda_array_interface__` describes them (for torch.as_tensor)."""

    def __init__(self, address: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (address, False),
                                         "strides": None, "version": 2}


def device_bytes(mapped: Mapped, device: int, offset: int, nbytes: int) -> "torch.Tensor":
    """A uint8 tensor on cuda:`device` over [offset, offset + nbytes) of a mapping."""
    import torch

    if nbytes == 0:            # nothing to view (an empty tensor): no pointer for torch to check
        return torch.empty(0, dtype=torch.uint8, device=f"cuda:{device}")
    return torch.as_tensor(_CudaArray(mapped.address + offset, nbytes), device=f"cuda:{device}")
