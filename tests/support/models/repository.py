"""The session's test model repository: every catalogue of tests/support/models in one tree.

`build_test_repository(root)` writes all of them under `root` (a small
fraction of a second once torch is imported); tests/conftest.py builds it once
per session and end-to-end tests start the real server on it.
`EXPECTED_READY` holds which versions of which models must be READY (the
models that must fail to load are in `load_failures.expected_load_errors`).
"""
from __future__ import annotations

from pathlib import Path

from . import (backend_parameters, basic, execution_errors, naming, sequences, shapes_and_batching, slow,
               strings, versions)
from .load_failures import write_load_failures

_CATALOGUES = (basic, versions, naming, strings, shapes_and_batching, backend_parameters,
               execution_errors, slow, sequences)

# Model -> versions that must be READY (gpu_instance is left out: it depends on CUDA).
EXPECTED_READY: dict[str, tuple[int, ...]] = {
    name: ready for catalogue in _CATALOGUES for name, ready in catalogue.READY.items()}


def build_test_repository(root: Path) -> None:
    """Write every catalogue's models under `root`."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    basic.write_basic(root)
    versions.write_versions(root)
    naming.write_naming(root)
    strings.write_strings(root)
    shapes_and_batching.write_shapes_and_batching(root)
    backend_parameters.write_backend_parameters(root)
    execution_errors.write_execution_errors(root)
    slow.write_slow(root)
    sequences.write_sequences(root)
    write_load_failures(root)
