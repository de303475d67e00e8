"""An AsyncClient on the daemon's host takes the request lane and direct
paths from its event loop (client/aio_lane.py), as a sync Client does from
its threads: plain calls go straight to the model's worker and are counted
as the daemon's own, many of them in flight on one path at once each get
their own answer, a call past its timeout fails DEADLINE_EXCEEDED and its
late answer is dropped, a path whose worker dies fails its call with the
daemon's words and the next call goes on, requests a path does not take
keep the lane, and a session the daemon ended is said hello to again."""
from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path
from typing import Callable

import numpy as np
import pytest

from torchpool import AsyncClient, Client
from torchpool.client.aio_lane import AsyncLane, AsyncPaths
from torchpool.client.common import encode_control
from torchpool.protocol import errors
from torchpool.protocol.errors import InferenceError

from ..support.daemon import Daemon, daemon_segments
from ..support.models.slow import slow_iterations
from .test_e2e_direct import _busy, _ready_lines, stats, transfer, worker_pid
from .test_e2e_lane import A


@pytest.fixture(scope="module")
def small(small_repository: Path, tmp_path_factory: pytest.TempPathFactory):
    d = Daemon(small_repository, tmp_path_factory.mktemp("async_direct"), "--log-level", "debug").start()
    yield d
    assert d.stop() == 0, d.log()
    assert "Traceback" not in d.log(), d.log()
    assert not daemon_segments(d.urls), "the daemon left shared memory behind"


@pytest.fixture(scope="module")
def observer(small: Daemon):
    """Reads the daemon's counts over ZeroMQ (it sends nothing on lanes or paths)."""
    with Client(small.url, timeout=30, local=False) as c:
        yield c


async def until(predicate: Callable[[], object], timeout: float, what: str) -> None:
    """Wait in the event loop (its readers run meanwhile) until `predicate` holds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.01)


async def open_paths(c: AsyncClient, model: str, inputs: dict) -> None:
    """A call to `model` (on the lane: the client asks for its paths beside
    it), then until the paths are open."""
    await c.infer(model, inputs)
    await until(lambda: c._state.direct.open_path(model, "") is not None, 20, f"the paths to {model}")


def counts(observer: Client) -> tuple[int, int]:
    t = transfer(observer)
    return t.get("requests_direct", 0), t.get("requests_on_lane", 0)


def test_plain_calls_go_on_the_direct_path_and_are_counted(small: Daemon, observer: Client) -> None:
    async def main() -> None:
        async with AsyncClient(small.url, timeout=30) as c:
            direct, lane = counts(observer)
            # the first call goes on the lane while the client asks for paths beside it
            out = await c.infer("addsub", {"INPUT0": A, "INPUT1": A})
            np.testing.assert_array_equal(out["OUTPUT0"], A + A)
            await until(lambda: c._state.direct.open_path("addsub", "") is not None, 20, "the paths")
            assert counts(observer) == (direct, lane + 2)             # the call and the ask
            counted = stats(observer, "addsub")
            for i in range(20):
                out = await c.infer("addsub", {"INPUT0": A + i, "INPUT1": A})
                np.testing.assert_array_equal(out["OUTPUT0"], A + i + A)
                np.testing.assert_array_equal(out["OUTPUT1"], A + i - A)
                # counted before the answer came
                assert stats(observer, "addsub")["inference_count"] == counted["inference_count"] + i + 1
            assert isinstance(c._state.link.lane, AsyncLane)
            assert isinstance(c._state.direct.open_path("addsub", ""), AsyncPaths)
            assert counts(observer) == (direct + 20, lane + 2)
            for i in range(5):                                       # a per-call timeout goes along
                out = await c.infer("addsub", {"INPUT0": A + i, "INPUT1": A}, timeout=20)
                np.testing.assert_array_equal(out["OUTPUT0"], A + i + A)
            assert counts(observer) == (direct + 25, lane + 2)
    asyncio.run(main())


def test_many_concurrent_calls_on_one_path_each_get_their_own_answer(small: Daemon, observer: Client) -> None:
    async def main() -> None:
        async with AsyncClient(small.url, timeout=60) as c:
            await open_paths(c, "addsub", {"INPUT0": A, "INPUT1": A})
            direct, lane = counts(observer)
            xs = [A * i for i in range(200)]
            outs = await asyncio.gather(*(c.infer("addsub", {"INPUT0": x, "INPUT1": A}) for x in xs))
            for x, out in zip(xs, outs):
                np.testing.assert_array_equal(out["OUTPUT0"], x + A)
                np.testing.assert_array_equal(out["OUTPUT1"], x - A)
            # BYTES both ways, concurrently, on a second path
            texts = [[f"a{i}", "bc"] for i in range(50)]
            outs = await asyncio.gather(*(c.infer("strings", {"INPUT__0": t}) for t in texts))
            for t, out in zip(texts, outs):
                assert [s.decode() if isinstance(s, bytes) else s for s in out["OUTPUT__0"]] == \
                    [s.upper() for s in t]
            d, on_lane = counts(observer)
            # the 200 on the paths; the strings calls made while its paths were asked for took the lane
            assert d - direct >= 200 and d - direct + on_lane - lane == 250 + 1     # (and the ask)
    asyncio.run(main())


def test_a_call_past_its_timeout_fails_and_later_calls_get_their_own_answers(small: Daemon,
                                                                             observer: Client) -> None:
    n = slow_iterations(0.5)

    async def main() -> None:
        async with AsyncClient(small.url, timeout=30) as c:
            await open_paths(c, "slow", {"INPUT__0": np.array([5])})
            direct, lane = counts(observer)
            for how in ({"timeout": 0.05}, {}):          # its own timeout, and the client's
                if not how:
                    c.timeout = 0.05
                with pytest.raises(InferenceError) as exc:
                    await c.infer("slow", {"INPUT__0": np.array([n])}, **how)
                assert exc.value.code == errors.DEADLINE_EXCEEDED
                assert c._state.quarantine, "its id is kept for the late answer"
                c.timeout = 30
                # the late answer comes first, meanwhile: each call gets its own
                got = await asyncio.gather(*(c.infer("slow", {"INPUT__0": np.array([i + 1])}) for i in range(3)))
                assert [int(o["OUTPUT__0"][0]) for o in got] == [1, 2, 3]
                await until(lambda: not c._state.quarantine, 10, "the late answer to be taken")
            assert counts(observer) == (direct + 8, lane)
    asyncio.run(main())


def test_a_path_whose_worker_dies_fails_its_call_and_the_next_call_works(small: Daemon,
                                                                         observer: Client) -> None:
    async def main() -> None:
        async with AsyncClient(small.url, timeout=60) as c:
            await open_paths(c, "slow", {"INPUT__0": np.array([1], dtype=np.int64)})
            pid = worker_pid(small, "slow")
            before = _ready_lines(small, "slow")
            failed = stats(observer, "slow")["inference_stats"]["fail"]["count"]
            started = time.monotonic()
            call = asyncio.ensure_future(
                c.infer("slow", {"INPUT__0": np.array([slow_iterations(30)], dtype=np.int64)}))
            await until(lambda: _busy(pid), 20, "the slow request to run")
            os.kill(pid, 9)
            with pytest.raises(InferenceError) as exc:
                await call
            # worded as the daemon words its own: the instance, how it died
            assert exc.value.code == errors.INTERNAL, exc.value
            assert "'slow'" in exc.value.message and "SIGKILL" in exc.value.message, exc.value
            assert time.monotonic() - started < 20
            assert stats(observer, "slow")["inference_stats"]["fail"]["count"] == failed + 1
            await until(lambda: _ready_lines(small, "slow") > before, 30, "a new instance of slow")
            direct, _ = counts(observer)
            # the next call takes the lane while new paths are asked for beside it
            await open_paths(c, "slow", {"INPUT__0": np.array([3], dtype=np.int64)})
            assert counts(observer)[0] == direct
            out = await c.infer("slow", {"INPUT__0": np.array([4], dtype=np.int64)})     # a new path
            assert out["OUTPUT__0"].tolist() == [4]
            assert counts(observer)[0] == direct + 1
    asyncio.run(main())


def test_requests_a_path_does_not_take_keep_the_lane(small: Daemon, observer: Client) -> None:
    async def main() -> None:
        async with AsyncClient(small.url, timeout=30) as c:
            await open_paths(c, "addsub", {"INPUT0": A, "INPUT1": A})
            direct, lane = counts(observer)
            out = await c.infer("addsub", {"INPUT0": A, "INPUT1": A}, priority=1)      # a priority
            np.testing.assert_array_equal(out["OUTPUT0"], A + A)
            big = np.arange(1 << 16, dtype=np.float32)                   # 256 KiB: in the arena
            np.testing.assert_array_equal((await c.infer("identity", {"INPUT__0": big}))["OUTPUT__0"], big)
            assert counts(observer) == (direct, lane + 2)                # no path asked for either
            # and from a client that is not local: over ZeroMQ, as before
            async with AsyncClient(small.url, timeout=30, local=False) as remote:
                out = await remote.infer("addsub", {"INPUT0": A, "INPUT1": A})
                np.testing.assert_array_equal(out["OUTPUT1"], A - A)
            assert counts(observer) == (direct, lane + 2)
    asyncio.run(main())


def test_a_session_the_daemon_ended_is_said_hello_to_again(small: Daemon, observer: Client) -> None:
    async def main() -> None:
        async with AsyncClient(small.url, timeout=30) as c:
            await open_paths(c, "addsub", {"INPUT0": A, "INPUT1": A})
            old = c.session
            lane, path = c._state.link.lane, c._state.direct.open_path("addsub", "")
            rid = next(c._ids)                       # the session ends: its lane and paths close
            await c._call(encode_control(rid, "goodbye", session=old), rid, 10)
            await until(lambda: lane.lost and path.lost, 10, "the lane and the path to close")
            for i in range(3):
                out = await c.infer("addsub", {"INPUT0": A + i, "INPUT1": A})
                np.testing.assert_array_equal(out["OUTPUT0"], A + i + A)
            assert c.session is not None and c.session != old and c.is_local
            direct, _ = counts(observer)
            await c.infer("addsub", {"INPUT0": A, "INPUT1": A})
            assert counts(observer)[0] == direct + 1              # a new path
    asyncio.run(main())


def test_an_unversioned_and_a_numbered_call_share_a_path_or_take_the_lane(daemon: Daemon) -> None:
    """The daemon keeps one path per session and model version (asking
    again replaces it): concurrent calls naming one version two ways never
    make it close a path under a call in flight."""
    async def main() -> None:
        async with AsyncClient(daemon.url, timeout=30) as c:
            x = np.array([[1.0, 2.0, 3.0, 4.0]], np.float32)
            for _ in range(5):
                got = await asyncio.gather(*(c.infer("versioned_all", {"INPUT0": x}, version=v)
                                             for v in (1, 2, 3, None, 3, None)))
                assert [float(r["OUTPUT0"][0, 0]) for r in got] == [1.0, 2.0, 3.0, 3.0, 3.0, 3.0]
    asyncio.run(main())


def test_a_model_of_two_instances_gets_a_path_to_each_and_calls_go_to_a_free_one(daemon: Daemon) -> None:
    """slow_x2 runs two instances: the client holds a path to each, and a
    tiny call made while a long one runs on one instance goes to the other
    (it answers first), both on the paths."""
    n = slow_iterations(0.5)

    async def main() -> None:
        async with AsyncClient(daemon.url, timeout=60) as c, \
                AsyncClient(daemon.url, timeout=60, local=False) as observer:
            await open_paths(c, "slow_x2", {"INPUT__0": np.array([5])})
            paths = c._state.direct.open_path("slow_x2", "")
            assert isinstance(paths, AsyncPaths) and len(paths.members) == 2
            before = (await observer.server_metadata())["transfer"].get("requests_direct", 0)
            order: list[str] = []

            async def one(tag: str, k: int) -> None:
                out = await c.infer("slow_x2", {"INPUT__0": np.array([k])})
                assert int(out["OUTPUT__0"][0]) == k
                order.append(tag)

            long = asyncio.ensure_future(one("long", n))
            await asyncio.sleep(0)           # the long call goes first (not a wait for anything)
            await asyncio.gather(long, one("tiny", 3))
            assert order == ["tiny", "long"]
            after = (await observer.server_metadata())["transfer"].get("requests_direct", 0)
            assert after - before == 2

    asyncio.run(main())


def test_a_model_with_dynamic_batching_keeps_an_async_clients_calls_on_the_lane(daemon: Daemon) -> None:
    """The daemon batches every caller's requests across its instances: an
    AsyncClient is refused paths to each, and its calls keep the lane."""
    async def main() -> None:
        async with AsyncClient(daemon.url, timeout=60) as c:
            for _ in range(3):
                xs = [np.full((1, 1), k, np.float32) for k in range(4)]
                outs = await asyncio.gather(*(c.infer("batch_probe", {"INPUT__0": x}) for x in xs))
                for x, out in zip(xs, outs):
                    np.testing.assert_array_equal(out["OUTPUT__1"], x)
                assert all(1 <= int(out["OUTPUT__0"][0, 0]) <= 4 for out in outs)
            await until(lambda: not c._asking, 20, "the client's ask for paths to end")
            assert c._state.direct.open_path("batch_probe", "") is None
            assert not c._state.direct.due("batch_probe", "")       # refused: asked again later

    asyncio.run(main())


def test_calls_waiting_for_an_instance_take_turns_by_caller(small: Daemon, observer: Client) -> None:
    """One caller's many calls do not all go before another caller's one
    (a gateway's connections: gateway/backend.py names each call's caller).
    The model's one worker is stopped (SIGSTOP) while the calls arrive, so
    what waits where is the test's doing: two of caller a's eight calls at
    the worker (one running, one sent ahead), six waiting in the client;
    then caller b's one call waits beside them. Once the worker runs
    again, each freed place goes to the next caller in turn: a's third
    call, then b's, then the rest of a's (in arrival order, b's call would
    have been the ninth answered)."""
    async def main() -> None:
        async with AsyncClient(small.url, timeout=60) as c:
            await open_paths(c, "slow", {"INPUT__0": np.array([1])})
            paths = c._state.direct.open_path("slow", "")
            assert isinstance(paths, AsyncPaths) and len(paths.members) == 1
            order: list[str] = []

            async def one(tag: str, k: int) -> None:
                out = await c.infer("slow", {"INPUT__0": np.array([k])}, caller=tag[0])
                assert int(out["OUTPUT__0"][0]) == k
                order.append(tag)

            (row,) = observer.statistics("slow")["model_stats"][0]["instances"]
            worker = row["pid"]              # (an earlier test may have replaced the first one)
            os.kill(worker, signal.SIGSTOP)
            try:
                calls = [asyncio.ensure_future(one(f"a{i}", i)) for i in range(1, 9)]
                await until(lambda: paths.waiting() == {"a": 6}, 20, "six of a's calls waiting")
                calls.append(asyncio.ensure_future(one("b1", 100)))
                await until(lambda: paths.waiting() == {"a": 6, "b": 1}, 20, "b's call waiting beside them")
                assert order == []
            finally:
                os.kill(worker, signal.SIGCONT)
            await asyncio.gather(*calls)
            assert order == ["a1", "a2", "a3", "b1", "a4", "a5", "a6", "a7", "a8"]

    asyncio.run(main())
