"""Dynamic batching with Triton's semantics.

End to end (a daemon on the repository of tests/support/models/batching_repository.py):
concurrent requests are batched (fewer executions than requests) and each gets exactly
its own rows and strings; the queue delay is honoured; preferred sizes send
at once; max_batch_size is never exceeded; shapes are not mixed; priorities
are served first; timeouts REJECT and DELAY; a full queue rejects at once;
preserve_ordering; ragged inputs with every batch_input kind and a
batch_output; outputs lent to a local client as sub-ranges; a worker crash
fails every request of its batch; statistics count executions and items.

Unit tests of the batcher's rules (no processes) come first.
"""
from __future__ import annotations

import asyncio
import os
import signal
import time

import msgpack
import numpy as np
import pytest

from torchpool.client import AsyncClient, Client, decode_infer
from torchpool.protocol import errors
from torchpool.protocol.errors import InferenceError

from ..support.models.batching_repository import build_batching_repository
from ..support.daemon import free_tcp_port
from ..support.daemon import Daemon, RawConnection, wait_for, worker_pids

# ================================================================ unit tests

# ================================================================ end to end

@pytest.fixture(scope="module")
def bdaemon(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("batching_repository")
    build_batching_repository(root)
    d = Daemon(root, tmp_path_factory.mktemp("batching_daemon"), "--log-level", "debug",
               tcp_port=free_tcp_port()).start()
    yield d
    assert d.stop() == 0, d.log()


@pytest.fixture(params=["ipc", "tcp"])
def burl(request: pytest.FixtureRequest, bdaemon: Daemon) -> str:
    return next(u for u in bdaemon.urls if u.startswith(request.param))


def probe_inputs(x: np.ndarray, pause: float = 0.0) -> dict:
    return {"INPUT__0": x, "PAUSE__1": np.full((x.shape[0], 1), pause, np.float32)}


def stats_of(url: str, model: str) -> dict:
    with Client(url, timeout=10, local=False) as c:
        return c.statistics(model)["model_stats"][0]


def stats_delta(before: dict, after: dict) -> dict:
    sizes = lambda s: {b["batch_size"]: b["compute_infer"]["count"] for b in s["batch_stats"]}  # noqa: E731
    b_sizes, a_sizes = sizes(before), sizes(after)
    return {"executions": after["execution_count"] - before["execution_count"],
            "items": after["inference_count"] - before["inference_count"],
            "queued": after["inference_stats"]["queue"]["count"] - before["inference_stats"]["queue"]["count"],
            "success": after["inference_stats"]["success"]["count"] - before["inference_stats"]["success"]["count"],
            "sizes": {k: v - b_sizes.get(k, 0) for k, v in a_sizes.items() if v != b_sizes.get(k, 0)}}


async def gather_infer(url: str, model: str, inputs: list[dict], **kw) -> list:
    async with AsyncClient(url, timeout=60, **kw) as c:
        return await asyncio.gather(*(c.infer(model, i) for i in inputs))


class Raw:
    """Requests spoken by hand, for the header fields the client has no argument for."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.conn = RawConnection(url)
        self.sent: dict = {}

    def send(self, rid, model: str, x: np.ndarray, pause: float = 0.0, **fields) -> None:
        inputs = probe_inputs(x, pause)
        header = {"v": 1, "op": "infer", "id": rid, "model": model, "version": "", "outputs": None,
                  "timeout_us": 0, **fields,
                  "inputs": [{"name": k, "datatype": "FP32", "shape": list(v.shape), "data": v.tobytes()}
                             for k, v in inputs.items()]}
        self.sent[rid] = time.monotonic()
        self.conn.send(msgpack.packb(header, use_bin_type=True))

    def dispatched(self, model: str) -> int:
        """Requests of `model` that have left the queue for a worker."""
        with RawConnection(self.url) as rc:
            header, _ = rc.call(msgpack.packb({"v": 1, "op": "statistics", "id": 0, "model": model},
                                              use_bin_type=True))
        return header["result"]["model_stats"][0]["inference_stats"]["queue"]["count"]

    def send_running(self, rid, model: str, x: np.ndarray, pause: float = 0.0, **fields) -> None:
        """Send, then wait (with a deadline) until a worker is running it."""
        before = self.dispatched(model)
        self.send(rid, model, x, pause, **fields)
        wait_for(lambda: self.dispatched(model) > before, 10, f"request {rid!r} to reach a worker")

    def collect(self, n: int, timeout: float = 30.0) -> list[tuple]:
        """[(id, ok, outputs or error, seconds after sending)] in arrival order."""
        got = []
        for _ in range(n):
            header, frames = self.conn.recv(timeout)
            rid = header["id"]
            took = time.monotonic() - self.sent[rid]
            got.append((rid, header["ok"], decode_infer(header, frames) if header["ok"] else header["error"], took))
        assert not self.conn.pending(0.05), "an extra answer arrived"
        return got

    def close(self) -> None:
        self.conn.close()


def test_concurrent_requests_are_batched_and_get_their_own_rows(burl: str) -> None:
    before = stats_of(burl, "probe_delay")
    rows = [1, 2, 1, 1, 2, 1]
    inputs = [probe_inputs(np.arange(r * 4, dtype=np.float32).reshape(r, 4) + 100 * i)
              for i, r in enumerate(rows)]
    results = asyncio.run(gather_infer(burl, "probe_delay", inputs))
    executions: dict = {}
    for r, i, res in zip(rows, inputs, results):
        np.testing.assert_array_equal(res["OUTPUT__0"], i["INPUT__0"])
        assert res["ROWS__1"].shape == (r, 1) and len(set(res["ROWS__1"].ravel())) == 1
        assert len(set(res["SEQ__2"].ravel())) == 1
        executions.setdefault(int(res["SEQ__2"][0, 0]), []).append((r, int(res["ROWS__1"][0, 0])))
    for members in executions.values():        # every row knows the size of its own batch
        assert all(size == sum(m[0] for m in members) for _, size in members)
    delta = stats_delta(before, stats_of(burl, "probe_delay"))
    assert delta["executions"] == len(executions) < len(rows)
    assert delta["items"] == sum(rows) and delta["queued"] == delta["success"] == len(rows)
    assert sum(delta["sizes"].values()) == delta["executions"]
    assert sorted(delta["sizes"]) == sorted({sum(m[0] for m in ms) for ms in executions.values()})


def test_queue_delay_is_honoured(bdaemon: Daemon) -> None:
    x = np.ones((1, 4), np.float32)
    with Client(bdaemon.url, timeout=30) as c:
        c.infer("probe_plain", probe_inputs(x))            # warm both
        c.infer("probe_delay", probe_inputs(x))
        t0 = time.monotonic()
        c.infer("probe_delay", probe_inputs(x))
        lone = time.monotonic() - t0
        t0 = time.monotonic()
        c.infer("probe_plain", probe_inputs(x))
        plain = time.monotonic() - t0
    assert 0.29 <= lone < 3.0, lone          # a lone request waits max_queue_delay (0.3 s) for company
    assert plain < 0.25, plain


def test_preferred_batch_size_goes_without_waiting(burl: str) -> None:
    inputs = [probe_inputs(np.full((1, 3), i, np.float32)) for i in range(4)]
    t0 = time.monotonic()
    results = asyncio.run(gather_infer(burl, "probe_preferred", inputs))
    assert time.monotonic() - t0 < 2.5          # the queue delay is 5 s: preferred size 4 went at once
    assert {int(r["ROWS__1"][0, 0]) for r in results} == {4}
    for i, r in zip(inputs, results):
        np.testing.assert_array_equal(r["OUTPUT__0"], i["INPUT__0"])


def test_max_batch_size_and_shapes_are_respected(burl: str) -> None:
    inputs = ([probe_inputs(np.full((3, 3), i, np.float32)) for i in range(4)]
              + [probe_inputs(np.full((1, 5), 10 + i, np.float32)) for i in range(3)])
    results = asyncio.run(gather_infer(burl, "probe_delay", inputs))
    widths: dict = {}
    for i, r in zip(inputs, results):
        np.testing.assert_array_equal(r["OUTPUT__0"], i["INPUT__0"])
        assert int(r["ROWS__1"][0, 0]) <= 8
        widths.setdefault(int(r["SEQ__2"][0, 0]), set()).add(i["INPUT__0"].shape[1])
    assert all(len(w) == 1 for w in widths.values()), widths     # widths 3 and 5 never share a batch
    assert any(int(r["ROWS__1"][0, 0]) > 3 for r in results[:4])   # but equal shapes do


def test_batched_strings_each_get_their_own(burl: str) -> None:
    before = stats_of(burl, "strings_batched")
    texts = [[f"r{i}-{j}" + "x" * (i % 5) for j in range(1 + i % 3)] for i in range(10)]
    inputs = [{"INPUT__0": np.array([[t.encode()] for t in ts], dtype=object)} for ts in texts]
    results = asyncio.run(gather_infer(burl, "strings_batched", inputs))
    for ts, r in zip(texts, results):
        assert r["OUTPUT__0"].shape == (len(ts), 1)
        assert r["OUTPUT__0"].ravel().tolist() == [t[::-1].encode() for t in ts]
        assert r["OUTPUT__1"].ravel().tolist() == [len(t) for t in ts]
    delta = stats_delta(before, stats_of(burl, "strings_batched"))
    assert delta["executions"] < len(texts) and delta["items"] == sum(len(t) for t in texts)


def test_ragged_batch_inputs_and_batch_output(burl: str) -> None:
    shapes = [(2, 3), (1, 2), (3, 1), (2, 2)]
    xs = [np.arange(a * b, dtype=np.float32).reshape(1, a, b) + 10 * i for i, (a, b) in enumerate(shapes)]
    results = asyncio.run(gather_infer(burl, "ragged_all", [{"INPUT__0": x} for x in xs]))
    sizes = []
    for (a, b), x, r in zip(shapes, xs, results):
        np.testing.assert_array_equal(r["SCATTER__1"], x * 2)          # its own elements, its own shape
        info = r["INFO__0"]
        assert info.shape == (1, 11)
        count, acc, start, end, biggest, sa, sb, fa, fb, total, n = info[0].tolist()
        assert count == a * b and acc == end and end - start == a * b
        assert (sa, sb) == (a, b) == (fa, fb) and total == x.sum()
        sizes.append(n)
        assert biggest >= a * b
    assert max(sizes) > 1                        # some were batched together
    single = asyncio.run(gather_infer(burl, "ragged_all", [{"INPUT__0": xs[0]}]))[0]
    assert single["INFO__0"][0].tolist() == [6, 6, 0, 6, 6, 2, 3, 2, 3, float(xs[0].sum()), 1]


def test_ragged_sum_from_the_test_repository(url: str) -> None:
    xs = [np.arange(k, dtype=np.float32).reshape(1, k) + i for i, k in enumerate([3, 1, 5, 2])]
    results = asyncio.run(gather_infer(url, "ragged_sum", [{"INPUT__0": x} for x in xs]))
    for x, r in zip(xs, results):
        assert r["OUTPUT__0"].tolist() == [[float(x.sum())]]


def test_priorities_are_served_first(bdaemon: Daemon) -> None:
    raw = Raw(bdaemon.url)
    try:
        raw.send_running("blocker", "probe_priority", np.zeros((1, 2), np.float32), pause=0.8, priority=2)
        for i in range(4):
            raw.send(f"low{i}", "probe_priority", np.full((1, 2), i, np.float32), priority=2)
        for i in range(2):
            raw.send(f"high{i}", "probe_priority", np.full((1, 2), 10 + i, np.float32), priority=1)
        got = {rid: out for rid, ok, out, _ in raw.collect(7)}
    finally:
        raw.close()
    seq = {rid: int(out["SEQ__2"][0, 0]) for rid, out in got.items()}
    assert max(seq["high0"], seq["high1"]) < min(seq[f"low{i}"] for i in range(4)), seq
    assert seq["blocker"] < seq["high0"]


def test_reject_timeout(bdaemon: Daemon) -> None:
    raw = Raw(bdaemon.url)
    try:
        raw.send_running("blocker", "probe_reject", np.zeros((1, 2), np.float32), pause=1.0, timeout_us=10_000_000)
        raw.send("default", "probe_reject", np.ones((1, 2), np.float32))              # policy: 150 ms
        raw.send("short", "probe_reject", np.ones((1, 2), np.float32), timeout_us=50_000)   # shortened
        raw.send("long", "probe_reject", np.ones((1, 2), np.float32), timeout_us=5_000_000)  # not extended
        answers = raw.collect(4)
    finally:
        raw.close()
    got = {rid: (ok, out, took) for rid, ok, out, took in answers}
    for rid, at_least in (("default", 0.14), ("short", 0.045), ("long", 0.14)):
        ok, err, took = got[rid]
        assert not ok and err["code"] == errors.UNAVAILABLE and "Request timeout expired" in err["message"]
        assert at_least <= took < 0.75, (rid, took)      # answered while the blocker still runs
    assert [a[0] for a in answers][0] == "short" and answers[-1][0] == "blocker" and got["blocker"][0]


def test_delay_timeout_moves_behind(bdaemon: Daemon) -> None:
    raw = Raw(bdaemon.url)
    try:
        raw.send_running("blocker", "probe_delayed", np.zeros((1, 2), np.float32), pause=0.8)
        raw.send("late", "probe_delayed", np.ones((1, 2), np.float32), timeout_us=20_000)
        raw.send("a", "probe_delayed", np.ones((1, 2), np.float32))
        raw.send("b", "probe_delayed", np.ones((1, 2), np.float32))
        got = {rid: (ok, out) for rid, ok, out, _ in raw.collect(4)}
    finally:
        raw.close()
    assert all(ok for ok, _ in got.values()), got       # DELAY never rejects
    seq = {rid: int(out["SEQ__2"][0, 0]) for rid, (ok, out) in got.items()}
    assert seq["blocker"] < seq["a"] < seq["b"] < seq["late"], seq


def test_full_queue_rejects_at_once(bdaemon: Daemon) -> None:
    raw = Raw(bdaemon.url)
    try:
        raw.send_running("blocker", "probe_full", np.zeros((1, 2), np.float32), pause=0.8)
        for i in range(3):
            raw.send(i, "probe_full", np.ones((1, 2), np.float32))
        got = {rid: (ok, out, took) for rid, ok, out, took in raw.collect(4)}
    finally:
        raw.close()
    ok, err, took = got[2]
    assert not ok and err["code"] == errors.UNAVAILABLE and "Exceeds maximum queue size" in err["message"]
    assert "probe_full" in err["message"] and took < 0.5
    assert got[0][0] and got[1][0] and got["blocker"][0]


@pytest.mark.parametrize("model, in_order", [("probe_ordered", True), ("probe_unordered", False)])
def test_preserve_ordering(bdaemon: Daemon, model: str, in_order: bool) -> None:
    with Client(bdaemon.url, timeout=30) as c:      # both instances warm
        for _ in range(2):
            c.infer(model, probe_inputs(np.ones((1, 2), np.float32)))
    raw = Raw(bdaemon.url)
    try:
        raw.send_running("slow", model, np.zeros((1, 2), np.float32), pause=0.6)
        raw.send("fast", model, np.ones((1, 2), np.float32))
        order = [rid for rid, ok, _, _ in raw.collect(2) if ok]
    finally:
        raw.close()
    assert order == (["slow", "fast"] if in_order else ["fast", "slow"])


@pytest.mark.parametrize("local", [True, False])
def test_big_outputs_are_split_in_place(bdaemon: Daemon, local: bool) -> None:
    """80 KB rows: lent to a local client as sub-ranges of one batch block,
    or sent zero-copy from it; released and reused round after round."""
    url = bdaemon.urls[0 if local else 1]
    with Client(url, timeout=10, local=False) as c:
        before = c.server_metadata()["transfer"]
    for round_ in range(3):
        inputs = [probe_inputs(np.full((1, 20000), 100 * round_ + i, np.float32)) for i in range(4)]
        results = asyncio.run(gather_infer(url, "probe_delay", inputs, local=local))
        for i, r in zip(inputs, results):
            np.testing.assert_array_equal(r["OUTPUT__0"], i["INPUT__0"])
        del results
    with Client(url, timeout=10, local=False) as c:
        after = c.server_metadata()["transfer"]
    if local:
        assert after.get("output_bytes_lent", 0) - before.get("output_bytes_lent", 0) >= 12 * 80000
    else:
        assert after.get("output_bytes_sent", 0) - before.get("output_bytes_sent", 0) >= 12 * 80000


def test_a_worker_crash_fails_every_request_of_its_batch(bdaemon: Daemon) -> None:
    async def main() -> list:
        async with AsyncClient(bdaemon.url, timeout=30) as c:
            calls = [asyncio.ensure_future(c.infer("probe_preferred", probe_inputs(np.ones((1, 2), np.float32), 5.0)))
                     for _ in range(4)]
            await asyncio.sleep(0.8)
            pids = worker_pids(bdaemon.log(), "probe_preferred")
            os.kill(pids[-1], signal.SIGKILL)
            return await asyncio.gather(*calls, return_exceptions=True)

    results = asyncio.run(main())
    assert all(isinstance(r, InferenceError) and r.code == errors.INTERNAL for r in results), results
    assert all("killed by signal" in r.message for r in results)
    wait_for(lambda: len(worker_pids(bdaemon.log(), "probe_preferred")) == 2, 30, "the worker's replacement")
    inputs = [probe_inputs(np.full((1, 2), i, np.float32)) for i in range(4)]

    def again():
        try:
            return asyncio.run(gather_infer(bdaemon.url, "probe_preferred", inputs))
        except InferenceError:
            return None
    results = wait_for(again, 30, "the model to answer again", interval=0.2)
    assert [r["OUTPUT__0"].tolist() for r in results] == [i["INPUT__0"].tolist() for i in inputs]


def test_priority_must_be_an_integer(bdaemon: Daemon) -> None:
    raw = Raw(bdaemon.url)
    try:
        raw.send("bad", "probe_priority", np.zeros((1, 2), np.float32), priority="high")
        (rid, ok, err, _), = raw.collect(1)
    finally:
        raw.close()
    assert not ok and err["code"] == errors.INVALID_ARG and "priority" in err["message"]
