"""torch.export programs bound to configs (worker/exported.py, signature.py,
shapes.py): each program is exported, saved and loaded back through
`load_model`, as a worker does."""
from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.export import Dim

from torchpool.config.model_config import ModelConfig, TensorSpec
from torchpool.worker.exported import ProgramRunner
from torchpool.worker.formats import EXPORTED_PROGRAM, LoadedModel, load_model
from torchpool.worker.settings import ExecutionError, ExecutionSettings, ModelLoadError, grad_context

SETTINGS = ExecutionSettings()


def spec(name: str, dims: tuple, data_type: str = "TYPE_FP32") -> TensorSpec:
    return TensorSpec(name, data_type, tuple(dims))


def config(inputs: list, outputs: list, max_batch_size: int = 0) -> ModelConfig:
    return ModelConfig(
        name="m", platform="", backend="pytorch", max_batch_size=max_batch_size,
        inputs=tuple(inputs), outputs=tuple(outputs), instance_groups=(),
        version_policy={"latest": {"num_versions": 1}}, default_model_filename="model.pt2",
        parameters={})


def saved(tmp_path: Path, module: torch.nn.Module, args: tuple, kwargs: Any = None,
          dynamic_shapes: Any = None) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.export.export(module, args, kwargs, dynamic_shapes=dynamic_shapes)
    path = tmp_path / "model.pt2"
    torch.export.save(program, str(path))
    return path


def load(path: Path, cfg: ModelConfig) -> LoadedModel:
    with grad_context(SETTINGS):
        return load_model(cfg, path, torch.device("cpu"), "m", SETTINGS)


def run(model: LoadedModel, inputs: dict) -> dict:
    with grad_context(SETTINGS):
        return model.binding.run(model.module, inputs)


def load_error(path: Path, cfg: ModelConfig) -> str:
    with pytest.raises(ModelLoadError) as info:
        load(path, cfg)
    return info.value.message


class Scaled(torch.nn.Module):
    def forward(self, a: torch.Tensor, *, scale: torch.Tensor) -> torch.Tensor:
        return a * scale


class Pair(torch.nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return x + y


class Counter(torch.nn.Module):
    """A buffer the program updates on every call: state kept between batches."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1)
        return x + self.calls


def test_keyword_arguments_bind_by_name(tmp_path: Path) -> None:
    path = saved(tmp_path, Scaled(), (torch.ones(3),), {"scale": torch.ones(3)})
    model = load(path, config([spec("scale", [3]), spec("a", [3])], [spec("OUTPUT__0", [3])]))
    assert model.format == EXPORTED_PROGRAM and isinstance(model.module, ProgramRunner)
    assert model.binding.input_index == {"a": 0, "scale": 1}
    out = run(model, {"a": torch.tensor([1.0, 2, 3]), "scale": torch.tensor([2.0, 2, 2])})
    assert out["OUTPUT__0"].tolist() == [2.0, 4.0, 6.0]


def test_dtypes_the_program_does_not_take_or_return_fail_the_load(tmp_path: Path) -> None:
    path = saved(tmp_path, Pair(), (torch.ones(3), torch.ones(3)))
    message = load_error(path, config([spec("x", [3], "TYPE_INT32"), spec("y", [3])],
                                      [spec("OUTPUT__0", [3])]))
    assert message == "configuration expects datatype TYPE_INT32 for input 'x', model takes TYPE_FP32"
    message = load_error(path, config([spec("x", [3]), spec("y", [3])],
                                      [spec("OUTPUT__0", [3], "TYPE_FP64")]))
    assert message == ("configuration expects datatype TYPE_FP64 for output 'OUTPUT__0', model "
                       "provides TYPE_FP32")
    message = load_error(path, config([spec("x", [3], "TYPE_STRING"), spec("y", [3])],
                                      [spec("OUTPUT__0", [3])]))
    assert "PyTorch 2 programs take and return tensors only" in message
    message = load_error(path, config([spec("x", [3])], [spec("OUTPUT__0", [3])]))
    assert message == "unable to load model 'm', configuration expects 1 inputs, model provides 2"


def test_shapes_the_config_promises_and_the_program_lacks_fail_the_load(tmp_path: Path) -> None:
    static = saved(tmp_path, Pair(), (torch.ones(2, 3), torch.ones(2, 3)))
    message = load_error(static, config([spec("x", [3]), spec("y", [3])], [spec("OUTPUT__0", [3])], 4))
    assert "exported with a fixed batch size of 2" in message and "torch.export.Dim('batch'" in message
    message = load_error(static, config([spec("x", [2, -1]), spec("y", [2, 3])], [spec("OUTPUT__0", [2, 3])]))
    assert "dimension 1 is -1 (any size) in the configuration, but the exported program only takes 3" in message
    message = load_error(static, config([spec("x", [6]), spec("y", [2, 3])], [spec("OUTPUT__0", [2, 3])]))
    assert "the configuration gives it 1 dimensions ([6])" in message and "takes 2 ([2,3])" in message
    (tmp_path / "big").mkdir()
    big_batch = Dim("batch", min=3, max=64)
    needs_three = saved(tmp_path / "big", Pair(), (torch.ones(4, 3), torch.ones(4, 3)),
                        dynamic_shapes=({0: big_batch}, {0: big_batch}))
    message = load_error(needs_three, config([spec("x", [3]), spec("y", [3])], [spec("OUTPUT__0", [3])], 8))
    assert "a batch may hold a single request but the exported program needs at least 3" in message


def test_open_dimensions_are_checked_per_batch_and_tied_ones_must_agree(tmp_path: Path) -> None:
    batch, n = Dim("batch", min=1, max=8), Dim("n", min=1, max=10)
    path = saved(tmp_path, Pair(), (torch.ones(2, 5), torch.ones(2, 5)),
                 dynamic_shapes=({0: batch, 1: n}, {0: batch, 1: n}))
    model = load(path, config([spec("x", [-1]), spec("y", [-1])], [spec("OUTPUT__0", [-1])], 8))
    assert run(model, {"x": torch.ones(1, 10), "y": torch.ones(1, 10)})["OUTPUT__0"].shape == (1, 10)
    with pytest.raises(ExecutionError) as info:
        run(model, {"x": torch.ones(1, 11), "y": torch.ones(1, 11)})
    assert info.value.code == "INVALID_ARG"
    assert info.value.message == ("unexpected shape for input 'x' for model 'm': dimension 1 is 11, but "
                                  "the exported program accepts at most 10 (got shape [1,11])")
    with pytest.raises(ExecutionError) as info:
        run(model, {"x": torch.ones(1, 3), "y": torch.ones(1, 4)})
    assert info.value.message == ("unexpected shape for input 'y' for model 'm': dimension 1 is 4, but "
                                  "the exported program requires it to equal dimension 1 of input 'x' (3)")


def test_a_config_that_fixes_every_dimension_adds_no_check_per_batch(tmp_path: Path) -> None:
    batch = Dim("batch", min=1, max=8)
    path = saved(tmp_path, Pair(), (torch.ones(2, 3), torch.ones(2, 3)),
                 dynamic_shapes=({0: batch}, {0: batch}))
    model = load(path, config([spec("x", [3]), spec("y", [3])], [spec("OUTPUT__0", [3])], 8))
    assert model.binding.shapes is not None and model.binding.shapes._checks == ()


def test_a_program_that_updates_a_buffer_keeps_its_state(tmp_path: Path) -> None:
    path = saved(tmp_path, Counter(), (torch.zeros(2),))
    model = load(path, config([spec("x", [2])], [spec("OUTPUT__0", [2])]))
    assert isinstance(model.module, ProgramRunner)
    assert run(model, {"x": torch.zeros(2)})["OUTPUT__0"].tolist() == [1.0, 1.0]
    assert run(model, {"x": torch.zeros(2)})["OUTPUT__0"].tolist() == [2.0, 2.0]


class Nested(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> tuple:
        return x, (x + 1, x + 2)


def test_structures_torchpool_cannot_read_fail_the_load(tmp_path: Path) -> None:
    path = saved(tmp_path, Nested(), (torch.ones(2),))
    message = load_error(path, config([spec("x", [2])], [spec("OUTPUT__0", [2])]))
    assert "torchpool reads a tensor, or a tuple, list or dict of tensors" in message


class TakesDict(torch.nn.Module):
    def forward(self, inputs: dict) -> torch.Tensor:
        return inputs["x"] - inputs["y"]


def test_a_dict_arguments_keys_must_be_the_config_inputs(tmp_path: Path) -> None:
    path = saved(tmp_path, TakesDict(), ({"x": torch.ones(2), "y": torch.ones(2)},))
    model = load(path, config([spec("y", [2]), spec("x", [2])], [spec("OUTPUT__0", [2])]))
    assert run(model, {"x": torch.tensor([5.0, 6]), "y": torch.tensor([1.0, 1])})["OUTPUT__0"].tolist() == [4, 5]
    message = load_error(path, config([spec("x", [2]), spec("z", [2])], [spec("OUTPUT__0", [2])]))
    assert "input 'z' is not a key of the dict the program takes" in message
