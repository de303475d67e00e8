"""Shared fixtures: the test model repository and one daemon for the session.

The session also checks that it leaves nothing behind: no torchpool process,
no /dev/shm segment, no socket file.
"""
from __future__ import annotations

import socket
from pathlib import Path

import pytest

from .daemon import Daemon, torchpool_processes, torchpool_segments, wait_for
from .model_repository import build_test_repository


def free_tcp_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def test_repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("repository")
    build_test_repository(root)
    return root


@pytest.fixture(scope="session")
def daemon(test_repository: Path, tmp_path_factory: pytest.TempPathFactory):
    workdir = tmp_path_factory.mktemp("daemon")
    d = Daemon(test_repository, workdir, tcp_port=free_tcp_port()).start()
    yield d
    assert d.stop() == 0, d.log()
    assert not d.socket_path.exists(), "the daemon left its socket file behind"


@pytest.fixture(scope="session", autouse=True)
def nothing_left_behind():
    before = set(torchpool_segments())
    yield
    wait_for(lambda: not torchpool_processes(), 30, "torchpool processes to exit")
    left = set(torchpool_segments()) - before
    assert not left, f"shared-memory segments left behind: {sorted(left)}"
