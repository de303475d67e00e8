"""End to end: the client library (sync and asyncio) against the real daemon."""
from __future__ import annotations

import asyncio
import time
from pathlib import Path

import numpy as np
import pytest

from torchpool.client import AsyncClient, Client
from torchpool.protocol import errors
from torchpool.protocol.errors import InferenceError

from ..support.models.slow import slow_iterations

F32 = "libtorch_float32_float32_float32"


def addsub(i: int) -> dict:
    return {"INPUT__0": np.full((1, 16), float(i), np.float32),
            "INPUT__1": np.arange(16, dtype=np.float32).reshape(1, 16)}


def test_async_client_control_calls(url: str) -> None:
    async def main() -> None:
        async with AsyncClient(url, timeout=30) as c:
            live, ready, model_ready, not_ready, meta, cfg, index = await asyncio.gather(
                c.server_live(), c.server_ready(), c.model_ready(F32), c.model_ready(F32, 5),
                c.model_metadata("versioned_all"), c.model_config(F32), c.repository_index())
            assert live is True and ready is False
            assert model_ready is True and not_ready is False
            assert meta["versions"] == ["1", "2", "3"]
            assert cfg["max_batch_size"] == 8
            assert any(r["name"] == F32 and r["state"] == "READY" for r in index)
            with pytest.raises(InferenceError) as exc:
                await c.model_metadata("no_such_model")
            assert exc.value.code == errors.NOT_FOUND
    asyncio.run(main())


def test_async_client_many_concurrent_infers(url: str) -> None:
    async def main() -> None:
        async with AsyncClient(url, timeout=60) as c:
            inputs = [addsub(i) for i in range(100)]
            results = await asyncio.gather(*(c.infer(F32, x) for x in inputs))
            for x, r in zip(inputs, results):
                assert np.array_equal(r["OUTPUT__0"], x["INPUT__0"] + x["INPUT__1"])
                assert np.array_equal(r["OUTPUT__1"], x["INPUT__0"] - x["INPUT__1"])
            # versions and a subset of outputs, concurrently
            x4 = np.array([[1.0, 2.0, 3.0, 4.0]], np.float32)
            by_version = await asyncio.gather(*(c.infer("versioned_all", {"INPUT0": x4}, version=v)
                                                for v in (1, 2, 3, None)))
            assert [float(r["OUTPUT0"][0, 0]) for r in by_version] == [1.0, 2.0, 3.0, 3.0]
            subset = await c.infer(F32, addsub(3), outputs=["OUTPUT__1"])
            assert list(subset) == ["OUTPUT__1"]
    asyncio.run(main())


def test_async_clients_side_by_side(url: str) -> None:
    async def one(k: int) -> None:
        async with AsyncClient(url, timeout=60) as c:
            texts = [f"client{k}-{i}" for i in range(20)]
            results = await asyncio.gather(*(c.infer("string_io", {"INPUT__0": [t]}) for t in texts))
            assert [r["OUTPUT__0"][0] for r in results] == [t[::-1].encode() for t in texts]

    async def main() -> None:
        await asyncio.gather(*(one(k) for k in range(4)))
    asyncio.run(main())


def test_async_errors_are_per_request(url: str) -> None:
    async def main() -> None:
        async with AsyncClient(url, timeout=30) as c:
            good, bad, unknown = await asyncio.gather(
                c.infer(F32, addsub(1)),
                c.infer(F32, {"INPUT__0": np.ones((1, 3), np.float32),
                              "INPUT__1": np.ones((1, 3), np.float32)}),
                c.infer("nope", addsub(1)), return_exceptions=True)
            assert np.array_equal(good["OUTPUT__0"], addsub(1)["INPUT__0"] + addsub(1)["INPUT__1"])
            assert isinstance(bad, InferenceError) and bad.code == errors.INVALID_ARG
            assert isinstance(unknown, InferenceError) and unknown.code == errors.NOT_FOUND
    asyncio.run(main())


def test_client_timeout_without_a_server(tmp_path: Path) -> None:
    url = f"ipc://{tmp_path / 'nobody.sock'}"
    with Client(url, timeout=0.2) as c:
        started = time.monotonic()
        with pytest.raises(InferenceError) as exc:
            c.server_live()
        assert time.monotonic() - started < 5
    assert exc.value.code == errors.UNAVAILABLE and url in exc.value.message

    async def main() -> None:
        async with AsyncClient(url, timeout=0.2) as c:
            with pytest.raises(InferenceError) as exc:
                await c.server_live()
            assert exc.value.code == errors.UNAVAILABLE
    asyncio.run(main())


def test_late_answer_of_a_timed_out_call_is_discarded(daemon) -> None:
    n = slow_iterations(0.3)
    with Client(daemon.url, timeout=30) as c:
        c.infer("slow", {"INPUT__0": np.array([10])})           # warm
        with pytest.raises(InferenceError) as exc:
            c.infer("slow", {"INPUT__0": np.array([n])}, timeout=0.02)
        assert exc.value.code == errors.DEADLINE_EXCEEDED   # reachable, just slow
        # the slow answer arrives now, but this call gets its own answer
        result = c.infer(F32, addsub(5))
        assert np.array_equal(result["OUTPUT__0"], addsub(5)["INPUT__0"] + addsub(5)["INPUT__1"])
        assert int(c.infer("slow", {"INPUT__0": np.array([7])})["OUTPUT__0"][0]) == 7


def test_closed_async_client_fails_pending_calls(daemon) -> None:
    n = slow_iterations(0.3)

    async def main() -> None:
        c = AsyncClient(daemon.url, timeout=30)
        pending = asyncio.ensure_future(c.infer("slow", {"INPUT__0": np.array([n])}))
        await asyncio.sleep(0)
        c.close()
        with pytest.raises(InferenceError) as exc:
            await pending
        assert exc.value.code == errors.CANCELLED
    asyncio.run(main())
    with Client(daemon.url, timeout=30) as c:      # the daemon does not mind
        assert int(c.infer("slow", {"INPUT__0": np.array([3])})["OUTPUT__0"][0]) == 3


def test_outputs_stay_valid_after_later_calls(client: Client) -> None:
    big = np.arange(1 << 18, dtype=np.float32)       # 1 MiB: payload frames
    out = client.infer("identity_fp32", {"INPUT__0": big})["OUTPUT__0"]
    small = client.infer("identity_fp32", {"INPUT__0": big[:10]})["OUTPUT__0"]
    other = client.infer("identity_fp32", {"INPUT__0": -big})["OUTPUT__0"]
    assert np.array_equal(out, big) and np.array_equal(small, big[:10])
    assert np.array_equal(other, -big)


# --- outputs that are views of an input, over inline frames ---------------------------

def test_inline_outputs_that_are_views_of_an_input_are_sent_from_it(url: str, daemon) -> None:
    from ..support.daemon import daemon_segments

    n = 1 << 18                                                    # 1 MiB of FP32
    x = np.arange(n, dtype=np.float32)
    with Client(url, timeout=30, local=False) as c:
        t0 = c.server_metadata()["transfer"]
        out = c.infer("input_views", {"INPUT__0": x})
        np.testing.assert_array_equal(out["OUTPUT__0"], x)
        np.testing.assert_array_equal(out["OUTPUT__1"], x[8:])
        np.testing.assert_array_equal(out["OUTPUT__2"], x[::2])
        t1 = c.server_metadata()["transfer"]
        # x and x[8:] left from the block the broker copied the input into (no worker
        # copy); the strided x[::2] was written by the worker; all three were sent
        assert t1["output_bytes_reused"] - t0.get("output_bytes_reused", 0) == 2 * x.nbytes - 32
        assert t1["output_bytes_sent"] - t0.get("output_bytes_sent", 0) == 2 * x.nbytes - 32 + x.nbytes // 2
        # each input block is freed once its answer has been sent: 200 MiB through a
        # 64 MiB arena without it growing, every answer its own
        arena = {s for s in daemon_segments(daemon.urls) if ".in" in s}
        for i in range(200):
            y = c.infer("identity_fp32", {"INPUT__0": np.full(n, i, np.float32)})["OUTPUT__0"]
            assert y[0] == y[-1] == i
        assert {s for s in daemon_segments(daemon.urls) if ".in" in s} == arena


def test_concurrent_inline_views_never_see_another_requests_bytes(url: str) -> None:
    n = 1 << 18
    errors_seen: list[str] = []

    def caller(k: int) -> None:
        with Client(url, timeout=60, local=False) as c:
            for i in range(30):
                value = float(k * 1000 + i)
                y = c.infer("identity_fp32", {"INPUT__0": np.full(n, value, np.float32)})["OUTPUT__0"]
                if not (y.min() == y.max() == value):
                    errors_seen.append(f"caller {k} request {i}: got {y.min()}..{y.max()}")

    import threading
    threads = [threading.Thread(target=caller, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors_seen
