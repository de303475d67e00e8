"""End to end: sequence batching (`sequence_batching { }`) for stateful
models — correlation ids, START / END, control tensors, implicit state kept
between the requests of a sequence, idle sequences released; Triton's
sequence batcher across sequences: `direct` and `oldest` batch the requests
of different sequences together, each with its own state, and a worker
crash fails exactly the sequences it held."""
from __future__ import annotations

import asyncio
import io
import os
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import List, Tuple

import numpy as np
import pytest
import torch
from torch import Tensor, nn

from torchpool import AsyncClient, Client, InferenceError
from torchpool.protocol import errors

from ..support.daemon import Daemon, cpu_ticks, free_tcp_port, wait_for, worker_pids

ACCUMULATE = "sequence_accumulate"      # running sum in an implicit INT32 state, START only


def value(x: int) -> dict:
    return {"INPUT__0": np.array([x], np.int32)}


def total(c: Client, x: int, seq, model: str = ACCUMULATE, **flags) -> int:
    if model == ACCUMULATE:
        out = c.infer(model, value(x), sequence_id=seq, **flags)
    else:
        out = c.infer(model, {"INPUT__0": np.array([[x]], np.int32)}, sequence_id=seq, **flags)
    assert "STATE_OUT__1" not in out, "the state output must never reach the client"
    return int(out["OUTPUT__0"].reshape(-1)[0])


# --- a model that shows every control tensor ----------------------------------------------

class Controls(nn.Module):
    """One row per request: [x, start, end, ready, corrid, requests in the sequence so far]."""

    def forward(self, x: Tensor, start: Tensor, end: Tensor, ready: Tensor, corrid: Tensor,
                count: Tensor) -> Tuple[Tensor, Tensor]:
        n = count + 1
        row = torch.cat([x, start.to(torch.float32), end.to(torch.float32), ready.to(torch.float32),
                         corrid.to(torch.float32), n.to(torch.float32)], dim=1)
        return row, n


CONTROLS_CONFIG = """\
name: "sequence_controls"
platform: "pytorch_libtorch"
max_batch_size: 4
input [ { name: "INPUT__0" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ 6 ] } ]
sequence_batching {
  max_sequence_idle_microseconds: 300000
  control_input [
    { name: "START__1" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ] },
    { name: "END__2" control [ { kind: CONTROL_SEQUENCE_END fp32_false_true: [ 0, 1 ] } ] },
    { name: "READY__3" control [ { kind: CONTROL_SEQUENCE_READY bool_false_true: [ false, true ] } ] },
    { name: "CORRID__4" control [ { kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_INT64 } ] }
  ]
  state [
    {
      input_name: "COUNT_IN__5"
      output_name: "COUNT_OUT__1"
      data_type: TYPE_INT64
      dims: [ 1 ]
      initial_state: { name: "hundred" data_type: TYPE_INT64 dims: [ 1 ] data_file: "hundred.bin" }
    }
  ]
}
"""


class Accumulate(nn.Module):
    """Running sum in an implicit state; beside it, the controls its row got
    and the batch size: [start, end, ready, corrid, rows in the batch]."""

    def forward(self, x: Tensor, start: Tensor, end: Tensor, ready: Tensor, corrid: Tensor,
                state: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        total = torch.where(start != 0, x, x + state)
        total = torch.where(ready, total, torch.zeros_like(total))
        rows = torch.full_like(corrid, x.shape[0])
        seen = torch.cat([start.to(torch.int64), end.to(torch.int64), ready.to(torch.int64), corrid, rows], dim=1)
        return total, total, seen


class SlotRows(nn.Module):
    """Accumulate, and beside it what the whole batch held (at most 4 rows):
    [READY of rows 0..3, CORRID of rows 0..3], -1 past the last row."""

    def forward(self, x: Tensor, start: Tensor, end: Tensor, ready: Tensor, corrid: Tensor,
                state: Tensor) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
        total = torch.where(start != 0, x, x + state)
        total = torch.where(ready, total, torch.zeros_like(total))
        n = x.shape[0]
        rows = torch.full_like(corrid, n)
        seen = torch.cat([start.to(torch.int64), end.to(torch.int64), ready.to(torch.int64), corrid, rows],
                         dim=1)
        pad = torch.full([4 - n], -1, dtype=torch.int64)
        batch = torch.cat([ready.reshape(-1).to(torch.int64), pad, corrid.reshape(-1), pad])
        return total, total, seen, batch.reshape(1, 8).expand(n, 8).contiguous()


class SlowAccumulate(nn.Module):
    """Running sum; an input above 1000 first spins that many iterations."""

    def forward(self, x: Tensor, start: Tensor, state: Tensor) -> Tuple[Tensor, Tensor]:
        n = int(x.max())
        count = torch.zeros([1], dtype=torch.int64)
        for _ in range(n if n > 1000 else 0):
            count = count + 1
        total = torch.where(start != 0, x, x + state)
        return total, total


class Grow(nn.Module):
    """Variable-shape state: the sequence's inputs so far (after a leading 0);
    the output is [sum, length of the state]."""

    def forward(self, x: Tensor, start: Tensor, state: Tensor) -> Tuple[Tensor, Tensor]:
        keep = (start == 0).to(state.dtype)
        new = torch.cat([state * keep, x], dim=1)
        length = torch.full_like(x, new.shape[1])
        return torch.cat([new.sum(dim=1, keepdim=True).to(x.dtype), length], dim=1), new


class Concat(nn.Module):
    """TYPE_STRING state: the sequence's strings joined."""

    def forward(self, x: List[str], start: Tensor, state: List[str]) -> Tuple[List[str], List[str]]:
        flags = start.reshape(-1)
        out: List[str] = []
        for i in range(len(x)):
            out.append(x[i] if bool(flags[i] != 0) else state[i] + "+" + x[i])
        return out, out


ACCUMULATE_IO = """
input [ { name: "INPUT__0" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [
  { name: "OUTPUT__0" data_type: TYPE_INT32 dims: [ 1 ] },
  { name: "SEEN__2" data_type: TYPE_INT64 dims: [ 5 ] }
]
"""
ALL_CONTROLS = """
  control_input [
    { name: "START__1" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ] },
    { name: "END__2" control [ { kind: CONTROL_SEQUENCE_END int32_false_true: [ 0, 1 ] } ] },
    { name: "READY__3" control [ { kind: CONTROL_SEQUENCE_READY bool_false_true: [ false, true ] } ] },
    { name: "CORRID__4" control [ { kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_INT64 } ] }
  ]
  state [ { input_name: "STATE_IN__5" output_name: "STATE_OUT__1" data_type: TYPE_INT32 dims: [ 1 ] } ]
"""
START_ONLY = """
  control_input [ { name: "START__1" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ] } ]
"""


def sequence_model(name: str, mbs: int, body: str, io_text: str = ACCUMULATE_IO, extra: str = "") -> str:
    return (f'name: "{name}"\nplatform: "pytorch_libtorch"\nmax_batch_size: {mbs}\n{io_text}{extra}\n'
            f"sequence_batching {{\n{body}\n}}\n")


# one instance each unless said; a direct batch waits up to 20 ms for every slot to be ready
MODELS = {
    "seq_direct": (Accumulate(), sequence_model("seq_direct", 8, """
  max_sequence_idle_microseconds: 5000000
  direct { max_queue_delay_microseconds: 20000 minimum_slot_utilization: 1.0 }""" + ALL_CONTROLS,
                                                extra='instance_group [ { count: 1 kind: KIND_CPU } ]')),
    "seq_oldest": (Accumulate(), sequence_model("seq_oldest", 8, """
  max_sequence_idle_microseconds: 5000000
  oldest { max_candidate_sequences: 8 preferred_batch_size: [ 8 ] max_queue_delay_microseconds: 20000 }"""
                                                + ALL_CONTROLS,
                                                extra='instance_group [ { count: 1 kind: KIND_CPU } ]')),
    # four slots; a batch with fewer than two ready slots waits up to 200 ms for a second
    "seq_slots": (SlotRows(), sequence_model("seq_slots", 4, """
  max_sequence_idle_microseconds: 30000000
  direct { max_queue_delay_microseconds: 200000 minimum_slot_utilization: 0.5 }""" + ALL_CONTROLS,
                                            io_text=ACCUMULATE_IO.replace("\n]", """,
  { name: "BATCH__3" data_type: TYPE_INT64 dims: [ 8 ] }\n]"""),
                                            extra='instance_group [ { count: 1 kind: KIND_CPU } ]')),
    "seq_one_slot": (Accumulate(), sequence_model("seq_one_slot", 1, """
  max_sequence_idle_microseconds: 300000
  direct { }""" + ALL_CONTROLS, extra='instance_group [ { count: 1 kind: KIND_CPU } ]')),
    "seq_crash": (SlowAccumulate(), sequence_model("seq_crash", 2, """
  max_sequence_idle_microseconds: 30000000
  direct { }""" + START_ONLY + """
  state [ { input_name: "STATE_IN__2" output_name: "STATE_OUT__1" data_type: TYPE_INT32 dims: [ 1 ] } ]""",
                                                   io_text='''
input [ { name: "INPUT__0" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUTPUT__0" data_type: TYPE_INT32 dims: [ 1 ] } ]
''', extra='instance_group [ { count: 2 kind: KIND_CPU } ]')),
    "seq_variable": (Grow(), sequence_model("seq_variable", 4, """
  direct { }""" + START_ONLY + """
  state [ { input_name: "STATE_IN__2" output_name: "STATE_OUT__1" data_type: TYPE_INT32 dims: [ -1 ] } ]""",
                                            io_text='''
input [ { name: "INPUT__0" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUTPUT__0" data_type: TYPE_INT32 dims: [ 2 ] } ]
''', extra='instance_group [ { count: 1 kind: KIND_CPU } ]')),
    "seq_strings": (Concat(), sequence_model("seq_strings", 4, """
  direct { }""" + START_ONLY + """
  state [ { input_name: "STATE_IN__2" output_name: "STATE_OUT__1" data_type: TYPE_STRING dims: [ 1 ] } ]""",
                                           io_text='''
input [ { name: "INPUT__0" data_type: TYPE_STRING dims: [ 1 ] reshape: { shape: [ ] } } ]
output [ { name: "OUTPUT__0" data_type: TYPE_STRING dims: [ 1 ] reshape: { shape: [ ] } } ]
''', extra='instance_group [ { count: 1 kind: KIND_CPU } ]')),
}


def save_model(root: Path, name: str, module: nn.Module, config: str) -> Path:
    model = root / name
    (model / "1").mkdir(parents=True)
    (model / "config.pbtxt").write_text(config)
    buffer = io.BytesIO()
    torch.jit.save(torch.jit.script(module), buffer)
    (model / "1" / "model.pt").write_bytes(buffer.getvalue())
    return model


@pytest.fixture(scope="module")
def seq_daemon(tmp_path_factory: pytest.TempPathFactory, test_repository: Path):
    root = tmp_path_factory.mktemp("sequence_repository")
    model = save_model(root, "sequence_controls", Controls(), CONTROLS_CONFIG)
    (model / "initial_state").mkdir()
    (model / "initial_state" / "hundred.bin").write_bytes(np.array([100], np.int64).tobytes())
    for name, (module, config) in MODELS.items():
        save_model(root, name, module, config)
    shutil.copytree(test_repository / ACCUMULATE, root / ACCUMULATE)
    d = Daemon(root, tmp_path_factory.mktemp("sequences"), "--log-level", "debug",
               tcp_port=free_tcp_port()).start()
    yield d
    assert d.stop() == 0, d.log()


@pytest.fixture(params=["ipc", "tcp"])
def seq_url(request: pytest.FixtureRequest, seq_daemon: Daemon) -> str:
    return next(u for u in seq_daemon.urls if u.startswith(request.param))


def stats(c: Client, model: str) -> tuple[int, int]:
    s = c.statistics(model)["model_stats"][0]
    return s["inference_count"], s["execution_count"]


# --- tests ----------------------------------------------------------------------------------

def test_interleaved_sequences_keep_their_own_state(seq_url: str) -> None:
    with Client(seq_url, timeout=30) as c:
        t = lambda x, seq, **flags: total(c, x, seq, "seq_direct", **flags)    # noqa: E731
        assert t(1, 101, sequence_start=True) == 1
        assert t(10, 102, sequence_start=True) == 10
        assert t(2, 101) == 3
        assert t(20, 102, sequence_end=True) == 30
        assert t(3, 101) == 6
        # START on a live sequence starts it afresh
        assert t(7, 101, sequence_start=True) == 7
        assert t(1, 101, sequence_end=True) == 8
        # string ids work too (on a model without a CORRID input)
        assert total(c, 5, "b-103", sequence_start=True, sequence_end=True) == 5


def test_sequence_errors_use_tritons_words(url: str) -> None:
    with Client(url, timeout=30) as c:
        with pytest.raises(InferenceError) as no_id:
            c.infer(ACCUMULATE, value(1))
        assert no_id.value.code == errors.INVALID_ARG
        assert ("inference request to model 'sequence_accumulate' must specify a non-zero or non-empty "
                "correlation ID") in no_id.value.message
        with pytest.raises(InferenceError) as no_start:
            c.infer(ACCUMULATE, value(1), sequence_id=555)
        assert ("inference request for sequence 555 to model 'sequence_accumulate' must specify the START "
                "flag on the first request of the sequence") in no_start.value.message
        # END closes the sequence: the id needs START again
        assert total(c, 4, 556, sequence_start=True, sequence_end=True) == 4
        with pytest.raises(InferenceError, match="must specify the START flag"):
            c.infer(ACCUMULATE, value(1), sequence_id=556)
        assert total(c, 5, 556, sequence_start=True) == 5
        c.infer(ACCUMULATE, value(0), sequence_id=556, sequence_end=True)


def test_requests_of_one_sequence_run_in_order_even_when_sent_together(seq_url: str) -> None:
    def x(v: int) -> dict:
        return {"INPUT__0": np.array([[v]], np.int32)}

    async def main() -> list[int]:
        async with AsyncClient(seq_url, timeout=30) as c:
            first = c.infer("seq_direct", x(1), sequence_id=777, sequence_start=True)
            rest = [c.infer("seq_direct", x(v), sequence_id=777, sequence_end=(v == 5)) for v in range(2, 6)]
            other = [c.infer("seq_direct", x(100 * v), sequence_id=778, sequence_start=(v == 1),
                             sequence_end=(v == 3)) for v in range(1, 4)]
            outs = await asyncio.gather(first, *rest, *other)
            return [int(o["OUTPUT__0"].reshape(-1)[0]) for o in outs]

    assert asyncio.run(main()) == [1, 3, 6, 10, 15, 100, 300, 600]


def test_every_control_tensor_and_an_initial_state_from_a_file(seq_daemon: Daemon) -> None:
    def row(x: float, seq, **flags) -> list[float]:
        out = c.infer("sequence_controls", {"INPUT__0": np.array([[x]], np.float32)}, sequence_id=seq, **flags)
        assert list(out) == ["OUTPUT__0"]
        return out["OUTPUT__0"].reshape(-1).tolist()

    with Client(seq_daemon.url, timeout=30) as c:
        # [x, start, end, ready, corrid, n]: n counts on from the initial state (100)
        assert row(1, 41, sequence_start=True) == [1, 1, 0, 1, 41, 101]
        assert row(2, 41) == [2, 0, 0, 1, 41, 102]
        assert row(3, 41, sequence_end=True) == [3, 0, 1, 1, 41, 103]
        assert row(4, 41, sequence_start=True) == [4, 1, 0, 1, 41, 101]
        with pytest.raises(InferenceError) as text_id:
            row(1, "not-a-number", sequence_start=True)
        assert "takes the correlation ID as INT64" in text_id.value.message
        # the failed request does not disturb the live sequence
        assert row(5, 41, sequence_end=True) == [5, 0, 1, 1, 41, 102]


def test_an_idle_sequence_is_released(seq_daemon: Daemon) -> None:
    with Client(seq_daemon.url, timeout=30) as c:
        start = c.infer("sequence_controls", {"INPUT__0": np.array([[1]], np.float32)},
                        sequence_id=42, sequence_start=True)["OUTPUT__0"]
        assert start.reshape(-1).tolist()[-1] == 101
        # max_sequence_idle_microseconds is 300 ms here
        wait_for(lambda: "sequence 42 idle" in seq_daemon.log(), 10, "the idle sequence to be released")
        with pytest.raises(InferenceError, match="must specify the START flag"):
            c.infer("sequence_controls", {"INPUT__0": np.array([[1]], np.float32)}, sequence_id=42)


# --- batching across sequences (Triton's sequence batcher) -------------------------------------

def run_sequences(url: str, model: str, first_id: int, count: int, steps: int) -> list[list[dict]]:
    """`count` sequences at once, each sending `steps` requests one after the other:
    sequence k sends 100 k + i at step i."""
    async def one(c: AsyncClient, k: int) -> list[dict]:
        outs = []
        for i in range(steps):
            outs.append(await c.infer(model, {"INPUT__0": np.array([[100 * k + i]], np.int32)},
                                      sequence_id=first_id + k, sequence_start=(i == 0),
                                      sequence_end=(i == steps - 1)))
        return outs

    async def main() -> list[list[dict]]:
        async with AsyncClient(url, timeout=60) as c:
            return list(await asyncio.gather(*(one(c, k) for k in range(count))))

    return asyncio.run(main())


@pytest.mark.parametrize("model", ["seq_direct", "seq_oldest"])
def test_concurrent_sequences_run_together_each_on_its_own_state(seq_url: str, model: str) -> None:
    count, steps = 8, 6
    with Client(seq_url, timeout=30) as c:
        inferences, executions = stats(c, model)
        results = run_sequences(seq_url, model, 5000, count, steps)
        after_inferences, after_executions = stats(c, model)
    batch_rows = []
    for k, outs in enumerate(results):
        running = 0
        for i, out in enumerate(outs):
            running += 100 * k + i
            assert sorted(out) == ["OUTPUT__0", "SEEN__2"], "the state output must never reach the client"
            assert int(out["OUTPUT__0"].reshape(-1)[0]) == running, (model, k, i)
            start, end, ready, corrid, rows = out["SEEN__2"].reshape(-1).tolist()
            assert (start, end, ready, corrid) == (int(i == 0), int(i == steps - 1), 1, 5000 + k)
            batch_rows.append(rows)
    assert after_inferences - inferences == count * steps
    assert after_executions - executions < count * steps, "sequences must share batches"
    assert max(batch_rows) == count, f"a batch should hold all {count} sequences: {batch_rows}"


def test_an_idle_sequence_frees_its_slot_for_a_waiting_one(seq_url: str) -> None:
    """seq_one_slot has one slot: a second sequence waits until the first one
    has been idle for max_sequence_idle_microseconds (300 ms)."""
    with Client(seq_url, timeout=30) as c:
        t = lambda x, seq, **flags: total(c, x, seq, "seq_one_slot", **flags)    # noqa: E731
        assert t(1, 61, sequence_start=True) == 1
        begun = time.monotonic()
        assert t(5, 62, sequence_start=True) == 5
        assert time.monotonic() - begun >= 0.2, "sequence 62 got the slot before 61 was idle"
        with pytest.raises(InferenceError, match="must specify the START flag"):
            t(1, 61)
        assert t(6, 62, sequence_end=True) == 11


def test_a_worker_crash_fails_exactly_the_sequences_it_held(seq_daemon: Daemon) -> None:
    """seq_crash: two instances of two slots. Sequences take the lowest free
    slot across instances: 1 and 3 share an instance, 2 and 4 the other."""
    pids = worker_pids(seq_daemon.log(), "seq_crash")
    assert len(pids) == 2
    outcome: dict = {}
    with Client(seq_daemon.url, timeout=60) as c:
        t = lambda x, seq, **flags: total(c, x, seq, "seq_crash", **flags)    # noqa: E731
        for k in (1, 2, 3, 4):
            assert t(k, 900 + k, sequence_start=True) == k

        def slow() -> None:
            with Client(seq_daemon.url, timeout=60) as c2:
                try:
                    outcome["result"] = total(c2, 10 ** 9, 901, "seq_crash")
                except InferenceError as exc:
                    outcome["error"] = exc

        before = {p: cpu_ticks(p) for p in pids}
        thread = threading.Thread(target=slow)
        thread.start()
        busy = wait_for(lambda: [p for p in pids if cpu_ticks(p) >= before[p] + 3], 30,
                        "an instance to run the slow request")[0]
        os.kill(busy, signal.SIGKILL)
        thread.join(30)
        err = outcome.get("error")
        assert err is not None, outcome
        assert "seq_crash" in err.message and "SIGKILL" in err.message, err.message
        # sequence 3 shared the dead instance: it is gone, and says so
        with pytest.raises(InferenceError) as lost:
            t(10, 903)
        assert "model 'seq_crash': sequence 903 was lost: instance" in lost.value.message
        assert "start it again with the START flag" in lost.value.message
        # sequences 2 and 4 lived on the other instance: untouched, state and all
        assert t(10, 902) == 12
        assert t(10, 904, sequence_end=True) == 14
        assert t(1, 902, sequence_end=True) == 13
        # a lost sequence starts again
        assert t(7, 901, sequence_start=True) == 7
        assert t(1, 901, sequence_end=True) == 8


def test_variable_shape_state_takes_the_shape_the_model_returns(seq_url: str) -> None:
    async def main() -> tuple[list, list]:
        async with AsyncClient(seq_url, timeout=30) as c:
            async def run(seq: int, values: list[int]) -> list:
                outs = []
                for i, v in enumerate(values):
                    out = await c.infer("seq_variable", {"INPUT__0": np.array([[v]], np.int32)},
                                        sequence_id=seq, sequence_start=(i == 0),
                                        sequence_end=(i == len(values) - 1))
                    outs.append(out["OUTPUT__0"].reshape(-1).tolist())
                return outs
            a, b = await asyncio.gather(run(71, [1, 2, 3, 4]), run(72, [10, 20]))
            return a, b

    a, b = asyncio.run(main())
    # [sum, state length]: the state grows by one element per request (after a leading 0)
    assert a == [[1, 2], [3, 3], [6, 4], [10, 5]]
    assert b == [[10, 2], [30, 3]]


def test_string_state(seq_url: str) -> None:
    async def main() -> tuple[list, list]:
        async with AsyncClient(seq_url, timeout=30) as c:
            async def run(seq: int, words: list[bytes]) -> list:
                outs = []
                for i, w in enumerate(words):
                    out = await c.infer("seq_strings", {"INPUT__0": np.array([[w]], dtype=object)},
                                        sequence_id=seq, sequence_start=(i == 0),
                                        sequence_end=(i == len(words) - 1))
                    outs.append(out["OUTPUT__0"].reshape(-1)[0])
                return outs
            return await asyncio.gather(run(81, [b"a", b"bb", b"c"]), run(82, [b"x", b"yyy"]))

    a, b = asyncio.run(main())
    assert a == [b"a", b"a+bb", b"a+bb+c"]
    assert b == [b"x", b"x+yyy"]


def test_an_empty_slot_below_a_busy_one_is_a_not_ready_row(seq_daemon: Daemon) -> None:
    """Triton's direct layout: with slots 0 and 2 busy and slot 1 free, a batch
    of both has three rows, the middle one READY=0 and CORRID 0, and each
    sequence still gets its own row's result."""
    def send(c: Client, x: int, seq: int, **flags) -> tuple[int, list[int], list[int]]:
        out = c.infer("seq_slots", {"INPUT__0": np.array([[x]], np.int32)}, sequence_id=seq, **flags)
        assert sorted(out) == ["BATCH__3", "OUTPUT__0", "SEEN__2"]
        return (int(out["OUTPUT__0"].reshape(-1)[0]), out["SEEN__2"].reshape(-1).tolist(),
                out["BATCH__3"].reshape(-1).tolist())

    with Client(seq_daemon.url, timeout=30) as c:
        # one at a time: 301 takes slot 0, 302 slot 1, 303 slot 2
        assert send(c, 1, 301, sequence_start=True) == (1, [1, 0, 1, 301, 1],
                                                        [1, -1, -1, -1, 301, -1, -1, -1])
        # 301 holds slot 0 but sends nothing: its row is there, not ready
        assert send(c, 2, 302, sequence_start=True) == (2, [1, 0, 1, 302, 2], [0, 1, -1, -1, 0, 302, -1, -1])
        assert send(c, 3, 303, sequence_start=True) == (3, [1, 0, 1, 303, 3], [0, 0, 1, -1, 0, 0, 303, -1])
        assert send(c, 20, 302, sequence_end=True)[0] == 22      # slot 1 is free now
        inferences, executions = stats(c, "seq_slots")

    async def both() -> list[dict]:
        async with AsyncClient(seq_daemon.url, timeout=30) as ac:
            return list(await asyncio.gather(*(
                ac.infer("seq_slots", {"INPUT__0": np.array([[x]], np.int32)}, sequence_id=seq)
                for x, seq in ((10, 301), (30, 303)))))

    a, b = asyncio.run(both())
    # one batch of three rows: 301 in row 0, the empty slot 1, 303 in row 2
    assert a["BATCH__3"].reshape(-1).tolist() == [1, 0, 1, -1, 301, 0, 303, -1]
    assert b["BATCH__3"].reshape(-1).tolist() == [1, 0, 1, -1, 301, 0, 303, -1]
    assert a["SEEN__2"].reshape(-1).tolist() == [0, 0, 1, 301, 3]
    assert b["SEEN__2"].reshape(-1).tolist() == [0, 0, 1, 303, 3]
    assert int(a["OUTPUT__0"].reshape(-1)[0]) == 11 and int(b["OUTPUT__0"].reshape(-1)[0]) == 33
    with Client(seq_daemon.url, timeout=30) as c:
        assert stats(c, "seq_slots") == (inferences + 2, executions + 1)
        assert send(c, 100, 303, sequence_end=True)[0] == 133
        assert send(c, 100, 301, sequence_end=True)[0] == 111
