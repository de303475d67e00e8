"""worker/gpu_copies.HostPinning: the bookkeeping of which mapped segments a
GPU worker has registered with the CUDA driver (issue 30, item 2), as plain
logic over the two driver calls: each segment registered once, however
many inputs it holds; unregistered before it is unmapped (also when a
segment of the same name replaces it); one the driver refused is not asked
again. (The calls themselves run in tests/gpu and scripts/gpu-check.)"""
from __future__ import annotations

import os

from torchpool.shm.arena import MappedSegments
from torchpool.shm.segment import Segment
from torchpool.worker.gpu_copies import HostPinning


class Driver:
    """Records the registrations it is asked for; refuses the sizes in `refuse`."""

    def __init__(self, refuse: tuple = ()) -> None:
        self.calls: list[tuple] = []
        self.registered: set[int] = set()
        self.refuse = refuse

    def register(self, address: int, size: int) -> bool:
        self.calls.append(("register", address, size))
        if size in self.refuse:
            return False
        assert address not in self.registered, "registered twice"
        self.registered.add(address)
        return True

    def unregister(self, address: int) -> None:
        self.calls.append(("unregister", address))
        self.registered.remove(address)


def test_a_segment_is_registered_once_and_unregistered_once() -> None:
    driver = Driver()
    pinning = HostPinning(driver.register, driver.unregister, "test")
    for _ in range(5):                     # five inputs in one segment
        assert pinning.pin("seg0", 0x1000, 4096)
    assert pinning.pin("seg1", 0x9000, 8192)
    assert driver.calls == [("register", 0x1000, 4096), ("register", 0x9000, 8192)]
    pinning.unpin("seg0")
    pinning.unpin("seg0")                  # (already gone: nothing)
    assert driver.registered == {0x9000}
    pinning.unpin_all()
    assert driver.registered == set() and pinning.pinned == {}


def test_a_segment_the_driver_refuses_is_not_asked_again() -> None:
    driver = Driver(refuse=(4096,))
    pinning = HostPinning(driver.register, driver.unregister, "test")
    assert not pinning.pin("seg0", 0x1000, 4096)
    assert not pinning.pin("seg0", 0x1000, 4096)
    assert driver.calls == [("register", 0x1000, 4096)]
    pinning.unpin("seg0")                  # unmapped: a new segment of that name is asked again
    assert not pinning.pin("seg0", 0x1000, 4096) and len(driver.calls) == 2
    assert not pinning.pin("empty", 0x2000, 0) and len(driver.calls) == 2


def test_segments_are_unregistered_before_they_are_unmapped_also_when_replaced() -> None:
    """The worker's MappedSegments closes a segment through its hook, which
    unpins first: when the broker drops it, when one of the same name
    replaces it, and when the worker closes them all."""
    driver = Driver()
    pinning = HostPinning(driver.register, driver.unregister, "test")
    order: list[str] = []

    def unmap(seg: Segment) -> None:
        pinning.unpin(seg.name)
        order.append(f"unmap {seg.name} ({'pinned' if seg.name in pinning.pinned else 'unpinned'})")
        seg.close()

    mapped = MappedSegments(unmap)
    owners = []
    for name in ("a", "b"):
        owner = Segment.create(f"tp-test-pin-{name}", 4096)      # a memfd: nothing to unlink
        owners.append(owner)
        seg = mapped.add(name, os.dup(owner.fd))
        assert pinning.pin(name, id(seg), seg.size)
    mapped.add("a", os.dup(owners[0].fd))       # replaced: the old mapping is unpinned, then unmapped
    mapped.drop(lambda name: name == "b")
    assert order == ["unmap a (unpinned)", "unmap b (unpinned)"]
    assert driver.registered == set()
    mapped.close()
    for owner in owners:
        owner.close()


def test_which_cuda_errors_lose_the_context() -> None:
    """A worker whose CUDA context is lost (a device-side assert, an illegal
    address: every later call fails) ends after its answer and is replaced;
    out of memory is not such an error (the next batch may fit), nor is any
    error that does not come from CUDA. The model's error arrives wrapped
    (ExecutionError from the RuntimeError torch raised)."""
    from torchpool.worker.binding import ExecutionError
    from torchpool.worker.gpu_copies import lost_cuda_context

    def wrapped(message: str) -> Exception:
        try:
            try:
                raise RuntimeError(message)
            except RuntimeError as inner:
                raise ExecutionError("model 'm' failed: " + message.splitlines()[0]) from inner
        except ExecutionError as outer:
            return outer

    assert lost_cuda_context(wrapped("CUDA error: device-side assert triggered\nCUDA kernel errors might be "
                                     "asynchronously reported at some other API call"))
    assert lost_cuda_context(RuntimeError("CUDA error: an illegal memory access was encountered"))
    assert lost_cuda_context(wrapped("CUDA error: unspecified launch failure"))
    assert not lost_cuda_context(wrapped("CUDA out of memory. Tried to allocate 20.00 GiB"))
    assert not lost_cuda_context(wrapped("index 5 is out of bounds for dimension 0 with size 3"))
    assert not lost_cuda_context(ValueError("an illegal value"))


def test_out_of_gpu_memory_is_told_apart_through_the_wrapping() -> None:
    """A GPU out-of-memory error, as torch raises it or as its text inside a
    TorchScript error wrapped by the worker: RESOURCE_EXHAUSTED for that
    batch or load (process.py), never a lost context."""
    import torch

    from torchpool.worker.binding import ExecutionError
    from torchpool.worker.gpu_copies import lost_cuda_context, out_of_gpu_memory

    def wrapped(inner: Exception) -> Exception:
        try:
            try:
                raise inner
            except Exception as e:
                raise ExecutionError("model 'm' failed") from e
        except ExecutionError as outer:
            return outer

    oom = torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total "
                                      "capacity of 79.10 GiB of which 1.02 GiB is free.")
    assert out_of_gpu_memory(oom) and out_of_gpu_memory(wrapped(oom))
    assert out_of_gpu_memory(wrapped(RuntimeError("The following operation failed in the TorchScript "
                                                  "interpreter.\nRuntimeError: CUDA out of memory. Tried to "
                                                  "allocate 2.00 MiB")))
    assert not lost_cuda_context(wrapped(oom))
    assert not out_of_gpu_memory(wrapped(RuntimeError("CUDA error: device-side assert triggered")))
    assert not out_of_gpu_memory(MemoryError("out of memory"))

