"""The sequence batcher (broker/schedulers/sequence.py) driven without a daemon.

A real shared-memory arena holds the batches; a stand-in worker reads each
batch's inputs from it, computes the model in numpy and writes the outputs
back, so what the scheduler wrote (inputs, controls, state) is checked by
value.
"""
from __future__ import annotations

import itertools
from collections import Counter
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import pytest

from torchpool.broker.answers.split import split_outputs
from torchpool.broker.batch import Batch
from torchpool.broker.requests import InferRequest, batch_layout
from torchpool.broker.schedulers import make_scheduler
from torchpool.broker.schedulers.base import SchedulerHold
from torchpool.broker.stats import VersionStats
from torchpool.rules.request import read_infer
from torchpool.broker.schedulers.sequence import SequenceBatcher
from torchpool.config import ModelConfig, parse_pbtxt
from torchpool.protocol import datatypes, errors
from torchpool.protocol.errors import TorchpoolError
from torchpool.shm import Arena
from torchpool.rules.validation import Staged

KiB = 1024

CONTROLS = """
  control_input [
    { name: "START__1" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ] },
    { name: "END__2" control [ { kind: CONTROL_SEQUENCE_END fp32_false_true: [ 0, 1 ] } ] },
    { name: "READY__3" control [ { kind: CONTROL_SEQUENCE_READY bool_false_true: [ false, true ] } ] },
    { name: "CORRID__4" control [ { kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_UINT64 } ] }
  ]
"""


def make_config(text: str, name: str = "seq") -> ModelConfig:
    d = parse_pbtxt(text)
    d["name"] = name
    return ModelConfig.from_json(d)


def accumulator(mbs: int = 4, strategy: str = "direct { }", state: str = "", idle_us: int = 1_000_000,
                dtype: str = "TYPE_INT32", dims: str = "[ 1 ]") -> ModelConfig:
    state = state or f"""
  state [ {{ input_name: "STATE_IN__5" output_name: "STATE_OUT__1" data_type: {dtype} dims: {dims} }} ]"""
    return make_config(f"""
platform: "pytorch_libtorch"
max_batch_size: {mbs}
input [ {{ name: "INPUT__0" data_type: {dtype} dims: {dims} }} ]
output [ {{ name: "OUTPUT__0" data_type: {dtype} dims: {dims} }} ]
sequence_batching {{
  max_sequence_idle_microseconds: {idle_us}
  {strategy}
  {CONTROLS}
  {state}
}}
""")


@pytest.fixture
def arena(prefix):
    a = Arena(lambda i: f"{prefix}{i}", 256 * KiB, 4096 * KiB)
    yield a
    a.close()


class Harness:
    """A scheduler, its requests, and a stand-in worker."""

    def __init__(self, cfg: ModelConfig, arena: Arena, model_dir: Path = Path("/nonexistent"),
                 hold: Optional[SchedulerHold] = None) -> None:
        self.cfg = cfg
        self.arena = arena
        self.transfer: Counter = Counter()
        self.s = make_scheduler(cfg, model_dir, arena, self.transfer, hold or SchedulerHold())
        self.now = 100.0
        self.s.clock = lambda: self.now
        self.ids = itertools.count()
        self.answers: dict[int, object] = {}

    def send(self, value, corrid, start=False, end=False, datatype="INT32", outputs=None) -> InferRequest:
        """What the server does on accept: admit, hidden outputs, push."""
        spec = self.cfg.input("INPUT__0")
        batching = self.cfg.max_batch_size > 0
        if datatype == "BYTES":
            items = list(value)
            payload = datatypes.encode_bytes(items)
            shape = [1, len(items)] if batching else [len(items)]
        else:
            arr = np.asarray(value, datatypes.numpy_dtype(datatype)).reshape(-1)
            payload = arr.tobytes()
            shape = [1, arr.size] if batching else [arr.size]
        staged = [Staged(spec, shape, shape, memoryview(payload), None)]
        req = InferRequest(None, b"client", next(self.ids), None, [], list(outputs or ["OUTPUT__0"]))
        req.batch_size = 1
        self.s.admit(req, read_infer({"sequence": {"id": corrid, "start": start, "end": end}}))
        hidden = [n for n in self.s.hidden_outputs if n not in req.outputs]
        req.outputs = req.outputs + hidden
        req.hidden_outputs = frozenset(hidden)
        batch_layout(req, staged, self.cfg)
        req.staged = staged
        self.s.push(req, self.now)
        return req

    # --- the stand-in worker ---------------------------------------------------------

    def read(self, segment, offset, nbytes) -> memoryview:
        return memoryview(self.arena.segments[segment].buf)[offset:offset + nbytes]

    def inputs(self, batch: Batch) -> dict:
        out = {}
        for name, datatype, shape, segment, offset, nbytes, *_ in batch.inputs:
            data = bytes(self.read(segment, offset, nbytes))
            if datatype == "BYTES":
                out[name] = datatypes.decode_bytes(data)
            else:
                out[name] = np.frombuffer(data, datatypes.numpy_dtype(datatype)).reshape(shape).copy()
        return out

    def run(self, batch: Batch, model: Callable[[dict], dict], fail: bool = False) -> list:
        """Execute `batch`, tell the scheduler, and split the outputs per request
        as the answer path does (requests' rows in order)."""
        if fail:
            self.s.finished(batch, None, self.read)
            return []
        results = model(self.inputs(batch))
        descriptors, blocks = [], []
        for name, value in results.items():
            if isinstance(value, list):
                data, shape, dt = datatypes.encode_bytes(value), [len(value)], "BYTES"
            else:
                value = np.ascontiguousarray(value)
                data, shape, dt = value.tobytes(), list(value.shape), datatypes.wire_from_numpy(value.dtype)
            block = self.arena.alloc(len(data))
            blocks.append(block)
            self.arena.view(block)[:len(data)] = data
            descriptors.append([name, dt, shape, block.segment, block.offset, len(data)])
        self.s.finished(batch, descriptors, self.read)
        out = []
        starts = batch.starts()
        value = results["OUTPUT__0"]
        for i, req in enumerate(batch.requests):
            if isinstance(value, list):
                out.append(value[starts[i]])
            else:
                row = np.asarray(value[starts[i]]).reshape(-1).tolist()
                out.append(row[0] if len(row) == 1 else row)
            self.answers[req.request_id] = out[-1]
        for block in blocks:
            self.arena.free(block)
        for block in batch.blocks:
            self.arena.free(block)
        return out


def accumulate(inputs: dict) -> dict:
    """total = x + (state unless START); zero where not READY; the controls echoed."""
    x, start, ready = inputs["INPUT__0"], inputs["START__1"], inputs["READY__3"]
    total = np.where(start != 0, x, x + inputs["STATE_IN__5"]) * ready
    return {"OUTPUT__0": total.astype(x.dtype), "STATE_OUT__1": total.astype(x.dtype)}


# ------------------------------------------------------------------ direct

def test_direct_batches_across_sequences_with_their_own_state(arena) -> None:
    h = Harness(accumulator(mbs=4), arena)
    assert isinstance(h.s, SequenceBatcher)
    assert h.s.hidden_outputs == {"STATE_OUT__1"}
    reqs = [h.send(10 * (k + 1), corrid=k + 1, start=True) for k in range(3)]
    assert len(h.s) == 3
    batch = h.s.take("w0", h.now)
    assert batch is not None and batch.requests == reqs and batch.rows == 3 and batch.items == 3
    assert len(h.s) == 0 and all(r.staged == [] for r in reqs)
    inputs = h.inputs(batch)
    assert inputs["INPUT__0"].reshape(-1).tolist() == [10, 20, 30]
    assert inputs["START__1"].reshape(-1).tolist() == [1, 1, 1]
    assert inputs["END__2"].reshape(-1).tolist() == [0, 0, 0]
    assert inputs["READY__3"].reshape(-1).tolist() == [True, True, True]
    assert inputs["CORRID__4"].reshape(-1).tolist() == [1, 2, 3]
    assert inputs["START__1"].shape == (3, 1) and inputs["STATE_IN__5"].shape == (3, 1)
    assert "STATE_OUT__1" in batch.outputs and "OUTPUT__0" in batch.outputs
    assert h.run(batch, accumulate) == [10, 20, 30]
    # the next round: one request per sequence per batch, each on its own state
    h.send(1, 1)
    h.send(2, 1)              # queued behind the first: never in the same batch
    h.send(5, 3, end=True)
    batch = h.s.take("w0", h.now)
    assert [r.sequence.corrid for r in batch.requests] == [1, 3]
    inputs = h.inputs(batch)
    # Triton's layout: slot 1 (sequence 2, nothing ready) is a not-ready row of zeros
    assert batch.rows == 3 and batch.row_starts == [0, 2]
    assert inputs["STATE_IN__5"].reshape(-1).tolist() == [10, 0, 30]
    assert inputs["READY__3"].reshape(-1).tolist() == [True, False, True]
    assert inputs["END__2"].reshape(-1).tolist() == [0.0, 0.0, 1.0]
    assert h.run(batch, accumulate) == [11, 35]
    batch = h.s.take("w0", h.now)
    assert [r.sequence.corrid for r in batch.requests] == [1]
    assert h.run(batch, accumulate) == [13]
    assert h.s.take("w0", h.now) is None
    # END closed sequence 3: it needs START again
    with pytest.raises(TorchpoolError, match="must specify the START flag"):
        h.send(1, 3)


def test_a_sequence_is_not_taken_again_while_its_request_runs(arena) -> None:
    h = Harness(accumulator(mbs=4), arena)
    h.send(1, 7, start=True)
    first = h.s.take("w0", h.now)
    h.send(2, 7)
    assert h.s.take("w0", h.now) is None, "its state is not back yet"
    assert h.run(first, accumulate) == [1]
    second = h.s.take("w0", h.now)
    assert h.run(second, accumulate) == [3]


def test_slots_are_per_instance_and_new_sequences_wait_for_a_free_slot(arena) -> None:
    h = Harness(accumulator(mbs=2), arena)
    assert h.s.take("w0", h.now) is None         # w0 is known: two slots
    assert h.s.take("w1", h.now) is None         # w1 too
    for k in range(1, 6):
        h.send(k, k, start=True)
    # lowest slot first across instances: 1 -> w0/0, 2 -> w1/0, 3 -> w0/1, 4 -> w1/1; 5 waits
    b0 = h.s.take("w0", h.now)
    b1 = h.s.take("w1", h.now)
    assert [r.sequence.corrid for r in b0.requests] == [1, 3]
    assert [r.sequence.corrid for r in b1.requests] == [2, 4]
    assert len(h.s) == 1 and [s.corrid for s in h.s.backlog] == [5]
    h.run(b0, accumulate)
    h.run(b1, accumulate)
    # sequence 3 continues on w0 only
    h.send(100, 3)
    assert h.s.take("w1", h.now) is None
    b = h.s.take("w0", h.now)
    assert [r.sequence.corrid for r in b.requests] == [3] and h.run(b, accumulate) == [103]
    # END of sequence 2 frees its slot on w1: the backlog's sequence 5 takes it
    h.send(1, 2, end=True)
    b = h.s.take("w1", h.now)
    assert [r.sequence.corrid for r in b.requests] == [2]
    assert h.s.backlog == deque_of() and h.s.sequences[5].home.handle == "w1"
    h.run(b, accumulate)
    b = h.s.take("w1", h.now)
    assert [r.sequence.corrid for r in b.requests] == [5] and h.run(b, accumulate) == [5]


def test_instances_have_their_slots_from_ready_not_from_their_first_take(arena) -> None:
    """Two STARTs that arrive before either instance asked for a batch go
    one to each instance (lowest slot first), as Triton's batchers have
    their slots from the start (qa/L0_sequence_batcher test_half_batch)."""
    h = Harness(accumulator(mbs=2), arena)
    h.s.instance_ready("w0")
    h.s.instance_ready("w1")
    h.send(1, 1, start=True)
    h.send(2, 2, start=True)
    b0 = h.s.take("w0", h.now)
    b1 = h.s.take("w1", h.now)
    assert [r.sequence.corrid for r in b0.requests] == [1]
    assert [r.sequence.corrid for r in b1.requests] == [2]
    assert (h.run(b0, accumulate), h.run(b1, accumulate)) == ([1], [2])


def test_a_sequences_requests_never_take_a_direct_path(arena) -> None:
    assert Harness(accumulator(), arena).s.direct_refusal() == "its requests are sequenced by the daemon"


def deque_of(*items):
    from collections import deque
    return deque(items)


def test_an_idle_sequence_frees_its_slot(arena) -> None:
    h = Harness(accumulator(mbs=1, idle_us=500_000), arena)
    h.s.take("w0", h.now)
    h.send(1, 1, start=True)
    h.send(2, 2, start=True)                     # one slot: waits in the backlog
    h.run(h.s.take("w0", h.now), accumulate)
    assert h.s.take("w0", h.now) is None
    due = h.s.next_deadline()
    assert due == pytest.approx(h.now + 0.5)
    assert h.s.expire(due - 0.01) == [] and 1 in h.s.sequences
    assert h.s.expire(due + 0.01) == []
    assert 1 not in h.s.sequences
    b = h.s.take("w0", due + 0.02)
    assert [r.sequence.corrid for r in b.requests] == [2]
    with pytest.raises(TorchpoolError, match="must specify the START flag"):
        h.send(5, 1)


def test_a_dead_instance_fails_exactly_its_sequences(arena) -> None:
    h = Harness(accumulator(mbs=2), arena)
    h.s.take("w0", h.now)
    h.s.take("w1", h.now)
    for k in (1, 2, 3, 4):
        h.send(k, k, start=True)                 # 1, 3 on w0; 2, 4 on w1
    running = h.s.take("w0", h.now)
    h.run(h.s.take("w1", h.now), accumulate)
    h.send(10, 1)
    h.send(20, 2)
    waiting_w0 = h.send(30, 3)
    h.send(5, 5, start=True)                     # backlog
    gone = h.s.instance_gone("w0")
    assert {r.sequence.corrid for r, _ in gone} == {1, 3}
    assert len(gone) == 2 and waiting_w0 in [r for r, _ in gone]
    for _req, err in gone:
        assert err.code == errors.UNAVAILABLE
        assert "model 'seq'" in err.message and "instance w0" in err.message
    assert "sequence 3" in dict((r.sequence.corrid, e.message) for r, e in gone)[3]
    h.run(running, accumulate, fail=True)        # the server fails the batch it ran
    with pytest.raises(TorchpoolError, match="sequence 1 was lost: instance w0"):
        h.send(1, 1)
    # w1's sequences carry on; the backlog goes to w1's slots when they free up
    b = h.s.take("w1", h.now)
    assert [r.sequence.corrid for r in b.requests] == [2] and h.run(b, accumulate) == [22]
    assert h.s.take("w0-respawned", h.now) is not None      # a new handle: fresh slots for the backlog
    assert len(h.s) == 0


def test_a_failed_batch_keeps_the_previous_state(arena) -> None:
    h = Harness(accumulator(mbs=2), arena)
    h.send(5, 1, start=True)
    h.run(h.s.take("w0", h.now), accumulate)
    h.send(1, 1)
    h.run(h.s.take("w0", h.now), accumulate, fail=True)
    h.send(2, 1)
    assert h.run(h.s.take("w0", h.now), accumulate) == [7]


def test_drain_returns_every_waiting_request(arena) -> None:
    h = Harness(accumulator(mbs=1), arena)
    a = h.send(1, 1, start=True)
    b = h.send(2, 1)
    c = h.send(3, 2, start=True)
    assert set(map(id, h.s.drain())) == {id(a), id(b), id(c)}
    assert len(h.s) == 0 and h.s.take("w0", h.now) is None


def test_flags_and_correlation_ids_are_checked_with_tritons_words(arena) -> None:
    h = Harness(accumulator(), arena)
    with pytest.raises(TorchpoolError, match="must specify a non-zero or non-empty correlation ID"):
        h.send(1, 0, start=True)
    with pytest.raises(TorchpoolError, match="takes the correlation ID as UINT64"):
        h.send(1, "text-id", start=True)
    with pytest.raises(TorchpoolError) as err:
        h.send(1, 99)
    assert err.value.message == ("inference request for sequence 99 to model 'seq' must specify the START "
                                 "flag on the first request of the sequence")
    assert len(h.s) == 0


def test_empty_slot_rows_in_tritons_layout(arena) -> None:
    h = Harness(accumulator(mbs=4), arena)
    for k in (1, 2, 3):
        h.send(k, k, start=True)
    h.run(h.s.take("w0", h.now), accumulate)
    h.send(10, 2)                                # slot 1 only; slot 0 empty; slot 2 idle
    b = h.s.take("w0", h.now)
    assert b.rows == 2 and b.row_starts == [1] and b.items == 1
    inputs = h.inputs(b)
    assert inputs["READY__3"].reshape(-1).tolist() == [False, True]
    assert inputs["CORRID__4"].reshape(-1).tolist() == [0, 2]
    assert inputs["START__1"].reshape(-1).tolist() == [0, 0]
    assert inputs["INPUT__0"].reshape(-1).tolist() == [0, 10]
    assert inputs["STATE_IN__5"].reshape(-1).tolist() == [0, 2]
    assert h.run(b, accumulate) == [12]
    h.send(1, 1)
    h.send(1, 3)
    b = h.s.take("w0", h.now)
    assert b.rows == 3 and b.row_starts == [0, 2]
    assert h.inputs(b)["READY__3"].reshape(-1).tolist() == [True, False, True]
    assert h.run(b, accumulate) == [2, 4]


def test_an_empty_middle_slot_gets_a_not_ready_row_of_zeros(arena) -> None:
    """Slots 0 and 2 busy, slot 1 empty (its sequence ended): three rows, the
    middle one READY=0, START/END 0, CORRID 0, zero input and state; the
    others' controls are their own, and the answer path splits by row_starts."""
    h = Harness(accumulator(mbs=4), arena)
    for k in (1, 2, 3):
        h.send(k, k, start=True)
    h.run(h.s.take("w0", h.now), accumulate)
    h.send(5, 2, end=True)
    h.run(h.s.take("w0", h.now), accumulate)    # sequence 2 ended: slot 1 is free
    assert h.s.instances["w0"].slots[1] is None
    first = h.send(7, 1, end=True)
    third = h.send(9, 3, start=True)             # a START on a live sequence: afresh
    b = h.s.take("w0", h.now)
    assert b.requests == [first, third] and b.rows == 3 and b.items == 2 and b.row_starts == [0, 2]
    inputs = h.inputs(b)
    assert inputs["READY__3"].reshape(-1).tolist() == [True, False, True]
    assert inputs["START__1"].reshape(-1).tolist() == [0, 0, 1]
    assert inputs["END__2"].reshape(-1).tolist() == [1.0, 0.0, 0.0]
    assert inputs["CORRID__4"].reshape(-1).tolist() == [1, 0, 3]
    assert inputs["INPUT__0"].reshape(-1).tolist() == [7, 0, 9]
    assert inputs["STATE_IN__5"].reshape(-1).tolist() == [1, 0, 0]      # START: the initial state
    assert inputs["START__1"].shape == (3, 1)
    # what the answer path hands each request: its own row of the outputs
    results = accumulate(inputs)
    data = results["OUTPUT__0"].tobytes()
    parts = split_outputs(h.cfg, b, [["OUTPUT__0", "INT32", [3, 1], "seg", 64, len(data)],
                                     ["STATE_OUT__1", "INT32", [3, 1], "seg", 128, len(data)]], None)
    assert [p[0] for p in parts] == [("OUTPUT__0", "INT32", [1, 1], "seg", 64, 4),
                                     ("OUTPUT__0", "INT32", [1, 1], "seg", 72, 4)]
    assert h.run(b, accumulate) == [8, 9]
    assert h.s.sequences[3].state["STATE_IN__5"] == ((1, 1), np.int32([9]).tobytes())


def test_oldest_and_a_full_prefix_of_slots_have_no_empty_rows(arena) -> None:
    h = Harness(accumulator(mbs=4, strategy="oldest { max_candidate_sequences: 4 }"), arena)
    for k in (1, 2, 3):
        h.send(k, k, start=True)
    h.run(h.s.take("w0", h.now), accumulate)
    h.send(1, 3)
    b = h.s.take("w0", h.now)
    assert b.rows == 1 and b.row_starts is None and h.run(b, accumulate) == [4]
    d = Harness(accumulator(mbs=4), arena)
    d.send(1, 1, start=True)
    d.send(2, 2, start=True)
    b = d.s.take("w0", d.now)
    assert b.rows == 2 and b.row_starts is None and b.starts() == [0, 1]


def test_direct_waits_for_slot_utilization_at_most_the_queue_delay(arena) -> None:
    cfg = accumulator(mbs=4, strategy="direct { max_queue_delay_microseconds: 20000 "
                                       "minimum_slot_utilization: 0.5 }")
    h = Harness(cfg, arena)
    h.send(1, 1, start=True)
    assert h.s.take("w0", h.now) is None
    assert h.s.next_deadline() == pytest.approx(h.now + 0.02)
    h.send(2, 2, start=True)                     # 2 of 4 slots ready: enough
    b = h.s.take("w0", h.now + 0.001)
    assert len(b.requests) == 2


def corrids(batch: Batch) -> list:
    return [r.sequence.corrid for r in batch.requests]


def test_the_test_switch_holds_until_slots_and_backlog_hold_enough(arena) -> None:
    # L0_sequence_batcher test_backlog_fill (TRITONSERVER_DELAY_SCHEDULER=10,
    # TRITONSERVER_BACKLOG_DELAY_SCHEDULER=2): four sequences in the four slots, two
    # more in the backlog fill the slots the short ones free: three batches of four
    h = Harness(accumulator(mbs=4), arena, hold=SchedulerHold(10, 2))
    assert h.s.take("w0", h.now) is None
    sequences = {1: 3, 2: 2, 3: 2, 4: 3}
    for corrid, length in sequences.items():
        for i in range(length):
            h.send(i + 1, corrid, start=i == 0, end=i == length - 1)
            assert h.s.take("w0", h.now) is None          # fewer than 10 in the slots
    h.send(7, 5, start=True, end=True)
    assert h.s.take("w0", h.now) is None                  # 1 of 2 in the backlog
    h.send(8, 6, start=True, end=True)
    batches = []
    while (b := h.s.take("w0", h.now)) is not None:
        batches.append(corrids(b))
        h.run(b, accumulate)
    assert batches == [[1, 2, 3, 4], [1, 2, 3, 4], [1, 5, 6, 4]]
    assert h.answers == {0: 1, 1: 3, 2: 6, 3: 1, 4: 3, 5: 1, 6: 3, 7: 1, 8: 3, 9: 6, 10: 7, 11: 8}


def test_the_test_switch_counts_requests_in_the_slots_of_every_instance(arena) -> None:
    # test_half_batch on models2 (two instances of two slots, TRITONSERVER_DELAY_SCHEDULER=8)
    h = Harness(accumulator(mbs=2), arena, hold=SchedulerHold(8))
    for w in ("w0", "w1"):
        assert h.s.take(w, h.now) is None
    for corrid in (987, 988):
        for i in range(4):
            h.send(i, corrid, start=i == 0, end=i == 3)
            if corrid == 988 and i == 3:
                break
            assert h.s.take("w0", h.now) is None and h.s.take("w1", h.now) is None
    b0, b1 = h.s.take("w0", h.now), h.s.take("w1", h.now)
    assert (corrids(b0), corrids(b1)) == ([987], [988])   # one sequence on each instance


def test_empty_slots_are_padding_in_the_batch_statistics(arena) -> None:
    # L0_sequence_batcher test_queue_delay_*: the second batch is "null, sequence 2",
    # a batch of size 2 in Triton's batch statistics, one inference
    h = Harness(accumulator(mbs=4), arena)
    h.send(1, 1001, start=True)
    h.send(11, 1002, start=True)
    first = h.s.take("w0", h.now)
    assert corrids(first) == [1001, 1002] and first.padding == 0
    h.run(first, accumulate)
    h.send(12, 1002)
    second = h.s.take("w0", h.now)
    assert corrids(second) == [1002] and second.rows == 2 and second.padding == 1
    stats = VersionStats()
    for b in (first, second):
        stats.record_execution(b.items, len(b.requests), 1, 1, 1, padding=b.padding)
    reported = stats.to_triton("m", 1)
    assert [s["batch_size"] for s in reported["batch_stats"]] == [2]
    assert reported["batch_stats"][0]["compute_infer"]["count"] == 2
    assert (reported["inference_count"], reported["execution_count"]) == (3, 2)


# ------------------------------------------------------------------ oldest

def test_oldest_forms_batches_of_the_oldest_requests_of_candidate_sequences(arena) -> None:
    cfg = accumulator(mbs=4, strategy="oldest { max_candidate_sequences: 3 preferred_batch_size: [ 2 ] "
                                      "max_queue_delay_microseconds: 50000 }")
    h = Harness(cfg, arena)
    assert h.s.slot_count == 3
    h.send(1, 1, start=True)
    assert h.s.take("w0", h.now) is None         # waits for more (delay, preferred size 2)
    assert h.s.next_deadline() == pytest.approx(h.now + 0.05)
    h.now += 0.001
    h.send(2, 2, start=True)
    b = h.s.take("w0", h.now)                    # preferred size reached
    assert [r.sequence.corrid for r in b.requests] == [1, 2]
    assert h.run(b, accumulate) == [1, 2]
    for k in (3, 4):
        h.now += 0.001
        h.send(k, k, start=True)                 # 3 gets the last candidate slot; 4 waits
    h.now += 0.001
    h.send(10, 2)
    h.send(10, 1)
    b = h.s.take("w0", h.now)
    # oldest first: sequence 3's START, then 2, then 1 (the preferred size is 2)
    assert [r.sequence.corrid for r in b.requests] == [3, 2]
    assert h.run(b, accumulate) == [3, 12]
    b = h.s.take("w0", h.now + 1)                # past the delay: what is there goes
    assert [r.sequence.corrid for r in b.requests] == [1] and h.run(b, accumulate) == [11]
    assert [s.corrid for s in h.s.backlog] == [4]


# ------------------------------------------------------------------ state shapes and strings

def test_variable_shape_state_follows_the_model_and_batches_by_shape(arena) -> None:
    cfg = accumulator(mbs=4, state="""
  state [ { input_name: "STATE_IN__5" output_name: "STATE_OUT__1" data_type: TYPE_INT32 dims: [ -1 ] } ]""",
                      dims="[ -1 ]")
    h = Harness(cfg, arena)

    def append(inputs: dict) -> dict:
        """The state grows by the input's values on every request (START: starts afresh)."""
        x, state, start = inputs["INPUT__0"], inputs["STATE_IN__5"], inputs["START__1"].reshape(-1)
        rows = [np.concatenate([x[i]] if start[i] else [state[i], x[i]]) for i in range(len(x))]
        new = np.stack(rows)
        return {"OUTPUT__0": new.sum(axis=1, keepdims=True).astype(np.int32), "STATE_OUT__1": new}

    h.send([1], 1, start=True)
    h.send([2], 2, start=True)
    b = h.s.take("w0", h.now)
    assert h.inputs(b)["STATE_IN__5"].shape == (2, 1)          # dims -1 start as 1
    h.run(b, append)
    h.send([3], 1)
    b = h.s.take("w0", h.now)
    assert h.inputs(b)["STATE_IN__5"].tolist() == [[1]]
    h.run(b, append)
    assert h.s.sequences[1].state["STATE_IN__5"][0] == (1, 2)
    # sequence 1 holds [1, 3] now, sequence 2 [2]: their states differ in shape, one batch each
    h.send([4], 1)
    h.send([5], 2)
    b = h.s.take("w0", h.now)
    assert [r.sequence.corrid for r in b.requests] == [1]
    assert h.inputs(b)["STATE_IN__5"].tolist() == [[1, 3]]
    assert h.run(b, append) == [8]
    b = h.s.take("w0", h.now)
    assert [r.sequence.corrid for r in b.requests] == [2]
    # slot 0 (sequence 1) has nothing ready: a not-ready row of zeros before it
    assert h.inputs(b)["STATE_IN__5"].tolist() == [[0], [2]] and b.row_starts == [1]
    assert h.inputs(b)["READY__3"].reshape(-1).tolist() == [False, True]
    assert h.run(b, append) == [7]


def test_string_state_carries_bytes_elements(arena) -> None:
    cfg = make_config("""
platform: "pytorch_libtorch"
max_batch_size: 4
input [ { name: "INPUT__0" data_type: TYPE_STRING dims: [ 1 ] reshape: { shape: [ ] } } ]
output [ { name: "OUTPUT__0" data_type: TYPE_STRING dims: [ 1 ] reshape: { shape: [ ] } } ]
sequence_batching {
  control_input [ { name: "START__1" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ] } ]
  state [ { input_name: "STATE_IN__5" output_name: "STATE_OUT__1" data_type: TYPE_STRING dims: [ 1 ] } ]
}
""")
    h = Harness(cfg, arena)

    def concat(inputs: dict) -> dict:
        xs, states, start = inputs["INPUT__0"], inputs["STATE_IN__5"], inputs["START__1"].reshape(-1)
        out = [x if start[i] else states[i] + b"+" + x for i, x in enumerate(xs)]
        return {"OUTPUT__0": out, "STATE_OUT__1": out}

    h.send([b"a"], 1, start=True, datatype="BYTES")
    h.send([b"x"], 2, start=True, datatype="BYTES")
    b = h.s.take("w0", h.now)
    assert h.inputs(b)["STATE_IN__5"] == [b"", b""]             # initial: empty strings
    h.run(b, concat)
    h.send([b"bb"], 1, datatype="BYTES")
    h.send([b"yyy"], 2, datatype="BYTES")
    b = h.s.take("w0", h.now)
    assert h.run(b, concat) == [b"a+bb", b"x+yyy"]
    h.send([b"c"], 1, datatype="BYTES", end=True)
    assert h.run(h.s.take("w0", h.now), concat) == [b"a+bb+c"]


def test_initial_state_from_a_file_and_from_zero_data(arena, tmp_path: Path) -> None:
    (tmp_path / "initial_state").mkdir()
    (tmp_path / "initial_state" / "seven.bin").write_bytes(np.array([7, 8], np.int32).tobytes())
    cfg = accumulator(mbs=2, dims="[ -1 ]", state="""
  state [ { input_name: "STATE_IN__5" output_name: "STATE_OUT__1" data_type: TYPE_INT32 dims: [ -1 ]
            initial_state: { name: "seven" data_type: TYPE_INT32 dims: [ 2 ] data_file: "seven.bin" } } ]""")
    h = Harness(cfg, arena, tmp_path)
    h.send([1, 1], 1, start=True)
    b = h.s.take("w0", h.now)
    assert h.inputs(b)["STATE_IN__5"].tolist() == [[7, 8]]
    plus_state = lambda i: {"OUTPUT__0": i["INPUT__0"] + i["STATE_IN__5"],     # noqa: E731
                            "STATE_OUT__1": i["INPUT__0"] + i["STATE_IN__5"]}
    assert h.run(b, plus_state) == [[8, 9]]
    h.send([1, 1], 1)
    assert h.run(h.s.take("w0", h.now), plus_state) == [[9, 10]]


@pytest.mark.parametrize("dims, init, message", [
    ("1", 'data_type: TYPE_FP32 dims: [ 1 ] zero_data: true',
     "The data type used for 'initial_state' field of state 'STATE_IN__5' does not match the state "
     "data type."),
    ("1", 'data_type: TYPE_INT32 dims: [ 1, 1 ] zero_data: true',
     "Number of dimensions in 'initial_state' doesn't match the size of 'state' dimensions for state "
     "input 'STATE_IN__5'. 2 != 1"),
    ("-1", 'data_type: TYPE_INT32 dims: [ -1 ] zero_data: true',
     "'initial_state' field for state input name 'STATE_IN__5' contains variable dimensions."),
    ("2", 'data_type: TYPE_INT32 dims: [ 3 ] zero_data: true',
     "'initial_state' dim for input name 'STATE_IN__5' doesn't match 'state' dim description. 3 != 2"),
    ("-1", 'data_type: TYPE_INT32 dims: [ 4 ] data_file: "short.bin"',
     "initial_state setting expects 16 bytes, but the data provided from short.bin only has 4 bytes."),
])
def test_bad_initial_states_are_refused_with_tritons_words(arena, tmp_path: Path, dims: str, init: str,
                                                            message: str) -> None:
    (tmp_path / "initial_state").mkdir()
    (tmp_path / "initial_state" / "short.bin").write_bytes(bytes(4))
    cfg = accumulator(mbs=2, state=f"""
  state [ {{ input_name: "STATE_IN__5" output_name: "STATE_OUT__1" data_type: TYPE_INT32 dims: [ {dims} ]
            initial_state: {{ name: "init" {init} }} }} ]""")
    with pytest.raises(TorchpoolError) as err:
        SequenceBatcher(cfg, tmp_path, arena)
    assert err.value.message == message


def test_non_batching_model_runs_one_sequence_per_instance(arena) -> None:
    h = Harness(accumulator(mbs=0), arena)
    h.s.take("w0", h.now)
    h.send(1, 1, start=True)
    h.send(2, 2, start=True)
    b = h.s.take("w0", h.now)
    assert len(b.requests) == 1 and h.inputs(b)["START__1"].shape == (1,)
    assert h.inputs(b)["STATE_IN__5"].shape == (1,)
    h.run(b, accumulate)
    assert h.s.take("w0", h.now) is None         # sequence 2 waits for a slot
    b = h.s.take("w1", h.now)
    assert [r.sequence.corrid for r in b.requests] == [2]


# ------------------------------------------------------------------ Triton's QA implicit-state models load

def qa_config(data_type: str, dims: str, mbs: int = 8, init: str = "", reshape: str = "") -> ModelConfig:
    """The layout of Triton's L0_implicit_state libtorch repositories."""
    return make_config(f"""
platform: "pytorch_libtorch"
max_batch_size: {mbs}
input [ {{ name: "INPUT__0" data_type: {data_type} dims: {dims} {reshape} }} ]
output [ {{ name: "OUTPUT__0" data_type: {data_type} dims: {dims} {reshape} }} ]
sequence_batching {{
  control_input [
    {{ name: "START__2" control [ {{ kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] }} ] }},
    {{ name: "READY__3" control [ {{ kind: CONTROL_SEQUENCE_READY int32_false_true: [ 0, 1 ] }} ] }}
  ]
  state [ {{ input_name: "INPUT_STATE__1" output_name: "OUTPUT_STATE__1" data_type: {data_type}
            dims: {dims} {init} }} ]
}}
""", name="libtorch_sequence")


@pytest.mark.parametrize("data_type, dims, mbs, init, reshape", [
    ("TYPE_INT32", "[ -1 ]", 8, "", ""),
    ("TYPE_FP32", "[ -1 ]", 8, 'initial_state: { name: "state init" data_type: TYPE_FP32 dims: [ 1 ] '
                               'zero_data: true }', ""),
    ("TYPE_STRING", "[ 1 ]", 0, "", ""),
    ("TYPE_STRING", "[ 1 ]", 0, 'initial_state: { name: "state init" data_type: TYPE_STRING dims: [ 1 ] '
                                'zero_data: true }', ""),
    # batched strings: the client's tensors need `reshape: []` (as in Triton); the state is a
    # flat List[str] of the batch (Triton refuses a batched string state output; we take it)
    ("TYPE_STRING", "[ 1 ]", 8, "", "reshape: { shape: [ ] }"),
])
def test_tritons_qa_implicit_state_models_load(arena, tmp_path: Path, data_type: str, dims: str, mbs: int,
                                               init: str, reshape: str) -> None:
    import torch
    from typing import List, Tuple

    from .test_binding import load

    class Numbers(torch.nn.Module):
        def forward(self, x: torch.Tensor, state: torch.Tensor, start: torch.Tensor, ready: torch.Tensor
                    ) -> Tuple[torch.Tensor, torch.Tensor]:
            keep = torch.logical_and(ready != 0, start == 0)
            total = x + state * keep
            return total, total

    class Strings(torch.nn.Module):
        def forward(self, x: List[str], state: List[str], start: torch.Tensor, ready: torch.Tensor
                    ) -> Tuple[List[str], List[str]]:
            keep = torch.logical_and(ready != 0, start == 0).reshape(-1)
            out: List[str] = []
            for i in range(len(x)):
                base = int("0" + state[i]) if bool(keep[i]) else 0
                out.append(str(base + int("0" + x[i])))
            return out, out

    cfg = qa_config(data_type, dims, mbs, init, reshape)
    _model, binding = load(Strings() if data_type == "TYPE_STRING" else Numbers(), cfg, tmp_path)
    assert binding.output_index == {"OUTPUT__0": 0, "OUTPUT_STATE__1": 1}
    s = SequenceBatcher(cfg, tmp_path, arena)
    assert s.hidden_outputs == {"OUTPUT_STATE__1"}


def test_a_request_of_a_sequence_has_batch_size_one(arena) -> None:
    h = Harness(accumulator(mbs=4), arena)
    spec = h.cfg.input("INPUT__0")
    staged = [Staged(spec, [2, 1], [2, 1], memoryview(bytes(8)), None)]
    req = InferRequest(None, b"client", 1, None, [], ["OUTPUT__0"], batch_size=2)
    h.s.admit(req, read_infer({"sequence": {"id": 5, "start": True}}))
    batch_layout(req, staged, h.cfg)
    req.staged = staged
    with pytest.raises(TorchpoolError) as err:
        h.s.push(req, h.now)
    assert err.value.message == ("inference request to model 'seq' must specify batch-size 1 due to "
                                 "requirements of sequence batcher")
    assert len(h.s) == 0 and 5 not in h.s.sequences
