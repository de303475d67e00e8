"""config/paths.py: every file a configuration names resolves inside its model's
directory, for each field, whether the config is on disk or comes with a load
(the daemon-level attacks are tests/e2e/test_e2e_repository_paths.py)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from torchpool.config import load_model_entry
from torchpool.config.paths import resolved_inside

STATEFUL = {
    "name": "m", "platform": "pytorch_libtorch", "max_batch_size": 0,
    "input": [{"name": "INPUT__0", "data_type": "TYPE_FP32", "dims": [4]}],
    "output": [{"name": "OUTPUT__0", "data_type": "TYPE_FP32", "dims": [4]}],
}


@pytest.fixture
def root(tmp_path: Path) -> Path:
    (tmp_path / "repo" / "m" / "1").mkdir(parents=True)
    (tmp_path / "repo" / "m" / "config.json").write_text(json.dumps(STATEFUL))
    (tmp_path / "secret").write_bytes(b"s" * 64)
    return tmp_path / "repo"


def _error(root: Path, **fields: object) -> str:
    entry = load_model_entry(root, "m", json.dumps({**STATEFUL, **fields}))
    return entry.error or ""


def test_resolved_inside(tmp_path: Path) -> None:
    (tmp_path / "m" / "sub").mkdir(parents=True)
    (tmp_path / "m" / "out").symlink_to(tmp_path)
    assert resolved_inside(tmp_path / "m", "sub/../labels.txt") == (tmp_path / "m" / "labels.txt").resolve()
    for path in ("../x", "/etc/passwd", "out/x", "sub/../../x", "a\0b"):
        assert resolved_inside(tmp_path / "m", path) is None, path


@pytest.mark.parametrize("fields, field", [
    ({"sequence_batching": {"state": [{
        "input_name": "INPUT__0", "output_name": "OUTPUT__0", "data_type": "TYPE_FP32", "dims": [4],
        "initial_state": [{"name": "s", "data_type": "TYPE_FP32", "dims": [4],
                           "data_file": "../../secret"}]}]}},
     "sequence_batching.state[0].initial_state[0].data_file"),
    ({"parameters": {"TORCHPOOL_PYTHON_MODULES": {"string_value": "ok.py, ../../secret"}}},
     "parameters['TORCHPOOL_PYTHON_MODULES']"),
    ({"parameters": {"TORCHPOOL_OP_LIBRARIES": {"string_value": "/lib/x.so"}}},
     "parameters['TORCHPOOL_OP_LIBRARIES']"),
    ({"output": [{**STATEFUL["output"][0], "label_filename": "../secret"}]}, "output[0].label_filename"),
])
def test_each_field_that_names_a_file(root: Path, fields: dict, field: str) -> None:
    error = _error(root, **fields)
    assert f"model 'm': {field} '" in error and "leaves the model directory" in error, error


def test_warmup_file_through_a_symlink(root: Path) -> None:
    (root / "m" / "warmup").mkdir()
    (root / "m" / "warmup" / "x").symlink_to(root.parent / "secret")
    warmup = [{"name": "w", "batch_size": 1, "inputs": {"INPUT__0": {
        "data_type": "TYPE_FP32", "dims": [4], "input_data_file": "x"}}}]
    error = _error(root, model_warmup=warmup)
    assert "model_warmup[0].inputs['INPUT__0'].input_data_file 'x' leaves the model directory" in error
    assert "bytes" not in error                   # the file's size is not told either


def test_default_model_filename_is_a_file_name(root: Path) -> None:
    for name in ("sub/model.pt", "../model.pt", "/model.pt", ".."):
        assert "must be a file name in each version directory" in _error(root, default_model_filename=name)
    (root / "m" / "1" / "link.pt").symlink_to(root.parent / "secret")
    assert "default_model_filename '1/link.pt' leaves" in _error(root, default_model_filename="link.pt")
    assert _error(root, default_model_filename="net.pt") == ""     # missing: the worker says so


def test_a_linked_model_directory_serves_its_own_files(root: Path, tmp_path: Path) -> None:
    (root / "linked").symlink_to(root / "m", target_is_directory=True)
    (root / "m" / "labels.txt").write_text("a\n")
    output = [{**STATEFUL["output"][0], "label_filename": "labels.txt"}]
    entry = load_model_entry(root, "linked", json.dumps({**STATEFUL, "name": "linked", "output": output}))
    assert entry.error is None and entry.versions == (1,)
