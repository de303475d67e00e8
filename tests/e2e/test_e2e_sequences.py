"""End to end: sequence batching (`sequence_batching { }`) for stateful
models — correlation ids, START / END, control tensors, implicit state kept
between the requests of a sequence, idle sequences released."""
from __future__ import annotations

import asyncio
import io
import shutil
from pathlib import Path
from typing import Tuple

import numpy as np
import pytest
import torch
from torch import Tensor, nn

from torchpool import AsyncClient, Client, InferenceError
from torchpool.protocol import errors

from ..support.daemon import Daemon, wait_for

ACCUMULATE = "sequence_accumulate"      # running sum in an implicit INT32 state, START only


def value(x: int) -> dict:
    return {"INPUT__0": np.array([x], np.int32)}


def total(c: Client, x: int, seq, **flags) -> int:
    out = c.infer(ACCUMULATE, value(x), sequence_id=seq, **flags)
    assert list(out) == ["OUTPUT__0"], "the state output must never reach the client"
    return int(out["OUTPUT__0"][0])


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


@pytest.fixture(scope="module")
def controls_daemon(tmp_path_factory: pytest.TempPathFactory, test_repository: Path):
    root = tmp_path_factory.mktemp("sequence_repository")
    model = root / "sequence_controls"
    (model / "1").mkdir(parents=True)
    (model / "config.pbtxt").write_text(CONTROLS_CONFIG)
    (model / "initial_state").mkdir()
    (model / "initial_state" / "hundred.bin").write_bytes(np.array([100], np.int64).tobytes())
    buffer = io.BytesIO()
    torch.jit.save(torch.jit.script(Controls()), buffer)
    (model / "1" / "model.pt").write_bytes(buffer.getvalue())
    shutil.copytree(test_repository / ACCUMULATE, root / ACCUMULATE)
    d = Daemon(root, tmp_path_factory.mktemp("sequences"), "--log-level", "debug").start()
    yield d
    assert d.stop() == 0, d.log()


# --- tests ----------------------------------------------------------------------------------

def test_interleaved_sequences_keep_their_own_state(url: str) -> None:
    with Client(url, timeout=30) as c:
        assert total(c, 1, 101, sequence_start=True) == 1
        assert total(c, 10, "b-102", sequence_start=True) == 10         # string ids work too
        assert total(c, 2, 101) == 3
        assert total(c, 20, "b-102", sequence_end=True) == 30
        assert total(c, 3, 101) == 6
        # START on a live sequence starts it afresh
        assert total(c, 7, 101, sequence_start=True) == 7
        assert total(c, 1, 101, sequence_end=True) == 8


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


def test_requests_of_one_sequence_run_in_order_even_when_sent_together(url: str) -> None:
    async def main() -> list[int]:
        async with AsyncClient(url, timeout=30) as c:
            first = c.infer(ACCUMULATE, value(1), sequence_id=777, sequence_start=True)
            rest = [c.infer(ACCUMULATE, value(x), sequence_id=777, sequence_end=(x == 5)) for x in range(2, 6)]
            other = [c.infer(ACCUMULATE, value(100 * x), sequence_id=778, sequence_start=(x == 1))
                     for x in range(1, 4)]
            outs = await asyncio.gather(first, *rest, *other)
            return [int(o["OUTPUT__0"][0]) for o in outs]

    assert asyncio.run(main()) == [1, 3, 6, 10, 15, 100, 300, 600]


def test_every_control_tensor_and_an_initial_state_from_a_file(controls_daemon: Daemon) -> None:
    def row(x: float, seq, **flags) -> list[float]:
        out = c.infer("sequence_controls", {"INPUT__0": np.array([[x]], np.float32)}, sequence_id=seq, **flags)
        assert list(out) == ["OUTPUT__0"]
        return out["OUTPUT__0"].reshape(-1).tolist()

    with Client(controls_daemon.url, timeout=30) as c:
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


def test_an_idle_sequence_is_released(controls_daemon: Daemon) -> None:
    with Client(controls_daemon.url, timeout=30) as c:
        start = c.infer("sequence_controls", {"INPUT__0": np.array([[1]], np.float32)},
                        sequence_id=42, sequence_start=True)["OUTPUT__0"]
        assert start.reshape(-1).tolist()[-1] == 101
        # max_sequence_idle_microseconds is 300 ms here
        wait_for(lambda: "sequence 42 idle" in controls_daemon.log(), 10, "the idle sequence to be released")
        with pytest.raises(InferenceError, match="must specify the START flag"):
            c.infer("sequence_controls", {"INPUT__0": np.array([[1]], np.float32)}, sequence_id=42)
