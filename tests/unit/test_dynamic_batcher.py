"""The dynamic batcher and the output split, driven without a daemon.

A real broker arena in /dev/shm, requests built as the intake builds them;
the scheduler is driven through the interface the server's loop uses.
"""
from __future__ import annotations

import os
from types import SimpleNamespace

import numpy as np
import pytest

from torchpool.broker.answers.split import split_outputs
from torchpool.broker.batch import Batch, batch_input_values
from torchpool.broker.requests import InferRequest, batch_layout
from torchpool.broker.schedulers.base import SchedulerHold
from torchpool.broker.schedulers.dynamic import DynamicBatcher
from torchpool.config import ModelConfig
from torchpool.config.pbtxt import parse_pbtxt
from torchpool.protocol import datatypes
from torchpool.protocol.errors import TorchpoolError
from torchpool.shm.arena import Arena
from torchpool.rules.validation import Staged

INSTANCE = "instance-0"     # instances are opaque to the dynamic batcher


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
    a.close()


def request(cfg: ModelConfig, rows: int = 1, width: int = 2, value: float = 0.0, level: int = 1,
            timeout_us: int = 0, location=None, rid=None) -> InferRequest:
    spec = cfg.inputs[0]
    x = np.full((rows, width), value, np.float32)
    shape = list(x.shape)
    model_shape = [x.size] if spec.allow_ragged_batch else shape
    staged = [Staged(spec, shape, model_shape, memoryview(x.tobytes()), location)]
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
    batch = b.take(INSTANCE, 100.0)      # 3 queued: the largest preferred size reached is 2
    assert [r.request_id for r in batch.requests] == [0, 1]
    batch = b.take(INSTANCE, 100.0)      # 1 left: wait for the queue delay
    assert batch is None and b.next_deadline() == pytest.approx(101.0)
    assert b.expire(101.0) == []
    batch = b.take(INSTANCE, 101.0)
    assert [r.request_id for r in batch.requests] == [2] and len(b) == 0
    for i in range(6):
        b.push(request(cfg, value=i), 200.0)
    batch = b.take(INSTANCE, 200.0)      # never above the largest preferred size
    assert batch.items == 4


def test_shapes_are_not_mixed_and_max_batch_size_holds(arena: Arena) -> None:
    cfg = make_config("dynamic_batching { }", mbs=4)
    b = DynamicBatcher(cfg, arena)
    for r in (request(cfg, width=2, value=0), request(cfg, width=2, value=1),
              request(cfg, width=3, value=2), request(cfg, rows=3, width=3, value=3)):
        b.push(r, 0.0)
    sizes = []
    while len(b):
        batch = b.take(INSTANCE, 0.0)
        sizes.append([r.request_id for r in batch.requests])
        assert batch.items <= 4
        assert batch.inputs[0][2] == [batch.rows, batch.requests[0].shapes["INPUT__0"][1]]
    assert sizes == [[0, 1], [2, 3]]


TRITON_QA = "dynamic_batching { preferred_batch_size: [ 2, 6 ] max_queue_delay_microseconds: 10000000 }"


def take_all(b: DynamicBatcher, now: float) -> list:
    """The batches that go now, as the request sizes in each."""
    out = []
    while (batch := b.take(INSTANCE, now)) is not None:
        out.append([r.batch_size for r in batch.requests])
        for block in batch.blocks:
            b.arena.free(block)
    return out


def test_a_batch_past_its_queue_delay_takes_everything_up_to_max_batch_size(arena: Arena) -> None:
    # L0_batcher test_multi_batch_delayed_use_max_batch: 3 + 4 queued, a 1 after the delay
    cfg = make_config(TRITON_QA)
    b = DynamicBatcher(cfg, arena)
    b.push(request(cfg, rows=3), 0.0)
    b.push(request(cfg, rows=4), 0.0)
    assert take_all(b, 0.0) == [[3]]          # within the delay: 3 + 4 is beyond every preferred size
    b.push(request(cfg, rows=3), 1.0)
    b.push(request(cfg, rows=1), 11.5)
    assert take_all(b, 11.5) == [[4, 3, 1]]   # the 4 waited 11 s: all of it, 8 = max_batch_size
    # and a preferred size reached no longer caps a batch whose oldest request waited too long
    for _ in range(3):
        b.push(request(cfg), 20.0)
    assert take_all(b, 20.0) == [[1, 1]]
    assert take_all(b, 31.0) == [[1]]
    for _ in range(3):
        b.push(request(cfg), 40.0)
    assert take_all(b, 50.0) == [[1, 1, 1]]


def test_the_test_switch_holds_the_batcher_until_so_many_requests_are_queued(arena: Arena) -> None:
    # L0_batcher test_multi_batch_use_biggest_preferred (TRITONSERVER_DELAY_SCHEDULER=6):
    # six singles sent together go as one batch of the biggest preferred size
    cfg = make_config(TRITON_QA)
    b = DynamicBatcher(cfg, arena, hold=SchedulerHold(6))
    for i in range(5):
        b.push(request(cfg), float(i))
        assert take_all(b, float(i)) == [] and b.next_deadline() is None     # held, no timer
    b.push(request(cfg), 5.0)
    assert take_all(b, 5.0) == [[1] * 6]
    b.push(request(cfg), 6.0)
    b.push(request(cfg), 6.0)
    assert take_all(b, 6.0) == [[1, 1]]       # released for good: as usual from then on


def test_preferred_sizes_without_a_queue_delay_under_the_test_switch(arena: Arena) -> None:
    # L0_batcher test_preferred_batch_only_*: preferred [4, 6], no max_queue_delay_microseconds
    cfg = make_config("dynamic_batching { preferred_batch_size: [ 4, 6 ] }")
    for count, batches in ((4, [[1] * 4]), (5, [[1] * 4, [1]]), (7, [[1] * 6, [1]]), (3, [[1] * 3])):
        b = DynamicBatcher(cfg, arena, hold=SchedulerHold(count))
        for _ in range(count):
            b.push(request(cfg), 0.0)
        assert take_all(b, 0.0) == batches, count


def test_the_test_switches_are_read_as_triton_reads_them(arena: Arena) -> None:
    read = SchedulerHold.from_environment
    assert read({}) == SchedulerHold(0, 0)
    assert read({"TRITONSERVER_DELAY_SCHEDULER": "12", "TRITONSERVER_BACKLOG_DELAY_SCHEDULER": "2"}) == \
        SchedulerHold(12, 2)
    assert read({"TRITONSERVER_DELAY_SCHEDULER": " 3x", "TRITONSERVER_BACKLOG_DELAY_SCHEDULER": "x"}) == \
        SchedulerHold(3, 0)                   # atoi: the leading integer, else 0
    hold = SchedulerHold(0, 5)
    assert not hold.holding(queued=0, backlog=0)    # the backlog count only holds with a delay count
    hold = SchedulerHold(2, 1)
    assert hold.holding(queued=2, backlog=0) and hold.holding(queued=1, backlog=1)
    assert not hold.holding(queued=2, backlog=1) and not hold.holding(queued=0, backlog=0)
    # the dynamic batcher has no backlog: TRITONSERVER_BACKLOG_DELAY_SCHEDULER does not hold it
    cfg = make_config(TRITON_QA)
    b = DynamicBatcher(cfg, arena, hold=SchedulerHold(2, 1))
    b.push(request(cfg), 0.0)
    assert take_all(b, 0.0) == []
    b.push(request(cfg), 0.0)
    assert take_all(b, 0.0) == [[1, 1]]


def test_priority_levels_and_queue_policies(arena: Arena) -> None:
    cfg = make_config("""dynamic_batching {
      priority_levels: 2 default_priority_level: 2
      default_queue_policy { timeout_action: DELAY allow_timeout_override: true }
      priority_queue_policy { key: 1 value: { timeout_action: REJECT default_timeout_microseconds: 1000
                                              max_queue_size: 1 } }
    }""", mbs=1)
    b = DynamicBatcher(cfg, arena)
    assert b.level_of(None) == 2 and b.level_of(0) == 2 and b.level_of(7) == 2 and b.level_of(1) == 1
    with pytest.raises(TorchpoolError):
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
    assert [r.request_id for r in b._ordered()] == ["high", "low", "late"]
    rejected = b.expire(0.01)                          # REJECT after 1 ms
    assert [(r.request_id, e.message) for r, e in rejected] == [("high", "Request timeout expired")]
    order = []
    while len(b):
        order.append(b.take(INSTANCE, 1.0).requests[0].request_id)
    assert order == ["low", "late"]
    b.push(request(cfg, rid="left", level=2), 2.0)
    assert [r.request_id for r in b.drain()] == ["left"] and len(b) == 0 and b.next_deadline() is None


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
    batch = b.take(INSTANCE, 0.0)
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
    batch = b.take(INSTANCE, 0.0)
    assert list(batch.inputs[0][3:7]) == ["client-seg", 64, 8, 7] and batch.blocks == []
    assert counts == {"input_bytes_in_place": 8}
    b.push(request(cfg, value=1.0, location=["client-seg", 64, 8, 7]), 0.0)
    b.push(request(cfg, value=2.0, location=["client-seg", 128, 8, 9]), 0.0)
    batch = b.take(INSTANCE, 0.0)                 # two: both copied into one block
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


def test_split_outputs_skips_rows_of_no_request_by_row_starts() -> None:
    """A direct sequence batch with an empty slot: rows 0 and 2 are requests',
    row 1 is nobody's. Each request gets its own rows, even alone in a batch."""
    cfg = make_config("")
    reqs = [SimpleNamespace(rows=1, outputs=["OUTPUT__0"]), SimpleNamespace(rows=1, outputs=["OUTPUT__0"])]
    batch = Batch(reqs, 2, 3, [], [], row_starts=[0, 2])
    parts = split_outputs(cfg, batch, [["OUTPUT__0", "FP32", [3, 2], "seg", 1000, 24]], None)
    assert parts == [[("OUTPUT__0", "FP32", [1, 2], "seg", 1000, 8)],
                     [("OUTPUT__0", "FP32", [1, 2], "seg", 1016, 8)]]
    alone = Batch(reqs[:1], 1, 3, [], [], row_starts=[2])
    parts = split_outputs(cfg, alone, [["OUTPUT__0", "FP32", [3, 2], "seg", 1000, 24]], None)
    assert parts == [[("OUTPUT__0", "FP32", [1, 2], "seg", 1016, 8)]]
    # BYTES: two strings per row; rows 0 and 2 are the requests'
    strings = ModelConfig.from_json({**parse_pbtxt(
        'name: "s"\nplatform: "pytorch_libtorch"\nmax_batch_size: 8\n'
        'input [ { name: "I" data_type: TYPE_STRING dims: [ 2 ] } ]\n'
        'output [ { name: "O" data_type: TYPE_STRING dims: [ 2 ] } ]\n'), "name": "s"})
    data = datatypes.encode_bytes([b"a", b"bcd", b"", b"", b"ef", b"g"])
    read = lambda seg, off, n: memoryview(data)[off:off + n]    # noqa: E731
    reqs = [SimpleNamespace(rows=1, outputs=["O"]), SimpleNamespace(rows=1, outputs=["O"])]
    parts = split_outputs(strings, Batch(reqs, 2, 3, [], [], row_starts=[0, 2]),
                          [["O", "BYTES", [6], "seg", 0, len(data)]], read)
    first, second = parts[0][0], parts[1][0]
    assert first == ("O", "BYTES", [2], "seg", 0, 12)
    assert second == ("O", "BYTES", [2], "seg", 20, len(data) - 20)
    assert datatypes.decode_bytes(data[second[4]:second[4] + second[5]]) == [b"ef", b"g"]
    parts = split_outputs(strings, Batch(reqs[1:], 1, 3, [], [], row_starts=[1]),
                          [["O", "BYTES", [6], "seg", 0, len(data)]], read)
    assert parts == [[("O", "BYTES", [2], "seg", 12, 8)]]


def test_bytes_boundaries_and_truncation() -> None:
    data = datatypes.encode_bytes([b"a", b"bcd", b"", b"ef"])
    assert datatypes.bytes_boundaries(data, [1, 2, 1]) == [0, 5, 16, len(data)]
    assert datatypes.bytes_boundaries(memoryview(data), []) == [0]
    with pytest.raises(ValueError):
        datatypes.bytes_boundaries(data[:-1], [4])
    with pytest.raises(ValueError):
        datatypes.bytes_boundaries(data, [5])


def test_what_keeps_a_dynamic_batchers_requests_off_direct_paths(arena: Arena) -> None:
    """The batcher says itself what only the daemon's queue can do
    (broker/direct.py asks it, never its class)."""
    plain = make_config("dynamic_batching { max_queue_delay_microseconds: 100 }")
    assert DynamicBatcher(plain, arena).direct_refusal() is None
    levels = make_config("dynamic_batching { priority_levels: 2 default_priority_level: 1 }")
    assert DynamicBatcher(levels, arena).direct_refusal() == \
        "the daemon orders its queue (priority levels, queue timeouts or sizes)"
    ragged = make_config("dynamic_batching { }",
                         inputs='{ name: "INPUT__0" data_type: TYPE_FP32 dims: [ -1 ] allow_ragged_batch: true }')
    assert DynamicBatcher(ragged, arena).direct_refusal() == "the daemon batches its ragged inputs"
    held = DynamicBatcher(plain, arena, hold=SchedulerHold(queued=2))
    assert held.direct_refusal() == \
        "the daemon holds its batcher (TRITONSERVER_DELAY_SCHEDULER, a switch for testing)"
