"""Which GPUs this host shows, without initialising CUDA.

The broker must never create a CUDA context (workers are forked from a
template process, and CUDA does not survive a fork), and it does not even
import torch. So GPUs are counted from the NVIDIA driver's
`/proc/driver/nvidia/gpus/` (one entry per device) and narrowed by
`CUDA_VISIBLE_DEVICES` the way the CUDA runtime numbers them: the visible
devices become 0..n-1 in the order given.

The configuration resolves `KIND_AUTO` with this list, and the supervisor
places instances with it, so what `model_config` reports is where the
instances run.
"""
from __future__ import annotations

import os

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
