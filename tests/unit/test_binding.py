"""torchpool.worker.settings, .binding and .torchscript against real TorchScript models.

Every model here is scripted, saved into tmp_path and loaded back through
`load_model`, so the tests see exactly what a worker sees.
"""
from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import pytest
import torch

from torchpool.config.model_config import ModelConfig, TensorSpec
from torchpool.worker import settings as settings_module
from torchpool.worker.binding import Binding, ExecutionError, ModelLoadError
from torchpool.worker.formats import load_model as load_model_file
from torchpool.worker.naming import NamingConvention
from torchpool.worker.torchscript import bind
from torchpool.worker.settings import (
    ExecutionSettings,
    after_execution,
    apply_process_settings,
    grad_context,
    parse_parameters,
)

CPU = torch.device("cpu")
DEFAULTS = ExecutionSettings()


# --- helpers -------------------------------------------------------------------

def spec(name: str, data_type: str = "TYPE_FP32", dims: tuple = (4,), **kw: Any) -> TensorSpec:
    return TensorSpec(name=name, data_type=data_type, dims=tuple(dims), **kw)


def config(
    inputs: tuple,
    outputs: tuple,
    *,
    name: str = "m",
    max_batch_size: int = 0,
    parameters: Optional[dict] = None,
    **kw: Any,
) -> ModelConfig:
    return ModelConfig(
        name=name, platform="pytorch_libtorch", backend="pytorch",
        max_batch_size=max_batch_size, inputs=tuple(inputs), outputs=tuple(outputs),
        instance_groups=(), version_policy={"latest": {"num_versions": 1}},
        default_model_filename="model.pt", parameters=parameters or {}, **kw,
    )


def save(module: torch.nn.Module, directory: Path) -> Path:
    """Script and save a module the way a user exports one."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)   # torch.jit.script's notice
        scripted = torch.jit.script(module)
    path = directory / "model.pt"
    scripted.save(str(path))
    return path


def load_model(cfg: ModelConfig, path: Path, device: torch.device, instance: str,
               settings: ExecutionSettings) -> tuple[Any, Binding]:
    """What a worker loads: the runnable module and its binding."""
    loaded = load_model_file(cfg, path, device, instance, settings)
    return loaded.module, loaded.binding


def load(module: torch.nn.Module, cfg: ModelConfig, tmp_path: Path) -> tuple[Any, Binding]:
    return load_model(cfg, save(module, tmp_path), CPU, f"{cfg.name}_0", DEFAULTS)


def run(model: Any, binding: Binding, inputs: dict, requested: Any = None) -> dict:
    with grad_context(DEFAULTS):
        return binding.run(model, inputs, requested)


def load_error(module: torch.nn.Module, cfg: ModelConfig, tmp_path: Path) -> ModelLoadError:
    with pytest.raises(ModelLoadError) as info:
        load(module, cfg, tmp_path)
    return info.value


def run_error(module: torch.nn.Module, cfg: ModelConfig, tmp_path: Path, inputs: dict) -> ExecutionError:
    model, binding = load(module, cfg, tmp_path)
    with pytest.raises(ExecutionError) as info:
        run(model, binding, inputs)
    return info.value


# --- models --------------------------------------------------------------------

class AddSub(torch.nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        return a + b, a - b


class Sub(torch.nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a - b


class Identity(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class DictModel(torch.nn.Module):
    def forward(self, d: Dict[str, torch.Tensor]) -> torch.Tensor:
        out = d["x"] * 2 + d["y"]
        if "z" in d:
            out = out + d["z"]
        return out


class Strings(torch.nn.Module):
    def forward(self, words: List[str], n: torch.Tensor) -> Tuple[List[str], torch.Tensor]:
        return [w.upper() for w in words], n + len(words)


X = torch.tensor([1.0, 2.0, 3.0, 4.0])
Y = torch.tensor([10.0, 20.0, 30.0, 40.0])
FP32_OUT = spec("OUTPUT", dims=(4,))


# --- parameters ----------------------------------------------------------------

def test_parameters_default_when_absent() -> None:
    assert parse_parameters("m", {}) == ExecutionSettings()
    assert parse_parameters("m", {"SOMETHING_ELSE": "x", "max_tokens": "7"}) == ExecutionSettings()


@pytest.mark.parametrize("spelling, value", [
    ("true", True), ("TRUE", True), ("True", True), ("on", True), ("ON", True), ("1", True),
    ("false", False), ("False", False), ("off", False), ("Off", False), ("0", False),
])
def test_parameters_boolean_spellings(spelling: str, value: bool) -> None:
    keys = {
        "INFERENCE_MODE": "inference_mode",
        "DISABLE_OPTIMIZED_EXECUTION": "disable_optimized_execution",
        "DISABLE_CUDNN": "disable_cudnn",
        "ENABLE_CACHE_CLEANING": "enable_cache_cleaning",
        "ENABLE_WEIGHT_SHARING": "enable_weight_sharing",
        "ENABLE_JIT_PROFILING": "jit_profiling",
        "ENABLE_JIT_EXECUTOR": "jit_executor",
        "ENABLE_TENSOR_FUSER": "tensor_fuser",
    }
    parsed = parse_parameters("m", {key: spelling for key in keys})
    assert all(getattr(parsed, field) is value for field in keys.values())


def test_parameters_bad_boolean_fails_the_load() -> None:
    with pytest.raises(ModelLoadError) as info:
        parse_parameters("resnet", {"INFERENCE_MODE": "maybe"})
    assert info.value.code == "INVALID_ARG"
    assert "failed to convert 'maybe' to boolean" in info.value.message
    assert "INFERENCE_MODE" in info.value.message and "resnet" in info.value.message


def test_parameters_thread_counts() -> None:
    parsed = parse_parameters("m", {"INTRA_OP_THREAD_COUNT": "3", "INTER_OP_THREAD_COUNT": "0"})
    assert parsed.intra_op_threads == 3 and parsed.inter_op_threads is None
    for bad in ("-1", "two", "1.5"):
        with pytest.raises(ModelLoadError) as info:
            parse_parameters("m", {"INTRA_OP_THREAD_COUNT": bad})
        assert info.value.code == "INVALID_ARG"
        assert "INTRA_OP_THREAD_COUNT" in info.value.message and bad in info.value.message


# --- process settings ------------------------------------------------------------

@pytest.fixture
def restore_torch_globals():
    """apply_process_settings changes process-wide state: put it back afterwards."""
    optimize = torch._C._get_graph_executor_optimize()
    cudnn = torch.backends.cudnn.enabled
    fuser = torch._C._jit_texpr_fuser_enabled()
    profiling_mode = torch._C._jit_set_profiling_mode(True)
    torch._C._jit_set_profiling_mode(profiling_mode)
    executor = torch._C._jit_set_profiling_executor(True)
    torch._C._jit_set_profiling_executor(executor)
    threads = torch.get_num_threads()
    yield
    torch._C._set_graph_executor_optimize(optimize)
    torch.backends.cudnn.enabled = cudnn
    torch._C._jit_set_texpr_fuser_enabled(fuser)
    torch._C._jit_set_profiling_mode(profiling_mode)
    torch._C._jit_set_profiling_executor(executor)
    torch.set_num_threads(threads)


def test_apply_process_settings(restore_torch_globals) -> None:
    apply_process_settings(ExecutionSettings(
        disable_optimized_execution=True, disable_cudnn=True, jit_profiling=False,
        jit_executor=False, tensor_fuser=False, intra_op_threads=1,
    ))
    assert torch._C._get_graph_executor_optimize() is False
    assert torch.backends.cudnn.enabled is False
    assert torch._C._jit_texpr_fuser_enabled() is False
    assert torch._C._jit_set_profiling_mode(True) is False
    assert torch._C._jit_set_profiling_executor(True) is False
    assert torch.get_num_threads() == 1

    apply_process_settings(ExecutionSettings())   # JIT switches left alone when not given
    assert torch._C._get_graph_executor_optimize() is True
    assert torch.backends.cudnn.enabled is True
    assert torch._C._jit_texpr_fuser_enabled() is False
    assert torch.get_num_threads() == 1


def test_inter_op_threads_once_only_is_a_warning(restore_torch_globals, caplog) -> None:
    current = torch.get_num_interop_threads()
    try:   # lock the pool size: torch allows one set_num_interop_threads per process
        torch.set_num_interop_threads(current)
    except RuntimeError:
        pass
    with caplog.at_level(logging.WARNING, logger="torchpool.worker.settings"):
        apply_process_settings(ExecutionSettings(inter_op_threads=current + 1))
    assert torch.get_num_interop_threads() == current
    assert "could not set the inter-op thread count" in caplog.text


def test_grad_context() -> None:
    with grad_context(ExecutionSettings()):
        assert torch.is_inference_mode_enabled()
    with grad_context(ExecutionSettings(inference_mode=False)):
        assert not torch.is_inference_mode_enabled()
        assert not torch.is_grad_enabled()


def test_after_execution_empties_the_cuda_cache_only_when_asked(monkeypatch) -> None:
    calls: list[int] = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append(1))
    cleaning = ExecutionSettings(enable_cache_cleaning=True)
    after_execution(cleaning, torch.device("cpu"))
    after_execution(DEFAULTS, torch.device("cuda", 0))
    assert calls == []
    after_execution(cleaning, torch.device("cuda", 0))
    assert calls == [1]


def test_errors_are_shared_by_both_modules() -> None:
    assert settings_module.ModelLoadError is ModelLoadError
    assert settings_module.ExecutionError is ExecutionError


# --- loading -------------------------------------------------------------------

def test_missing_model_file(tmp_path: Path) -> None:
    path = tmp_path / "1" / "model.pt"
    with pytest.raises(ModelLoadError) as info:
        load_model(config([spec("x")], [FP32_OUT]), path, CPU, "m_0", DEFAULTS)
    assert info.value.message == f"unable to find '{path}' for model instance 'm_0'"
    assert info.value.code == "UNAVAILABLE"


def test_unloadable_model_file(tmp_path: Path) -> None:
    path = tmp_path / "model.pt"
    path.write_bytes(b"not a torchscript archive")
    with pytest.raises(ModelLoadError) as info:
        load_model(config([spec("x")], [FP32_OUT], name="broken"), path, CPU, "broken_0", DEFAULTS)
    assert info.value.message.startswith("failed to load model 'broken': ")
    assert info.value.code == "INTERNAL"


def test_loaded_model_is_in_eval_mode(tmp_path: Path) -> None:
    model, _ = load(Identity(), config([spec("x")], [FP32_OUT]), tmp_path)
    assert model.training is False


def test_bind_needs_a_torchscript_forward() -> None:
    cfg = config([spec("x")], [spec("y")])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        scripted = torch.jit.script(Identity())
    assert bind(scripted, cfg).input_index == {"x": 0}
    with pytest.raises(ModelLoadError) as info:
        bind(Identity(), cfg)                       # eager module: no schema to bind to
    assert info.value.code == "INVALID_ARG" and "TorchScript" in info.value.message


# --- naming conventions ----------------------------------------------------------

def test_forward_argument_names_in_another_order(tmp_path: Path) -> None:
    cfg = config([spec("b"), spec("a")], [FP32_OUT])
    model, binding = load(Sub(), cfg, tmp_path)
    assert binding.input_convention is NamingConvention.FORWARD_ARGUMENT
    assert binding.input_index == {"b": 1, "a": 0}
    assert torch.equal(run(model, binding, {"a": Y, "b": X})["OUTPUT"], Y - X)


def test_named_index_out_of_order(tmp_path: Path) -> None:
    cfg = config([spec("IN__1"), spec("IN__0")], [spec("OUT__1"), spec("OUT__0")])
    model, binding = load(AddSub(), cfg, tmp_path)
    assert binding.input_convention is NamingConvention.NAMED_INDEX
    assert binding.output_convention is NamingConvention.NAMED_INDEX
    assert binding.input_index == {"IN__1": 1, "IN__0": 0}
    assert binding.output_index == {"OUT__1": 1, "OUT__0": 0}
    out = run(model, binding, {"IN__0": Y, "IN__1": X})
    assert list(out) == ["OUT__1", "OUT__0"]
    assert torch.equal(out["OUT__0"], Y + X) and torch.equal(out["OUT__1"], Y - X)


def test_named_index_uses_the_last_double_underscore(tmp_path: Path) -> None:
    cfg = config([spec("my__in__1"), spec("my__in__0")], [FP32_OUT])
    model, binding = load(Sub(), cfg, tmp_path)
    assert binding.input_index == {"my__in__1": 1, "my__in__0": 0}


def test_strict_config_ordering(tmp_path: Path, caplog) -> None:
    cfg = config([spec("first"), spec("second")], [spec("SUM"), spec("DIFF")])
    with caplog.at_level(logging.WARNING):
        model, binding = load(AddSub(), cfg, tmp_path)
    assert caplog.text == ""                # no `__` anywhere: nothing to warn about
    assert binding.input_convention is NamingConvention.STRICT_CONFIG_ORDERING
    assert binding.output_convention is NamingConvention.STRICT_CONFIG_ORDERING
    out = run(model, binding, {"first": Y, "second": X})
    assert torch.equal(out["SUM"], Y + X) and torch.equal(out["DIFF"], Y - X)


def test_non_integer_suffix_falls_back_to_strict_order_with_warnings(tmp_path: Path, caplog) -> None:
    cfg = config([spec("IN__0"), spec("IN__b")], [spec("OUT__x"), spec("OUT__1")])
    with caplog.at_level(logging.WARNING, logger="torchpool.worker.naming"):
        model, binding = load(AddSub(), cfg, tmp_path)
    assert binding.input_convention is NamingConvention.STRICT_CONFIG_ORDERING
    assert binding.output_convention is NamingConvention.STRICT_CONFIG_ORDERING
    assert binding.output_index == {"OUT__x": 0, "OUT__1": 1}
    assert (
        "input 'IN__b' or previous input(s) are neither an input argument to the model 'm' "
        "nor do they follow the <name>__<index> naming convention. Falling back to "
        "enforcing strict ordering from model configuration." in caplog.messages
    )
    assert (
        "output 'OUT__x' or previous output(s) of the model 'm' do not follow the "
        "<name>__<index> naming convention. Falling back to enforcing strict ordering "
        "from model configuration." in caplog.messages
    )
    out = run(model, binding, {"IN__0": Y, "IN__b": X})
    assert torch.equal(out["OUT__x"], Y + X)


def test_named_index_beyond_forward_arguments(tmp_path: Path) -> None:
    error = load_error(Sub(), config([spec("IN__0"), spec("IN__5")], [FP32_OUT]), tmp_path)
    assert error.code == "INVALID_ARG" and "IN__5" in error.message


# --- dict input ------------------------------------------------------------------

def test_dict_input(tmp_path: Path) -> None:
    cfg = config([spec("y"), spec("x"), spec("z", optional=True)], [FP32_OUT])
    model, binding = load(DictModel(), cfg, tmp_path)
    assert binding.is_dict_input and binding.input_convention is None
    assert set(binding.input_index) == {"x", "y", "z"}
    assert torch.equal(run(model, binding, {"x": X, "y": Y})["OUTPUT"], X * 2 + Y)
    assert torch.equal(run(model, binding, {"x": X, "y": Y, "z": X})["OUTPUT"], X * 3 + Y)


def test_multiple_dict_inputs(tmp_path: Path) -> None:
    class TwoDicts(torch.nn.Module):
        def forward(self, x: torch.Tensor, d: Dict[str, torch.Tensor]) -> torch.Tensor:
            return x

    error = load_error(TwoDicts(), config([spec("x"), spec("d")], [FP32_OUT]), tmp_path)
    assert error.message == (
        "Multiple inputs of kind DictType were detected. Only a single input of type "
        "Dict(str, Tensor) is supported."
    )
    assert error.code == "INTERNAL"


def test_unsupported_argument_types(tmp_path: Path) -> None:
    class IntArgument(torch.nn.Module):
        def forward(self, x: torch.Tensor, n: int) -> torch.Tensor:
            return x * n

    class IntDict(torch.nn.Module):
        def forward(self, d: Dict[str, int]) -> torch.Tensor:
            return torch.zeros(1)

    error = load_error(IntArgument(), config([spec("x"), spec("n")], [FP32_OUT]), tmp_path)
    assert error.message == (
        "An input of type 'int' was detected in the model. Only a single input of type "
        "Dict(str, Tensor) or input(s) of type Tensor are supported."
    )
    error = load_error(IntDict(), config([spec("x")], [FP32_OUT]), tmp_path)
    assert error.message.startswith("An input of type 'Dict[str, int]' was detected")


def test_input_count_mismatch(tmp_path: Path) -> None:
    error = load_error(Sub(), config([spec("a")], [FP32_OUT], name="sub"), tmp_path)
    assert error.message == "unable to load model 'sub', configuration expects 1 inputs, model provides 2"
    assert error.code == "INVALID_ARG"


def test_config_without_inputs_or_outputs(tmp_path: Path) -> None:
    class NoArguments(torch.nn.Module):
        def forward(self) -> torch.Tensor:
            return torch.zeros(1)

    error = load_error(NoArguments(), config([], [FP32_OUT]), tmp_path)
    assert error.message == "model configuration must contain at least one input, none were specified."
    error = load_error(Identity(), config([spec("x")], []), tmp_path)
    assert error.message == "model configuration must contain at least one output, none were specified."


def test_unsupported_datatype(tmp_path: Path) -> None:
    error = load_error(Identity(), config([spec("x", "TYPE_FOO")], [FP32_OUT]), tmp_path)
    assert error.message == "unsupported datatype TYPE_FOO for input 'x' for model 'm'"
    error = load_error(Identity(), config([spec("x")], [spec("y", "TYPE_COMPLEX")]), tmp_path)
    assert error.message == "unsupported datatype TYPE_COMPLEX for output 'y' for model 'm'"


# --- strings -----------------------------------------------------------------------

def test_string_list_in_and_out(tmp_path: Path) -> None:
    cfg = config(
        [spec("words", "TYPE_STRING", (-1,)), spec("n", "TYPE_INT64", (1,))],
        [spec("UPPER", "TYPE_STRING", (-1,)), spec("COUNT", "TYPE_INT64", (1,))],
    )
    model, binding = load(Strings(), cfg, tmp_path)
    assert binding.output_datatype == {"UPPER": "BYTES", "COUNT": "INT64"}
    out = run(model, binding, {"words": ["a", "bc"], "n": torch.tensor([1])})
    assert out["UPPER"] == ["A", "BC"]
    assert torch.equal(out["COUNT"], torch.tensor([3]))


def test_string_rank_counts_the_batch_dimension_and_reshape(tmp_path: Path) -> None:
    def strings_config(words: TensorSpec, upper: TensorSpec, max_batch_size: int) -> ModelConfig:
        return config([words, spec("n", "TYPE_INT64", (1,))],
                      [upper, spec("COUNT", "TYPE_INT64", (1,))], max_batch_size=max_batch_size)

    one_d = spec("words", "TYPE_STRING", (-1,))
    upper = spec("UPPER", "TYPE_STRING", (-1,))
    error = load_error(Strings(), strings_config(one_d, upper, 8), tmp_path)
    assert error.message == ("Triton only supports 1 dimensional List of String as input for 'words' for model "
                             "'m' (with max_batch_size > 0 the batch is the list's one dimension: give 'words' "
                             "dims: [ 1 ] and reshape: { shape: [ ] }, or set max_batch_size: 0)")
    assert error.code == "INTERNAL"

    reshaped = spec("words", "TYPE_STRING", (1,), reshape=())
    error = load_error(Strings(), strings_config(reshaped, upper, 8), tmp_path)
    assert error.message.startswith("Triton only supports 1 dimensional List of String as output for 'UPPER' "
                                    "for model 'm' (")

    load(Strings(), strings_config(reshaped, spec("UPPER", "TYPE_STRING", (1,), reshape=()), 8), tmp_path)
    two_d = spec("words", "TYPE_STRING", (2, 2), reshape=(4,))
    load(Strings(), strings_config(two_d, upper, 0), tmp_path)


# --- outputs -------------------------------------------------------------------------

def test_tuple_outputs_and_requested_subset(tmp_path: Path) -> None:
    cfg = config([spec("a"), spec("b")], [spec("SUM"), spec("DIFF")])
    model, binding = load(AddSub(), cfg, tmp_path)
    out = run(model, binding, {"a": X, "b": Y}, requested=["DIFF"])
    assert list(out) == ["DIFF"] and torch.equal(out["DIFF"], X - Y)
    with pytest.raises(ExecutionError) as info:
        run(model, binding, {"a": X, "b": Y}, requested=["NOPE"])
    assert info.value.message == "unexpected inference output 'NOPE' for model 'm'"
    assert info.value.code == "INVALID_ARG"


def test_outputs_are_contiguous(tmp_path: Path) -> None:
    class Transpose(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.t()

    model, binding = load(Transpose(), config([spec("x", dims=(2, 3))], [spec("y", dims=(3, 2))]), tmp_path)
    x = torch.arange(6.0).reshape(2, 3)
    y = run(model, binding, {"x": x})["y"]
    assert y.is_contiguous() and torch.equal(y, x.t())


@pytest.mark.parametrize("module, text", [
    ("dict", "output must be of type Tensor, List[str] or Tuple containing one of these two "
             "types. It should not be a List / Dictionary of Tensors or a Scalar"),
    ("int", "output must be of type Tensor, List[str] or Tuple containing one of these two "
            "types. It should not be a List / Dictionary of Tensors or a Scalar"),
    ("tensors", "output must be of type Tensor or List[str], received List[Tensor]"),
    ("tuple_ints", "output at index 1 must be of type Tensor or List[str], received List[int]"),
])
def test_unsupported_return_values(tmp_path: Path, module: str, text: str) -> None:
    class ReturnsDict(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> Dict[str, torch.Tensor]:
            return {"y": x}

    class ReturnsInt(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> int:
            return 3

    class ReturnsTensors(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> List[torch.Tensor]:
            return [x, x]

    class ReturnsInts(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, List[int]]:
            return x, [1, 2]

    modules = {"dict": ReturnsDict, "int": ReturnsInt, "tensors": ReturnsTensors, "tuple_ints": ReturnsInts}
    error = run_error(modules[module](), config([spec("x")], [FP32_OUT]), tmp_path, {"x": X})
    assert error.message == "PyTorch execute failure: " + text
    assert error.code == "INTERNAL"


def test_forward_exception(tmp_path: Path) -> None:
    class Raises(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.sum() > 0:
                raise RuntimeError("negative inputs only")
            return x

    error = run_error(Raises(), config([spec("x")], [FP32_OUT]), tmp_path, {"x": X})
    assert error.message.startswith("PyTorch execute failure: ")
    assert "negative inputs only" in error.message and error.code == "INTERNAL"


def test_output_index_beyond_outputs(tmp_path: Path) -> None:
    cfg = config([spec("x")], [spec("OUT__0"), spec("OUT__2")])
    error = run_error(Identity(), cfg, tmp_path, {"x": X})
    assert error.message == (
        "The output OUT__2 in the model configuration refers to an output index which "
        "doesn't exist. This model has 1 outputs"
    )
    assert error.code == "INVALID_ARG"


def test_output_datatype_mismatch(tmp_path: Path) -> None:
    error = run_error(Identity(), config([spec("x", "TYPE_INT32")], [spec("y", "TYPE_FP32")]),
                      tmp_path, {"x": torch.ones(4, dtype=torch.int32)})
    assert error.message == "configuration expects datatype TYPE_FP32 for output 'y', model provides TYPE_INT32"
    assert error.code == "INVALID_ARG"
    cfg = config([spec("words", "TYPE_STRING", (-1,)), spec("n", "TYPE_INT64", (1,))],
                 [spec("UPPER", "TYPE_FP32"), spec("COUNT", "TYPE_INT64", (1,))])
    error = run_error(Strings(), cfg, tmp_path, {"words": ["a"], "n": torch.tensor([1])})
    assert error.message == "configuration expects datatype TYPE_FP32 for output 'UPPER', model provides TYPE_STRING"


def test_scalar_output(tmp_path: Path) -> None:
    class Total(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.sum()

    error = run_error(Total(), config([spec("x")], [spec("total")]), tmp_path, {"x": X})
    assert error.message == "output 'total' is a scalar which is not supported."
    assert error.code == "INVALID_ARG"


# --- inputs at execution ----------------------------------------------------------

def test_zero_size_input(tmp_path: Path) -> None:
    cfg = config([spec("a"), spec("b")], [spec("SUM"), spec("DIFF")], max_batch_size=8)
    model, binding = load(AddSub(), cfg, tmp_path)
    empty = torch.zeros(0, 4)
    out = run(model, binding, {"a": empty, "b": empty})
    assert out["SUM"].shape == (0, 4) and out["DIFF"].shape == (0, 4)


def test_bf16_input_and_output(tmp_path: Path) -> None:
    class Double(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * 2

    model, binding = load(Double(), config([spec("x", "TYPE_BF16")], [spec("y", "TYPE_BF16")]), tmp_path)
    assert binding.output_datatype == {"y": "BF16"}
    y = run(model, binding, {"x": X.to(torch.bfloat16)})["y"]
    assert y.dtype == torch.bfloat16 and torch.equal(y, (X * 2).to(torch.bfloat16))


@pytest.mark.parametrize("data_type, dtype", [
    ("TYPE_BOOL", torch.bool), ("TYPE_UINT8", torch.uint8), ("TYPE_INT8", torch.int8),
    ("TYPE_INT16", torch.int16), ("TYPE_INT64", torch.int64), ("TYPE_FP16", torch.float16),
    ("TYPE_FP64", torch.float64),
])
def test_every_bound_datatype_round_trips(tmp_path: Path, data_type: str, dtype: torch.dtype) -> None:
    model, binding = load(Identity(), config([spec("x", data_type)], [spec("y", data_type)]), tmp_path)
    x = torch.ones(4, dtype=dtype)
    y = run(model, binding, {"x": x})["y"]
    assert y.dtype == dtype and torch.equal(y, x)


# Triton's qa/L0_libtorch_io_types: the PyTorch backend binds no UINT16/32/64
# (torch has them, with few operators); the model fails to load with these texts.
@pytest.mark.parametrize("inputs, outputs, message", [
    ([spec("INPUT0", "TYPE_UINT32")], [spec("OUTPUT__0", "TYPE_UINT32")],
     "unsupported datatype TYPE_UINT32 for input 'INPUT0' for model 'm'"),
    ([spec("INPUT0", "TYPE_INT32")], [spec("OUTPUT__0", "TYPE_UINT64")],
     "unsupported datatype TYPE_UINT64 for output 'OUTPUT__0' for model 'm'"),
    ([spec("INPUT0", "TYPE_UINT16")], [spec("OUTPUT__0")],
     "unsupported datatype TYPE_UINT16 for input 'INPUT0' for model 'm'"),
])
def test_unsigned_datatypes_beyond_uint8_fail_the_load(tmp_path: Path, inputs: list, outputs: list,
                                                        message: str) -> None:
    assert load_error(Identity(), config(inputs, outputs), tmp_path).message == message


@pytest.mark.parametrize("data_type", ["TYPE_UINT32", "TYPE_UINT64", "TYPE_STRING"])
def test_a_correlation_id_control_of_a_type_pytorch_cannot_take_fails_the_load(
        tmp_path: Path, data_type: str) -> None:
    class WithCorrid(torch.nn.Module):
        def forward(self, x: torch.Tensor, corrid: torch.Tensor) -> torch.Tensor:
            return x + corrid

    sequence = {"control_input": [{"name": "CORRID__1", "control": [
        {"kind": "CONTROL_SEQUENCE_CORRID", "data_type": data_type}]}]}
    cfg = config([spec("INPUT__0", "TYPE_INT32", (1,))], [spec("OUTPUT__0", "TYPE_INT32", (1,))],
                 sequence_batching=sequence)
    assert load_error(WithCorrid(), cfg, tmp_path).message == \
        f"input 'CORRID__1' type '{data_type}' is not supported by PyTorch."
    sequence["control_input"][0]["control"][0]["data_type"] = "TYPE_INT64"
    _model, binding = load(WithCorrid(), cfg, tmp_path)          # a signed id is taken
    assert binding.input_index["CORRID__1"] == 1


def test_inputs_are_passed_without_copies(tmp_path: Path) -> None:
    model, binding = load(Identity(), config([spec("x")], [spec("y")]), tmp_path)
    x = X.clone()
    assert run(model, binding, {"x": x})["y"].data_ptr() == x.data_ptr()


def test_missing_and_unexpected_inputs(tmp_path: Path) -> None:
    model, binding = load(Sub(), config([spec("a"), spec("b")], [FP32_OUT]), tmp_path)
    with pytest.raises(ExecutionError) as info:
        run(model, binding, {"a": X})
    assert info.value.code == "INVALID_ARG" and "missing required input(s) ['b']" in info.value.message
    with pytest.raises(ExecutionError) as info:
        run(model, binding, {"a": X, "b": X, "c": X})
    assert info.value.message == "unexpected inference input 'c' for model 'm'"


def test_optional_tensor_argument(tmp_path: Path) -> None:
    class MaybeAdd(torch.nn.Module):
        def forward(self, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
            if bias is None:
                return x
            return x + bias

    cfg = config([spec("x"), spec("bias", optional=True)], [FP32_OUT])
    model, binding = load(MaybeAdd(), cfg, tmp_path)
    assert binding.required_inputs == {"x"}
    assert torch.equal(run(model, binding, {"x": X})["OUTPUT"], X)
    assert torch.equal(run(model, binding, {"x": X, "bias": Y})["OUTPUT"], X + Y)


# --- batch inputs and sequence state --------------------------------------------------

BATCH_INPUT = {"kind": "BATCH_ELEMENT_COUNT", "target_name": ["count"],
               "data_type": "TYPE_FP32", "source_input": ["x"]}


def test_batch_input_follows_config_inputs(tmp_path: Path) -> None:
    class Scale(torch.nn.Module):
        def forward(self, x: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
            return x * n

    cfg = config([spec("INPUT")], [FP32_OUT], batch_inputs=(BATCH_INPUT,))
    model, binding = load(Scale(), cfg, tmp_path)
    assert binding.input_index == {"INPUT": 0, "count": 1}
    out = run(model, binding, {"INPUT": X, "count": torch.tensor([4.0])})
    assert torch.equal(out["OUTPUT"], X * 4)

    error = load_error(Scale(), config([spec("INPUT")], [FP32_OUT], name="s"), tmp_path)
    assert error.message == "unable to load model 's', configuration expects 1 inputs, model provides 2"


def test_batch_input_by_forward_argument_name(tmp_path: Path) -> None:
    class Scale(torch.nn.Module):
        def forward(self, count: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
            return x * count

    model, binding = load(Scale(), config([spec("x")], [FP32_OUT], batch_inputs=(BATCH_INPUT,)), tmp_path)
    assert binding.input_index == {"x": 1, "count": 0}


def test_sequence_controls_and_state(tmp_path: Path) -> None:
    class Accumulate(torch.nn.Module):
        def forward(self, x: torch.Tensor, start: torch.Tensor, state: torch.Tensor
                    ) -> Tuple[torch.Tensor, torch.Tensor]:
            total = torch.where(start != 0, x, x + state)
            return total, total

    sequence = {
        "control_input": [{"name": "START__1", "control": [
            {"kind": "CONTROL_SEQUENCE_START", "int32_false_true": [0, 1]}]}],
        "state": [{"input_name": "STATE_IN__2", "output_name": "STATE_OUT__1",
                   "data_type": "TYPE_FP32", "dims": ["4"]}],
    }
    cfg = config([spec("INPUT__0")], [spec("OUTPUT__0")], sequence_batching=sequence)
    model, binding = load(Accumulate(), cfg, tmp_path)
    assert binding.input_index == {"INPUT__0": 0, "START__1": 1, "STATE_IN__2": 2}
    assert binding.output_index == {"OUTPUT__0": 0, "STATE_OUT__1": 1}
    inputs = {"INPUT__0": X, "START__1": torch.tensor([0], dtype=torch.int32), "STATE_IN__2": Y}
    assert list(run(model, binding, inputs)) == ["OUTPUT__0"]
    out = run(model, binding, inputs, requested=["OUTPUT__0", "STATE_OUT__1"])
    assert torch.equal(out["STATE_OUT__1"], X + Y)

    strict = config([spec("INPUT")], [spec("OUTPUT__0")], sequence_batching=sequence)
    error = load_error(Accumulate(), strict, tmp_path)
    assert error.code == "INVALID_ARG"
    assert "is using sequence batching with state but not all inputs and outputs follow" in error.message
