"""Add/sub models in Triton's QA style (pure functions, version 1 only), and identities.

forward(input0, input1) -> (input0 + input1, input0 - input1).
  libtorch_int8_int8_int8          INPUT__0, INPUT__1 INT8 [16], mbs 8 ->
                                   OUTPUT__0 = a + b, OUTPUT__1 = a - b (INT8;
                                   int8 wraps: keep values in [-60, 60]).
  libtorch_int16_int16_int16       [backend] INPUT0, INPUT1 INT16 [16], mbs 8 ->
                                   OUTPUT0 = a + b, OUTPUT1 = a - b (INT16).
  libtorch_int32_int32_int32       INPUT0, INPUT1 INT32 [16], mbs 8 ->
                                   OUTPUT0 = a + b, OUTPUT1 = a - b (INT32).
  libtorch_float32_float32_float32 INPUT__0, INPUT__1 FP32 [16], mbs 8 ->
                                   OUTPUT__0 = a + b, OUTPUT__1 = a - b (FP32).
  libtorch_nobatch_float32_float32_float32
                                   as libtorch_float32_float32_float32 but
                                   mbs 0: shapes are exactly [16].
  libtorch_json_config             config.json (Triton's JSON, int64 values as
                                   strings: "dims": ["16"]), no config.pbtxt.
                                   INPUT0, INPUT1 INT32 [16], mbs 8 ->
                                   OUTPUT0 = a + b, OUTPUT1 = a - b.
  custom_filename                  `default_model_filename: "weights.pt"`; the
                                   version dir holds only 1/weights.pt.
                                   INPUT__0, INPUT__1 FP32 [16], mbs 8 ->
                                   OUTPUT__0 = a + b, OUTPUT__1 = a - b.
  multi_instance                   instance_group [ { count: 2 kind: KIND_CPU } ]:
                                   two instances, same I/O as custom_filename.
  gpu_instance                     instance_group [ { count: 1 kind: KIND_GPU } ],
                                   same I/O as custom_filename. Without CUDA it
                                   FAILS to load (message mentions GPU); on a
                                   machine with CUDA it loads and computes the
                                   same, outputs on CPU for the client. Not in
                                   READY: it depends on CUDA.
  identity_bf16                    INPUT__0 BF16 [-1], mbs 0 -> OUTPUT__0 =
                                   INPUT__0 (BF16). Triton rejects BF16; torch
                                   supports it, so torchpool should load it.

Not in the session repository: `write_plus_one(root)` writes `plus_one`
(INPUT__0 FP32 [-1] -> OUTPUT__0 = x + 1, mbs 0) for tests that build their own.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence, Tuple

from torch import Tensor, nn

from .core import config, instances, serialize, tensor, write_model_dir


class AddSub(nn.Module):
    def forward(self, input0: Tensor, input1: Tensor) -> Tuple[Tensor, Tensor]:
        return input0 + input1, input0 - input1


class Identity(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x


class PlusOne(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x + 1


READY: dict[str, tuple[int, ...]] = {name: (1,) for name in [
    "libtorch_int8_int8_int8", "libtorch_int16_int16_int16", "libtorch_int32_int32_int32",
    "libtorch_float32_float32_float32", "libtorch_nobatch_float32_float32_float32",
    "libtorch_json_config", "custom_filename", "multi_instance", "identity_bf16"]}


def write_plus_one(root: Path, extra: str = "") -> None:
    """`plus_one` under `root`: INPUT__0 FP32 [-1] -> OUTPUT__0 = x + 1, mbs 0;
    `extra` is added to its config (e.g. `instances(2, "KIND_CPU")`)."""
    write_model_dir(root, "plus_one",
                    config("plus_one", inputs=[tensor("INPUT__0", "FP32", [-1])],
                           outputs=[tensor("OUTPUT__0", "FP32", [-1])], max_batch_size=0) + extra,
                    serialize(PlusOne()))


def _addsub_io(dtype: str, named_index: bool, dims: Sequence[int] = (16,)
               ) -> tuple[list[str], list[str]]:
    i0, i1, o0, o1 = (("INPUT__0", "INPUT__1", "OUTPUT__0", "OUTPUT__1") if named_index
                      else ("INPUT0", "INPUT1", "OUTPUT0", "OUTPUT1"))
    inputs = [tensor(i0, dtype, dims), tensor(i1, dtype, dims)]
    outputs = [tensor(o0, dtype, dims, comment=f"{i0} + {i1}"),
               tensor(o1, dtype, dims, comment=f"{i0} - {i1}")]
    return inputs, outputs


_JSON_CONFIG = {
    "name": "libtorch_json_config",
    "platform": "pytorch_libtorch",
    "max_batch_size": 8,
    "input": [
        {"name": "INPUT0", "data_type": "TYPE_INT32", "dims": ["16"]},
        {"name": "INPUT1", "data_type": "TYPE_INT32", "dims": ["16"]},
    ],
    "output": [
        {"name": "OUTPUT0", "data_type": "TYPE_INT32", "dims": ["16"]},
        {"name": "OUTPUT1", "data_type": "TYPE_INT32", "dims": ["16"]},
    ],
    "instance_group": [{"count": 1, "kind": "KIND_CPU"}],
}


def write_basic(root: Path) -> None:
    """Write this catalogue's models (gpu_instance included) under `root`."""
    addsub = serialize(AddSub())
    for dtype, np_name, named_index, backend in [
            ("INT8", "int8", True, False), ("INT16", "int16", False, True),
            ("INT32", "int32", False, False), ("FP32", "float32", True, False)]:
        name = f"libtorch_{np_name}_{np_name}_{np_name}"
        inputs, outputs = _addsub_io(dtype, named_index)
        write_model_dir(root, name, config(name, inputs=inputs, outputs=outputs, max_batch_size=8,
                                           backend=backend, comment=f"{dtype} add/sub"), addsub)

    name = "libtorch_nobatch_float32_float32_float32"
    inputs, outputs = _addsub_io("FP32", True)
    write_model_dir(root, name, config(name, inputs=inputs, outputs=outputs, max_batch_size=0,
                                       comment="add/sub without batching: shapes are exactly [16]"), addsub)

    write_model_dir(root, "libtorch_json_config", json.dumps(_JSON_CONFIG, indent=2) + "\n", addsub,
                    config_file="config.json")

    inputs, outputs = _addsub_io("FP32", True)
    write_model_dir(root, "custom_filename",
                    config("custom_filename", inputs=inputs, outputs=outputs, max_batch_size=8,
                           comment="the model file is 1/weights.pt",
                           extra='default_model_filename: "weights.pt"\n'),
                    addsub, filename="weights.pt")
    write_model_dir(root, "multi_instance",
                    config("multi_instance", inputs=inputs, outputs=outputs, max_batch_size=8,
                           comment="two CPU instances", extra=instances(2, "KIND_CPU")),
                    addsub)
    write_model_dir(root, "gpu_instance",
                    config("gpu_instance", inputs=inputs, outputs=outputs, max_batch_size=8,
                           comment="loads only where CUDA is available",
                           extra=instances(1, "KIND_GPU")),
                    addsub)
    write_model_dir(root, "identity_bf16",
                    config("identity_bf16", inputs=[tensor("INPUT__0", "BF16", [-1])],
                           outputs=[tensor("OUTPUT__0", "BF16", [-1])], max_batch_size=0,
                           comment="BF16: Triton rejects it, torch supports it"),
                    serialize(Identity()))
