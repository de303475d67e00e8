"""Naming conventions: binding config inputs to forward arguments, and every datatype.

All FP32 dims [4], mbs 8 unless said. A wrong binding changes the sign or swaps outputs.
  naming_forward_argument  forward(b, a) -> a - b. Config lists input `a`, then
                           `b` (FORWARD_ARGUMENT: bound by argument name).
                           OUTPUT__0 = a - b.
  naming_named_index       forward(x, y) -> (x - y, x * y). Config lists
                           INPUT__1 before INPUT__0 and OUTPUT__1 before
                           OUTPUT__0 (NAMED_INDEX). OUTPUT__0 = INPUT__0 -
                           INPUT__1, OUTPUT__1 = INPUT__0 * INPUT__1.
  naming_strict            forward(x, y) -> (x - y, x * y). Config inputs ZETA,
                           ALPHA and outputs SUB, MUL in that order
                           (STRICT_CONFIG_ORDERING; an alphabetical sort would
                           swap both). SUB = ZETA - ALPHA, MUL = ZETA * ALPHA.
  naming_bad_suffix        forward(x, y) -> (x - y, x * y). Config inputs
                           INPUT__1, then INPUT__a: `a` is not an integer, so
                           STRICT ordering (a warning is logged) binds
                           INPUT__1 -> x, INPUT__a -> y. Outputs (NAMED_INDEX):
                           OUTPUT__0 = INPUT__1 - INPUT__a,
                           OUTPUT__1 = INPUT__1 * INPUT__a.
  dict_input               forward(inputs: Dict[str, Tensor]) ->
                           inputs["x"] * 2 + inputs["y"]. Config lists `y`
                           before `x` (the names are the keys; order is
                           irrelevant). OUTPUT__0 = x * 2 + y.
  all_dtypes               forward(BOOL, UINT8, INT8, INT16, INT32, INT64,
                           FP16, FP32, FP64) returns each argument unchanged.
                           Inputs named exactly so (FORWARD_ARGUMENT), each of
                           that TYPE_ with dims [-1], mbs 0. Outputs BOOL_OUT,
                           UINT8_OUT, ... FP64_OUT (STRICT order, same types):
                           X_OUT == X bit for bit.
"""
from __future__ import annotations

from pathlib import Path
from typing import Dict, Tuple

from torch import Tensor, nn

from .core import config, fp32_4, serialize, tensor, write_model_dir


class ForwardArgs(nn.Module):
    # Arguments deliberately in the opposite order of the config inputs.
    def forward(self, b: Tensor, a: Tensor) -> Tensor:
        return a - b


class SubMul(nn.Module):
    # Antisymmetric first output (shows swapped inputs), distinct second
    # output (shows swapped outputs).
    def forward(self, x: Tensor, y: Tensor) -> Tuple[Tensor, Tensor]:
        return x - y, x * y


class DictInput(nn.Module):
    def forward(self, inputs: Dict[str, Tensor]) -> Tensor:
        return inputs["x"] * 2 + inputs["y"]


class AllDtypes(nn.Module):
    def forward(self, BOOL: Tensor, UINT8: Tensor, INT8: Tensor, INT16: Tensor,
                INT32: Tensor, INT64: Tensor, FP16: Tensor, FP32: Tensor,
                FP64: Tensor) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor,
                                       Tensor, Tensor, Tensor, Tensor]:
        return BOOL, UINT8, INT8, INT16, INT32, INT64, FP16, FP32, FP64


READY: dict[str, tuple[int, ...]] = {name: (1,) for name in [
    "naming_forward_argument", "naming_named_index", "naming_strict", "naming_bad_suffix",
    "dict_input", "all_dtypes"]}


def write_naming(root: Path) -> None:
    """Write this catalogue's models under `root`."""
    submul = serialize(SubMul())
    write_model_dir(root, "naming_forward_argument",
                    config("naming_forward_argument",
                           inputs=[fp32_4("a"), fp32_4("b")], outputs=[fp32_4("OUTPUT__0", comment="a - b")],
                           max_batch_size=8,
                           comment="forward(self, b, a): inputs bind by argument name"),
                    serialize(ForwardArgs()))
    write_model_dir(root, "naming_named_index",
                    config("naming_named_index",
                           inputs=[fp32_4("INPUT__1"), fp32_4("INPUT__0")],
                           outputs=[fp32_4("OUTPUT__1", comment="INPUT__0 * INPUT__1"),
                                    fp32_4("OUTPUT__0", comment="INPUT__0 - INPUT__1")],
                           max_batch_size=8, comment="<name>__<index>: the suffix is the position"),
                    submul)
    write_model_dir(root, "naming_strict",
                    config("naming_strict",
                           inputs=[fp32_4("ZETA"), fp32_4("ALPHA")],
                           outputs=[fp32_4("SUB", comment="ZETA - ALPHA"), fp32_4("MUL", comment="ZETA * ALPHA")],
                           max_batch_size=8, comment="no convention matches: config order is argument order"),
                    submul)
    write_model_dir(root, "naming_bad_suffix",
                    config("naming_bad_suffix",
                           inputs=[fp32_4("INPUT__1"), fp32_4("INPUT__a")],
                           outputs=[fp32_4("OUTPUT__0", comment="INPUT__1 - INPUT__a"),
                                    fp32_4("OUTPUT__1", comment="INPUT__1 * INPUT__a")],
                           max_batch_size=8,
                           comment="'a' is not an index: inputs fall back to strict ordering"),
                    submul)
    write_model_dir(root, "dict_input",
                    config("dict_input", inputs=[fp32_4("y"), fp32_4("x")],
                           outputs=[fp32_4("OUTPUT__0", comment="x * 2 + y")], max_batch_size=8,
                           comment="forward(self, inputs: Dict[str, Tensor]): names are the keys"),
                    serialize(DictInput()))
    all_types = ["BOOL", "UINT8", "INT8", "INT16", "INT32", "INT64", "FP16", "FP32", "FP64"]
    write_model_dir(root, "all_dtypes",
                    config("all_dtypes", inputs=[tensor(t, t, [-1]) for t in all_types],
                           outputs=[tensor(f"{t}_OUT", t, [-1]) for t in all_types],
                           max_batch_size=0, comment="every Triton datatype, returned unchanged"),
                    serialize(AllDtypes()))
