"""A model's `parameters`, parsed and validated once.

`config.pbtxt` gives every parameter as a string (`string_value`). The ones
torchpool understands are read here, into one frozen `ModelParameters`, by
the broker (weight sharing, the execution timeout) and by the worker (torch's
switches, custom operators) alike; nobody else reads `ModelConfig.parameters`
for them. Keys not listed are ignored: the same map carries parameters meant
for the model itself or for other tools.

Triton's PyTorch backend            field                          value
  INFERENCE_MODE                    inference_mode                 bool, default true
  DISABLE_OPTIMIZED_EXECUTION       disable_optimized_execution    bool
  DISABLE_CUDNN                     disable_cudnn                  bool
  ENABLE_CACHE_CLEANING             enable_cache_cleaning          bool
  ENABLE_WEIGHT_SHARING             enable_weight_sharing          bool
  ENABLE_JIT_PROFILING              jit_profiling                  bool, None = torch's
  ENABLE_JIT_EXECUTOR               jit_executor                   bool, None = torch's
  ENABLE_TENSOR_FUSER               tensor_fuser                   bool, None = torch's
  INTRA_OP_THREAD_COUNT             intra_op_threads               int >= 0, 0/None = torch's
  INTER_OP_THREAD_COUNT             inter_op_threads               int >= 0, 0/None = torch's
torchpool's own
  TORCHPOOL_EXECUTION_TIMEOUT_S     execution_timeout              seconds >= 0 (0 = never),
                                                                   None = the daemon's --execution-timeout
  TORCHPOOL_OP_LIBRARIES            op_libraries                   comma-separated paths (model directory)
  TORCHPOOL_PYTHON_MODULES          python_modules                 comma-separated paths (model directory)

Booleans take Triton's spellings (true/on/1, false/off/0, any case). A value
that cannot be read raises `ParameterError`, a `ConfigError` that names the
model and the parameter; the worker reports it as a load failure
(INVALID_ARG), as Triton does.

This module must not import torch: the broker uses it.
"""
from __future__ import annotations

import functools
import math
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional

from .errors import ConfigError

if TYPE_CHECKING:
    from .model_config import ModelConfig


class ParameterError(ConfigError):
    """A parameter's value cannot be read; `.model` and `.key` say whose."""

    def __init__(self, model: str, key: str, message: str) -> None:
        super().__init__(message)
        self.model = model
        self.key = key
        self.message = message

    def __reduce__(self) -> tuple:
        return type(self), (self.model, self.key, self.message)


@dataclass(frozen=True)
class ModelParameters:
    """The parameters of one model, typed. `None` means "leave the default"
    (torch's for the JIT switches and thread pools, the daemon's for the
    execution timeout)."""

    inference_mode: bool = True
    disable_optimized_execution: bool = False
    disable_cudnn: bool = False
    enable_cache_cleaning: bool = False
    enable_weight_sharing: bool = False
    jit_profiling: Optional[bool] = None
    jit_executor: Optional[bool] = None
    tensor_fuser: Optional[bool] = None
    intra_op_threads: Optional[int] = None
    inter_op_threads: Optional[int] = None
    execution_timeout: Optional[float] = None
    op_libraries: tuple[str, ...] = ()
    python_modules: tuple[str, ...] = ()

    def execution_timeout_or(self, default: float) -> float:
        """Seconds a batch may run: this model's timeout if it sets one, else `default`."""
        return default if self.execution_timeout is None else self.execution_timeout


_TRUE_SPELLINGS = frozenset({"true", "on", "1"})
_FALSE_SPELLINGS = frozenset({"false", "off", "0"})


def read_boolean(model: str, key: str, value: str) -> bool:
    word = str(value).strip().lower()
    if word in _TRUE_SPELLINGS:
        return True
    if word in _FALSE_SPELLINGS:
        return False
    raise ParameterError(model, key, f"failed to convert '{value}' to boolean for parameter '{key}' of "
                                     f"model '{model}' (expected true/on/1 or false/off/0)")


def _thread_count(model: str, key: str, value: str) -> Optional[int]:
    try:
        count = int(str(value).strip())
    except ValueError:
        raise ParameterError(model, key, f"failed to convert '{value}' to integral number for "
                                         f"parameter '{key}' of model '{model}'") from None
    if count < 0:
        raise ParameterError(model, key, f"parameter '{key}' of model '{model}' must be a "
                                         f"non-negative thread count, got {count}")
    return count or None


def _seconds(model: str, key: str, value: str) -> float:
    try:
        seconds = float(str(value).strip())
    except ValueError:
        raise ParameterError(model, key, f"failed to convert '{value}' to a number of seconds for "
                                         f"parameter '{key}' of model '{model}'") from None
    if not math.isfinite(seconds) or seconds < 0:
        raise ParameterError(model, key, f"parameter '{key}' of model '{model}' must be a finite "
                                         f"number of seconds >= 0 (0 = no limit), got '{value}'")
    return seconds


def _paths(model: str, key: str, value: str) -> tuple[str, ...]:
    return tuple(p for p in (item.strip() for item in str(value).split(",")) if p)


# config key -> (ModelParameters field, reader)
_READERS: dict[str, tuple[str, Callable[[str, str, str], object]]] = {
    "INFERENCE_MODE": ("inference_mode", read_boolean),
    "DISABLE_OPTIMIZED_EXECUTION": ("disable_optimized_execution", read_boolean),
    "DISABLE_CUDNN": ("disable_cudnn", read_boolean),
    "ENABLE_CACHE_CLEANING": ("enable_cache_cleaning", read_boolean),
    "ENABLE_WEIGHT_SHARING": ("enable_weight_sharing", read_boolean),
    "ENABLE_JIT_PROFILING": ("jit_profiling", read_boolean),
    "ENABLE_JIT_EXECUTOR": ("jit_executor", read_boolean),
    "ENABLE_TENSOR_FUSER": ("tensor_fuser", read_boolean),
    "INTRA_OP_THREAD_COUNT": ("intra_op_threads", _thread_count),
    "INTER_OP_THREAD_COUNT": ("inter_op_threads", _thread_count),
    "TORCHPOOL_EXECUTION_TIMEOUT_S": ("execution_timeout", _seconds),
    "TORCHPOOL_OP_LIBRARIES": ("op_libraries", _paths),
    "TORCHPOOL_PYTHON_MODULES": ("python_modules", _paths),
}
KNOWN_KEYS = frozenset(_READERS)


def parse_parameters(model: str, parameters: Mapping[str, str]) -> ModelParameters:
    """Read the parameters torchpool understands out of a `parameters` map.

    Raises `ParameterError` (naming `model` and the key) for a value that
    cannot be read; keys not in `KNOWN_KEYS` are ignored.
    """
    fields: dict[str, Any] = {}
    for key, (field_name, read) in _READERS.items():
        if key in parameters:
            fields[field_name] = read(model, key, parameters[key])
    return ModelParameters(**fields)


# id(config) -> (weak reference to it, its parameters). A ModelConfig is
# frozen but holds a dict, so it cannot be a key itself; the entry goes when
# the config does.
_cache: dict[int, tuple[weakref.ref, ModelParameters]] = {}


def model_parameters(config: ModelConfig) -> ModelParameters:
    """The parsed parameters of a `ModelConfig`, parsed on the first call for
    that config object and cached while it lives. Raises `ParameterError`."""
    entry = _cache.get(id(config))
    if entry is not None and entry[0]() is config:
        return entry[1]
    parsed = parse_parameters(config.name, config.parameters)
    key = id(config)
    _cache[key] = (weakref.ref(config, functools.partial(_drop, key)), parsed)
    return parsed


def _drop(key: int, ref: weakref.ref[ModelConfig]) -> None:
    entry = _cache.get(key)
    if entry is not None and entry[0] is ref:
        del _cache[key]


__all__ = ["KNOWN_KEYS", "ModelParameters", "ParameterError", "model_parameters", "parse_parameters"]
