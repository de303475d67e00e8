"""The escalation for a hung worker (broker/supervisor.py): SIGABRT, so that
its faulthandler logs where it is, then SIGKILL; never a signal to a process
that has exited or been reaped. Real child processes, real signals."""
from __future__ import annotations

import faulthandler
import multiprocessing
import signal
import socket
import sys
from typing import Iterator

import pytest

from torchpool.broker.supervisor import DEAD, WorkerHandle

_fork = multiprocessing.get_context("fork")


def _stuck(ignore_abort: bool, ready: "multiprocessing.synchronize.Event") -> None:
    faulthandler.enable(file=sys.stderr, all_threads=True)     # as worker_main does
    if ignore_abort:
        signal.signal(signal.SIGABRT, signal.SIG_IGN)
    ready.set()
    signal.pause()


@pytest.fixture
def handles() -> Iterator[list[WorkerHandle]]:
    made: list[WorkerHandle] = []
    yield made
    for h in made:                        # whatever a failed test left running
        if h.process.exitcode is None:
            h.process.kill()
        h.process.join(10)
        h.sock.close()


def start(handles: list[WorkerHandle], ignore_abort: bool = False) -> WorkerHandle:
    ready = _fork.Event()
    process = _fork.Process(target=_stuck, args=(ignore_abort, ready))
    process.start()
    assert ready.wait(30), "the child did not start"
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    theirs.close()
    handle = WorkerHandle(0, None, None, process, ours)     # spec and version: unused here
    handles.append(handle)
    return handle


def test_abort_ends_a_stuck_process_with_sigabrt(handles: list[WorkerHandle], capfd: pytest.CaptureFixture) -> None:
    h = start(handles)
    assert h.running()
    assert h.abort() is True
    h.process.join(30)
    assert h.process.exitcode == -signal.SIGABRT
    assert "Fatal Python error: Aborted" in capfd.readouterr().err    # its stack, on its stderr
    assert not h.running() and h.abort() is False    # exited: nothing more is sent
    h.kill()                                         # nor a SIGKILL (no error either)


def test_kill_ends_one_that_survives_sigabrt(handles: list[WorkerHandle]) -> None:
    h = start(handles, ignore_abort=True)
    assert h.abort() is True
    assert h.running()         # SIG_IGN: a SIGABRT already delivered changed nothing
    h.kill()
    h.process.join(30)
    assert h.process.exitcode == -signal.SIGKILL


def test_a_reaped_handle_gets_no_signal(handles: list[WorkerHandle]) -> None:
    """Once reaped its process is closed and its pid may be reused: the
    escalation's timer must not signal whatever has that pid now."""
    h = start(handles)
    h.process.kill()
    h.process.join(30)
    h.state = DEAD             # what Supervisor.reap sets before closing the process
    h.process.close()          # its exitcode and kill() would raise ValueError now
    assert not h.running() and h.abort() is False
    h.kill()
    handles.remove(h)
    h.sock.close()
