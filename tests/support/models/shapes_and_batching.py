"""Shapes, reshape and batching: what the model saw, and which rows it got.

  identity_fp32    [backend] INPUT__0 FP32 [-1], mbs 0 -> OUTPUT__0 = INPUT__0.
                   Zero-size ([0]) and any-length inputs must round-trip.
  identity_batched INPUT__0 FP32 [-1, 3], mbs 4 -> OUTPUT__0 = INPUT__0, shape
                   [n, k, 3] with n <= 4; n = 5 must be rejected (batch size
                   above max_batch_size 4).
  input_views      INPUT__0 FP32 [-1], mbs 0 -> OUTPUT__0 = INPUT__0 (the input
                   itself), OUTPUT__1 = INPUT__0[8:] (a contiguous view into it),
                   OUTPUT__2 = INPUT__0[::2] (a strided view), all FP32 [-1]:
                   which outputs may come back in a local client's own input block.
  reshape_model    mbs 0. INPUT__0 FP32 dims [2, 6] reshape { shape: [3, 4] }.
                   OUTPUT__0 INT64 dims [2] = the shape the model saw: [3, 4].
                   OUTPUT__1 FP32 dims [4, 3] reshape { shape: [12] }: the
                   model returns x.flatten() ([12]), the client gets [4, 3] =
                   the input's 12 values in row-major order.
  reshape_batched  mbs 4. INPUT__0 FP32 dims [2, 6] reshape { shape: [3, 4] }.
                   OUTPUT__0 INT64 dims [3]: every row = the shape the model
                   saw = [n, 3, 4] for a request of n items.
  reshape_variable mbs 4. INPUT__0 FP32 dims [-1, 6] reshape { shape: [-1, 2, 3] }
                   (Triton resolves the reshape's -1 from the request).
                   OUTPUT__0 INT64 dims [4]: every row = the shape the model
                   saw = [n, k, 2, 3] for a request of shape [n, k, 6].
  batch_probe      mbs 8, dynamic_batching { max_queue_delay_microseconds:
                   100000 }. INPUT__0 FP32 [1] -> OUTPUT__0 INT64 [1] = the
                   batch size of the execution this row was part of (same for
                   every row of one execution; never above 8), OUTPUT__1 FP32
                   [1] = INPUT__0 (so each request can check it got its own
                   rows back). One lone request waits up to 0.1 s.
  ragged_sum       mbs 8, INPUT__0 FP32 [-1] allow_ragged_batch: true,
                   batch_input BATCH_ACCUMULATED_ELEMENT_COUNT (target
                   INDEX__1, TYPE_INT32, source INPUT__0), output
                   OUTPUT__0 FP32 [1], dynamic_batching {
                   max_queue_delay_microseconds: 50000 }. A request sends
                   [1, k] and gets [1, 1] = the sum of its k values, also
                   when requests of different k are batched together.
                   The model gets INPUT__0 as one flat concatenation and
                   INDEX__1 = end offsets (any shape; it is flattened).
"""
from __future__ import annotations

from pathlib import Path
from typing import List, Tuple

import torch
from torch import Tensor, nn

from .basic import Identity
from .core import config, dynamic_batching, serialize, tensor, write_model_dir


class InputViews(nn.Module):
    def forward(self, x: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        return x, x[8:], x[::2]


class ShapeAndFlat(nn.Module):
    def forward(self, x: Tensor) -> Tuple[Tensor, Tensor]:
        return torch.tensor(x.size(), dtype=torch.int64), x.flatten()


class ShapePerRow(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        shape = torch.tensor(x.size(), dtype=torch.int64)
        return shape.unsqueeze(0).repeat(x.size(0), 1)


class BatchProbe(nn.Module):
    def forward(self, x: Tensor) -> Tuple[Tensor, Tensor]:
        batch = x.size(0)
        return torch.full([batch, 1], batch, dtype=torch.int64), x


class RaggedSum(nn.Module):
    def forward(self, data: Tensor, ends: Tensor) -> Tensor:
        flat = data.flatten()
        offsets = ends.flatten().to(torch.int64)
        sums: List[Tensor] = []
        begin = 0
        for i in range(offsets.size(0)):
            end = int(offsets[i])
            sums.append(flat[begin:end].sum().reshape([1]))
            begin = end
        return torch.stack(sums)


READY: dict[str, tuple[int, ...]] = {name: (1,) for name in [
    "identity_fp32", "identity_batched", "input_views", "reshape_model", "reshape_batched",
    "reshape_variable", "batch_probe", "ragged_sum"]}

_RAGGED_BATCH_INPUT = """\
batch_input [
  {
    kind: BATCH_ACCUMULATED_ELEMENT_COUNT
    target_name: "INDEX__1"
    data_type: TYPE_INT32
    source_input: "INPUT__0"
  }
]
"""


def write_shapes_and_batching(root: Path) -> None:
    """Write this catalogue's models under `root`."""
    identity = serialize(Identity())
    write_model_dir(root, "identity_fp32",
                    config("identity_fp32", inputs=[tensor("INPUT__0", "FP32", [-1])],
                           outputs=[tensor("OUTPUT__0", "FP32", [-1])], max_batch_size=0,
                           backend=True, comment="any length, zero included"),
                    identity)
    write_model_dir(root, "identity_batched",
                    config("identity_batched", inputs=[tensor("INPUT__0", "FP32", [-1, 3])],
                           outputs=[tensor("OUTPUT__0", "FP32", [-1, 3])], max_batch_size=4),
                    identity)
    write_model_dir(root, "input_views",
                    config("input_views", inputs=[tensor("INPUT__0", "FP32", [-1])],
                           outputs=[tensor(f"OUTPUT__{i}", "FP32", [-1]) for i in range(3)], max_batch_size=0),
                    serialize(InputViews()))
    write_model_dir(root, "reshape_model",
                    config("reshape_model",
                           inputs=[tensor("INPUT__0", "FP32", [2, 6], reshape=[3, 4])],
                           outputs=[tensor("OUTPUT__0", "INT64", [2], comment="the shape forward saw"),
                                    tensor("OUTPUT__1", "FP32", [4, 3], reshape=[12],
                                           comment="forward returns [12]")],
                           max_batch_size=0, comment="reshape on an input and on an output"),
                    serialize(ShapeAndFlat()))
    write_model_dir(root, "reshape_batched",
                    config("reshape_batched",
                           inputs=[tensor("INPUT__0", "FP32", [2, 6], reshape=[3, 4])],
                           outputs=[tensor("OUTPUT__0", "INT64", [3],
                                           comment="every row: the shape forward saw")],
                           max_batch_size=4),
                    serialize(ShapePerRow()))
    write_model_dir(root, "reshape_variable",
                    config("reshape_variable",
                           inputs=[tensor("INPUT__0", "FP32", [-1, 6], reshape=[-1, 2, 3])],
                           outputs=[tensor("OUTPUT__0", "INT64", [4],
                                           comment="every row: the shape forward saw")],
                           max_batch_size=4),
                    serialize(ShapePerRow()))
    write_model_dir(root, "batch_probe",
                    config("batch_probe", inputs=[tensor("INPUT__0", "FP32", [1])],
                           outputs=[tensor("OUTPUT__0", "INT64", [1], comment="executed batch size"),
                                    tensor("OUTPUT__1", "FP32", [1], comment="INPUT__0")],
                           max_batch_size=8, extra=dynamic_batching(100000)),
                    serialize(BatchProbe()))
    write_model_dir(root, "ragged_sum",
                    config("ragged_sum",
                           inputs=[tensor("INPUT__0", "FP32", [-1], extra="allow_ragged_batch: true")],
                           outputs=[tensor("OUTPUT__0", "FP32", [1], comment="sum of the request's values")],
                           max_batch_size=8, extra=_RAGGED_BATCH_INPUT + dynamic_batching(50000),
                           comment="ragged batch: one flat input plus end offsets"),
                    serialize(RaggedSum()))
