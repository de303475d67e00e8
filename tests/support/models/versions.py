"""Versions and version policies: forward(x) -> x * v, v = the version number.

All: INPUT0 FP32 [4], mbs 8 -> OUTPUT0 FP32 [4] = INPUT0 * v. Version dirs
1, 2, 3 unless said. A request without a version gets the highest loaded one;
a request for a version that is not loaded fails.
  versioned                 default policy (latest 1)          -> ready: 3
  versioned_latest_2        latest { num_versions: 2 }          -> ready: 2, 3
  versioned_all             all { }                             -> ready: 1, 2, 3
  versioned_specific_1_3    specific { versions: [ 1, 3 ] }     -> ready: 1, 3
  versioned_numeric_order   dirs 2/, 10/ and notes/ (not a number: ignored),
                            default policy -> ready: 10 (10 > 2 numerically;
                            a string sort would pick 2).
"""
from __future__ import annotations

import io
from pathlib import Path

import torch
from torch import Tensor, nn

from .core import config, tensor, write_model_dir


class Scale(nn.Module):
    """x * version: each version's outputs can be told apart."""

    def __init__(self, factor: int = 1) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, x: Tensor) -> Tensor:
        return x * self.factor


READY: dict[str, tuple[int, ...]] = {
    "versioned": (3,),
    "versioned_latest_2": (2, 3),
    "versioned_all": (1, 2, 3),
    "versioned_specific_1_3": (1, 3),
    "versioned_numeric_order": (10,),
}

_POLICIES = {
    "versioned": "",
    "versioned_latest_2": "version_policy: { latest: { num_versions: 2 } }\n",
    "versioned_all": "version_policy: { all: { } }\n",
    "versioned_specific_1_3": "version_policy: { specific: { versions: [ 1, 3 ] } }\n",
    "versioned_numeric_order": "",
}


def write_versions(root: Path) -> None:
    """Write this catalogue's models under `root`."""
    scale = torch.jit.script(Scale())
    scaled: dict[int, bytes] = {}
    for version in (1, 2, 3, 10):
        scale.factor = version
        buffer = io.BytesIO()
        torch.jit.save(scale, buffer)
        scaled[version] = buffer.getvalue()
    for name, policy in _POLICIES.items():
        versions = (2, 10) if name == "versioned_numeric_order" else (1, 2, 3)
        write_model_dir(root, name, config(name, inputs=[tensor("INPUT0", "FP32", [4])],
                                           outputs=[tensor("OUTPUT0", "FP32", [4], comment="INPUT0 * version")],
                                           max_batch_size=8, extra=policy,
                                           comment="version v returns INPUT0 * v"),
                        None, versions=versions)
        for version in versions:
            (root / name / str(version) / "model.pt").write_bytes(scaled[version])
    notes = root / "versioned_numeric_order" / "notes"
    notes.mkdir(exist_ok=True)
    (notes / "README.txt").write_text("Not a version directory: must be ignored.\n")
