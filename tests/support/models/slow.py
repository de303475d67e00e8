"""Slow models: a busy loop as long as the request asks for.

  slow     INPUT__0 INT64 [1], mbs 0 -> OUTPUT__0 INT64 [1] = INPUT__0:
           forward runs INPUT__0 iterations of a tiny add (about 1 us each
           once warm; the first call is a few times slower).
           `slow_iterations(seconds)` measures the count for a duration on
           this machine. Other models keep answering while it runs.
  slow_x2  the same with instance_group count 2 (KIND_CPU): two concurrent
           slow requests overlap.
"""
from __future__ import annotations

import functools
import time
from pathlib import Path

import torch
from torch import Tensor, nn

from .core import config, instances, serialize, tensor, write_model_dir


class Slow(nn.Module):
    """Busy loop: TorchScript has no clock or sleep, so work stands in for time."""

    def forward(self, iterations: Tensor) -> Tensor:
        n = int(iterations.reshape([-1])[0])
        count = torch.zeros([1], dtype=torch.int64)
        for _ in range(n):
            count = count + 1
        return count


READY: dict[str, tuple[int, ...]] = {"slow": (1,), "slow_x2": (1,)}


@functools.lru_cache(maxsize=None)
def slow_iterations(seconds: float) -> int:
    """Iterations of the `slow` model that take about `seconds` here (warm)."""
    model = torch.jit.script(Slow())
    probe = 20000
    with torch.inference_mode():
        for _ in range(3):  # the profiling executor's first calls are slower
            model(torch.tensor([probe]))
        start = time.perf_counter()
        model(torch.tensor([probe]))
        per_iteration = (time.perf_counter() - start) / probe
    return max(1, int(seconds / per_iteration))


def write_slow(root: Path) -> None:
    """Write this catalogue's models under `root`."""
    slow = serialize(Slow())
    slow_io = dict(inputs=[tensor("INPUT__0", "INT64", [1], comment="iterations")],
                   outputs=[tensor("OUTPUT__0", "INT64", [1], comment="iterations done")],
                   max_batch_size=0)
    write_model_dir(root, "slow", config("slow", **slow_io, comment="busy loop of INPUT__0 iterations"), slow)
    write_model_dir(root, "slow_x2", config("slow_x2", **slow_io, extra=instances(2, "KIND_CPU"),
                                            comment="two instances of the busy loop"), slow)
