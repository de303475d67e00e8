"""Models that must FAIL to load (the server keeps serving all the others).

`expected_load_errors(root)` holds, as data, the text each load error must contain.
  broken_missing_file   valid config, empty 1/: "unable to find
                        'broken_missing_file/1/model.pt' for model
                        instance 'broken_missing_file'" (Triton puts the model
                        name where the message says instance).
  broken_arg_count      config inputs INPUT__0, INPUT__1; forward(x):
                        "unable to load model 'broken_arg_count', configuration
                        expects 2 inputs, model provides 1".
  broken_arg_type       forward(x: Tensor, n: int): "An input of type 'int' was
                        detected in the model. Only a single input of type
                        Dict(str, Tensor) or input(s) of type Tensor are
                        supported."
  broken_two_dicts      forward(a: Dict[str, Tensor], b: Dict[str, Tensor]):
                        "Multiple inputs of kind DictType were detected. Only a
                        single input of type Dict(str, Tensor) is supported."
  broken_string_2d      mbs 8 with a TYPE_STRING input of dims [-1] (2-D with
                        the batch dim): "Triton only supports 1 dimensional
                        List of String as input for 'INPUT__0' for model
                        'broken_string_2d'".
  broken_bool_param     parameters INFERENCE_MODE "maybe": "failed to convert
                        'maybe' to boolean".
  broken_pbtxt_syntax   config.pbtxt is not valid protobuf text (an input
                        block is never closed); the message names the config
                        file (exact text is the parser's).
  broken_platform_onnx  platform: "onnxruntime_onnx" (1/model.pt is a valid
                        TorchScript file); the message names the platform.
  broken_no_config      1/model.pt but no config.pbtxt / config.json: never
                        READY (absent from the index or UNAVAILABLE, the
                        message saying the config is missing).
  broken_corrupt_model  1/model.pt holds random bytes: "failed to load model
                        'broken_corrupt_model': PytorchStreamReader failed
                        reading zip archive".
gpu_instance (catalogue `basic`) also fails, but only where CUDA is unavailable.
"""
from __future__ import annotations

import random
from pathlib import Path
from typing import Dict, List, Optional

from torch import Tensor, nn

from .basic import Identity
from .core import config, fp32_4, parameters, serialize, tensor, write_model_dir


class OneArg(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x


class IntArg(nn.Module):
    def forward(self, x: Tensor, n: int) -> Tensor:
        return x * n


class TwoDicts(nn.Module):
    def forward(self, a: Dict[str, Tensor], b: Dict[str, Tensor]) -> Tensor:
        return a["x"] + b["x"]


class UpperStrings(nn.Module):
    def forward(self, text: List[str]) -> List[str]:
        return [s.upper() for s in text]


def expected_load_errors(root: Path) -> dict[str, Optional[str]]:
    """Model -> text its load error must contain (None: only "not ready")."""
    root = Path(root)
    return {
        "broken_missing_file":
            # Triton names the full path; torchpool shows it relative to the repository
            # (server paths never reach a client: docs/security.md)
            f"unable to find '{Path('broken_missing_file') / '1' / 'model.pt'}' "
            "for model instance 'broken_missing_file'",
        "broken_arg_count":
            "unable to load model 'broken_arg_count', configuration expects 2 inputs, "
            "model provides 1",
        "broken_arg_type":
            "An input of type 'int' was detected in the model. Only a single input of "
            "type Dict(str, Tensor) or input(s) of type Tensor are supported.",
        "broken_two_dicts":
            "Multiple inputs of kind DictType were detected. Only a single input of "
            "type Dict(str, Tensor) is supported.",
        "broken_string_2d":
            "Triton only supports 1 dimensional List of String as input for "
            "'INPUT__0' for model 'broken_string_2d'",
        "broken_bool_param": "failed to convert 'maybe' to boolean",
        "broken_pbtxt_syntax": "config.pbtxt",
        "broken_platform_onnx": "onnxruntime_onnx",
        "broken_no_config": None,
        "broken_corrupt_model":
            "failed to load model 'broken_corrupt_model': PytorchStreamReader failed "
            "reading zip archive",
    }


_BROKEN_PBTXT = """\
# The input block is never closed.
name: "broken_pbtxt_syntax"
platform: "pytorch_libtorch"
max_batch_size: 8
input [
  {
    name: "INPUT__0"
    data_type: TYPE_FP32
    dims: [ 4 ]
output [
  {
    name: "OUTPUT__0"
    data_type: TYPE_FP32
    dims: [ 4 ]
  }
]
"""


def write_load_failures(root: Path) -> None:
    """Write this catalogue's models under `root`."""
    identity = serialize(Identity())
    write_model_dir(root, "broken_missing_file",
                    config("broken_missing_file", inputs=[fp32_4("INPUT__0")], outputs=[fp32_4("OUTPUT__0")],
                           max_batch_size=8, comment="1/ is empty"),
                    None)
    write_model_dir(root, "broken_arg_count",
                    config("broken_arg_count", inputs=[fp32_4("INPUT__0"), fp32_4("INPUT__1")],
                           outputs=[fp32_4("OUTPUT__0")], max_batch_size=8,
                           comment="two inputs for a one-argument forward"),
                    serialize(OneArg()))
    write_model_dir(root, "broken_arg_type",
                    config("broken_arg_type",
                           inputs=[fp32_4("INPUT__0"), tensor("INPUT__1", "INT64", [1])],
                           outputs=[fp32_4("OUTPUT__0")], max_batch_size=8,
                           comment="forward(self, x: Tensor, n: int)"),
                    serialize(IntArg()))
    write_model_dir(root, "broken_two_dicts",
                    config("broken_two_dicts", inputs=[fp32_4("x")], outputs=[fp32_4("OUTPUT__0")],
                           max_batch_size=8, comment="two Dict[str, Tensor] arguments"),
                    serialize(TwoDicts()))
    write_model_dir(root, "broken_string_2d",
                    config("broken_string_2d", inputs=[tensor("INPUT__0", "STRING", [-1])],
                           outputs=[tensor("OUTPUT__0", "STRING", [1], reshape=[])],
                           max_batch_size=8, comment="[-1] plus the batch dimension is 2-D"),
                    serialize(UpperStrings()))
    write_model_dir(root, "broken_bool_param",
                    config("broken_bool_param", inputs=[fp32_4("INPUT__0")], outputs=[fp32_4("OUTPUT__0")],
                           max_batch_size=8, extra=parameters(INFERENCE_MODE="maybe")),
                    identity)
    write_model_dir(root, "broken_pbtxt_syntax", _BROKEN_PBTXT, identity)
    write_model_dir(root, "broken_platform_onnx",
                    config("broken_platform_onnx", inputs=[fp32_4("INPUT__0")], outputs=[fp32_4("OUTPUT__0")],
                           max_batch_size=8, platform="onnxruntime_onnx",
                           comment="not a PyTorch model"),
                    identity)
    write_model_dir(root, "broken_no_config", None, identity)
    rng = random.Random(1234)  # deterministic "random" bytes
    write_model_dir(root, "broken_corrupt_model",
                    config("broken_corrupt_model", inputs=[fp32_4("INPUT__0")], outputs=[fp32_4("OUTPUT__0")],
                           max_batch_size=8, comment="1/model.pt is not a TorchScript archive"),
                    bytes(rng.getrandbits(8) for _ in range(4096)))
