"""CPU workers share the daemon's CPUs by default (issue 27.0).

torch gives each process an intra-op pool as large as the host: two
workers on two cores each ran with two threads, and stalled each other. Now
a worker whose model sets no INTRA_OP_THREAD_COUNT gets its share of the
daemon's CPUs (affinity and cgroup quota) among the CPU instances it serves;
a model's own setting wins. Shown on real workers: after a matmul large
enough for torch to run in parallel, a worker given one thread has started
no pool threads, and one whose model sets two has (/proc/<pid>/task).
"""
from __future__ import annotations

import os
import re
from typing import Iterator

import numpy as np
import pytest
from torch import Tensor, nn

from torchpool.client import Client
from torchpool.config.devices import cpu_budget, threads_per_worker
from torchpool.examples import IDENTITY_CONFIG, serialize, write_model

from ..support.daemon import Daemon, worker_pids

SHARED = min(cpu_budget(), 4)         # instances of the model that sets nothing


class Square(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x @ x


def square_config(name: str, count: int, threads: int = 0) -> str:
    text = IDENTITY_CONFIG.replace('"identity"', f'"{name}"').replace("dims: [ -1 ]", "dims: [ 512, 512 ]")
    text += f"instance_group [ {{ count: {count} kind: KIND_CPU }} ]\n"
    if threads:
        text += f'parameters: {{ key: "INTRA_OP_THREAD_COUNT" value: {{ string_value: "{threads}" }} }}\n'
    return text


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    repo = tmp_path_factory.mktemp("cpu_share")
    write_model(repo, "shares", square_config("shares", SHARED), serialize(Square()))
    write_model(repo, "sets_two", square_config("sets_two", 1, threads=2), serialize(Square()))
    d = Daemon(repo, tmp_path_factory.mktemp("cpu_share_daemon"), "--log-level", "debug").start()
    yield d
    assert d.stop() == 0, d.log()


def threads_of(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def test_workers_share_the_cpus_unless_their_model_says(shared: Daemon) -> None:
    budget, instances = cpu_budget(), SHARED + 1
    each = threads_per_worker(budget, instances)
    assert re.search(rf"{budget} CPUs \(affinity and cgroup quota\) for {instances} CPU instances: "
                     rf"{each} intra-op and inter-op threads? each", shared.log()), shared.log()
    x = np.random.default_rng(0).standard_normal((512, 512)).astype(np.float32)
    with Client(shared.url, local=False, timeout=60) as c:
        for model in ("sets_two", *["shares"] * (2 * SHARED)):        # every instance runs one
            out = c.infer(model, {"INPUT__0": x})["OUTPUT__0"]
            np.testing.assert_allclose(out, x @ x, rtol=1e-3, atol=1e-3)
        # `torchpool ps` and the statistics' instances say what each got
        threads = {m: [r["threads"] for r in c.statistics(m)["model_stats"][0]["instances"]]
                   for m in ("shares", "sets_two")}
    assert threads == {"shares": [each] * SHARED, "sets_two": [2]}, threads
    explicit = threads_of(worker_pids(shared.log(), "sets_two")[0])
    defaults = {threads_of(pid) for pid in worker_pids(shared.log(), "shares")}
    # the same worker code, so the same other threads: only the pools differ; a
    # worker of one thread runs its matmul inline, one of two starts an OpenMP team
    assert len(defaults) == 1, defaults
    if each == 1:
        assert explicit > defaults.pop(), (explicit, defaults)
