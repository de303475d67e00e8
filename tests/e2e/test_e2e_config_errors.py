"""End to end: strict configurations, KIND_AUTO resolved, specific versions
that are missing, warmup samples, as a real daemon reports them.

One daemon serves a repository of copies of the example `addsub` model, each
with its own config.pbtxt: a typo at the top level, an unknown enum value
deep inside, a version policy naming a version that has no directory, and a
warmup sample. The broken ones are UNAVAILABLE with the parser's message as
their reason; the others serve.
"""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest

from torchpool.client import Client
from torchpool.config.devices import visible_gpus
from torchpool.protocol import errors
from torchpool.protocol.errors import InferenceError

from ..support.daemon import Daemon

WARMUP = """
model_warmup [ { name: "zeros" batch_size: 2
  inputs [ { key: "INPUT0" value { data_type: TYPE_FP32 dims: [ 16 ] zero_data: true } },
           { key: "INPUT1" value { data_type: TYPE_FP32 dims: [ 16 ] random_data: true } } ] } ]
"""


def add_model(root: Path, source: Path, name: str, extra: str, versions: tuple[str, ...] = ("1",)) -> Path:
    """A copy of addsub named `name`, with `extra` appended to its config."""
    model_dir = root / name
    model_dir.mkdir()
    text = (source / "config.pbtxt").read_text().replace('name: "addsub"', f'name: "{name}"')
    (model_dir / "config.pbtxt").write_text(text + extra)
    for version in versions:
        shutil.copytree(source / "1", model_dir / version)
    return model_dir


@pytest.fixture(scope="module")
def repository(small_repository: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("config_errors")
    source = small_repository / "addsub"
    shutil.copytree(source, root / "addsub")
    add_model(root, source, "typo", "max_batch_sz: 8\n")
    add_model(root, source, "bad_enum", "instance_group [\n  { count: 1 kind: KIND_CPUU }\n]\n")
    add_model(root, source, "specific", "version_policy { specific { versions: [ 1, 4 ] } }\n")
    add_model(root, source, "warm", WARMUP)
    return root


@pytest.fixture(scope="module")
def daemon(repository: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    d = Daemon(repository, tmp_path_factory.mktemp("config_errors_daemon"))
    try:
        d.start()
        yield d
    finally:
        assert d.stop() == 0, d.log()


@pytest.fixture
def client(daemon: Daemon) -> Iterator[Client]:
    with Client(daemon.url, timeout=30) as c:
        yield c


def reasons(client: Client) -> dict[str, list[tuple[str, str, str]]]:
    rows: dict[str, list[tuple[str, str, str]]] = {}
    for row in client.repository_index():
        rows.setdefault(row["name"], []).append((row["version"], row["state"], row["reason"]))
    return rows


def test_unknown_field_and_enum_are_the_models_unavailable_reason(client: Client) -> None:
    # clients see the path inside the repository (the daemon hides where the repository is)
    typo = "typo/config.pbtxt:31:1: unknown field 'max_batch_sz' in ModelConfig (did you mean 'max_batch_size'?)"
    bad_enum = ("bad_enum/config.pbtxt:32:20: unknown value 'KIND_CPUU' for field 'kind' in ModelInstanceGroup "
                "(did you mean 'KIND_CPU'?)")
    index = reasons(client)
    assert index["typo"] == [("", "UNAVAILABLE", typo)]
    assert index["bad_enum"] == [("", "UNAVAILABLE", bad_enum)]
    for model, reason in (("typo", typo), ("bad_enum", bad_enum)):
        assert client.model_ready(model) is False
        with pytest.raises(InferenceError) as exc:
            client.infer(model, {"INPUT0": np.zeros((1, 16), np.float32), "INPUT1": np.zeros((1, 16), np.float32)})
        assert exc.value.code == errors.UNAVAILABLE
        assert exc.value.message == f"model '{model}' is not available: {reason}"


def test_the_daemon_log_names_the_bad_configs(daemon: Daemon, repository: Path) -> None:
    log = daemon.log()
    assert (f"model 'typo' is UNAVAILABLE: {repository / 'typo' / 'config.pbtxt'}:31:1: unknown field "
            "'max_batch_sz' in ModelConfig (did you mean 'max_batch_size'?)") in log
    assert (f"model 'bad_enum' is UNAVAILABLE: {repository / 'bad_enum' / 'config.pbtxt'}:32:20: unknown value "
            "'KIND_CPUU' for field 'kind' in ModelInstanceGroup (did you mean 'KIND_CPU'?)") in log


def test_kind_auto_is_reported_resolved(client: Client) -> None:
    gpus = visible_gpus()
    group = client.model_config("addsub")["instance_group"]
    if gpus:
        assert group == [{"name": "addsub", "kind": "KIND_GPU", "count": 1, "gpus": gpus}]
    else:
        assert group == [{"name": "addsub", "kind": "KIND_CPU", "count": 1, "gpus": []}]


def test_a_missing_specific_version_is_a_warning_and_version_1_serves(
        client: Client, daemon: Daemon, repository: Path) -> None:
    assert reasons(client)["specific"] == [("1", "READY", "")]
    assert client.model_ready("specific") is True and client.model_ready("specific", 1) is True
    assert client.model_ready("specific", 4) is False
    assert (f"version 4 is specified for model 'specific', but the version directory is not present in "
            f"{repository / 'specific'}; serving version 1") in daemon.log()
    a = np.arange(32, dtype=np.float32).reshape(2, 16)
    b = np.full((2, 16), 3, np.float32)
    result = client.infer("specific", {"INPUT0": a, "INPUT1": b})
    assert np.array_equal(result["OUTPUT0"], a + b) and np.array_equal(result["OUTPUT1"], a - b)


def test_model_warmup_is_shown_as_triton_does(client: Client) -> None:
    assert client.model_ready("warm") is True
    assert client.model_config("warm")["model_warmup"] == [{
        "name": "zeros", "batch_size": 2, "count": 0,
        "inputs": {"INPUT0": {"data_type": "TYPE_FP32", "dims": [16], "zero_data": True},
                   "INPUT1": {"data_type": "TYPE_FP32", "dims": [16], "random_data": True}}}]
