"""Sequence batching with an implicit state.

  sequence_accumulate  mbs 0, sequence_batching (direct,
                       max_sequence_idle_microseconds 5000000).
                       INPUT__0 INT32 [1]; control START__1
                       (CONTROL_SEQUENCE_START, int32_false_true [0, 1]);
                       implicit state STATE_IN__2 / STATE_OUT__1 INT32 [1]
                       (zero initial state). forward(x, start, state) ->
                       (total, total) with total = state * (1 - start) + x.
                       OUTPUT__0 INT32 [1] = running sum of the sequence's
                       inputs: sequence A sending 1, 2, 3 gets 1, 3, 6 while
                       an interleaved sequence B sending 10, 20 gets 10, 30.
                       STATE_OUT__1 is never sent to the client.
"""
from __future__ import annotations

from pathlib import Path
from typing import Tuple

from torch import Tensor, nn

from .core import config, serialize, tensor, write_model_dir


class SequenceAccumulate(nn.Module):
    def forward(self, x: Tensor, start: Tensor, state: Tensor) -> Tuple[Tensor, Tensor]:
        total = state * (1 - start) + x
        return total, total


READY: dict[str, tuple[int, ...]] = {"sequence_accumulate": (1,)}

_SEQUENCE_BATCHING = """\
sequence_batching {
  max_sequence_idle_microseconds: 5000000
  direct { }
  control_input [
    {
      name: "START__1"
      control [
        {
          kind: CONTROL_SEQUENCE_START
          int32_false_true: [ 0, 1 ]
        }
      ]
    }
  ]
  state [
    {
      input_name: "STATE_IN__2"
      output_name: "STATE_OUT__1"
      data_type: TYPE_INT32
      dims: [ 1 ]
      initial_state: {
        name: "zero"
        data_type: TYPE_INT32
        dims: [ 1 ]
        zero_data: true
      }
    }
  ]
}
"""


def write_sequences(root: Path) -> None:
    """Write this catalogue's models under `root`."""
    write_model_dir(root, "sequence_accumulate",
                    config("sequence_accumulate",
                           inputs=[tensor("INPUT__0", "INT32", [1])],
                           outputs=[tensor("OUTPUT__0", "INT32", [1], comment="running sum")],
                           max_batch_size=0, extra=_SEQUENCE_BATCHING,
                           comment="running sum per sequence, kept in an implicit state"),
                    serialize(SequenceAccumulate()))
