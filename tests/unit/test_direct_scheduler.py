"""The direct scheduler (no batching), driven without a daemon through the
interface the server's loop uses, over a real broker arena."""
from __future__ import annotations

import os
import uuid
from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest

from torchpool.broker.requests import InferRequest, batch_layout
from torchpool.broker.schedulers import make_scheduler
from torchpool.broker.schedulers.direct import DirectScheduler
from torchpool.config import ModelConfig
from torchpool.config.pbtxt import parse_pbtxt
from torchpool.rules.request import read_infer
from torchpool.shm.arena import Arena
from torchpool.rules.validation import Staged

CONFIG = ('name: "m"\nplatform: "pytorch_libtorch"\nmax_batch_size: 0\n'
          'input [ { name: "INPUT__0" data_type: TYPE_FP32 dims: [ 2 ] } ]\n'
          'output [ { name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ 2 ] } ]\n')


@pytest.fixture
def arena():
    a = Arena(lambda i: f"torchpool.unit{os.getpid()}.{uuid.uuid4().hex[:6]}direct{i}", 1 << 20, 4 << 20)
    yield a
    a.close()


def config(text: str = CONFIG) -> ModelConfig:
    return ModelConfig.from_json({**parse_pbtxt(text), "name": "m"})


def request(cfg: ModelConfig, value: float, timeout_us: int = 0, location=None,
            identity: bytes = b"") -> InferRequest:
    x = np.full(2, value, np.float32)
    staged = [Staged(cfg.inputs[0], [2], [2], memoryview(x.tobytes()), location)]
    req = InferRequest(None, identity, value, SimpleNamespace(name="m"), [], ["OUTPUT__0"], [], None,
                       timeout_us=timeout_us)
    batch_layout(req, staged, cfg)
    req.staged = staged
    return req


def test_make_scheduler_picks_the_policy_and_refuses_two(arena: Arena) -> None:
    assert isinstance(make_scheduler(config(), None, arena, Counter()), DirectScheduler)
    with pytest.raises(Exception) as both:
        make_scheduler(config(CONFIG.replace("max_batch_size: 0", "max_batch_size: 4")
                              + "dynamic_batching { }\nsequence_batching { }\n"), None, arena, Counter())
    assert "dynamic_batching or sequence_batching, not both" in str(both.value)


def test_requests_run_alone_in_arrival_order_and_are_copied_once(arena: Arena) -> None:
    counts: Counter = Counter()
    s = DirectScheduler(config(), arena, counts)
    reqs = [request(s.config, float(i)) for i in range(3)]
    for r in reqs:
        s.admit(r, read_infer({}))
        s.push(r, 0.0)
    assert len(s) == 3 and counts["input_bytes_copied"] == 24 and all(r.staged == [] for r in reqs)
    got = []
    while (batch := s.take("any instance", 0.0)) is not None:
        assert batch.error is None and len(batch.requests) == 1 and batch.items == 1
        name, datatype, shape, segment, offset, nbytes = batch.inputs[0][:6]
        assert (name, datatype, shape, nbytes) == ("INPUT__0", "FP32", [2], 8)
        got.append(np.frombuffer(arena.segments[segment].buf, np.float32, 2, offset).tolist())
        for block in batch.requests[0].blocks:
            arena.free(block)
    assert got == [[0, 0], [1, 1], [2, 2]] and len(s) == 0


def test_inputs_in_shared_memory_are_passed_by_descriptor(arena: Arena) -> None:
    counts: Counter = Counter()
    s = DirectScheduler(config(), arena, counts)
    s.push(request(s.config, 1.0, location=["client-seg", 64, 8, 3]), 0.0)
    batch = s.take("i", 0.0)
    assert list(batch.inputs[0][3:7]) == ["client-seg", 64, 8, 3] and batch.requests[0].blocks == []
    assert counts == Counter({"input_bytes_in_place": 8})


def test_timeouts_expire_queued_requests_only(arena: Arena) -> None:
    s = DirectScheduler(config(), arena, Counter())
    late, patient, quick = request(s.config, 1.0, 1000), request(s.config, 2.0), request(s.config, 3.0, 5000)
    for r in (late, patient, quick):
        s.push(r, 10.0)
    assert s.next_deadline() == pytest.approx(10.001)
    expired = s.expire(10.002)
    assert [(r.request_id, e.message) for r, e in expired] == [(1.0, "Request timeout expired")]
    assert s.next_deadline() == pytest.approx(10.005)
    first = s.take("i", 10.003)
    assert first.requests == [patient] and first.error is None
    # past its deadline when an instance frees up: failed, not run
    gone = s.take("i", 10.006)
    assert gone.requests == [quick] and gone.error.message == "Request timeout expired"
    assert s.next_deadline() is None and s.expire(99.0) == [] and len(s) == 0
    for r in (late, patient, quick):
        for block in r.blocks:
            arena.free(block)


def test_drain_hands_back_everything_queued(arena: Arena) -> None:
    s = DirectScheduler(config(), arena, Counter())
    reqs = [request(s.config, float(i), 1000) for i in range(2)]
    for r in reqs:
        s.push(r, 0.0)
    assert s.drain() == reqs and len(s) == 0 and s.next_deadline() is None and s.take("i", 0.0) is None
    for r in reqs:
        for block in r.blocks:
            arena.free(block)


def test_connections_are_served_in_turn_so_a_flood_delays_only_its_sender(arena: Arena) -> None:
    s = DirectScheduler(config(), arena, Counter())
    flood = [request(s.config, float(i), identity=b"flood") for i in range(5)]
    honest = [request(s.config, 100.0 + i, identity=b"honest") for i in range(2)]
    for r in flood + honest:            # the flood arrived first
        s.admit(r, read_infer({}))
        s.push(r, 0.0)
    assert len(s) == 7
    taken = []
    while len(s):
        batch = s.take(None, 0.0)
        taken.append(batch.requests[0].request_id)
    # round robin between connections, each in its own arrival order
    assert taken == [0.0, 100.0, 1.0, 101.0, 2.0, 3.0, 4.0]
    assert s.take(None, 0.0) is None and s.queues == {}


def test_a_request_is_sent_ahead_unless_it_has_a_deadline_and_goes_back_first(arena: Arena) -> None:
    """take_ahead hands out the next request in turn for a busy instance, but
    not one with a timeout (only the queue can fail it on time); put_back
    (its instance died before running it) queues it again, first in turn."""
    s = DirectScheduler(config(), arena, Counter())
    plain = request(s.config, 1.0, identity=b"a")
    timed = request(s.config, 2.0, timeout_us=10_000_000, identity=b"b")
    other = request(s.config, 3.0, identity=b"a")
    for r in (plain, timed, other):
        s.push(r, 0.0)
    ahead = s.take_ahead("busy", 0.0)
    assert ahead.requests == [plain] and ahead.error is None and len(s) == 2
    assert s.take_ahead("busy", 0.0) is None and len(s) == 2      # b's turn, and it has a deadline
    s.put_back(ahead)
    assert len(s) == 3 and plain.queued
    assert [s.take("i", 0.0).requests[0] for _ in range(3)] == [plain, timed, other]
    for r in (plain, timed, other):
        for block in r.blocks:
            arena.free(block)


def test_a_worker_may_take_its_requests_on_a_direct_path(arena) -> None:
    assert DirectScheduler(config(), arena, Counter()).direct_refusal() is None
