"""Which idle instance takes a batch: the one idle for the shortest time
(broker/server.py `_dispatch`). Its caches (the model's weights) and thread
pool are still warm; taken in turn, two CPU instances of a ResNet-18 ran
0.87x one at concurrency 1 (each ran every other request).

The model counts its own calls (a buffer it adds one to): each instance is
its own process with its own count, so one caller's requests, one after the
other, answered 1, 2, 3, ... came to one instance; in turn they answered
1, 1, 2, 2, ..."""
from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import torch

from torchpool import Client
from torchpool.examples import write_model

from ..support.daemon import Daemon


class Counter(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros(1, dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.calls + x.to(torch.int64) * 0


CONFIG = """name: "counter"
backend: "pytorch"
max_batch_size: 0
input [ { name: "INPUT__0" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "OUTPUT__0" data_type: TYPE_INT64 dims: [ 1 ] } ]
instance_group [ { count: 2 kind: KIND_CPU } ]
"""


def counter_repository(root: Path) -> Path:
    buffer = io.BytesIO()
    torch.jit.save(torch.jit.script(Counter()), buffer)
    write_model(root, "counter", CONFIG, buffer.getvalue())
    return root


def call(client: Client) -> int:
    return int(client.infer("counter", {"INPUT__0": np.zeros(1, np.float32)}, copy=True)["OUTPUT__0"][0])


def test_one_caller_keeps_to_the_warm_instance(tmp_path: Path) -> None:
    d = Daemon(counter_repository(tmp_path / "repo"), tmp_path).start()
    try:
        # local=False: through the broker's scheduler, which chooses the instance
        with Client(d.url, local=False) as client:
            assert [call(client) for _ in range(20)] == list(range(1, 21))
    finally:
        assert d.stop() == 0, d.log()
