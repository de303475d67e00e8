"""The worker's entry point, as the broker names it to multiprocessing.

This module must not import torch at import time: the broker imports it to
name the target of a worker process. The fork server preloads
`torchpool.worker.process`, so the import inside `run_worker` is already done
there. It is its own module (not in `spec.py`) so that the worker process
module can import `WorkerSpec` without an import cycle.
"""
from __future__ import annotations

import socket
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .spec import WorkerSpec


def run_worker(spec: "WorkerSpec", sock: socket.socket) -> None:
    """The multiprocessing target: runs in the forked child."""
    from .process import worker_main

    worker_main(spec, sock)


__all__ = ["run_worker"]
