"""worker/loader.py's load_extensions: TORCHPOOL_PYTHON_MODULES files run in
the worker; one that is no Python source file fails the load with a message
that says so."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from torchpool.config.parameters import ModelParameters
from torchpool.worker.loader import load_extensions
from torchpool.worker.settings import ModelLoadError


def test_a_python_module_is_run(tmp_path: Path) -> None:
    (tmp_path / "ops.py").write_text("LOADED = True\n")
    load_extensions("m", tmp_path, ModelParameters(python_modules=("ops.py",)))
    assert sys.modules.pop("torchpool_ext_m_ops").LOADED is True


def test_a_file_that_is_no_python_module_says_so(tmp_path: Path) -> None:
    # importlib finds no loader for the suffix: the load failed with
    # "'NoneType' object has no attribute 'loader'"
    (tmp_path / "ops.txt").write_text("LOADED = True\n")
    with pytest.raises(ModelLoadError) as failed:
        load_extensions("m", tmp_path, ModelParameters(python_modules=("ops.txt",)))
    assert "TORCHPOOL_PYTHON_MODULES 'ops.txt'" in failed.value.message
    assert "is not a Python source file" in failed.value.message
    assert "NoneType" not in failed.value.message
