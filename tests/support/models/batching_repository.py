"""Models whose outputs reveal how they were batched (tests/e2e/test_e2e_batching.py).

`build_batching_repository(root)` writes them under `root`.

Probe models (one module, several dynamic_batching configs)
-----------------------------------------------------------
forward(x, pause) -> (x, rows, seq), mbs 8, one KIND_CPU instance unless said.
  INPUT__0  FP32 dims [-1]   echoed back as OUTPUT__0 (each request checks it
                             got its own rows; requests of different lengths
                             cannot share a batch)
  PAUSE__1  FP32 dims [1]    the execution sleeps max(PAUSE__1) seconds (a
                             custom op `tp_batching::sleep`, loaded in the
                             worker with TORCHPOOL_PYTHON_MODULES): keeps the
                             instance busy without burning CPU
  ROWS__1   INT64 dims [1]   every row: the rows of the execution it was part of
  SEQ__2    INT64 dims [1]   every row: the number of this execution in its
                             instance (1, 2, ...): which batch ran first

  probe_delay      max_queue_delay_microseconds 300000
  probe_preferred  preferred_batch_size [ 4 ], max_queue_delay 5 s
  probe_priority   priority_levels 2, default_priority_level 2,
                   preferred_batch_size [ 2 ] (batches of at most 2)
  probe_reject     default_queue_policy { REJECT, default_timeout 150 ms,
                   allow_timeout_override }
  probe_delayed    default_queue_policy { DELAY, allow_timeout_override },
                   preferred_batch_size [ 1 ] (one request per execution)
  probe_full       default_queue_policy { max_queue_size: 2 }
  probe_ordered    preserve_ordering, 2 instances, preferred_batch_size [ 1 ]
  probe_unordered  the same without preserve_ordering
  probe_plain      no dynamic_batching: one request per execution

Strings
-------
  strings_batched  forward(text: List[str]) -> (each string reversed, lengths
                   INT64); INPUT__0 STRING dims [1] reshape [ ], mbs 8,
                   max_queue_delay 200 ms.

Ragged batching with every batch_input kind and a batch_output
--------------------------------------------------------------
  ragged_all  mbs 8, max_queue_delay 300 ms. INPUT__0 FP32 dims [-1, -1],
              allow_ragged_batch: a request sends [1, a, b]. Batch inputs (all
              from INPUT__0): COUNT__1 BATCH_ELEMENT_COUNT INT32, ACC__2
              BATCH_ACCUMULATED_ELEMENT_COUNT FP32, ACC0__3 ..._WITH_ZERO
              INT32, MAX__4 BATCH_MAX_ELEMENT_COUNT_AS_SHAPE INT32, SHAPE__5
              BATCH_ITEM_SHAPE FP32, FLAT__6 BATCH_ITEM_SHAPE_FLATTEN INT32.
              INFO__0 FP32 [11] per request: [count, acc, acc0[i], acc0[i+1],
              len(MAX__4), item shape a, b (from SHAPE__5), a, b (from
              FLAT__6), sum of its own elements (located by ACC0__3), number
              of requests in the batch]. SCATTER__1 FP32 dims [-1, -1] =
              INPUT__0 * 2 as one flat run, split back with
              BATCH_SCATTER_WITH_INPUT_SHAPE: each request gets [1, a, b].
"""
from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import List, Tuple

import torch
from torch import Tensor, nn

from .core import serialize, write_model_dir
from .strings import ReverseStrings

SLEEP_OPS = '''
import time
import torch
lib = torch.library.Library("tp_batching", "DEF")
lib.define("sleep(Tensor seconds) -> Tensor")
def _sleep(seconds):
    if seconds.numel():
        time.sleep(max(0.0, float(seconds.max())))
    return torch.zeros([1], dtype=torch.int64)
lib.impl("sleep", _sleep, "CPU")
'''

_registered = False


def register_sleep_op(where: Path) -> None:
    """Define tp_batching::sleep in this process too (needed to script Probe)."""
    global _registered
    if _registered:
        return
    path = where / "batching_ops.py"
    path.write_text(SLEEP_OPS)
    spec = importlib.util.spec_from_file_location("tp_batching_ops_for_scripting", path)
    spec.loader.exec_module(importlib.util.module_from_spec(spec))
    _registered = True


class Probe(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros([1], dtype=torch.int64))

    def forward(self, x: Tensor, pause: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        slept = torch.ops.tp_batching.sleep(pause)     # zeros: used, so never optimised away
        self.calls.add_(slept + 1)
        n = x.size(0)
        rows = torch.full([n, 1], n, dtype=torch.int64)
        seq = self.calls.reshape([1, 1]).repeat(n, 1)
        return x, rows, seq


class RaggedReveal(nn.Module):
    def forward(self, data: Tensor, count: Tensor, acc: Tensor, acc0: Tensor, biggest: Tensor,
                item_shape: Tensor, item_flat: Tensor) -> Tuple[Tensor, Tensor]:
        flat = data.flatten()
        n = count.size(0)
        rows: List[Tensor] = []
        for i in range(n):
            begin = int(acc0[i])
            end = int(acc0[i + 1])
            rows.append(torch.stack([
                count[i].to(torch.float32), acc[i].to(torch.float32),
                acc0[i].to(torch.float32), acc0[i + 1].to(torch.float32),
                torch.tensor(float(biggest.size(0))),
                item_shape[i, 0].to(torch.float32), item_shape[i, 1].to(torch.float32),
                item_flat[2 * i].to(torch.float32), item_flat[2 * i + 1].to(torch.float32),
                flat[begin:end].sum(), torch.tensor(float(n))]))
        return torch.stack(rows), flat * 2.0


PROBE_IO = """\
input [
  { name: "INPUT__0" data_type: TYPE_FP32 dims: [ -1 ] },
  { name: "PAUSE__1" data_type: TYPE_FP32 dims: [ 1 ] }
]
output [
  { name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ -1 ] },
  { name: "ROWS__1" data_type: TYPE_INT64 dims: [ 1 ] },
  { name: "SEQ__2" data_type: TYPE_INT64 dims: [ 1 ] }
]
parameters { key: "TORCHPOOL_PYTHON_MODULES" value { string_value: "batching_ops.py" } }
"""

ONE_INSTANCE = "instance_group [ { count: 1 kind: KIND_CPU } ]\n"
TWO_INSTANCES = "instance_group [ { count: 2 kind: KIND_CPU } ]\n"

PROBES = {
    "probe_delay": ONE_INSTANCE + "dynamic_batching { max_queue_delay_microseconds: 300000 }",
    "probe_preferred": ONE_INSTANCE + """dynamic_batching {
  preferred_batch_size: [ 4 ]
  max_queue_delay_microseconds: 5000000
}""",
    "probe_priority": ONE_INSTANCE + """dynamic_batching {
  preferred_batch_size: [ 2 ]
  priority_levels: 2
  default_priority_level: 2
}""",
    "probe_reject": ONE_INSTANCE + """dynamic_batching {
  default_queue_policy {
    timeout_action: REJECT
    default_timeout_microseconds: 150000
    allow_timeout_override: true
  }
}""",
    "probe_delayed": ONE_INSTANCE + """dynamic_batching {
  preferred_batch_size: [ 1 ]
  default_queue_policy { timeout_action: DELAY allow_timeout_override: true }
}""",
    "probe_full": ONE_INSTANCE + "dynamic_batching { default_queue_policy { max_queue_size: 2 } }",
    "probe_ordered": TWO_INSTANCES + """dynamic_batching {
  preferred_batch_size: [ 1 ]
  preserve_ordering: true
}""",
    "probe_unordered": TWO_INSTANCES + "dynamic_batching { preferred_batch_size: [ 1 ] }",
    "probe_plain": ONE_INSTANCE,
}

STRINGS_CONFIG = """\
name: "strings_batched"
platform: "pytorch_libtorch"
max_batch_size: 8
input [ { name: "INPUT__0" data_type: TYPE_STRING dims: [ 1 ] reshape: { shape: [ ] } } ]
output [
  { name: "OUTPUT__0" data_type: TYPE_STRING dims: [ 1 ] reshape: { shape: [ ] } },
  { name: "OUTPUT__1" data_type: TYPE_INT64 dims: [ 1 ] reshape: { shape: [ ] } }
]
dynamic_batching { max_queue_delay_microseconds: 200000 }
"""

RAGGED_CONFIG = """\
name: "ragged_all"
platform: "pytorch_libtorch"
max_batch_size: 8
input [ { name: "INPUT__0" data_type: TYPE_FP32 dims: [ -1, -1 ] allow_ragged_batch: true } ]
output [
  { name: "INFO__0" data_type: TYPE_FP32 dims: [ 11 ] },
  { name: "SCATTER__1" data_type: TYPE_FP32 dims: [ -1, -1 ] }
]
batch_input [
  { kind: BATCH_ELEMENT_COUNT target_name: "COUNT__1" data_type: TYPE_INT32 source_input: "INPUT__0" },
  { kind: BATCH_ACCUMULATED_ELEMENT_COUNT target_name: "ACC__2" data_type: TYPE_FP32
    source_input: "INPUT__0" },
  { kind: BATCH_ACCUMULATED_ELEMENT_COUNT_WITH_ZERO target_name: "ACC0__3" data_type: TYPE_INT32
    source_input: "INPUT__0" },
  { kind: BATCH_MAX_ELEMENT_COUNT_AS_SHAPE target_name: "MAX__4" data_type: TYPE_INT32
    source_input: "INPUT__0" },
  { kind: BATCH_ITEM_SHAPE target_name: "SHAPE__5" data_type: TYPE_FP32 source_input: "INPUT__0" },
  { kind: BATCH_ITEM_SHAPE_FLATTEN target_name: "FLAT__6" data_type: TYPE_INT32
    source_input: "INPUT__0" }
]
batch_output [
  { target_name: "SCATTER__1" kind: BATCH_SCATTER_WITH_INPUT_SHAPE source_input: "INPUT__0" }
]
dynamic_batching { max_queue_delay_microseconds: 300000 }
"""




def build_batching_repository(root: Path) -> list[str]:
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    register_sleep_op(root)
    probe = serialize(Probe())
    for name, extra in PROBES.items():
        config = f'name: "{name}"\nplatform: "pytorch_libtorch"\nmax_batch_size: 8\n{PROBE_IO}{extra}\n'
        write_model_dir(root, name, config, probe)
        (root / name / "batching_ops.py").write_text(SLEEP_OPS)
    write_model_dir(root, "strings_batched", STRINGS_CONFIG, serialize(ReverseStrings()))
    write_model_dir(root, "ragged_all", RAGGED_CONFIG, serialize(RaggedReveal()))
    return [*PROBES, "strings_batched", "ragged_all"]
