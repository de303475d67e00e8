"""Which GPUs this host shows, without initialising CUDA; how many CPUs the daemon may use.

The broker must never create a CUDA context (workers are forked from a
template process, and CUDA does not survive a fork), and it does not even
import torch. So GPUs are counted from the NVIDIA driver's
`/proc/driver/nvidia/gpus/` (one entry per device) and narrowed by
`CUDA_VISIBLE_DEVICES` the way the CUDA runtime numbers them: the visible
devices become 0..n-1 in the order given.

The configuration resolves `KIND_AUTO` with this list, and the supervisor
places instances with it, so what `model_config` reports is where the
instances run.

The CPUs the daemon may use are its CPU affinity, narrowed by a cgroup CPU
quota (cgroup v2 `cpu.max`, v1 `cpu.cfs_quota_us` / `cpu.cfs_period_us`, on
the daemon's own cgroup and its parents): a container given two CPUs of a
64-core host has two, whatever `os.cpu_count()` says.
"""
from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Callable, Optional

NVIDIA_GPUS = "/proc/driver/nvidia/gpus"


def visible_gpus() -> list[int]:
    """The CUDA device ids a worker may use here, [] when there is no GPU."""
    try:
        count = len(os.listdir(NVIDIA_GPUS))
    except OSError:
        count = 0
    wanted = os.environ.get("CUDA_VISIBLE_DEVICES")
    if wanted is None:
        return list(range(count))
    listed = [d for d in wanted.split(",") if d.strip()]
    if not listed or listed[0].strip() == "-1":
        return []
    return list(range(min(len(listed), count)))


CGROUP_ROOT = Path("/sys/fs/cgroup")


def threads_per_worker(budget: int, cpu_workers: int) -> int:
    """Each CPU worker's share of `budget` CPUs when `cpu_workers` share them:
    their thread pools together never hold more threads than there are CPUs
    (at least one each). Two workers taking every core each for their
    intra-op pools (torch's default) ran a ResNet-18 at 3.3 infer/s at c=8
    on two cores, against 52 with one thread each."""
    return max(1, budget // max(1, cpu_workers))


def cpu_budget() -> int:
    """The CPUs this process may keep busy at once (at least 1)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    quota = cgroup_cpu_quota()
    if quota is not None:
        cpus = min(cpus, max(1, math.ceil(quota)))
    return max(1, cpus)


def cgroup_cpu_quota(proc_cgroup: str = "/proc/self/cgroup", root: Path = CGROUP_ROOT) -> Optional[float]:
    """The tightest CPU quota (in CPUs) of this process's cgroup and its
    parents, None when there is none (or no cgroup to read)."""
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError:
        return None
    quotas: list[float] = []
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":            # cgroup v2 (unified)
            top = root if (root / "cgroup.controllers").exists() else root / "unified"
            quotas += _up_from(top, path, _v2_quota)
        elif "cpu" in controllers.split(","):                 # cgroup v1's cpu controller
            v1_top = next((root / name for name in ("cpu", "cpu,cpuacct", "cpuacct,cpu")
                           if (root / name / "cpu.cfs_period_us").exists()), None)
            if v1_top is not None:
                quotas += _up_from(v1_top, path, _v1_quota)
    return min(quotas) if quotas else None


def _up_from(top: Path, path: str, read: Callable[[Path], Optional[float]]) -> list[float]:
    """The quotas `read` finds in the cgroup `path` under the hierarchy `top`
    and in each of its parents, up to `top` itself."""
    here = top / path.lstrip("/")
    found = []
    for d in (here, *here.parents):
        if not d.is_relative_to(top):
            break
        value = read(d)
        if value is not None:
            found.append(value)
    return found


def _v2_quota(d: Path) -> Optional[float]:
    try:
        quota, period = (d / "cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        return None
    return None if quota == "max" else int(quota) / int(period)


def _v1_quota(d: Path) -> Optional[float]:
    try:
        quota = int((d / "cpu.cfs_quota_us").read_text())
        period = int((d / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if quota <= 0 or period <= 0 else quota / period
