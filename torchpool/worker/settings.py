"""The model's execution parameters and what they do to torch in a worker.

Triton's PyTorch backend reads ten `parameters` from the model configuration
and applies them process-wide, so they leak between models that share the
server process. A torchpool worker runs one model instance, so the same
settings are applied once per worker process (`apply_process_settings`) and
belong to that model alone. Per-call behaviour (the grad mode around
`forward`, emptying the CUDA cache afterwards) is given by `grad_context` and
`after_execution`.

The worker's two error types live here, the lowest module of the worker, so
that parameter parsing and model binding raise the same classes;
`torchpool.worker.binding` re-exports them.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, ContextManager, Optional

from torchpool.protocol.errors import INTERNAL, INVALID_ARG, TorchpoolError

logger = logging.getLogger(__name__)


class ModelLoadError(TorchpoolError):
    """A model instance cannot be loaded; `.code` is a Triton error code."""

    def __init__(self, message: str, code: str = INTERNAL) -> None:
        super().__init__(code, message)


class ExecutionError(TorchpoolError):
    """A batch could not be executed or its outputs read; `.code` as above."""

    def __init__(self, message: str, code: str = INTERNAL) -> None:
        super().__init__(code, message)


@dataclass(frozen=True)
class ExecutionSettings:
    """The parameters of one model, typed. `None` means "leave torch's default"."""

    inference_mode: bool = True
    disable_optimized_execution: bool = False
    disable_cudnn: bool = False
    enable_cache_cleaning: bool = False
    enable_weight_sharing: bool = False
    jit_profiling: Optional[bool] = None
    jit_executor: Optional[bool] = None
    tensor_fuser: Optional[bool] = None
    intra_op_threads: Optional[int] = None      # None or 0: torch's default
    inter_op_threads: Optional[int] = None


# Config parameter key -> ExecutionSettings field, for each value kind.
_BOOLEAN_KEYS = {
    "INFERENCE_MODE": "inference_mode",
    "DISABLE_OPTIMIZED_EXECUTION": "disable_optimized_execution",
    "DISABLE_CUDNN": "disable_cudnn",
    "ENABLE_CACHE_CLEANING": "enable_cache_cleaning",
    "ENABLE_WEIGHT_SHARING": "enable_weight_sharing",
    "ENABLE_JIT_PROFILING": "jit_profiling",
    "ENABLE_JIT_EXECUTOR": "jit_executor",
    "ENABLE_TENSOR_FUSER": "tensor_fuser",
}
_THREAD_COUNT_KEYS = {
    "INTRA_OP_THREAD_COUNT": "intra_op_threads",
    "INTER_OP_THREAD_COUNT": "inter_op_threads",
}
_TRUE_SPELLINGS = frozenset({"true", "on", "1"})
_FALSE_SPELLINGS = frozenset({"false", "off", "0"})


def parse_parameters(model_name: str, parameters: dict[str, str]) -> ExecutionSettings:
    """Read the execution parameters out of a model's `parameters` map.

    Keys this module does not know are ignored: the same map carries
    parameters meant for other parts of the server or for the model itself.
    A value that cannot be read fails the load (INVALID_ARG), as in Triton.
    """
    fields: dict[str, Any] = {}
    for key, field_name in _BOOLEAN_KEYS.items():
        if key in parameters:
            fields[field_name] = _parse_boolean(model_name, key, parameters[key])
    for key, field_name in _THREAD_COUNT_KEYS.items():
        if key in parameters:
            fields[field_name] = _parse_thread_count(model_name, key, parameters[key])
    return ExecutionSettings(**fields)


def _parse_boolean(model_name: str, key: str, value: str) -> bool:
    """Triton's boolean spellings: true/on/1 and false/off/0, in any case."""
    word = str(value).strip().lower()
    if word in _TRUE_SPELLINGS:
        return True
    if word in _FALSE_SPELLINGS:
        return False
    raise ModelLoadError(
        f"failed to convert '{value}' to boolean for parameter '{key}' of model "
        f"'{model_name}' (expected true/on/1 or false/off/0)",
        INVALID_ARG,
    )


def _parse_thread_count(model_name: str, key: str, value: str) -> Optional[int]:
    """A non-negative integer; 0 keeps torch's default, like leaving it out."""
    try:
        count = int(str(value).strip())
    except ValueError:
        raise ModelLoadError(
            f"failed to convert '{value}' to integral number for parameter '{key}' "
            f"of model '{model_name}'",
            INVALID_ARG,
        ) from None
    if count < 0:
        raise ModelLoadError(
            f"parameter '{key}' of model '{model_name}' must be a non-negative "
            f"thread count, got {count}",
            INVALID_ARG,
        )
    return count or None


def apply_process_settings(settings: ExecutionSettings) -> None:
    """Set torch's process-wide switches for this worker's model.

    Called once per worker process, before the model is loaded: the thread
    pools in particular can only be sized before parallel work starts. A JIT
    switch left at `None` is not touched, as in Triton.
    """
    import torch

    torch._C._set_graph_executor_optimize(not settings.disable_optimized_execution)
    torch.backends.cudnn.enabled = not settings.disable_cudnn
    _set_jit_switch("_jit_set_profiling_mode", settings.jit_profiling)
    _set_jit_switch("_jit_set_profiling_executor", settings.jit_executor)
    _set_jit_switch("_jit_set_texpr_fuser_enabled", settings.tensor_fuser)
    if settings.intra_op_threads:
        torch.set_num_threads(settings.intra_op_threads)
    if settings.inter_op_threads:
        _set_interop_threads(settings.inter_op_threads)


def _set_jit_switch(setter_name: str, value: Optional[bool]) -> None:
    """Call a private `torch._C` JIT setter if the value is given and torch has it."""
    if value is None:
        return
    import torch

    setter = getattr(torch._C, setter_name, None)
    if setter is None:
        logger.warning("this torch has no %s; the setting is ignored", setter_name)
        return
    setter(value)


def _set_interop_threads(count: int) -> None:
    """Size the inter-op pool; torch allows this once, before parallel work."""
    import torch

    if torch.get_num_interop_threads() == count:
        return
    try:
        torch.set_num_interop_threads(count)
    except RuntimeError as exc:
        logger.warning(
            "could not set the inter-op thread count to %d (it stays %d): %s",
            count, torch.get_num_interop_threads(), exc,
        )


def grad_context(settings: ExecutionSettings) -> ContextManager[Any]:
    """The grad mode to load and run under: inference mode unless disabled.

    Inference mode is the cheaper of the two; some models need plain
    `no_grad` (tensors they create are later used in autograd-aware code).
    """
    import torch

    if settings.inference_mode:
        return torch.inference_mode()
    return torch.no_grad()


def after_execution(settings: ExecutionSettings, device: Any) -> None:
    """Give cached CUDA memory back after a batch when the model asks for it."""
    if not settings.enable_cache_cleaning or device is None:
        return
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


__all__ = [
    "ExecutionError", "ExecutionSettings", "ModelLoadError", "after_execution",
    "apply_process_settings", "grad_context", "parse_parameters",
]
