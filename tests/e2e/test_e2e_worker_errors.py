"""A model's exception: its traceback goes to the daemon's log, not to the client.

The worker logs a failed batch (model, instance, batch id, traceback) through
the daemon's logging set-up, in the daemon's --log-format; the client gets one
clean line naming the model and instance, with no traceback and no path of
the server's files (TorchScript embeds both in its error text).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from torchpool.client import Client
from torchpool.protocol import errors
from torchpool.protocol.errors import InferenceError

from ..support.daemon import ROOT, Daemon, wait_for
from ..support.model_repository import RaiseOnNegative, _write, config, serialize, tensor

MODEL = "raise_forward"


@pytest.fixture(params=["text", "json"])
def daemon(request: pytest.FixtureRequest, tmp_path: Path):
    f4 = tensor("INPUT__0", "FP32", [4]), tensor("OUTPUT__0", "FP32", [4])
    _write(tmp_path / "repository", MODEL, model=serialize(RaiseOnNegative()),
           config_text=config(MODEL, inputs=[f4[0]], outputs=[f4[1]], max_batch_size=8))
    d = Daemon(tmp_path / "repository", tmp_path, "--log-format", request.param).start()
    d.format = request.param
    yield d
    assert d.stop() == 0, d.log()


def test_traceback_in_the_log_clean_message_to_the_client(daemon: Daemon) -> None:
    x = np.ones((1, 4), np.float32)
    with Client(daemon.url, timeout=30) as client:
        assert np.array_equal(client.infer(MODEL, {"INPUT__0": x})["OUTPUT__0"], x)
        with pytest.raises(InferenceError) as info:
            client.infer(MODEL, {"INPUT__0": -x})
        # the worker survives and keeps serving
        assert np.array_equal(client.infer(MODEL, {"INPUT__0": 2 * x})["OUTPUT__0"], 2 * x)

    message = info.value.message
    assert info.value.code == errors.INTERNAL
    assert message.startswith("PyTorch execute failure: RuntimeError: boom: input sum is negative"), message
    assert f"model '{MODEL}'" in message and f"instance '{MODEL}_0'" in message, message
    assert "\n" not in message and "Traceback" not in message and "File " not in message, message
    assert str(ROOT) not in message and "model_repository.py" not in message, message

    log = wait_for(lambda: (lambda text: text if "Traceback" in text else None)(daemon.log()), 30,
                   "the worker's traceback in the daemon's log")
    if daemon.format == "json":
        entries = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
        failed = [e for e in entries if "batch" in e["message"] and "failed" in e["message"]]
        assert len(failed) == 1, entries
        entry = failed[0]
        assert entry["level"] == "ERROR" and entry["logger"] == "torchpool.worker"
        assert entry["pid"] != daemon.pid()          # written by the worker itself
        trace = entry["exception"]
        # every line of the log is one JSON object, the worker's included
        assert all(line.startswith("{") for line in log.splitlines() if line.strip()), log
    else:
        entry = {"message": log}
        trace = log
    assert f"model '{MODEL}' version 1 instance '{MODEL}_0' batch " in entry["message"]
    assert "boom: input sum is negative" in entry["message"]
    assert "Traceback (most recent call last)" in trace
    assert "Traceback of TorchScript" in trace and "RaiseException" in trace
    assert "boom: input sum is negative" in trace
