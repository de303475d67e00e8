"""Dynamic batching with Triton's semantics.

End to end (a daemon on tests/batching_models.py's repository): concurrent
requests are batched (fewer executions than requests) and each gets exactly
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
from types import SimpleNamespace

import msgpack
import numpy as np
import pytest

from torchpool.broker.batcher import Batch, DynamicBatcher, batch_input_values, split_outputs
from torchpool.broker.requests import InferRequest, batch_layout
from torchpool.client import AsyncClient, Client, decode_infer
from torchpool.config import ModelConfig
from torchpool.config.pbtxt import parse_pbtxt
from torchpool.protocol import datatypes, errors
from torchpool.protocol.errors import InferenceError
from torchpool.shm.arena import Arena

from ..support.batching_models import build_batching_repository
from ..support.daemon import free_tcp_port
from ..support.daemon import Daemon, RawConnection, wait_for, worker_pids

# ================================================================ unit tests

def make_config(extra: str, mbs: int = 8, inputs: str = "") -> ModelConfig:
    inputs = inputs or '{ name: "INPUT__0" data_type: TYPE_FP32 dims: [ -1 ] }'
    text = (f'name: "m"\nplatform: "pytorch_libtorch"\nmax_batch_size: {mbs}\n'
            f'input [ {inputs} ]\n'
            'output [ { name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ -1 ] } ]\n' + extra)
    return ModelConfig.from_json({**parse_pbtxt(text), "name": "m"})


@pytest.fixture
def arena():
    a = Arena(lambda i: f"torchpool.unit{os.getpid()}.batcher{i}", 1 << 20, 64 << 20)
    yield a
    a.close(unlink=True)


def request(cfg: ModelConfig, rows: int = 1, width: int = 2, value: float = 0.0, level: int = 1,
            timeout_us: int = 0, location=None, rid=None) -> InferRequest:
    spec = cfg.inputs[0]
    x = np.full((rows, width), value, np.float32)
    shape = list(x.shape)
    model_shape = [x.size] if spec.allow_ragged_batch else shape
    staged = [(spec, shape, model_shape, memoryview(x.tobytes()), location)]
    req = InferRequest(None, b"", value if rid is None else rid, SimpleNamespace(name="m"), [], ["OUTPUT__0"], [], None,
                       batch_size=max(rows, 1), timeout_us=timeout_us, level=level)
    batch_layout(req, staged, cfg)
    req.staged = staged
    return req


def test_preferred_size_max_size_and_delay(arena: Arena) -> None:
    cfg = make_config("dynamic_batching { preferred_batch_size: [ 2, 4 ] max_queue_delay_microseconds: 1000000 }")
    b = DynamicBatcher(cfg, arena)
    reqs = [request(cfg, value=i) for i in range(3)]
    for r in reqs:
        b.push(r, 100.0)
    batch, due = b.take(100.0)           # 3 queued: the largest preferred size reached is 2
    assert [r.request_id for r in batch.requests] == [0, 1] and due is None
    batch, due = b.take(100.0)           # 1 left: wait for the queue delay
    assert batch is None and due == pytest.approx(101.0)
    batch, _ = b.take(101.0)
    assert [r.request_id for r in batch.requests] == [2] and len(b) == 0
    for i in range(6):
        b.push(request(cfg, value=i), 200.0)
    batch, _ = b.take(200.0)             # never above the largest preferred size
    assert batch.items == 4


def test_shapes_are_not_mixed_and_max_batch_size_holds(arena: Arena) -> None:
    cfg = make_config("dynamic_batching { }", mbs=4)
    b = DynamicBatcher(cfg, arena)
    for r in (request(cfg, width=2, value=0), request(cfg, width=2, value=1),
              request(cfg, width=3, value=2), request(cfg, rows=3, width=3, value=3)):
        b.push(r, 0.0)
    sizes = []
    while b:
        batch, _ = b.take(0.0)
        sizes.append([r.request_id for r in batch.requests])
        assert batch.items <= 4
        assert batch.inputs[0][2] == [batch.rows, batch.requests[0].shapes["INPUT__0"][1]]
    assert sizes == [[0, 1], [2, 3]]


def test_priority_levels_and_queue_policies(arena: Arena) -> None:
    cfg = make_config("""dynamic_batching {
      priority_levels: 2 default_priority_level: 2
      default_queue_policy { timeout_action: DELAY allow_timeout_override: true }
      priority_queue_policy { key: 1 value: { timeout_action: REJECT default_timeout_microseconds: 1000
                                              max_queue_size: 1 } }
    }""", mbs=1)
    b = DynamicBatcher(cfg, arena)
    assert b.level_of(None) == 2 and b.level_of(0) == 2 and b.level_of(7) == 2 and b.level_of(1) == 1
    with pytest.raises(Exception):
        b.level_of(-1)
    low_late = request(cfg, rid="late", timeout_us=500, level=2)
    low = request(cfg, rid="low", level=2)
    high = request(cfg, rid="high", level=1)
    for r in (low_late, low, high):
        b.check_room(r)
        b.push(r, 0.0)
    with pytest.raises(Exception) as full:
        b.check_room(request(cfg, rid="x", level=1))
    assert "Exceeds maximum queue size" in str(full.value)
    assert b.next_deadline() == pytest.approx(0.0005)
    assert b.expire(0.0006) == []                      # DELAY: moved back, not rejected
    assert [r.request_id for r in b] == ["high", "low", "late"]
    assert [r.request_id for r in b.expire(0.01)] == ["high"]    # REJECT after 1 ms
    order = []
    while b:
        order.append(b.take(1.0)[0].requests[0].request_id)
    assert order == ["low", "late"]


def test_forming_batch_keeps_what_is_right(arena: Arena) -> None:
    cfg = make_config("dynamic_batching { priority_levels: 2 default_priority_level: 2 }")
    counts: dict = {}
    b = DynamicBatcher(cfg, arena, counts)
    a, c = request(cfg, value=1.0, level=2), request(cfg, value=2.0, level=2)
    b.push(a, 0.0)
    b.prepare(0.0)
    b.push(c, 0.0)
    b.prepare(0.0)
    assert counts["input_bytes_copied"] == 16            # each request written once
    urgent = request(cfg, value=3.0, level=1)
    b.push(urgent, 0.0)
    b.prepare(0.0)                                       # all rewritten behind the new first row
    batch, _ = b.take(0.0)
    assert [r.request_id for r in batch.requests] == [3.0, 1.0, 2.0]
    seg, off, nbytes = batch.inputs[0][3:6]
    data = np.frombuffer(arena.segments[seg].buf, np.float32, nbytes // 4, off)
    assert data.tolist() == [3, 3, 1, 1, 2, 2]
    for block in batch.blocks:
        arena.free(block)


def test_a_batch_of_one_in_shared_memory_is_not_copied(arena: Arena) -> None:
    cfg = make_config("dynamic_batching { }")
    counts: dict = {}
    b = DynamicBatcher(cfg, arena, counts)
    b.push(request(cfg, location=["client-seg", 64, 8, 7]), 0.0)
    batch, _ = b.take(0.0)
    assert batch.inputs[0][3:] == ["client-seg", 64, 8, 7] and batch.blocks == []
    assert counts == {"input_bytes_in_place": 8}
    b.push(request(cfg, value=1.0, location=["client-seg", 64, 8, 7]), 0.0)
    b.push(request(cfg, value=2.0, location=["client-seg", 128, 8, 9]), 0.0)
    batch, _ = b.take(0.0)                 # two: both copied into one block
    seg, off, nbytes = batch.inputs[0][3:6]
    assert np.frombuffer(arena.segments[seg].buf, np.float32, 4, off).tolist() == [1, 1, 2, 2]
    for block in batch.blocks:
        arena.free(block)


def test_batch_input_kinds() -> None:
    cfg = make_config("""batch_input [
      { kind: BATCH_ELEMENT_COUNT target_name: "A" data_type: TYPE_INT32 source_input: "INPUT__0" },
      { kind: BATCH_ACCUMULATED_ELEMENT_COUNT target_name: "B" data_type: TYPE_FP32 source_input: "INPUT__0" },
      { kind: BATCH_ACCUMULATED_ELEMENT_COUNT_WITH_ZERO target_name: "C" data_type: TYPE_INT32
        source_input: "INPUT__0" },
      { kind: BATCH_MAX_ELEMENT_COUNT_AS_SHAPE target_name: "D" data_type: TYPE_INT32 source_input: "INPUT__0" },
      { kind: BATCH_ITEM_SHAPE target_name: "E" data_type: TYPE_INT32 source_input: "INPUT__0" },
      { kind: BATCH_ITEM_SHAPE_FLATTEN target_name: "F" data_type: TYPE_FP32 source_input: "INPUT__0" }
    ]""", inputs='{ name: "INPUT__0" data_type: TYPE_FP32 dims: [ -1 ] allow_ragged_batch: true }')
    reqs = [request(cfg, rows=2, width=3), request(cfg, rows=1, width=5)]
    got = {name: (dt, shape, np.frombuffer(data, np.int32 if dt == "INT32" else np.float32).tolist())
           for name, dt, shape, data in batch_input_values(cfg, reqs)}
    assert got == {"A": ("INT32", [2], [6, 5]), "B": ("FP32", [2], [6, 11]),
                   "C": ("INT32", [3], [0, 6, 11]), "D": ("INT32", [6], [0] * 6),
                   "E": ("INT32", [3, 1], [3, 3, 5]), "F": ("FP32", [3], [3, 3, 5])}


def test_split_outputs_rows_strings_and_scatter() -> None:
    cfg = make_config("""batch_output [ { target_name: "OUTPUT__0" kind: BATCH_SCATTER_WITH_INPUT_SHAPE
                                           source_input: "INPUT__0" } ]""")
    reqs = [request(cfg, rows=1, width=3), request(cfg, rows=2, width=3)]
    batch = Batch(reqs, 3, 3, [], [])
    parts = split_outputs(cfg, batch, [["OUTPUT__0", "FP32", [9], "seg", 1000, 36]], None)
    assert parts == [[("OUTPUT__0", "FP32", [1, 3], "seg", 1000, 12)],
                     [("OUTPUT__0", "FP32", [2, 3], "seg", 1012, 24)]]
    strings = ModelConfig.from_json({**parse_pbtxt(
        'name: "s"\nplatform: "pytorch_libtorch"\nmax_batch_size: 8\n'
        'input [ { name: "I" data_type: TYPE_STRING dims: [ 1 ] reshape: { shape: [ ] } } ]\n'
        'output [ { name: "O" data_type: TYPE_STRING dims: [ 1 ] reshape: { shape: [ ] } } ]\n'), "name": "s"})
    data = datatypes.encode_bytes([b"a", b"bcd", b"", b"ef"])
    reqs = [SimpleNamespace(rows=1, outputs=["O"]), SimpleNamespace(rows=3, outputs=["O"])]
    parts = split_outputs(strings, Batch(reqs, 4, 4, [], []), [["O", "BYTES", [4], "seg", 0, len(data)]],
                          lambda seg, off, n: memoryview(data)[off:off + n])
    assert parts == [[("O", "BYTES", [1, 1], "seg", 0, 5)], [("O", "BYTES", [3, 1], "seg", 5, len(data) - 5)]]


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
