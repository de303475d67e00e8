"""What each worker process is and uses: the rows of `torchpool ps`, of the
statistics' `instances` extension and of the per-worker metrics.

    /proc/PID/stat          CPU time and resident memory: tens of us to read,
                            read whenever asked
    NVML (nvml.py)          GPU memory of a worker on a GPU: read on its own
                            thread, at most every 2 s
    /proc/PID/smaps_rollup  PSS, the process's share of the memory it maps
                            (torch's pages and shared weights split among the
                            processes that map them): the kernel walks every
                            page table for it, milliseconds for a worker that
                            maps torch, so it is read on PssSampler's thread,
                            never on the broker's loop

PSS is what to add up across workers: RSS counts the torch pages every worker
shares with the fork server once per worker.
"""
from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Mapping, Optional, Protocol, TypedDict

from .nvml import NVML, NvmlSampler

if TYPE_CHECKING:
    from multiprocessing.process import BaseProcess

    from ..worker.spec import WorkerSpec

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")
# A pid's PSS is read again when asked about and its reading is older than
# this: a statistics call or a metrics scrape costs at most one read per worker
# per PSS_EVERY_S (5-10 ms each, so a loop of calls or a 2 s scrape never keeps
# a core busy walking 60 workers' page tables, which also holds each worker's
# memory lock while it runs) ...
PSS_EVERY_S = 10.0
# ... and the reading of a pid nobody asked about for this long is dropped
PSS_FORGET_S = 60.0

# WorkerHandle states (supervisor.py) as an operator reads them
STATES = {"STARTING": "LOADING", "IDLE": "READY", "BUSY": "BUSY", "DEAD": "DEAD"}


@dataclass(frozen=True)
class CpuMemory:
    cpu_seconds: float      # user + system time of the process so far
    rss_bytes: int          # resident memory, shared pages counted whole


def read_stat(pid: int) -> Optional[CpuMemory]:
    """CPU time and RSS of `pid` from /proc/PID/stat; None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read()
    except OSError:
        return None
    fields = text.rsplit(b")", 1)[1].split()     # after the command name, which may hold spaces
    # fields[0] is field 3 of proc(5): utime is 14, stime 15, rss (pages) 24
    return CpuMemory((int(fields[11]) + int(fields[12])) / CLOCK_TICKS, int(fields[21]) * PAGE_BYTES)


def read_pss(pid: int) -> Optional[int]:
    """PSS of `pid` in bytes from /proc/PID/smaps_rollup; None once it is gone
    (or where it cannot be read: before Linux 4.14, another user's process)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as f:
            for line in f:
                if line.startswith(b"Pss:"):
                    return int(line.split()[1]) * 1024        # "Pss:  163394 kB"
    except (OSError, ValueError, IndexError):
        pass
    return None


class PssSampler:
    """The PSS of the pids asked about, read on its own thread, on demand:
    a pid asked about whose reading is missing or older than `every` seconds
    is read (once) by the thread, which otherwise sleeps. `pss(pid)` never
    waits: it answers the latest reading (None before the first)."""

    def __init__(self, every: float = PSS_EVERY_S, forget_after: float = PSS_FORGET_S) -> None:
        self.every, self.forget_after = every, forget_after
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._asked: dict[int, float] = {}          # pid -> when it was last asked about
        self._pss: dict[int, tuple[float, Optional[int]]] = {}    # pid -> (when read, reading)
        self._due: set[int] = set()                 # pids to read now
        self._reading: set[int] = set()             # pids the thread is reading (not asked again)
        self._thread: Optional[threading.Thread] = None

    def pss(self, pid: int) -> Optional[int]:
        return self.reading(pid)[0]

    def reading(self, pid: int) -> tuple[Optional[int], Optional[float]]:
        """(PSS, seconds since it was read): (None, None) before the first
        reading. A reading older than `every` is answered as it is, and read
        again at once on the thread: whoever needs a current one (`torchpool
        ps`) asks again when the age says it is old."""
        now = time.monotonic()
        with self._lock:
            self._asked[pid] = now
            read_at, value = self._pss.get(pid, (None, None))
            stale = (read_at is None or now - read_at > self.every) and pid not in self._due \
                and pid not in self._reading
            if stale:
                self._due.add(pid)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="torchpool-pss", daemon=True)
                self._thread.start()
        if stale:
            self._wake.set()
        return value, None if read_at is None else now - read_at

    def _run(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            with self._lock:
                now = time.monotonic()
                for pid, asked in list(self._asked.items()):
                    if now - asked > self.forget_after:
                        del self._asked[pid]
                        self._pss.pop(pid, None)
                due, self._due = self._due, set()
                self._reading = set(due)
            for pid in due:
                value = read_pss(pid)        # the slow part, outside the lock
                with self._lock:
                    if pid in self._asked:
                        self._pss[pid] = (time.monotonic(), value)
                    self._reading.discard(pid)


# One per process, as the workers it reads are the daemon's: the statistics
# call (the loop's thread) and the metrics scrape (its own) ask the same one.
PSS = PssSampler()


class Instance(Protocol):
    """What a row shows of a worker: a supervisor.WorkerHandle (not imported:
    the registry imports this module)."""

    process: BaseProcess
    spec: WorkerSpec
    state: str
    stopping: bool
    started: float


class InstanceRow(TypedDict):
    """One worker as `torchpool ps` shows it (a statistics call's `instances`)."""

    name: str
    pid: int
    device: str
    threads: int
    state: str
    restarts: int
    started: float              # wall-clock seconds
    uptime_s: float
    cpu_s: Optional[float]
    rss_bytes: Optional[int]
    pss_bytes: Optional[int]
    pss_age_s: Optional[float]  # how old pss_bytes is
    gpu_memory_bytes: Optional[int]     # what NVML says the process holds on GPUs (None on the CPU)


def instance_row(h: Instance, restarts: int, now: float, sampler: PssSampler = PSS,
                 gpus: NvmlSampler = NVML) -> Optional[InstanceRow]:
    """One worker as `torchpool ps` shows it; None when its process has
    just been reaped (the metrics thread reads handles while the loop runs)."""
    try:
        pid = h.process.pid
    except ValueError:                # closed: reaped since the caller listed it
        return None
    if pid is None:                   # not started (never so for a handle)
        return None
    usage = read_stat(pid)
    pss, pss_age = sampler.reading(pid)
    device = h.spec.device
    gpu_memory = None if device == "cpu" else gpus.reading().process_bytes.get(pid)
    uptime = now - h.started
    return {
        "name": h.spec.instance, "pid": pid, "device": device, "threads": h.spec.threads,
        "state": "STOPPING" if h.stopping else STATES.get(h.state, h.state),
        "restarts": restarts,
        "started": round(time.time() - uptime, 3), "uptime_s": round(uptime, 3),
        "cpu_s": None if usage is None else round(usage.cpu_seconds, 2),
        "rss_bytes": None if usage is None else usage.rss_bytes,
        "pss_bytes": pss,
        "pss_age_s": None if pss_age is None else round(pss_age, 3),   # how old pss_bytes is
        "gpu_memory_bytes": gpu_memory,
    }


def instance_rows(workers: Iterable[Instance], restarts: Mapping[str, int],
                  sampler: PssSampler = PSS) -> list[InstanceRow]:
    """The rows of a version's live workers, by instance name; `restarts` is
    its restarts per instance (VersionStats.restarts)."""
    now = time.monotonic()
    rows = [instance_row(h, restarts.get(h.spec.instance, 0), now, sampler) for h in list(workers)]
    return sorted((row for row in rows if row is not None), key=lambda row: row["name"])


__all__ = ["CpuMemory", "InstanceRow", "PSS", "PssSampler", "STATES", "instance_row", "instance_rows", "read_pss",
           "read_stat"]
