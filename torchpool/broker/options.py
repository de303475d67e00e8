"""The daemon's options: one owner for every default (the CLI reads them here)."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Optional

from ..gateway import defaults as gateway_defaults
from ..protocol.messages import MAX_HEADER_BYTES
from ..rules.validation import TensorLimits
from ..shm.bulkcopy import stream_bytes_from_environment
from ..worker.capture_size import capture_mib_from_environment

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
    # keep polling this long after activity before sleeping. Off: measured on
    # the 2-core VM (c=1, add/sub) 500 us cost the broker 100-150 us of CPU per
    # request for no measurable latency (its spin yields to the client and
    # worker it waits for); a host shared with its clients wants that CPU back
    busy_poll_us: int = 0
    worker_busy_poll_us: int = 0        # the same for workers, after each batch
    # A direct path's two ends poll at most this long without sleeping, while
    # the other answers sooner (rules/spin.py): on the 2-core VM it halves
    # a tiny request's latency for about the CPU the wake-ups cost. The
    # broker waits so for a worker running one of its batches (Loop.wait). 0: off
    direct_spin_us: int = 500
    # each worker's output capture region (worker/capture.py), MiB; 0: off.
    # Default: $TORCHPOOL_OUTPUT_CAPTURE_MIB (how it was set before), else 256
    output_capture_mib: int = field(default_factory=capture_mib_from_environment)
    # copies into shared memory of this many bytes and more store around the CPU
    # caches (shm/bulkcopy.py), in the broker and its workers; 0: never.
    # Default: $TORCHPOOL_STREAM_COPY_BYTES (how it was set before), else 0
    stream_copy_bytes: int = field(default_factory=stream_bytes_from_environment)
    stop_timeout: float = 10.0          # time a worker gets to exit at stop before SIGABRT, then SIGKILL
    max_restarts: int = 5               # crashes in a row, no batch done in between: UNAVAILABLE
    client_shm_size: int = 64 * MiB     # a local client's arena segment
    client_shm_limit: int = 1024 * MiB  # a local client's arena, all segments
    client_shm_total: int = 8192 * MiB  # every local client's arena together
    client_lease: float = 60.0          # an idle client session is closed after this long
    execution_timeout: float = 0.0      # a batch running longer gets its worker killed; 0 = never
    cache_dir: Optional[str] = None     # compile caches (TORCH_COMPILE); None = $TORCHPOOL_CACHE_DIR or ~/.cache/torchpool
    load_timeout: float = 600.0         # a worker not loaded by then is killed, its version fails; 0 = never
    metrics_port: Optional[int] = None  # Prometheus /metrics and /v2/health/* (None = off)
    metrics_host: str = "127.0.0.1"
    # Triton's --metrics-config: summary_latencies=true, summary_quantiles=0.5:0.05,0.9:0.01,...
    metrics_config: list[str] = field(default_factory=list)
    # KServe v2 / Triton gateways (torchpool/gateway): separate processes, clients of this daemon
    http_port: Optional[int] = None     # HTTP/REST (Triton's 8000); None = off
    http_host: str = "127.0.0.1"
    grpc_port: Optional[int] = None     # gRPC (Triton's 8001); None = off
    grpc_host: str = "127.0.0.1"
    # what the gateways' callers may do (defaults: torchpool/gateway/defaults.py)
    http_max_input_size: int = gateway_defaults.MAX_INPUT_BYTES    # Triton's --http-max-input-size
    grpc_max_input_size: int = gateway_defaults.MAX_INPUT_BYTES
    allow_client_shm: bool = gateway_defaults.ALLOW_CLIENT_SHM     # Triton's --allow-client-shm
    allow_client_shm_prefixes: list[str] = field(default_factory=list)  # empty: any key
    gateway_max_in_flight_per_caller: int = gateway_defaults.MAX_IN_FLIGHT_PER_CALLER
    http_max_connections: int = 0       # 0: a share of the gateway's open-files limit
    grpc_max_connections: int = 0
    grpc_max_streams_per_peer: int = gateway_defaults.MAX_STREAMS_PER_PEER   # 0: no cap
    log_format: str = "text"
    model_control_mode: str = "none"    # none | poll | explicit (Triton's)
    load_models: list[str] = field(default_factory=list)   # explicit mode: load these at start ("*" = all)
    repository_poll_secs: float = 15.0  # poll mode: between rescans; 0 = only on SIGHUP (systemctl reload)
    # Triton's --exit-on-error: a model failing to load at startup stops the daemon. Off by
    # default (Triton's is on): one broken model must not take every other one down with it.
    exit_on_error: bool = False
    # --- who may connect, and how much each may take (docs/security.md) ---
    local_socket: Optional[str] = None  # unix side channel of local sessions; None = auto, "" = off
    # local clients with a lane may send plain requests straight to a worker
    # (broker/direct.py); off: every request passes the broker's queue and limits
    direct_paths: bool = True
    local_allow_users: list[str] = field(default_factory=list)   # names or uids; empty = any peer
    local_allow_groups: list[str] = field(default_factory=list)  # that can open the socket file
    curve_secret_key: Optional[str] = None       # tcp: this daemon's CURVE key file (torchpool keygen)
    curve_authorized_keys: Optional[str] = None  # tcp: directory of client public keys allowed in
    insecure_tcp: bool = False          # allow non-loopback tcp without CURVE
    remote_model_control: bool = False  # load/unload from tcp clients too (default: ipc only)
    max_sessions: int = 1024            # client sessions, all peers together
    max_sessions_per_peer: int = 64     # per local uid, per tcp/ipc connection
    max_regions_per_session: int = 128  # registered regions of one session
    max_in_flight_per_client: int = 1024   # unanswered requests of one ipc process / tcp connection
    max_unread_replies: int = 1024      # replies queued for a connection that does not read
    max_connections: int = 0            # client connections in all; 0: the open-files limit less a quarter
    max_header_bytes: int = MAX_HEADER_BYTES   # a request's header frame (msgpack), refused unread past it
    max_bytes_elements: int = TensorLimits.max_bytes_elements          # elements of one BYTES tensor
    max_bytes_tensor_bytes: int = TensorLimits.max_bytes_tensor_bytes  # bytes of one BYTES tensor
