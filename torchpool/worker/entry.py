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

from ..logs import set_process_fields, set_process_title

if TYPE_CHECKING:
    from ..shm.cpu_ledger import LedgerFd
    from .spec import WorkerSpec


def worker_title(spec: "WorkerSpec") -> str:
    """`torchpool worker addsub v1 #0` (+ the device when it is a GPU): what
    `ps` shows for the worker, instead of the fork server's command line.
    Instances are named `<group>_<index>` and groups after their model
    (`addsub`, `addsub_1` for a second group): the model's prefix is not
    repeated; a group with a name of its own shows it whole."""
    prefix = f"{spec.model}_"
    instance = "#" + (spec.instance[len(prefix):] if spec.instance.startswith(prefix) else spec.instance)
    device = f" {spec.device}" if spec.device.startswith("cuda") else ""
    return f"torchpool worker {spec.model} v{spec.version} {instance}{device}"


def run_worker(spec: "WorkerSpec", sock: socket.socket, ledger: "LedgerFd | None" = None) -> None:
    """The multiprocessing target: runs in the forked child."""
    set_process_title(worker_title(spec))
    set_process_fields(spec.model, spec.version, spec.instance)    # in its JSON log records
    from .process import worker_main

    worker_main(spec, sock, ledger.fd if ledger is not None else -1)


__all__ = ["run_worker", "worker_title"]
