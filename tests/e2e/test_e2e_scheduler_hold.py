"""End to end: Triton's test switches for its schedulers, which its QA
(qa/L0_batcher, qa/L0_sequence_batcher) relies on: a daemon started with
TRITONSERVER_DELAY_SCHEDULER=N forms no batch of a model until N requests
are queued for it (the sequence batcher: in its slots, and with
TRITONSERVER_BACKLOG_DELAY_SCHEDULER=M, M more in its backlog), so the
batches requests form once they collected are Triton's: the biggest preferred
size, everything up to max_batch_size once the queue delay is over, freed
slots filled from the backlog. Waits are on the answers, never on sleeps."""
from __future__ import annotations

import asyncio
import io
from pathlib import Path
from typing import Tuple

import numpy as np
import pytest
import torch
from torch import Tensor, nn

from torchpool import AsyncClient, Client

from ..support.daemon import Daemon

HOLD = 6             # TRITONSERVER_DELAY_SCHEDULER
BACKLOG_HOLD = 1     # TRITONSERVER_BACKLOG_DELAY_SCHEDULER


class Double(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x * 2


class Accumulate(nn.Module):
    """Running sum in an implicit state."""

    def forward(self, x: Tensor, start: Tensor, ready: Tensor, state: Tensor) -> Tuple[Tensor, Tensor]:
        total = torch.where(start != 0, x, x + state) * ready
        return total, total


def dynamic(name: str, delay_us: int) -> str:
    return f"""
name: "{name}"
platform: "pytorch_libtorch"
max_batch_size: 8
input [ {{ name: "INPUT__0" data_type: TYPE_FP32 dims: [ 1 ] }} ]
output [ {{ name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ 1 ] }} ]
instance_group [ {{ kind: KIND_CPU count: 1 }} ]
dynamic_batching {{ preferred_batch_size: [ 2, 6 ] max_queue_delay_microseconds: {delay_us} }}
"""


SEQUENCE = """
name: "seq"
platform: "pytorch_libtorch"
max_batch_size: 4
input [ { name: "INPUT__0" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUTPUT__0" data_type: TYPE_INT32 dims: [ 1 ] } ]
instance_group [ { kind: KIND_CPU count: 1 } ]
sequence_batching {
  max_sequence_idle_microseconds: 5000000
  control_input [
    { name: "START__1" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ] },
    { name: "READY__2" control [ { kind: CONTROL_SEQUENCE_READY int32_false_true: [ 0, 1 ] } ] }
  ]
  state [ { input_name: "STATE_IN__3" output_name: "STATE_OUT__1" data_type: TYPE_INT32 dims: [ 1 ] } ]
}
"""


def save(root: Path, name: str, module: nn.Module, config: str) -> None:
    (root / name / "1").mkdir(parents=True)
    (root / name / "config.pbtxt").write_text(config)
    buffer = io.BytesIO()
    torch.jit.save(torch.jit.script(module), buffer)
    (root / name / "1" / "model.pt").write_bytes(buffer.getvalue())


@pytest.fixture(scope="module")
def held(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("held_repository")
    save(root, "preferred", Double(), dynamic("preferred", 10_000_000))
    save(root, "delayed", Double(), dynamic("delayed", 300_000))
    save(root, "seq", Accumulate(), SEQUENCE)
    d = Daemon(root, tmp_path_factory.mktemp("held"), env={
        "TRITONSERVER_DELAY_SCHEDULER": str(HOLD),
        "TRITONSERVER_BACKLOG_DELAY_SCHEDULER": str(BACKLOG_HOLD)}).start()
    yield d
    assert d.stop() == 0, d.log()


def batches(c: Client, model: str) -> dict[int, int]:
    """Triton's batch statistics: executions per batch size."""
    s = c.statistics(model)["model_stats"][0]
    return {b["batch_size"]: b["compute_infer"]["count"] for b in s["batch_stats"]}


def rows(n: int, value: float) -> dict:
    return {"INPUT__0": np.full((n, 1), value, np.float32)}


def test_requests_held_together_go_at_the_biggest_preferred_size(held: Daemon) -> None:
    # qa/L0_batcher test_multi_batch_use_biggest_preferred
    async def main() -> list:
        async with AsyncClient(held.url, timeout=30) as c:
            return await asyncio.gather(*(c.infer("preferred", rows(1, v)) for v in range(HOLD)))

    outs = asyncio.run(main())
    assert [o["OUTPUT__0"].tolist() for o in outs] == [[[2.0 * v]] for v in range(HOLD)]
    with Client(held.url, timeout=30) as c:
        assert batches(c, "preferred") == {6: 1}
        assert "TRITONSERVER_DELAY_SCHEDULER=6" in held.log() and "a switch for testing" in held.log()
        # released for good: a lone request now waits only for its preferred size
        c.infer("preferred", rows(2, 1.0))
        assert batches(c, "preferred") == {6: 1, 2: 1}


def test_once_the_queue_delay_is_over_the_batch_takes_up_to_max_batch_size(held: Daemon) -> None:
    # qa/L0_batcher test_multi_batch_delayed_use_max_batch: 3 + 1 + 1 + 1 + 1 held past the
    # 300 ms queue delay, then a sixth: one batch of 8 (within the delay it would be 6 and 2)
    async def main() -> list:
        async with AsyncClient(held.url, timeout=30) as c:
            early = [asyncio.ensure_future(c.infer("delayed", rows(3, 1.0)))]
            early += [asyncio.ensure_future(c.infer("delayed", rows(1, v))) for v in (2.0, 3.0, 4.0, 5.0)]
            done, _ = await asyncio.wait(early, timeout=0.6)
            assert not done, "the batcher is held until six requests are queued"
            last = await c.infer("delayed", rows(1, 6.0))
            return [*(await asyncio.gather(*early)), last]

    outs = asyncio.run(main())
    assert [o["OUTPUT__0"].reshape(-1).tolist() for o in outs] == \
        [[2.0, 2.0, 2.0], [4.0], [6.0], [8.0], [10.0], [12.0]]
    with Client(held.url, timeout=30) as c:
        assert batches(c, "delayed") == {8: 1}


def test_held_sequences_batch_together_and_the_backlog_fills_freed_slots(held: Daemon) -> None:
    # qa/L0_sequence_batcher test_backlog_fill, smaller: sequences 1 and 2 of two requests,
    # 3 and 4 of one, in the four slots (6 requests); 5 waits in the backlog (1) and takes
    # the slot 3 frees in the first batch
    def x(v: int) -> dict:
        return {"INPUT__0": np.array([[v]], np.int32)}

    async def main() -> list[int]:
        async with AsyncClient(held.url, timeout=30) as c:
            sent = [c.infer("seq", x(1), sequence_id=1, sequence_start=True),
                    c.infer("seq", x(10), sequence_id=2, sequence_start=True),
                    c.infer("seq", x(100), sequence_id=3, sequence_start=True, sequence_end=True),
                    c.infer("seq", x(1000), sequence_id=4, sequence_start=True, sequence_end=True),
                    c.infer("seq", x(2), sequence_id=1, sequence_end=True),
                    c.infer("seq", x(20), sequence_id=2, sequence_end=True),
                    c.infer("seq", x(5), sequence_id=5, sequence_start=True, sequence_end=True)]
            return [int(o["OUTPUT__0"].reshape(-1)[0]) for o in await asyncio.gather(*sent)]

    assert asyncio.run(main()) == [1, 10, 100, 1000, 3, 30, 5]
    with Client(held.url, timeout=30) as c:
        s = c.statistics("seq")["model_stats"][0]
        assert batches(c, "seq") == {4: 1, 3: 1}
        assert (s["inference_count"], s["execution_count"]) == (7, 2)
