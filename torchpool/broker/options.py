"""The daemon's options: one owner for every default (the CLI reads them here)."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Optional

MiB = 1 << 20


@dataclass
class ServerOptions:
    model_repository: str
    listen: list[str]
    log_level: int = logging.INFO
    shm_chunk: int = 64 * MiB           # broker input arena: segment size
    shm_limit: int = 2048 * MiB         # broker input arena: total cap
    worker_shm_chunk: int = 4 * MiB     # each worker's output arena: first segment
    worker_shm_limit: int = 1024 * MiB
    grace_period: float = 30.0          # SIGTERM: time to finish accepted requests
    busy_poll_us: int = 500             # keep polling this long after activity before sleeping
    worker_busy_poll_us: int = 0        # the same for workers, after each batch
    stop_timeout: float = 10.0          # time a worker gets to exit before SIGKILL
    max_restarts: int = 5               # crashes in a row, no batch done in between: UNAVAILABLE
    client_shm_size: int = 64 * MiB     # a local client's arena segment
    client_shm_limit: int = 1024 * MiB  # a local client's arena, all segments
    client_lease: float = 60.0          # an idle client session is closed after this long
    execution_timeout: float = 0.0      # a batch running longer gets its worker killed; 0 = never
    load_timeout: float = 600.0         # a worker not loaded by then is killed, its version fails; 0 = never
    metrics_port: Optional[int] = None  # Prometheus /metrics and /v2/health/* (None = off)
    metrics_host: str = "127.0.0.1"
    log_format: str = "text"
    model_control_mode: str = "none"    # none | poll | explicit (Triton's)
    load_models: list[str] = field(default_factory=list)   # explicit mode: load these at start ("*" = all)
    repository_poll_secs: float = 15.0
