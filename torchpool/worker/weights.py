"""ENABLE_WEIGHT_SHARING across worker processes: one copy of the weights.

Triton shares one model object between instances on a device. Here each
instance is its own process, so the first instance of a model version copies
its CPU parameters and buffers into a shared-memory segment and points the
tensors at it; every later instance (and a respawned one) loads the model,
then points its tensors at the same segment and drops its private copy. The
layout is derived from the model itself (named parameters and buffers, in
order), so instances of the same model file agree on it without talking.

The broker starts the other instances only after the first is ready, so the
segment is complete before anyone attaches to it. It lives as long as the
model version (the broker unlinks it with the daemon's other segments).
"""
from __future__ import annotations

import logging

import posix_ipc
import torch

from ..shm.arena import ALIGN
from ..shm.segment import NamedSegment
from .settings import ModelLoadError

log = logging.getLogger("torchpool.worker")


def _shareable_tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    """CPU parameters and buffers, each storage once (tied weights stay tied)."""
    seen: set[int] = set()
    tensors = []
    for _, t in list(module.named_parameters()) + list(module.named_buffers()):
        if t.device.type != "cpu" or t.numel() == 0 or not t.is_contiguous():
            continue
        key = t.untyped_storage().data_ptr()
        if key in seen:
            continue
        seen.add(key)
        tensors.append(t)
    return tensors


def share_weights(module: torch.nn.Module, segment_name: str, model: str) -> NamedSegment | None:
    """Back the module's CPU weights by the named segment; returns it (kept mapped)."""
    tensors = _shareable_tensors(module)
    layout, total = [], 0
    for t in tensors:
        layout.append(total)
        total += (t.numel() * t.element_size() + ALIGN - 1) & ~(ALIGN - 1)
    if total == 0:
        return None
    try:
        seg = NamedSegment.create(segment_name, total, prefault=False)
        created = True
    except posix_ipc.ExistentialError:
        seg = NamedSegment.attach(segment_name)
        created = False
        if seg.size != total:
            seg.close()
            raise ModelLoadError(f"failed to load model '{model}': shared weights segment holds "
                                 f"{seg.size} bytes but this model's weights need {total}; "
                                 f"were the instances loaded from different files?")
    with torch.no_grad():
        for t, offset in zip(tensors, layout):
            view = torch.frombuffer(seg.buf, dtype=t.dtype, count=t.numel(), offset=offset).view(t.shape)
            if created:
                view.copy_(t)
            t.set_(view.untyped_storage(), view.storage_offset(), view.shape, view.stride())
    log.info("%s %d weight tensors (%.1f MiB) in shared memory", "shared" if created else "attached",
             len(tensors), total / 2**20)
    return seg
