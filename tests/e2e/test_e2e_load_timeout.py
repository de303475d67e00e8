"""--load-timeout: a worker stuck while loading its model is killed, its
version fails to load with the reason, and the daemon still becomes ready
(systemd's READY=1 is not held back) and serves the other models."""
from __future__ import annotations

import io
import re
from pathlib import Path

import numpy as np
import torch

from torchpool import Client

from ..support.daemon import Daemon

CONFIG = """
name: "{name}"
platform: "pytorch_libtorch"
max_batch_size: 0
input [ {{ name: "INPUT__0" data_type: TYPE_FP32 dims: [ 2 ] }} ]
output [ {{ name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ 2 ] }} ]
{extra}
"""

# loaded in the worker before the model (TORCHPOOL_PYTHON_MODULES): never returns
HANG = "import threading\nthreading.Event().wait()\n"


class Double(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2


def _model(repo: Path, name: str, extra: str = "") -> Path:
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "config.pbtxt").write_text(CONFIG.format(name=name, extra=extra))
    buf = io.BytesIO()
    torch.jit.save(torch.jit.script(Double()), buf)
    (repo / name / "1" / "model.pt").write_bytes(buf.getvalue())
    return repo / name


def test_a_worker_stuck_loading_fails_its_version_and_the_daemon_serves_the_rest(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    _model(repo, "good")
    stuck = _model(repo, "stuck", 'parameters { key: "TORCHPOOL_PYTHON_MODULES" value { string_value: "hang.py" } }')
    (stuck / "hang.py").write_text(HANG)
    d = Daemon(repo, tmp_path, "--load-timeout", "2").start(timeout=60)
    try:
        assert "1 of 2 model versions READY" in d.log()
        with Client(d.url, timeout=30) as c:
            index = {m["name"]: m for m in c.repository_index()}
            assert index["good"]["state"] == "READY"
            assert index["stuck"]["state"] == "UNAVAILABLE"
            assert index["stuck"]["reason"] == ("instance 'stuck_0' did not finish loading within 2 s "
                                                "(--load-timeout) and was killed")
            got = c.infer("good", {"INPUT__0": np.array([1, 2], np.float32)})["OUTPUT__0"]
            assert got.tolist() == [2, 4]
        log = d.log()
        assert "did not finish loading within 2 s; killing it" in log
        # SIGABRT first: the worker's faulthandler logged where the load was stuck
        stack = log[log.index("did not finish loading within 2 s"):]
        assert "Fatal Python error: Aborted" in stack, log
        assert re.search(r'File ".*/stuck/hang\.py", line 2 in <module>\n', stack), log
    finally:
        assert d.stop() == 0, d.log()
