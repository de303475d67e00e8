"""A worker's life is tied to the broker's: a kill -9 of the broker leaves
no worker behind, not even one in the middle of a long request.

The broker's death closes the fork server's "alive" pipe, the fork server
exits, and the kernel kills its children (PR_SET_PDEATHSIG).
"""
from __future__ import annotations

import ctypes
import os
import signal


def _die_with_parent() -> None:
    """Ask the kernel for SIGKILL when the fork server (our parent) exits."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except OSError:  # pragma: no cover - not Linux
        pass


def _let_go_of_the_fork_server() -> None:
    """Close the fork server's "alive" pipe, which every child it forks inherits.

    The fork server exits when no process holds that pipe's writing end. A
    worker busy with a long request when the broker is killed would hold it,
    and so keep the fork server up, and through it itself (its PDEATHSIG
    fires only when the fork server exits): both ran until the request
    finished. Workers never fork through the fork server.
    """
    from multiprocessing import forkserver

    server = forkserver._forkserver            # multiprocessing's own, private: no public way
    fd = getattr(server, "_forkserver_alive_fd", None)
    if fd is not None:
        os.close(fd)
        # (multiprocessing's private attribute, which typeshed's stub lacks)
        server._forkserver_alive_fd = None  # type: ignore[attr-defined]


def tie_to_the_broker() -> None:
    """In a new worker, before anything else."""
    parent = os.getppid()
    _let_go_of_the_fork_server()
    _die_with_parent()
    if os.getppid() != parent:  # parent died before prctl took effect
        os._exit(1)
