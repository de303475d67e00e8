"""CPU workers size their threads by what is busy (issue 40, item 5):
against a real daemon, each CPU worker whose model sets no thread counts has
a slot in the daemon's CPU ledger (shm/cpu_ledger.py), marked while it runs a
batch, idle again after it, and cleared by the broker when the worker dies
mid-batch; a model whose own thread counts oversubscribe the CPUs is warned
about at load. (How many threads a share gives is tests/unit/test_cpu_share.py's.)
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import threading
from pathlib import Path

import numpy as np
import pytest

from torchpool import Client
from torchpool.config.devices import cpu_budget
from torchpool.protocol.errors import InferenceError
from torchpool.shm.cpu_ledger import SLOTS, CpuLedger

from ..support.daemon import Daemon, wait_for, worker_pids
from ..support.models.slow import slow_iterations


def _busy(ledger: CpuLedger) -> int:
    return bytes(ledger.buf[:SLOTS]).count(1)


@pytest.fixture
def repository(small_repository: Path, tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    for name, extra in (("slow_pair", 'instance_group [ { count: 2 kind: KIND_CPU } ]\n'),
                        ("overthreaded", 'instance_group [ { count: 2 kind: KIND_CPU } ]\n'
                                         'parameters { key: "INTRA_OP_THREAD_COUNT" '
                                         'value: { string_value: "%d" } }\n' % (cpu_budget() + 1))):
        shutil.copytree(small_repository / "slow", root / name)
        config = root / name / "config.pbtxt"
        config.write_text(config.read_text().replace('name: "slow"', f'name: "{name}"') + extra)
    return root


def test_a_busy_worker_marks_its_slot_and_a_dead_one_is_cleared(repository: Path, tmp_path: Path) -> None:
    d = Daemon(repository, tmp_path, "--log-level", "debug").start()
    try:
        ledger = CpuLedger.attach(_ledger_fd(d.pid()))
        try:
            assert _busy(ledger) == 0                       # loaded, nothing running
            with Client(d.url) as client:
                done = client.infer("slow_pair", {"INPUT__0": np.array([1000], np.int64)})
                assert done["OUTPUT__0"].tolist() == [1000]
            assert _busy(ledger) == 0                       # idle again after its batch

            # a request that runs for a minute: its worker's slot is busy while it runs
            answer: dict = {}

            def call() -> None:
                with Client(d.url) as c:
                    try:
                        c.infer("slow_pair", {"INPUT__0": np.array([slow_iterations(60.0)], np.int64)})
                    except InferenceError as exc:
                        answer["error"] = exc
            caller = threading.Thread(target=call)
            caller.start()
            wait_for(lambda: _busy(ledger) == 1, 30, "the running worker's slot marked busy")
            # it dies mid-batch: the broker clears its slot, the caller gets an error
            for pid in worker_pids(d.log(), "slow_pair"):
                os.kill(pid, signal.SIGKILL)
            caller.join(60)
            assert not caller.is_alive() and "error" in answer
            wait_for(lambda: _busy(ledger) == 0, 30, "the dead worker's slot cleared")
            # the instances come back and take slots again
            with Client(d.url) as client:
                wait_for(lambda: _ready(client), 60, "slow_pair ready again")
                done = client.infer("slow_pair", {"INPUT__0": np.array([10], np.int64)})
                assert done["OUTPUT__0"].tolist() == [10]
            assert _busy(ledger) == 0
        finally:
            ledger.close()
        # a model that sets its own threads for more than the CPUs is warned about
        assert re.search(r"model 'overthreaded' version 1: 2 CPU instances x INTRA_OP_THREAD_COUNT "
                         rf"{cpu_budget() + 1} = \d+ threads for {cpu_budget()} CPUs", d.log())
        assert "model 'slow_pair' version 1: 2 CPU instances" not in d.log()
    finally:
        assert d.stop() == 0, d.log()


def _ledger_fd(daemon_pid: int) -> int:
    """The daemon's CPU ledger, opened through its fd (same uid: /proc lets the test)."""
    fd_dir = f"/proc/{daemon_pid}/fd"
    for fd in os.listdir(fd_dir):
        try:
            target = os.readlink(f"{fd_dir}/{fd}")
        except OSError:
            continue
        if target.startswith("/memfd:cpu-ledger"):
            return os.open(f"{fd_dir}/{fd}", os.O_RDWR)
    raise AssertionError(f"the daemon {daemon_pid} holds no CPU ledger")


def _ready(client: Client) -> bool:
    try:
        return bool(client.model_ready("slow_pair"))
    except InferenceError:
        return False
