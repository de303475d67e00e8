"""Models that load fine but fail at execution (all of them, or one request's).

  raise_on_negative  INPUT__0 FP32 [4], mbs 8 -> OUTPUT__0 = INPUT__0; if the
                     sum of the whole input is < 0 forward raises
                     RuntimeError("boom: input sum is negative"): that request
                     fails with "PyTorch execute failure: " and the text
                     contains "boom: input sum is negative"; other requests
                     (before and after) succeed.
  bad_output_index   INPUT__0, INPUT__1 FP32 [4], mbs 8; config outputs
                     OUTPUT__0, OUTPUT__1, OUTPUT__2 (FP32 [4]); forward
                     returns 2 tensors -> every request fails: "The output
                     OUTPUT__2 in the model configuration refers to an output
                     index which doesn't exist. This model has 2 outputs".
  bad_output_dtype   INPUT__0 FP32 [4], mbs 8, output OUTPUT__0 TYPE_INT32 [4];
                     forward returns the FP32 input -> every request fails:
                     "configuration expects datatype TYPE_INT32 for output
                     'OUTPUT__0', model provides TYPE_FP32".
  bad_scalar_output  INPUT__0 FP32 [4], mbs 0, output OUTPUT__0 FP32 [1];
                     forward returns x.sum() (0-dim) -> every request fails:
                     "output 'OUTPUT__0' is a scalar which is not supported."
  bad_list_tensor_output
                     INPUT__0 FP32 [4], mbs 0, output OUTPUT__0 FP32 [4];
                     forward returns [x, x] (List[Tensor]) -> every request
                     fails: "PyTorch execute failure: output must be of type
                     Tensor or List[str], received List[Tensor]".
"""
from __future__ import annotations

from pathlib import Path
from typing import List

from torch import Tensor, nn

from .basic import Identity
from .core import config, fp32_4, serialize, tensor, write_model_dir
from .naming import SubMul


class RaiseOnNegative(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        if bool(x.sum() < 0):
            raise RuntimeError("boom: input sum is negative")
        return x


class Scalar(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x.sum()


class ListOfTensors(nn.Module):
    def forward(self, x: Tensor) -> List[Tensor]:
        return [x, x]


READY: dict[str, tuple[int, ...]] = {name: (1,) for name in [
    "raise_on_negative", "bad_output_index", "bad_output_dtype", "bad_scalar_output",
    "bad_list_tensor_output"]}


def write_execution_errors(root: Path) -> None:
    """Write this catalogue's models under `root`."""
    write_model_dir(root, "raise_on_negative",
                    config("raise_on_negative", inputs=[fp32_4("INPUT__0")], outputs=[fp32_4("OUTPUT__0")],
                           max_batch_size=8, comment="forward raises when the input sum is negative"),
                    serialize(RaiseOnNegative()))
    write_model_dir(root, "bad_output_index",
                    config("bad_output_index", inputs=[fp32_4("INPUT__0"), fp32_4("INPUT__1")],
                           outputs=[fp32_4("OUTPUT__0"), fp32_4("OUTPUT__1"),
                                    fp32_4("OUTPUT__2", comment="the model has only 2 outputs")],
                           max_batch_size=8),
                    serialize(SubMul()))
    write_model_dir(root, "bad_output_dtype",
                    config("bad_output_dtype", inputs=[fp32_4("INPUT__0")],
                           outputs=[tensor("OUTPUT__0", "INT32", [4], comment="the model returns FP32")],
                           max_batch_size=8),
                    serialize(Identity()))
    write_model_dir(root, "bad_scalar_output",
                    config("bad_scalar_output", inputs=[fp32_4("INPUT__0")],
                           outputs=[tensor("OUTPUT__0", "FP32", [1], comment="the model returns 0-dim")],
                           max_batch_size=0),
                    serialize(Scalar()))
    write_model_dir(root, "bad_list_tensor_output",
                    config("bad_list_tensor_output", inputs=[fp32_4("INPUT__0")],
                           outputs=[fp32_4("OUTPUT__0", comment="the model returns List[Tensor]")],
                           max_batch_size=0),
                    serialize(ListOfTensors()))
