"""What the broker tells a new worker.

This module must not import torch: the broker imports it, and the broker
never loads torch (it would cost it a second and a few hundred MB). The entry
point the broker starts is `torchpool.worker.entry.run_worker`.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

from ..config.model_config import ModelConfig
from .capture_size import DEFAULT_MIB


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker needs; pickled through the fork server."""

    model: str
    version: int
    instance: str                 # Triton instance name, e.g. "addsub_0"
    config: ModelConfig
    model_path: str
    device: str                   # "cpu", "cuda:0", or "model" (KIND_MODEL)
    segment_prefix: str           # names this worker's output segments
    arena_chunk: int
    arena_limit: int
    log_level: int = logging.INFO
    busy_poll_us: int = 0         # poll this long after a batch before sleeping
    shared_weights: str = ""      # ENABLE_WEIGHT_SHARING: the weights segment name
    log_format: str = "text"
    # intra-op threads it runs with: its model's INTRA_OP_THREAD_COUNT, else its share
    # of the daemon's CPUs (inter-op too, unless the model sets INTER_OP_THREAD_COUNT);
    # 0: torch's own (a GPU worker)
    threads: int = 0
    output_capture_mib: int = DEFAULT_MIB   # its capture region (capture.py); 0: off
    stream_copy_bytes: int = 0    # copies from this size up stream (shm/bulkcopy.py); 0: never
    # a CPU worker whose model sets no thread counts: its slot in the daemon's CPU
    # ledger (shm/cpu_ledger.py, handed over with the process) and the CPUs it
    # shares, its threads sized per batch
    cpu_slot: int = -1
    cpu_budget: int = 0
