"""ENABLE_WEIGHT_SHARING: instances of one model share one copy of the weights."""
from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch

from torchpool import Client

from ..support.daemon import Daemon, descendants, wait_for

CONFIG = """
name: "{name}"
platform: "pytorch_libtorch"
max_batch_size: 4
input [ {{ name: "INPUT__0" data_type: TYPE_FP32 dims: [ 512 ] }} ]
output [ {{ name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ 512 ] }} ]
instance_group [ {{ count: 3 kind: KIND_CPU }} ]
parameters {{ key: "ENABLE_WEIGHT_SHARING" value {{ string_value: "{sharing}" }} }}
"""

WEIGHT_BYTES = 2 * (512 * 512 + 512) * 4      # two Linear(512, 512) layers, FP32


def _model_bytes() -> bytes:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512))
    buf = io.BytesIO()
    torch.jit.save(torch.jit.script(net), buf)
    return buf.getvalue()


@pytest.fixture(scope="module")
def sharing_daemon(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("sharing")
    repo = root / "repo"
    model = _model_bytes()
    for name, sharing in (("shared", "true"), ("private", "false")):
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "config.pbtxt").write_text(CONFIG.format(name=name, sharing=sharing))
        (repo / name / "1" / "model.pt").write_bytes(model)
    d = Daemon(repo, root).start()
    yield d
    assert d.stop() == 0, d.log()


def _maps_of(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return ""


def test_shared_and_private_instances_compute_the_same(sharing_daemon: Daemon) -> None:
    x = np.random.default_rng(1).standard_normal((2, 512)).astype(np.float32)
    with Client(sharing_daemon.url) as c:
        # several calls so that more than one instance serves
        shared = [c.infer("shared", {"INPUT__0": x})["OUTPUT__0"] for _ in range(6)]
        private = c.infer("private", {"INPUT__0": x})["OUTPUT__0"]
    for out in shared:
        np.testing.assert_array_equal(out, private)
    assert np.abs(private).sum() > 0


def test_every_shared_instance_maps_one_weights_segment(sharing_daemon: Daemon) -> None:
    shm = Path("/dev/shm")
    segments = [p for p in shm.iterdir() if ".sw" in p.name and f".{sharing_daemon.pid()}." in p.name]
    assert len(segments) == 1, segments            # one model shares; the other does not
    seg = segments[0]
    assert seg.stat().st_size >= WEIGHT_BYTES
    assert seg.stat().st_mode & 0o777 == 0o600
    mapping = wait_for(lambda: [p for p in descendants(sharing_daemon.pid()) if seg.name in _maps_of(p)]
                       if len([p for p in descendants(sharing_daemon.pid()) if seg.name in _maps_of(p)]) == 3
                       else None, 30, "three workers mapping the shared weights")
    assert len(mapping) == 3
