"""Triton's CUDA shared memory without a GPU (issue 30, item 6): the broker's
checks of a registration and of a request's window (broker/regions.py), and
the worker's bookkeeping of the handles it opened (worker/cuda_ipc.py
DeviceRegions) as plain logic over the driver's two calls: each handle
opened once per device, at first use, a window past the allocation refused
before any read, closed when the region goes. (The calls themselves run in
tests/gpu and scripts/gpu-check.)"""
from __future__ import annotations

import os
from dataclasses import dataclass

import pytest

from torchpool.broker.regions import CudaRegion, open_cuda_region
from torchpool.protocol.errors import TorchpoolError
from torchpool.protocol.internal import DEVICE_REF, is_device_ref
from torchpool.worker.cuda_ipc import DeviceRegions
from torchpool.worker.settings import ExecutionError

HANDLE = bytes(range(64))


def test_a_registration_is_checked_as_far_as_the_broker_can() -> None:
    region = open_cuda_region("r", HANDLE, 1, 4096, gpus=[0, 1])
    assert (region.name, region.handle, region.device_id, region.byte_size) == ("r", HANDLE, 1, 4096)
    assert is_device_ref(region.worker_ref()) and region.worker_ref() == [DEVICE_REF, HANDLE, 1]
    cases = [((b"short", 0, 64, [0]), "'raw_handle' must be a valid base64 encoded cudaIpcMemHandle_t"),
             (("x" * 64, 0, 64, [0]), "'raw_handle' must be a valid base64 encoded cudaIpcMemHandle_t"),
             ((HANDLE, -1, 64, [0]), "region 'r': 'device_id' must be an unsigned integer"),
             ((HANDLE, True, 64, [0]), "region 'r': 'device_id' must be an unsigned integer"),
             ((HANDLE, 0, -5, [0]), "byte size -5 is not an integer"),
             ((HANDLE, 0, 64, []), "failed to register CUDA shared memory region: 'r', GPUs not supported"),
             ((HANDLE, 2, 64, [0, 1]), "failed to register CUDA shared memory region: 'r', device 2 is not a "
                                       "GPU of this server (its GPUs: 0, 1)")]
    for (handle, device, size, gpus), text in cases:
        with pytest.raises(TorchpoolError) as e:
            open_cuda_region("r", handle, device, size, gpus)
        assert text in e.value.message, (text, e.value.message)


def test_a_requests_window_is_checked_in_tritons_words() -> None:
    region = CudaRegion("r", HANDLE, 0, 1024)
    assert region.check("input 'x'", 512, 512) == (512, 512)
    assert len(region.view(512, 512)) == 512          # what validation measures, never read
    # a hostile size: 1 TiB is measured without reserving it (a plain anonymous mapping of it
    # failed here with ENOMEM, an OSError in the broker); 2^63 is the request's error
    huge = CudaRegion("huge", HANDLE, 0, (1 << 64) - 1)
    assert len(huge.view(0, 1 << 40)) == 1 << 40
    with pytest.raises(TorchpoolError) as e:
        huge.view(0, 1 << 63)
    assert "more than this server can take as one input" in e.value.message
    for offset, nbytes, text in ((1024, 1, "Invalid offset for shared memory region: 'r'"),
                                 (1000, 100, "Invalid offset + byte size for shared memory region: 'r'"),
                                 (8, (1 << 64) - 4, "Integer overflow detected")):
        with pytest.raises(TorchpoolError) as e:
            region.check("input 'x'", offset, nbytes)
        assert text in e.value.message


@dataclass(frozen=True)
class Opened:
    address: int
    available: int


class Driver:
    """Records what it is asked to open and close; a handle of all ones does not open."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.open_now: set[tuple[bytes, int]] = set()

    def open(self, handle: bytes, device: int) -> Opened:
        self.calls.append(("open", device))
        if handle == b"\xff" * 64:
            raise OSError("cuIpcOpenMemHandle: invalid argument")
        assert (handle, device) not in self.open_now, "opened twice"
        self.open_now.add((handle, device))
        return Opened(0x7F0000000000 + device, 4096)

    def close(self, mapped: Opened, device: int) -> None:
        self.calls.append(("close", device))
        self.open_now.remove(next(k for k in self.open_now if k[1] == device))


def test_each_handle_is_opened_once_and_closed_when_its_region_goes() -> None:
    driver = Driver()
    regions = DeviceRegions(lambda: driver)
    ref = [DEVICE_REF, HANDLE, 0]
    for _ in range(3):
        mapped, device = regions.mapped(ref, 4096, "input 'x'")
        assert (mapped.address, device) == (0x7F0000000000, 0)
    regions.mapped([DEVICE_REF, HANDLE, 1], 16, "input 'x'")      # the same handle on another device
    assert driver.calls == [("open", 0), ("open", 1)]
    # past the allocation the handle names (registered larger than it is): refused, nothing read
    with pytest.raises(ExecutionError) as e:
        regions.mapped(ref, 4097, "input 'x' for model 'm'")
    assert e.value.code == "INVALID_ARG" and "holds 4096 bytes" in e.value.message
    with pytest.raises(ExecutionError) as e:
        regions.mapped([DEVICE_REF, b"\xff" * 64, 0], 16, "input 'x' for model 'm'")
    assert "cannot be opened on device 0: cuIpcOpenMemHandle: invalid argument" in e.value.message
    regions.drop(ref)
    regions.drop(ref)                                             # twice: nothing more
    assert driver.calls[-1] == ("close", 0) and len([c for c in driver.calls if c[0] == "close"]) == 1
    regions.close()
    assert driver.open_now == set()


def test_a_host_without_the_driver_fails_the_request_not_the_worker() -> None:
    if os.path.exists("/proc/driver/nvidia"):
        pytest.skip("this host has the NVIDIA driver")
    with pytest.raises(ExecutionError) as e:
        DeviceRegions().mapped([DEVICE_REF, HANDLE, 0], 16, "input 'x' for model 'm'")
    assert e.value.code == "INVALID_ARG"
    assert e.value.message.startswith("input 'x' for model 'm': the CUDA region cannot be opened on device 0: "
                                      "the NVIDIA driver's libcuda.so.1 cannot be loaded")
