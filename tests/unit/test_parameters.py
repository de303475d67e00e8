"""torchpool.config.parameters: every parameter torchpool reads, parsed once."""
from __future__ import annotations

import gc
import math

import pytest

from torchpool.config import ConfigError, ModelConfig
from torchpool.config import parameters as params_module
from torchpool.config.parameters import (
    KNOWN_KEYS,
    ModelParameters,
    ParameterError,
    model_parameters,
    parse_parameters,
)


def make_config(name: str = "m", **parameters: str) -> ModelConfig:
    return ModelConfig.from_json({
        "name": name, "platform": "pytorch_libtorch", "max_batch_size": 0,
        "input": [{"name": "INPUT__0", "data_type": "TYPE_FP32", "dims": [4]}],
        "output": [{"name": "OUTPUT__0", "data_type": "TYPE_FP32", "dims": [4]}],
        "parameters": {k: {"string_value": v} for k, v in parameters.items()},
    })


def test_defaults_and_unknown_keys() -> None:
    assert parse_parameters("m", {}) == ModelParameters()
    assert parse_parameters("m", {"max_tokens": "7", "SOMETHING": "x"}) == ModelParameters()
    defaults = ModelParameters()
    assert defaults.inference_mode is True and defaults.enable_weight_sharing is False
    assert defaults.jit_profiling is None and defaults.intra_op_threads is None
    assert defaults.execution_timeout is None and defaults.op_libraries == ()


def test_every_known_key_is_read() -> None:
    parsed = parse_parameters("m", {
        "INFERENCE_MODE": "off", "DISABLE_OPTIMIZED_EXECUTION": "ON", "DISABLE_CUDNN": "1",
        "ENABLE_CACHE_CLEANING": "true", "ENABLE_WEIGHT_SHARING": " True ",
        "ENABLE_JIT_PROFILING": "false", "ENABLE_JIT_EXECUTOR": "0", "ENABLE_TENSOR_FUSER": "on",
        "INTRA_OP_THREAD_COUNT": "3", "INTER_OP_THREAD_COUNT": "0",
        "TORCHPOOL_EXECUTION_TIMEOUT_S": "2.5",
        "TORCHPOOL_OP_LIBRARIES": " libops.so, ,sub/more.so ",
        "TORCHPOOL_PYTHON_MODULES": "ops.py",
    })
    assert parsed == ModelParameters(
        inference_mode=False, disable_optimized_execution=True, disable_cudnn=True,
        enable_cache_cleaning=True, enable_weight_sharing=True, jit_profiling=False,
        jit_executor=False, tensor_fuser=True, intra_op_threads=3, inter_op_threads=None,
        execution_timeout=2.5, op_libraries=("libops.so", "sub/more.so"), python_modules=("ops.py",))
    assert len(KNOWN_KEYS) == 13


@pytest.mark.parametrize("key, value, text", [
    ("INFERENCE_MODE", "maybe",
     "failed to convert 'maybe' to boolean for parameter 'INFERENCE_MODE' of model 'resnet' "
     "(expected true/on/1 or false/off/0)"),
    ("ENABLE_WEIGHT_SHARING", "yes", "failed to convert 'yes' to boolean for parameter "
                                     "'ENABLE_WEIGHT_SHARING' of model 'resnet'"),
    ("INTRA_OP_THREAD_COUNT", "two",
     "failed to convert 'two' to integral number for parameter 'INTRA_OP_THREAD_COUNT' of model 'resnet'"),
    ("INTER_OP_THREAD_COUNT", "-1",
     "parameter 'INTER_OP_THREAD_COUNT' of model 'resnet' must be a non-negative thread count, got -1"),
    ("TORCHPOOL_EXECUTION_TIMEOUT_S", "soon",
     "failed to convert 'soon' to a number of seconds for parameter 'TORCHPOOL_EXECUTION_TIMEOUT_S' "
     "of model 'resnet'"),
    ("TORCHPOOL_EXECUTION_TIMEOUT_S", "-2", "parameter 'TORCHPOOL_EXECUTION_TIMEOUT_S' of model "
                                            "'resnet' must be a finite number of seconds >= 0"),
    ("TORCHPOOL_EXECUTION_TIMEOUT_S", "nan", "must be a finite number of seconds"),
])
def test_bad_values_name_model_and_parameter(key: str, value: str, text: str) -> None:
    with pytest.raises(ParameterError) as info:
        parse_parameters("resnet", {key: value})
    assert text in str(info.value) and text in info.value.message
    assert info.value.model == "resnet" and info.value.key == key
    assert isinstance(info.value, ConfigError)


def test_execution_timeout_or_the_daemons() -> None:
    assert ModelParameters().execution_timeout_or(7.0) == 7.0
    assert parse_parameters("m", {"TORCHPOOL_EXECUTION_TIMEOUT_S": "0"}).execution_timeout_or(7.0) == 0.0
    assert parse_parameters("m", {"TORCHPOOL_EXECUTION_TIMEOUT_S": "1e1"}).execution_timeout_or(7.0) == 10.0
    assert not math.isnan(ModelParameters().execution_timeout_or(0.0))


def test_model_parameters_is_parsed_once_per_config() -> None:
    config = make_config("cached", ENABLE_WEIGHT_SHARING="on")
    first = model_parameters(config)
    assert first.enable_weight_sharing is True
    assert model_parameters(config) is first
    # an equal config that is another object is parsed for itself
    other = make_config("cached", ENABLE_WEIGHT_SHARING="off")
    assert model_parameters(other).enable_weight_sharing is False
    assert model_parameters(config) is first
    key = id(other)
    del other
    gc.collect()
    assert key not in params_module._cache


def test_model_parameters_errors_name_the_model() -> None:
    config = make_config("broken", INFERENCE_MODE="maybe")
    with pytest.raises(ParameterError, match="of model 'broken'"):
        model_parameters(config)


def test_parameter_error_pickles() -> None:
    import pickle

    error = pickle.loads(pickle.dumps(ParameterError("m", "K", "bad K")))
    assert (error.model, error.key, error.message, str(error)) == ("m", "K", "bad K", "bad K")


def test_no_torch() -> None:
    import subprocess
    import sys

    code = ("import sys, torchpool.config.parameters, torchpool.broker.options; "
            "sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
