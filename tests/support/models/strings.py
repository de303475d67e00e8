"""Strings: TYPE_STRING <-> TorchScript List[str].

Use ASCII: TorchScript reverses bytes, which would break multi-byte UTF-8 characters.
forward(text: List[str]) -> (reversed strings, lengths as INT64 tensor).
  string_io       mbs 0. INPUT__0 STRING [-1] -> OUTPUT__0 STRING [-1] = each
                  string reversed, OUTPUT__1 INT64 [-1] = each string's length
                  in bytes. ["abc", "", "hello"] -> ["cba", "", "olleh"],
                  [3, 0, 5]. An empty list gives [] and an empty INT64 [0].
  string_batched  mbs 8, dynamic_batching { max_queue_delay_microseconds:
                  50000 }. INPUT__0 STRING dims [1] reshape { shape: [ ] }
                  (the model sees one flat List[str] of the whole batch;
                  this is how Triton accepts batched strings: 0 dims + batch
                  = 1-D). OUTPUT__0 STRING dims [1] reshape [ ] and OUTPUT__1
                  INT64 dims [1] reshape [ ], same functions. A request sends
                  [n, 1] and gets its own n results back, shape [n, 1] per the
                  config (Triton's C++ backend answers [n] for the string
                  output; compare values flattened). Concurrent requests get
                  batched together: each must get exactly its own strings.
"""
from __future__ import annotations

from pathlib import Path
from typing import List, Tuple

import torch
from torch import Tensor, nn

from .core import config, dynamic_batching, serialize, tensor, write_model_dir


class ReverseStrings(nn.Module):
    def forward(self, text: List[str]) -> Tuple[List[str], Tensor]:
        reversed_text: List[str] = []
        lengths: List[int] = []
        for s in text:
            reversed_text.append(s[::-1])
            lengths.append(len(s))
        return reversed_text, torch.tensor(lengths, dtype=torch.int64)


READY: dict[str, tuple[int, ...]] = {"string_io": (1,), "string_batched": (1,)}


def write_strings(root: Path) -> None:
    """Write this catalogue's models under `root`."""
    reverse_strings = serialize(ReverseStrings())
    write_model_dir(root, "string_io",
                    config("string_io", inputs=[tensor("INPUT__0", "STRING", [-1])],
                           outputs=[tensor("OUTPUT__0", "STRING", [-1], comment="each string reversed"),
                                    tensor("OUTPUT__1", "INT64", [-1], comment="each string's length")],
                           max_batch_size=0, comment="forward(self, text: List[str])"),
                    reverse_strings)
    write_model_dir(root, "string_batched",
                    config("string_batched",
                           inputs=[tensor("INPUT__0", "STRING", [1], reshape=[])],
                           outputs=[tensor("OUTPUT__0", "STRING", [1], reshape=[],
                                           comment="each string reversed"),
                                    tensor("OUTPUT__1", "INT64", [1], reshape=[],
                                           comment="each string's length")],
                           max_batch_size=8, extra=dynamic_batching(50000),
                           comment="batched strings: dims [1] reshaped to [] keeps the list 1-D"),
                    reverse_strings)
