"""GPU memory and utilisation as NVIDIA's management library (NVML) reports
them: per GPU (Triton's nv_gpu_* metrics) and per process (what each worker's
CUDA context, modules and allocator hold: `torchpool ps`, the statistics'
`instances`, torchpool_worker_gpu_memory_bytes).

NVML is the driver's library (libnvidia-ml.so.1), not CUDA: the broker reads
it without creating a CUDA context, so the rule that the broker never touches
CUDA holds. It is loaded with ctypes on first use; where it is missing (no
NVIDIA driver: a CPU host) or fails, every reading is empty and the GPU
metrics are absent.

All GPUs are read together, on a thread of their own, when a reading older
than EVERY_S is asked for, and the latest reading is answered at once: NVML
calls take 0.1-1 ms per GPU and may block while a GPU is in trouble, and the
broker's loop and the scrape thread never wait for the driver.

Inside a container with its own pid namespace NVML names processes by the
host's pids, which are not the daemon's pids of its workers: the per-worker
figure is then absent (docs/metrics.md), the per-GPU figures are not.
"""
from __future__ import annotations

import ctypes
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

LIBRARY = "libnvidia-ml.so.1"
EVERY_S = 2.0                # a reading older than this is taken again when asked for
MAX_PROCESSES = 256          # processes asked for per GPU at first (more: asked again)

_SUCCESS = 0
_INSUFFICIENT_SIZE = 7
_NOT_AVAILABLE = (1 << 64) - 1     # NVML_VALUE_NOT_AVAILABLE, as an unsigned long long
_UUID_BYTES = 96                   # NVML_DEVICE_UUID_V2_BUFFER_SIZE


class _ProcessInfo(ctypes.Structure):
    """nvmlProcessInfo_v2_t, which the _v3 call also fills."""
    _fields_ = [("pid", ctypes.c_uint), ("usedGpuMemory", ctypes.c_ulonglong),
                ("gpuInstanceId", ctypes.c_uint), ("computeInstanceId", ctypes.c_uint)]


class _Memory(ctypes.Structure):
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]


class _Utilization(ctypes.Structure):
    _fields_ = [("gpu", ctypes.c_uint), ("memory", ctypes.c_uint)]


@dataclass(frozen=True)
class GpuReading:
    """One GPU as NVML saw it."""
    index: int                   # NVML's index (PCI order, not CUDA_VISIBLE_DEVICES')
    uuid: str                    # "GPU-...": Triton's label for it
    total_bytes: int
    used_bytes: int
    utilization: Optional[float]     # 0..1 over NVML's last sample period; None where not reported


@dataclass(frozen=True)
class NvmlReading:
    """Every GPU, and the GPU memory of each process that holds some (summed
    over GPUs). Empty where NVML is missing."""
    gpus: tuple[GpuReading, ...] = ()
    process_bytes: dict[int, int] = field(default_factory=dict)
    error: str = ""              # why nothing was read ("" when it was, or NVML is simply absent)


class NvmlLibrary:
    """The calls torchpool makes, on a loaded libnvidia-ml (or a library with
    its ABI: the tests use one)."""

    def __init__(self, path: str = LIBRARY) -> None:
        lib = ctypes.CDLL(path)
        self._lib = lib
        for name in ("nvmlInit_v2", "nvmlDeviceGetCount_v2", "nvmlDeviceGetHandleByIndex_v2",
                     "nvmlDeviceGetMemoryInfo", "nvmlDeviceGetUUID", "nvmlDeviceGetUtilizationRates"):
            getattr(lib, name).restype = ctypes.c_int
        # the _v3 call where the driver has it (R510 and later), else _v2 (same record)
        processes = getattr(lib, "nvmlDeviceGetComputeRunningProcesses_v3", None) \
            or lib.nvmlDeviceGetComputeRunningProcesses_v2
        processes.restype = ctypes.c_int
        self._processes = processes
        self._check("nvmlInit_v2", lib.nvmlInit_v2())

    @staticmethod
    def _check(call: str, code: int) -> None:
        if code != _SUCCESS:
            raise OSError(f"{call} returned NVML error {code}")

    def read(self) -> NvmlReading:
        lib = self._lib
        count = ctypes.c_uint()
        self._check("nvmlDeviceGetCount_v2", lib.nvmlDeviceGetCount_v2(ctypes.byref(count)))
        gpus: list[GpuReading] = []
        per_process: dict[int, int] = {}
        for index in range(count.value):
            handle = ctypes.c_void_p()
            self._check("nvmlDeviceGetHandleByIndex_v2",
                        lib.nvmlDeviceGetHandleByIndex_v2(ctypes.c_uint(index), ctypes.byref(handle)))
            uuid = ctypes.create_string_buffer(_UUID_BYTES)
            self._check("nvmlDeviceGetUUID", lib.nvmlDeviceGetUUID(handle, uuid, ctypes.c_uint(_UUID_BYTES)))
            memory = _Memory()
            self._check("nvmlDeviceGetMemoryInfo", lib.nvmlDeviceGetMemoryInfo(handle, ctypes.byref(memory)))
            rates = _Utilization()
            busy = None
            if lib.nvmlDeviceGetUtilizationRates(handle, ctypes.byref(rates)) == _SUCCESS:
                busy = rates.gpu / 100.0
            gpus.append(GpuReading(index, uuid.value.decode(errors="replace"), memory.total, memory.used, busy))
            for pid, used in self._process_memory(handle):
                per_process[pid] = per_process.get(pid, 0) + used
        return NvmlReading(tuple(gpus), per_process)

    def _process_memory(self, handle: ctypes.c_void_p) -> list[tuple[int, int]]:
        size = MAX_PROCESSES
        while True:
            infos = (_ProcessInfo * size)()
            count = ctypes.c_uint(size)
            code = self._processes(handle, ctypes.byref(count), infos)
            if code == _INSUFFICIENT_SIZE and count.value > size:
                size = count.value + 16          # processes started meanwhile
                continue
            self._check("nvmlDeviceGetComputeRunningProcesses", code)
            # a process whose figure NVML cannot give (a MIG slice without the right) counts no bytes
            return [(info.pid, info.usedGpuMemory) for info in infos[:count.value]
                    if info.usedGpuMemory != _NOT_AVAILABLE]


def load(path: str = LIBRARY) -> tuple[Optional[NvmlLibrary], str]:
    """(the library, "") or (None, why not): "" where it is simply absent."""
    try:
        return NvmlLibrary(path), ""
    except OSError as exc:
        absent = "cannot open shared object" in str(exc) or "No such file" in str(exc)
        return None, "" if absent else f"NVML: {exc}"
    except AttributeError as exc:                    # a driver too old for the _v2 calls
        return None, f"NVML: {exc}"


class NvmlSampler:
    """The latest reading, taken again on a thread when asked for and older
    than `every` seconds. `reading()` never waits: the first call answers an
    empty reading and starts the first one."""

    def __init__(self, every: float = EVERY_S, library: Callable[[], tuple[Optional[NvmlLibrary], str]] = load
                 ) -> None:
        self.every = every
        self._library = library
        self._lib: Optional[NvmlLibrary] = None
        self._loaded = False
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._latest = NvmlReading()
        self._absent = NvmlReading()           # what a missing library reads as (with why)
        self._read_at: Optional[float] = None
        self._due = False
        self._thread: Optional[threading.Thread] = None

    def reading(self) -> NvmlReading:
        now = time.monotonic()
        with self._lock:
            stale = (self._read_at is None or now - self._read_at > self.every) and not self._due
            if stale:
                self._due = True
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name="torchpool-nvml", daemon=True)
                    self._thread.start()
            latest = self._latest
        if stale:
            self._wake.set()
        return latest

    def _run(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            reading = self._read()
            with self._lock:
                self._latest, self._read_at, self._due = reading, time.monotonic(), False

    def _read(self) -> NvmlReading:
        if not self._loaded:
            self._loaded = True
            self._lib, error = self._library()
            if self._lib is None:
                self._absent = NvmlReading(error=error)
        if self._lib is None:
            return self._absent
        try:
            return self._lib.read()
        except OSError as exc:
            return NvmlReading(error=str(exc))


# One per process, as PSS's: the statistics call and the scrape ask the same one.
NVML = NvmlSampler()
