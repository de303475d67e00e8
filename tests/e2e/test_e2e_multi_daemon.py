"""End to end: one client over two daemons, one of them killed mid-load.

With `retries=1` no request is lost and every answer is right; with
`retries=0` the requests the dead daemon held fail with a clear error and
the next ones go to the survivor; the health check brings a daemon that
was restarted on the same socket back into the rotation.
"""
from __future__ import annotations

import signal
from pathlib import Path

import pytest

from torchpool.client import Client, MultiClient, NoAnswer
from torchpool.protocol import errors

from ..support.daemon import Daemon, wait_for
from ..support.load import Load


@pytest.fixture
def pair(small_repository: Path, tmp_path: Path):
    daemons = [Daemon(small_repository, tmp_path / name) for name in ("a", "b")]
    try:
        for d in daemons:
            d.socket_path.parent.mkdir()
            d.start()
        yield daemons
    finally:
        for d in daemons:
            if d.proc is not None and d.proc.poll() is None:
                assert d.stop() == 0, d.log()


def served(client: MultiClient, url: str) -> int:
    return next(d["served"] for d in client.daemons() if d["url"] == url)


def is_up(client: MultiClient, url: str) -> bool:
    return next(d["up"] for d in client.daemons() if d["url"] == url)


def test_a_daemon_killed_mid_load_loses_nothing_with_retries_and_comes_back(pair: list[Daemon]) -> None:
    a, b = pair
    with Client([a.url, b.url], timeout=30, retries=1, health_interval=0.2) as c:
        assert isinstance(c, MultiClient)
        with Load(c) as load:
            wait_for(lambda: served(c, a.url) >= 100 and served(c, b.url) >= 100, 30, "both daemons to serve")
            a.stop(signal.SIGKILL)
            after_kill = served(c, b.url)
            wait_for(lambda: served(c, b.url) >= after_kill + 300, 30, "the survivor to serve on")
        assert load.errors == [] and load.wrong == [], (load.errors[:3], load.wrong[:3])
        assert not is_up(c, a.url)
        lost = next(d for d in c.daemons() if d["url"] == a.url)
        assert lost["failed"] >= 1 and a.url in lost["why"], lost     # requests did fail there, and moved

        a.start()                                   # the same socket path, a new daemon
        wait_for(lambda: is_up(c, a.url), 30, "the health check to bring the restarted daemon back")
        before = served(c, a.url)
        with Load(c) as load:
            wait_for(lambda: served(c, a.url) >= before + 50, 30, "requests to reach it again")
        assert load.errors == [] and load.wrong == [], (load.errors[:3], load.wrong[:3])


def test_without_retries_the_dead_daemons_requests_fail_clearly_then_the_survivor_serves(
        pair: list[Daemon]) -> None:
    a, b = pair
    with Client([a.url, b.url], timeout=30, health_interval=0.2) as c:
        with Load(c) as load:
            wait_for(lambda: served(c, a.url) >= 100 and served(c, b.url) >= 100, 30, "both daemons to serve")
            b.stop(signal.SIGKILL)
            wait_for(lambda: not is_up(c, b.url), 30, "the killed daemon to be marked down")
            after_kill = served(c, a.url)
            wait_for(lambda: served(c, a.url) >= after_kill + 300, 30, "the survivor to serve on")
            failures = len(load.errors)
            wait_for(lambda: served(c, a.url) >= after_kill + 600, 30, "the survivor to serve more")
        # what failed was the dead daemon's, said clearly; nothing failed after it was marked down
        assert len(load.errors) == failures and load.wrong == []
        for _, exc in load.errors:
            assert isinstance(exc, NoAnswer) and exc.code == errors.UNAVAILABLE, exc
            assert b.url in exc.message, exc.message
        assert sum(load.answered) >= 800
        assert not is_up(c, b.url) and is_up(c, a.url)
