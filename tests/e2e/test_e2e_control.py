"""End to end: the control calls (live, ready, metadata, config, repository index)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from torchpool.client import Client
from torchpool.config.devices import visible_gpus
from torchpool.protocol import errors
from torchpool.protocol.errors import InferenceError

from ..support.daemon import Daemon
from ..support.models.repository import EXPECTED_READY


def test_server_live(client: Client) -> None:
    assert client.server_live() is True


def test_server_ready_is_strict(client: Client) -> None:
    # the test repository holds broken models: Triton's strict readiness says no
    assert client.server_ready() is False


def test_server_ready_with_only_good_models(small_repository: Path, tmp_path: Path) -> None:
    # a small input arena, to see what happens when a request does not fit
    d = Daemon(small_repository, tmp_path, "--shm-chunk", "1M", "--shm-limit", "2M").start()
    try:
        # local=False: inputs travel inline and are staged in the daemon's input
        # arena (a local client's inputs are in its own arena and never hit the limit)
        with Client(d.url, timeout=30, local=False) as client:
            assert client.server_live() is True
            assert client.server_ready() is True
            index = client.repository_index()
            assert {r["name"] for r in index} == {"addsub", "mlp", "strings", "dict_input",
                                                  "identity", "clone", "slow"}
            assert all(r["state"] == "READY" and r["version"] == "1" for r in index), index
            assert all(client.model_ready(r["name"]) for r in index)

            too_big = np.ones(3 << 18, np.float32)                 # 3 MiB > --shm-limit
            with pytest.raises(InferenceError) as exc:
                client.infer("identity", {"INPUT__0": too_big})
            assert exc.value.code == errors.UNAVAILABLE
            assert "'identity'" in exc.value.message and "shm" in exc.value.message.lower()
            fits = np.arange(1 << 18, dtype=np.float32)             # 1 MiB
            for _ in range(3):
                assert np.array_equal(client.infer("identity", {"INPUT__0": fits})["OUTPUT__0"], fits)
            strings = client.infer("strings", {"INPUT__0": ["abc", "Zz"]})["OUTPUT__0"]
            assert strings.tolist() == [b"ABC", b"ZZ"]
            x = np.arange(8, dtype=np.float32).reshape(2, 4)
            assert np.array_equal(client.infer("dict_input", {"x": x, "y": x})["OUTPUT__0"], x * 3)
            assert client.infer("mlp", {"INPUT__0": np.zeros((3, 256), np.float32)})[
                "OUTPUT__0"].shape == (3, 10)
    finally:
        assert d.stop() == 0, d.log()


def test_server_metadata(client: Client) -> None:
    meta = client.server_metadata()
    assert meta["name"] == "torchpool"
    import torchpool
    assert meta["version"] == torchpool.__version__
    assert isinstance(meta["extensions"], list)


def test_model_ready(client: Client) -> None:
    assert client.model_ready("libtorch_float32_float32_float32") is True
    assert client.model_ready("libtorch_float32_float32_float32", 1) is True
    assert client.model_ready("libtorch_float32_float32_float32", 2) is False
    assert client.model_ready("no_such_model") is False
    assert client.model_ready("broken_arg_count") is False
    assert client.model_ready("broken_pbtxt_syntax") is False


def test_model_metadata_batching(client: Client) -> None:
    meta = client.model_metadata("libtorch_float32_float32_float32")
    assert meta == {
        "name": "libtorch_float32_float32_float32",
        "versions": ["1"],
        "platform": "pytorch_libtorch",
        "inputs": [{"name": "INPUT__0", "datatype": "FP32", "shape": [-1, 16]},
                   {"name": "INPUT__1", "datatype": "FP32", "shape": [-1, 16]}],
        "outputs": [{"name": "OUTPUT__0", "datatype": "FP32", "shape": [-1, 16]},
                    {"name": "OUTPUT__1", "datatype": "FP32", "shape": [-1, 16]}],
    }


def test_model_metadata_shapes_and_types(client: Client) -> None:
    nobatch = client.model_metadata("libtorch_nobatch_float32_float32_float32")
    assert [t["shape"] for t in nobatch["inputs"] + nobatch["outputs"]] == [[16]] * 4
    identity = client.model_metadata("identity_fp32")
    assert identity["inputs"] == [{"name": "INPUT__0", "datatype": "FP32", "shape": [-1]}]
    batched = client.model_metadata("identity_batched")
    assert batched["inputs"] == [{"name": "INPUT__0", "datatype": "FP32", "shape": [-1, -1, 3]}]
    strings = client.model_metadata("string_io")
    assert [(t["name"], t["datatype"]) for t in strings["outputs"]] == [("OUTPUT__0", "BYTES"),
                                                                       ("OUTPUT__1", "INT64")]
    json_config = client.model_metadata("libtorch_json_config")
    assert json_config["inputs"][0] == {"name": "INPUT0", "datatype": "INT32", "shape": [-1, 16]}
    assert client.model_metadata("versioned_all")["versions"] == ["1", "2", "3"]
    assert client.model_metadata("versioned_all", 2)["versions"] == ["2"]


def test_model_metadata_errors(client: Client) -> None:
    with pytest.raises(InferenceError) as exc:
        client.model_metadata("no_such_model")
    assert exc.value.code == errors.NOT_FOUND and "'no_such_model'" in exc.value.message
    with pytest.raises(InferenceError) as exc:
        client.model_metadata("versioned_all", 9)
    assert exc.value.code == errors.NOT_FOUND and "version 9" in exc.value.message
    with pytest.raises(InferenceError) as exc:
        client.model_metadata("broken_pbtxt_syntax")
    assert exc.value.code == errors.UNAVAILABLE and "config.pbtxt" in exc.value.message


def test_model_config_defaults_filled(client: Client) -> None:
    cfg = client.model_config("libtorch_float32_float32_float32")
    assert cfg["name"] == "libtorch_float32_float32_float32"
    assert cfg["platform"] == "pytorch_libtorch"
    assert cfg["max_batch_size"] == 8
    assert [(t["name"], t["data_type"], t["dims"]) for t in cfg["input"]] == [
        ("INPUT__0", "TYPE_FP32", [16]), ("INPUT__1", "TYPE_FP32", [16])]
    assert [(t["name"], t["data_type"], t["dims"]) for t in cfg["output"]] == [
        ("OUTPUT__0", "TYPE_FP32", [16]), ("OUTPUT__1", "TYPE_FP32", [16])]
    # defaults the file does not spell out
    assert cfg["version_policy"] == {"latest": {"num_versions": 1}}
    assert cfg["default_model_filename"] == "model.pt"
    assert len(cfg["instance_group"]) == 1 and cfg["instance_group"][0]["count"] == 1
    # KIND_AUTO (the default group) is reported resolved, as Triton does
    assert cfg["instance_group"][0]["kind"] == ("KIND_GPU" if visible_gpus() else "KIND_CPU")


def test_model_config_from_files(client: Client) -> None:
    json_cfg = client.model_config("libtorch_json_config")          # config.json, "16" strings
    assert json_cfg["input"][0]["dims"] == [16] and json_cfg["max_batch_size"] == 8
    assert client.model_config("custom_filename")["default_model_filename"] == "weights.pt"
    groups = client.model_config("multi_instance")["instance_group"]
    assert sum(g["count"] for g in groups) == 2 and groups[0]["kind"] == "KIND_CPU"
    assert client.model_config("versioned_all")["version_policy"] == {"all": {}}
    assert client.model_config("versioned_specific_1_3")["version_policy"] == {
        "specific": {"versions": [1, 3]}}
    assert client.model_config("versioned_latest_2")["version_policy"] == {
        "latest": {"num_versions": 2}}
    assert client.model_config("string_batched")["input"][0]["reshape"] == {"shape": []}
    with pytest.raises(InferenceError) as exc:
        client.model_config("no_such_model")
    assert exc.value.code == errors.NOT_FOUND


def test_repository_index(client: Client) -> None:
    index = client.repository_index()
    assert all(set(r) == {"name", "version", "state", "reason"} for r in index)
    assert all(isinstance(r["version"], str) for r in index)
    ready = {(r["name"], r["version"]) for r in index if r["state"] == "READY"}
    expected = {(name, str(v)) for name, versions in EXPECTED_READY.items() for v in versions}
    assert expected <= ready, expected - ready
    # versions outside the policy are not loaded at all
    assert ("versioned", "1") not in ready and ("versioned_specific_1_3", "2") not in ready
    assert ("versioned_numeric_order", "2") not in ready
    assert all(r["reason"] == "" for r in index if r["state"] == "READY")
    assert [r["name"] for r in index] == sorted(r["name"] for r in index)
