"""PyTorch 2 formats: torch.export programs and AOTInductor packages, made at test set-up.

`build_pt2_repository(root)` writes a Triton-style repository:

  pt2_addsub       ExportedProgram, max_batch_size 8, dynamic batching.
                   a, b FP32 [4] (forward's argument names) -> OUTPUT__0 = a + b,
                   OUTPUT__1 = a - b (a tuple). Batch: Dim("batch", min=1, max=8).
                   default_model_filename "model.pt2".
  pt2_static       ExportedProgram with static shapes, max_batch_size 0.
                   INPUT__0 FP32 [3, 4] -> OUTPUT__0 = 3 * INPUT__0. Its file is
                   model.pt2 and its config names no file: found beside a missing model.pt.
  pt2_stats        ExportedProgram returning a dict; max_batch_size 4.
                   x FP32 [-1] (Dim("n", min=1, max=16)) -> outputs "max" and "sum"
                   FP32 [1], bound by key (config order differs from the dict's).
  pt2_dict_input   ExportedProgram taking one dict: x, y FP32 [4] -> OUTPUT__0 = 2x + y.
  pt2_sequence     ExportedProgram with sequence batching (4 slots) and an implicit
                   state: the running sum of test_e2e_sequences' sequence_accumulate.
  pt2_shared       pt2_addsub with two instances and ENABLE_WEIGHT_SHARING (a Linear
                   with fixed weights: OUTPUT__0 = x @ W.T + b).
  pt2_aoti         pt2_addsub compiled by AOTInductor (aoti_compile_and_package).
  pt2_bad_batch    pt2_addsub's program with max_batch_size 16 (> the program's 8).
  pt2_bad_dims     pt2_addsub's program with dims [5] (the program takes 4).
  pt2_truncated    half of pt2_addsub's file: not a zip.
  pt2_aoti_cuda    pt2_aoti's package, its metadata saying it was compiled for CUDA.
  pt2_aoti_damaged pt2_aoti's package with its shared library replaced by junk.

Building takes a few exports and one AOTInductor compile of a tiny model
(about 10-20 s here); `build_once` keeps the result for the test session.
"""
from __future__ import annotations

import shutil
import warnings
import zipfile
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.export import Dim

MARKER = ".built"


class AddSub(nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return a + b, a - b


class Scale(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 3


class Stats(nn.Module):
    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"sum": x.sum(1, keepdim=True), "max": x.amax(1, keepdim=True)}


class DictInput(nn.Module):
    def forward(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        return inputs["x"] * 2 + inputs["y"]


class Accumulate(nn.Module):
    def forward(self, x: torch.Tensor, start: torch.Tensor, state: torch.Tensor):
        total = state * (1 - start) + x
        return total, total.clone()


class Affine(nn.Module):
    """Fixed weights: W = arange(16).view(4, 4) / 10, b = 1."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        with torch.no_grad():
            self.linear.weight.copy_(torch.arange(16.0).view(4, 4) / 10)
            self.linear.bias.fill_(1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


def affine_expected(x: torch.Tensor) -> torch.Tensor:
    return x @ (torch.arange(16.0).view(4, 4) / 10).T + 1


def export(module: nn.Module, args: tuple, dynamic_shapes: Any = None) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.export.export(module.eval(), args, dynamic_shapes=dynamic_shapes)


def tensor(name: str, dims: list[int], data_type: str = "TYPE_FP32") -> str:
    return f'{{ name: "{name}" data_type: {data_type} dims: {dims} }}'


def config(name: str, inputs: list[str], outputs: list[str], max_batch_size: int,
           extra: str = "") -> str:
    return (f'name: "{name}"\nbackend: "pytorch"\nmax_batch_size: {max_batch_size}\n'
            f'input [ {", ".join(inputs)} ]\noutput [ {", ".join(outputs)} ]\n{extra}')


ADDSUB_IO = ([tensor("a", [4]), tensor("b", [4])],
             [tensor("OUTPUT__0", [4]), tensor("OUTPUT__1", [4])])
PT2_FILE = 'default_model_filename: "model.pt2"\n'
CPU_INSTANCE = "instance_group [ { count: 1 kind: KIND_CPU } ]\n"

SEQUENCE = """\
sequence_batching {
  max_sequence_idle_microseconds: 5000000
  direct { }
  control_input [ { name: "START__1" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ] } ]
  state [ { input_name: "STATE_IN__2" output_name: "STATE_OUT__1" data_type: TYPE_INT32 dims: [ 1 ]
            initial_state: { name: "zero" data_type: TYPE_INT32 dims: [ 1 ] zero_data: true } } ]
}
"""


def write(root: Path, name: str, config_text: str, model: Path | bytes, filename: str = "model.pt2") -> Path:
    version = root / name / "1"
    version.mkdir(parents=True, exist_ok=True)
    (root / name / "config.pbtxt").write_text(config_text)
    target = version / filename
    if isinstance(model, Path):
        shutil.copyfile(model, target)
    else:
        target.write_bytes(model)
    return target


def save_program(program: Any, path: Path) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.export.save(program, str(path))
    return path


def aoti_package(program: Any, path: Path) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch._inductor.aoti_compile_and_package(program, package_path=str(path))
    return path


def rewrite_zip(source: Path, target: Path, change: Any) -> Path:
    """Copy a zip, passing every entry through `change(name, data) -> data`."""
    with zipfile.ZipFile(source) as old, zipfile.ZipFile(target, "w") as new:
        for item in old.infolist():
            new.writestr(item, change(item.filename, old.read(item.filename)))
    return target


def addsub_program() -> Any:
    batch = Dim("batch", min=1, max=8)
    # two tensors, not one twice: export would take the inputs for aliases
    return export(AddSub(), (torch.ones(2, 4), torch.ones(2, 4)), ({0: batch}, {0: batch}))


def affine_program(max_batch: int = 8) -> Any:
    return export(Affine(), (torch.ones(2, 4),), ({0: Dim("batch", min=1, max=max_batch)},))


def build_pt2_repository(root: Path, aoti: bool = True) -> list[str]:
    """Write the models above under `root` (the AOTInductor ones only with `aoti`)."""
    root.mkdir(parents=True, exist_ok=True)
    work = root / ".work"
    work.mkdir(exist_ok=True)
    addsub = save_program(addsub_program(), work / "addsub.pt2")
    write(root, "pt2_addsub", config("pt2_addsub", *ADDSUB_IO, 8, PT2_FILE + "dynamic_batching { }\n"),
          addsub)
    write(root, "pt2_bad_batch", config("pt2_bad_batch", *ADDSUB_IO, 16, PT2_FILE), addsub)
    write(root, "pt2_bad_dims", config("pt2_bad_dims", [tensor("a", [5]), tensor("b", [5])],
                                       ADDSUB_IO[1], 8, PT2_FILE), addsub)
    write(root, "pt2_truncated", config("pt2_truncated", *ADDSUB_IO, 8, PT2_FILE),
          addsub.read_bytes()[: addsub.stat().st_size // 2])

    static = export(Scale(), (torch.ones(3, 4),))
    write(root, "pt2_static", config("pt2_static", [tensor("INPUT__0", [3, 4])],
                                     [tensor("OUTPUT__0", [3, 4])], 0),
          save_program(static, work / "static.pt2"))

    n = Dim("n", min=1, max=16)
    stats = export(Stats(), (torch.ones(2, 5),), ({0: Dim("batch", min=1, max=4), 1: n},))
    write(root, "pt2_stats", config("pt2_stats", [tensor("x", [-1])],
                                    [tensor("max", [1]), tensor("sum", [1])], 4, PT2_FILE),
          save_program(stats, work / "stats.pt2"))

    batch = Dim("batch", min=1, max=8)
    dict_program = export(DictInput(), ({"x": torch.ones(2, 4), "y": torch.ones(2, 4)},),
                          ({"x": {0: batch}, "y": {0: batch}},))
    write(root, "pt2_dict_input", config("pt2_dict_input", [tensor("x", [4]), tensor("y", [4])],
                                         [tensor("OUTPUT__0", [4])], 8, PT2_FILE),
          save_program(dict_program, work / "dict_input.pt2"))

    slots = Dim("batch", min=1, max=4)
    sequence = export(Accumulate(), tuple(torch.ones(2, 1, dtype=torch.int32) for _ in range(3)),
                      tuple({0: slots} for _ in range(3)))
    write(root, "pt2_sequence", config("pt2_sequence", [tensor("INPUT__0", [1], "TYPE_INT32")],
                                       [tensor("OUTPUT__0", [1], "TYPE_INT32")], 4, PT2_FILE + SEQUENCE),
          save_program(sequence, work / "sequence.pt2"))

    shared = save_program(affine_program(), work / "affine.pt2")
    write(root, "pt2_shared", config(
        "pt2_shared", [tensor("x", [4])], [tensor("OUTPUT__0", [4])], 8,
        PT2_FILE + 'instance_group [ { count: 2 kind: KIND_CPU } ]\n'
        'parameters { key: "ENABLE_WEIGHT_SHARING" value: { string_value: "true" } }\n'), shared)

    names = ["pt2_addsub", "pt2_bad_batch", "pt2_bad_dims", "pt2_truncated", "pt2_static",
             "pt2_stats", "pt2_dict_input", "pt2_sequence", "pt2_shared"]
    if aoti:
        package = aoti_package(addsub_program(), work / "addsub_aoti.pt2")
        write(root, "pt2_aoti", config("pt2_aoti", [tensor("INPUT__0", [4]), tensor("INPUT__1", [4])],
                                       ADDSUB_IO[1], 8, PT2_FILE + "dynamic_batching { }\n"), package)
        as_cuda = rewrite_zip(package, work / "cuda.pt2", lambda name, data: data.replace(
            b'"AOTI_DEVICE_KEY": "cpu"', b'"AOTI_DEVICE_KEY": "cuda"') if name.endswith(".json") else data)
        write(root, "pt2_aoti_cuda", config("pt2_aoti_cuda", *ADDSUB_IO, 8, PT2_FILE), as_cuda)
        damaged = rewrite_zip(package, work / "damaged.pt2", lambda name, data: (
            b"\x7fELF but not really" if name.endswith(".so") else data))
        write(root, "pt2_aoti_damaged", config("pt2_aoti_damaged", *ADDSUB_IO, 8, PT2_FILE), damaged)
        names += ["pt2_aoti", "pt2_aoti_cuda", "pt2_aoti_damaged"]
    shutil.rmtree(work)
    return names


def build_once(root: Path, aoti: bool = True) -> Path:
    """The repository under `root`, built on the first call of the session only."""
    if not (root / MARKER).exists():
        build_pt2_repository(root, aoti)
        (root / MARKER).write_text("ok")
    return root


__all__ = ["Affine", "addsub_program", "affine_expected", "affine_program", "aoti_package",
           "build_once", "build_pt2_repository", "config", "export", "save_program", "tensor", "write"]
