"""End to end: isolation between models, parallel instances, one answer per request.

No absolute timings: what is asserted is ordering (which answer came first)
and overlap (answers that arrived while a slow request was still running).
"""
from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest

from torchpool.client import AsyncClient, Client
from torchpool.protocol import errors
from torchpool.protocol.errors import InferenceError

from ..support.daemon import RawConnection
from ..support.models.slow import slow_iterations

F32 = "libtorch_float32_float32_float32"
TINY = 2000          # iterations of `slow` that take a few ms at most, even cold


@pytest.fixture(scope="module")
def long_iterations(daemon) -> int:
    """Iterations of `slow` for about half a second; both slow models warmed up."""
    n = slow_iterations(0.5)

    async def warm() -> None:
        async with AsyncClient(daemon.url, timeout=60) as c:
            for _ in range(3):   # the profiling executor's first calls are slower
                await asyncio.gather(*(c.infer(model, {"INPUT__0": np.array([TINY])})
                                       for model in ("slow", "slow_x2", "slow_x2")))
    asyncio.run(warm())
    return n


def addsub(i: int) -> dict:
    return {"INPUT__0": np.full((1, 16), float(i), np.float32),
            "INPUT__1": np.arange(16, dtype=np.float32).reshape(1, 16)}


def check_addsub(i: int, result: dict) -> None:
    inputs = addsub(i)
    assert np.array_equal(result["OUTPUT__0"], inputs["INPUT__0"] + inputs["INPUT__1"])
    assert np.array_equal(result["OUTPUT__1"], inputs["INPUT__0"] - inputs["INPUT__1"])


def test_slow_model_does_not_block_others_threads(url: str, long_iterations: int) -> None:
    """A fast model answers, again and again, while `slow` computes (separate clients)."""
    sent = threading.Event()
    span: dict[str, float] = {}

    def run_slow() -> None:
        with Client(url, timeout=60) as c:
            sent.set()
            span["start"] = time.monotonic()
            out = c.infer("slow", {"INPUT__0": np.array([long_iterations])})
            span["end"] = time.monotonic()
            span["value"] = int(out["OUTPUT__0"][0])

    thread = threading.Thread(target=run_slow)
    thread.start()
    assert sent.wait(10)
    answered: list[float] = []
    with Client(url, timeout=30) as c:
        i = 0
        while thread.is_alive():
            check_addsub(i, c.infer(F32, addsub(i)))
            answered.append(time.monotonic())
            i += 1
    thread.join()
    assert span["value"] == long_iterations
    start, end = span["start"], span["end"]
    middle = start + (end - start) / 2
    during = [t for t in answered if start < t < end]
    late = [t for t in answered if middle < t < end]
    assert len(during) >= 5, (len(during), end - start)
    assert late, "no fast answer in the second half of the slow request"


def test_slow_model_does_not_block_others_one_socket(url: str, long_iterations: int) -> None:
    """Slow sent first on one socket: the fast answers overtake it."""
    async def main() -> list[str]:
        order: list[str] = []
        async with AsyncClient(url, timeout=60) as c:
            async def one(tag: str, coro) -> None:
                result = await coro
                order.append(tag)
                return result

            slow = asyncio.ensure_future(one("slow", c.infer("slow", {"INPUT__0": np.array([long_iterations])})))
            await asyncio.sleep(0)   # let the slow request go out first
            fast = [asyncio.ensure_future(one(f"fast{i}", c.infer(F32, addsub(i)))) for i in range(10)]
            results = await asyncio.gather(*fast)
            for i, result in enumerate(results):
                check_addsub(i, result)
            assert int((await slow)["OUTPUT__0"][0]) == long_iterations
        return order
    order = asyncio.run(main())
    assert order[-1] == "slow", order


def overtaking(url: str, model: str, long_iterations: int) -> list[str]:
    """Send a long, then a tiny request to `model` on one socket; the order of answers."""
    async def main() -> list[str]:
        order: list[str] = []
        async with AsyncClient(url, timeout=60) as c:
            async def one(tag: str, n: int) -> None:
                out = await c.infer(model, {"INPUT__0": np.array([n])})
                assert int(out["OUTPUT__0"][0]) == n
                order.append(tag)
            long = asyncio.ensure_future(one("long", long_iterations))
            await asyncio.sleep(0)
            await asyncio.gather(long, one("tiny", TINY))
        return order
    return asyncio.run(main())


def test_two_instances_run_in_parallel(url: str, long_iterations: int) -> None:
    # slow_x2 has two instances: the tiny request does not wait for the long one
    assert overtaking(url, "slow_x2", long_iterations) == ["tiny", "long"]


def test_one_instance_runs_one_request_at_a_time(url: str, long_iterations: int) -> None:
    # the control experiment: with one instance the tiny request queues behind
    assert overtaking(url, "slow", long_iterations) == ["long", "tiny"]


def test_200_concurrent_async_requests(url: str) -> None:
    async def main() -> None:
        async with AsyncClient(url, timeout=60) as c:
            results = await asyncio.gather(*(c.infer(F32, addsub(i)) for i in range(200)))
            for i, result in enumerate(results):
                check_addsub(i, result)
            # several models at once, each answer its own
            texts = [[f"t{i}", "x" * (i % 5)] for i in range(50)]
            mixed = await asyncio.gather(
                *(c.infer("string_io", {"INPUT__0": t}) for t in texts),
                *(c.infer("versioned_all", {"INPUT0": np.full((1, 4), float(i), np.float32)},
                          version=1 + i % 3) for i in range(30)),
                *(c.infer("multi_instance", addsub(i)) for i in range(40)))
            for t, result in zip(texts, mixed[:50]):
                assert result["OUTPUT__0"].tolist() == [s[::-1].encode() for s in t]
            for i, result in enumerate(mixed[50:80]):
                assert np.array_equal(result["OUTPUT0"], np.full((1, 4), float(i * (1 + i % 3)),
                                                                  np.float32))
            for i, result in enumerate(mixed[80:]):
                check_addsub(i, result)
    asyncio.run(main())


def test_exactly_one_answer_per_request_raw(url: str) -> None:
    """200 requests on one DEALER, good and bad mixed: 200 answers, one per id."""
    with RawConnection(url) as raw:
        x = np.arange(16, dtype=np.float32).tobytes()
        for i in range(200):
            shape = [1, 16] if i % 4 else [1, 8]          # every 4th is invalid
            raw.send(raw.pack({"v": 1, "op": "infer", "id": i, "model": F32, "version": "",
                               "inputs": [{"name": "INPUT__0", "datatype": "FP32", "shape": shape,
                                           "data": x if i % 4 else x[:32]},
                                          {"name": "INPUT__1", "datatype": "FP32", "shape": shape,
                                           "data": x if i % 4 else x[:32]}],
                               "outputs": ["OUTPUT__0"], "timeout_us": 0}))
        seen: dict[int, dict] = {}
        for _ in range(200):
            header, _frames = raw.recv(timeout=30)
            assert header["id"] not in seen, f"second answer for {header['id']}"
            seen[header["id"]] = header
        assert sorted(seen) == list(range(200))
        for i, header in seen.items():
            assert header["ok"] is bool(i % 4), header
            if i % 4:
                out = np.frombuffer(header["outputs"][0]["data"], np.float32)
                assert np.array_equal(out, np.arange(16, dtype=np.float32) * 2)
            else:
                assert header["error"]["code"] == errors.INVALID_ARG
        assert not raw.pending(0.2), "an extra answer arrived"


def test_bad_requests_do_not_affect_concurrent_good_ones(url: str) -> None:
    async def main() -> None:
        async with AsyncClient(url, timeout=60) as c:
            calls = []
            for i in range(40):
                sign = -1.0 if i % 3 == 0 else 1.0
                x = np.full((1, 4), sign * (i + 1), np.float32)
                calls.append(c.infer("raise_on_negative", {"INPUT__0": x}))
            outcomes = await asyncio.gather(*calls, return_exceptions=True)
            for i, outcome in enumerate(outcomes):
                if i % 3 == 0:
                    assert isinstance(outcome, InferenceError), outcome
                    assert outcome.code == errors.INTERNAL
                    assert "boom: input sum is negative" in outcome.message
                else:
                    assert np.array_equal(outcome["OUTPUT__0"], np.full((1, 4), i + 1.0, np.float32))
    asyncio.run(main())


def test_threads_with_their_own_clients(url: str) -> None:
    failures: list[BaseException] = []

    def worker(k: int) -> None:
        try:
            with Client(url, timeout=60) as c:
                for i in range(30):
                    check_addsub(k * 100 + i, c.infer("multi_instance", addsub(k * 100 + i)))
                    texts = [f"{k}-{i}", "abc"]
                    out = c.infer("string_io", {"INPUT__0": texts})["OUTPUT__0"].tolist()
                    assert out == [t[::-1].encode() for t in texts]
        except BaseException as exc:   # reported by the main thread
            failures.append(exc)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures, failures


def test_queued_request_times_out(url: str, long_iterations: int) -> None:
    """A request still queued when its timeout expires gets UNAVAILABLE, once."""
    with RawConnection(url) as raw:
        def slow_request(request_id: int, n: int, timeout_us: int) -> bytes:
            return raw.pack({"v": 1, "op": "infer", "id": request_id, "model": "slow", "version": "",
                             "inputs": [{"name": "INPUT__0", "datatype": "INT64", "shape": [1],
                                         "data": np.array([n], np.int64).tobytes()}],
                             "outputs": None, "timeout_us": timeout_us})
        raw.send(slow_request(1, long_iterations, 0))
        raw.send(slow_request(2, TINY, 20_000))       # queued behind request 1
        first, _ = raw.recv(timeout=30)
        second, _ = raw.recv(timeout=30)
        assert first["id"] == 2 and first["ok"] is False, first
        assert first["error"]["code"] == errors.UNAVAILABLE
        assert "Request timeout expired" in first["error"]["message"]
        assert second["id"] == 1 and second["ok"] is True
        assert not raw.pending(0.1)


def test_concurrent_batched_strings_each_get_their_own(url: str) -> None:
    """string_batched has dynamic batching: whatever is batched, each gets its own slice."""
    async def main() -> None:
        async with AsyncClient(url, timeout=60) as c:
            requests = [[f"r{i}-{j}" + "q" * (i % 4) for j in range(1 + i % 3)] for i in range(24)]
            results = await asyncio.gather(*(
                c.infer("string_batched", {"INPUT__0": np.array([[t.encode()] for t in texts],
                                                                  dtype=object)})
                for texts in requests))
            for texts, result in zip(requests, results):
                assert result["OUTPUT__0"].reshape(-1).tolist() == [t[::-1].encode() for t in texts]
                assert result["OUTPUT__1"].reshape(-1).tolist() == [len(t) for t in texts]
                assert result["OUTPUT__1"].shape == (len(texts), 1)
    asyncio.run(main())


def test_concurrent_batch_probe_rows_come_back_to_their_request(url: str) -> None:
    async def main() -> None:
        async with AsyncClient(url, timeout=60) as c:
            sizes = [1 + i % 3 for i in range(12)]
            inputs = [np.arange(n, dtype=np.float32).reshape(n, 1) + 100 * i
                      for i, n in enumerate(sizes)]
            results = await asyncio.gather(*(c.infer("batch_probe", {"INPUT__0": x}) for x in inputs))
            for x, result in zip(inputs, results):
                assert np.array_equal(result["OUTPUT__1"], x)
                batch = result["OUTPUT__0"].reshape(-1)
                assert len(set(batch.tolist())) == 1           # one execution per request's rows
                assert len(x) <= batch[0] <= 8
    asyncio.run(main())


def test_a_request_waits_for_the_instance_that_frees_first_not_behind_a_long_one(
        url: str, long_iterations: int) -> None:
    """A busy instance of a model with several is sent its next request ahead
    only while the model's executions average under 2 ms (rules/ahead.py);
    slow_x2's are far longer, so with both instances busy (long, medium) the
    tiny request stays queued and runs on the one that frees first, not
    behind the long one."""
    medium = max(TINY * 10, long_iterations // 8)

    async def main() -> list[str]:
        order: list[str] = []
        async with AsyncClient(url, timeout=60) as c:
            async def one(tag: str, n: int) -> None:
                out = await c.infer("slow_x2", {"INPUT__0": np.array([n])})
                assert int(out["OUTPUT__0"][0]) == n
                order.append(tag)
            await one("warm", medium)     # its mean execution is well over 2 ms whatever ran before
            await asyncio.gather(one("long", long_iterations), one("medium", medium), one("tiny", TINY))
        return order
    assert asyncio.run(main()) == ["warm", "medium", "tiny", "long"]
