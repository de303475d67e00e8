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
import torch
from torch import Tensor, nn

from torchpool.client import Client
from torchpool.protocol import errors
from torchpool.protocol.errors import InferenceError

from ..support.daemon import ROOT, Daemon, wait_for
from ..support.models.core import config, serialize, tensor, write_model_dir
from ..support.models.execution_errors import RaiseOnNegative

MODEL = "raise_forward"
SECRET_DIR = "/srv/torchpool-secret/weights"


class WrongShape(nn.Module):
    """A TorchScript op that fails on its input's shape: [n, 4] @ [3, 3]."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(3, 3))

    def forward(self, x: Tensor) -> Tensor:
        return torch.mm(x, self.weight)


class RaiseWithPath(nn.Module):
    """A model whose own error names a file of the server's."""

    def forward(self, x: Tensor) -> Tensor:
        if bool(x.sum() < 0):
            raise RuntimeError("cannot read /srv/torchpool-secret/weights/extra.bin")
        return x


@pytest.fixture(params=["text", "json"])
def daemon(request: pytest.FixtureRequest, tmp_path: Path):
    f4 = tensor("INPUT__0", "FP32", [4]), tensor("OUTPUT__0", "FP32", [4])
    f3 = tensor("OUTPUT__0", "FP32", [3])
    repository = tmp_path / "repository"
    for name, module, output in ((MODEL, RaiseOnNegative(), f4[1]), ("wrong_shape", WrongShape(), f3),
                                 ("raise_with_path", RaiseWithPath(), f4[1]), ("missing_file", None, f4[1])):
        write_model_dir(repository, name, model=None if module is None else serialize(module),
                        config_text=config(name, inputs=[f4[0]], outputs=[output], max_batch_size=8))
    d = Daemon(repository, tmp_path, "--log-format", request.param).start()
    d.format = request.param
    yield d
    assert d.stop() == 0, d.log()


def clean(message: str, daemon: Daemon) -> None:
    """One line, no traceback, no path of the server's files."""
    assert "\n" not in message and "Traceback" not in message and "File " not in message, message
    assert str(ROOT) not in message and "execution_errors.py" not in message, message
    assert str(daemon.socket_path.parent) not in message and "code/__torch__" not in message, message
    assert SECRET_DIR not in message, message


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
    clean(message, daemon)

    log = wait_for(lambda: (lambda text: text if "Traceback" in text else None)(daemon.log()), 30,
                   "the worker's traceback in the daemon's log")
    if daemon.format == "json":
        entries = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
        failed = [e for e in entries if "direct request" in e["message"] and "failed" in e["message"]]
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
    # the local client's request went on its direct path to the worker (worker/direct.py)
    assert f"model '{MODEL}' version 1 instance '{MODEL}_0' direct request " in entry["message"]
    assert "boom: input sum is negative" in entry["message"]
    assert "Traceback (most recent call last)" in trace
    assert "Traceback of TorchScript" in trace and "RaiseException" in trace
    assert "boom: input sum is negative" in trace


def test_torchscript_op_failure_reaches_the_client_as_one_clean_line(daemon: Daemon) -> None:
    """A TorchScript op failing on a bad shape: its error text carries two
    tracebacks (serialized code/__torch__ and the original source with the
    server's paths); the client gets the exception line, the model and the
    instance."""
    with Client(daemon.url, timeout=30) as client:
        for _ in range(2):          # the worker survives it and fails the same way again
            with pytest.raises(InferenceError) as info:
                client.infer("wrong_shape", {"INPUT__0": np.ones((1, 4), np.float32)})
            message = info.value.message
            assert info.value.code == errors.INTERNAL
            assert message == ("PyTorch execute failure: RuntimeError: mat1 and mat2 shapes cannot be "
                               "multiplied (1x4 and 3x3) (model 'wrong_shape' instance 'wrong_shape_0')"), message
            clean(message, daemon)
    log = wait_for(lambda: (lambda text: text if "mat1 and mat2" in text and "Traceback of TorchScript" in text
                            else None)(daemon.log()), 30, "the TorchScript traceback in the daemon's log")
    assert "code/__torch__" in log and "wrong_shape" in log


def test_a_path_in_a_models_own_error_is_cut_to_its_file_name(daemon: Daemon) -> None:
    x = np.ones((1, 4), np.float32)
    with Client(daemon.url, timeout=30) as client:
        assert np.array_equal(client.infer("raise_with_path", {"INPUT__0": x})["OUTPUT__0"], x)
        with pytest.raises(InferenceError) as info:
            client.infer("raise_with_path", {"INPUT__0": -x})
    assert info.value.message.startswith("PyTorch execute failure: RuntimeError: cannot read extra.bin"), \
        info.value.message
    clean(info.value.message, daemon)
    # the operator's log has the whole text
    wait_for(lambda: f"{SECRET_DIR}/extra.bin" in daemon.log(), 30, "the full path in the daemon's log")


def test_a_load_error_shows_paths_relative_to_the_repository(daemon: Daemon) -> None:
    """Load errors reach clients through infer, model_ready and the index:
    the model file they name is shown inside the repository, not where the
    repository lives on the server (the log keeps that)."""
    with Client(daemon.url, timeout=30) as client:
        with pytest.raises(InferenceError) as info:
            client.infer("missing_file", {"INPUT__0": np.ones((1, 4), np.float32)})
        reasons = [row["reason"] for row in client.repository_index() if row["name"] == "missing_file"]
        assert client.model_ready("missing_file") is False
    assert info.value.code == errors.UNAVAILABLE
    for message in [info.value.message, *reasons]:
        assert "unable to find 'missing_file/1/model.pt' for model instance 'missing_file'" in message, message
        clean(message, daemon)
    assert str(daemon.socket_path.parent / "repository" / "missing_file" / "1" / "model.pt") in daemon.log()
