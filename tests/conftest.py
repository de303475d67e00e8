"""Shared fixtures: the test model repository and one daemon for the session.

The session also checks that it leaves nothing behind: no torchpool process,
no /dev/shm segment, no socket file.
"""
from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

import pytest

from torchpool.shm import remove_segments_with_prefix

from .support.daemon import Daemon, free_tcp_port, torchpool_processes, torchpool_segments, wait_for
from .support.models.repository import build_test_repository


@pytest.fixture(scope="session")
def test_repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("repository")
    build_test_repository(root)
    return root


@pytest.fixture(scope="session")
def small_repository(test_repository: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Only good models: the example repository plus `slow` (for daemons a test starts)."""
    from torchpool.examples import build_example_repository

    root = tmp_path_factory.mktemp("small_repository")
    build_example_repository(root)
    shutil.copytree(test_repository / "slow", root / "slow")
    return root


@pytest.fixture(scope="session")
def daemon(test_repository: Path, tmp_path_factory: pytest.TempPathFactory):
    workdir = tmp_path_factory.mktemp("daemon")
    d = Daemon(test_repository, workdir, tcp_port=free_tcp_port()).start()
    yield d
    assert d.stop() == 0, d.log()
    assert not d.socket_path.exists(), "the daemon left its socket file behind"


@pytest.fixture(params=["ipc", "tcp"])
def url(request: pytest.FixtureRequest, daemon: Daemon) -> str:
    """The session daemon's address, once over ipc:// and once over tcp://."""
    return next(u for u in daemon.urls if u.startswith(request.param))


@pytest.fixture
def client(url: str):
    from torchpool.client import Client

    with Client(url, timeout=30) as c:
        yield c


@pytest.fixture
def prefix():
    """A unique segment name prefix for one test, in the daemon's namespace
    (`torchpool.<id>.<pid>.`); everything under it is removed after."""
    p = f"torchpool.{uuid.uuid4().hex[:8]}.{os.getpid()}.t{uuid.uuid4().hex[:6]}."
    yield p
    remove_segments_with_prefix(p)


@pytest.fixture(scope="session", autouse=True)
def nothing_left_behind():
    """Only what this session made counts: a daemon running beside the suite
    (scripts/run in another terminal) and its segments are not ours."""
    before = set(torchpool_segments())
    yield
    wait_for(lambda: not torchpool_processes(ours_only=True), 30, "torchpool processes to exit")
    strangers = {pid for pid, _ in torchpool_processes()}
    left = {name for name in set(torchpool_segments()) - before if segment_owner(name) not in strangers}
    assert not left, f"shared-memory segments left behind: {sorted(left)}"


def segment_owner(name: str) -> int:
    """The pid in a segment's name (`torchpool.<daemon-id>.<pid>.<tag>`), 0 if none."""
    parts = name.split(".")
    return int(parts[2]) if len(parts) > 3 and parts[2].isdigit() else 0
