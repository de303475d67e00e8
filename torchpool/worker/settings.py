"""The model's execution parameters and what they do to torch in a worker.

The parameters themselves are parsed in `torchpool.config.parameters` (one
`ModelParameters`, also read by the broker); this module applies them.
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
from typing import TYPE_CHECKING, ContextManager, Mapping, Optional

from torchpool.config.parameters import ModelParameters, ParameterError, model_parameters
from torchpool.config.parameters import read_boolean   # Triton's spellings, one owner
from torchpool.config.parameters import parse_parameters as _parse
from torchpool.protocol.errors import INTERNAL, INVALID_ARG, TorchpoolError

if TYPE_CHECKING:
    import torch

    from torchpool.config.model_config import ModelConfig

logger = logging.getLogger(__name__)


class ModelLoadError(TorchpoolError):
    """A model instance cannot be loaded; `.code` is a Triton error code."""

    def __init__(self, message: str, code: str = INTERNAL) -> None:
        super().__init__(code, message)


class ExecutionError(TorchpoolError):
    """A batch could not be executed or its outputs read; `.code` as above."""

    def __init__(self, message: str, code: str = INTERNAL) -> None:
        super().__init__(code, message)


# The parameters are parsed once, by torchpool.config.parameters (the broker
# reads the same object); the worker's name for them is kept.
ExecutionSettings = ModelParameters


def parse_parameters(model_name: str, parameters: Mapping[str, str]) -> ExecutionSettings:
    """Read a model's `parameters` map; a value that cannot be read fails the
    load (ModelLoadError, INVALID_ARG), as in Triton. Unknown keys are ignored."""
    try:
        return _parse(model_name, parameters)
    except ParameterError as exc:
        raise ModelLoadError(exc.message, INVALID_ARG) from None


def model_settings(config: ModelConfig) -> ExecutionSettings:
    """The parameters of a `ModelConfig` (parsed once per config object)."""
    try:
        return model_parameters(config)
    except ParameterError as exc:
        raise ModelLoadError(exc.message, INVALID_ARG) from None


# --- compiled execution (torchpool's own parameters) ---------------------------
#   TORCH_COMPILE        bool, default false: run the model through torch.compile
#   TORCH_COMPILE_MODE   torch.compile's mode; default "default"
# They are read here rather than in config/parameters.py because only the
# worker acts on them (the broker never compiles).

COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


@dataclass(frozen=True)
class CompileSettings:
    enabled: bool = False
    mode: str = "default"


def compile_settings(config: ModelConfig) -> CompileSettings:
    """TORCH_COMPILE / TORCH_COMPILE_MODE of a `ModelConfig`; a bad value fails the load."""
    parameters = config.parameters or {}
    try:
        enabled = read_boolean(config.name, "TORCH_COMPILE", parameters.get("TORCH_COMPILE", "false"))
    except ParameterError as exc:
        raise ModelLoadError(exc.message, INVALID_ARG) from None
    mode = str(parameters.get("TORCH_COMPILE_MODE", "default")).strip() or "default"
    if mode not in COMPILE_MODES:
        raise ModelLoadError(f"parameter 'TORCH_COMPILE_MODE' of model '{config.name}' is '{mode}'; "
                             f"expected one of {', '.join(COMPILE_MODES)}", INVALID_ARG)
    if "TORCH_COMPILE_MODE" in parameters and not enabled:
        logger.warning("model '%s' sets TORCH_COMPILE_MODE without TORCH_COMPILE: true; it is not "
                       "compiled", config.name)
    return CompileSettings(enabled, mode)


def apply_process_settings(settings: ExecutionSettings, default_threads: int = 0) -> None:
    """Set torch's process-wide switches for this worker's model.

    Called once per worker process, before the model is loaded: the thread
    pools in particular can only be sized before parallel work starts. A JIT
    switch left at `None` is not touched, as in Triton. A thread count the
    model does not set is `default_threads` (the daemon's share of its CPUs
    for this worker), or torch's when that is 0.
    """
    import torch

    torch._C._set_graph_executor_optimize(not settings.disable_optimized_execution)
    torch.backends.cudnn.enabled = not settings.disable_cudnn
    _set_jit_switch("_jit_set_profiling_mode", settings.jit_profiling)
    _set_jit_switch("_jit_set_profiling_executor", settings.jit_executor)
    _set_jit_switch("_jit_set_texpr_fuser_enabled", settings.tensor_fuser)
    intra = settings.intra_op_threads or default_threads
    inter = settings.inter_op_threads or default_threads
    if intra:
        torch.set_num_threads(intra)
    if inter:
        _set_interop_threads(inter)


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


def grad_context(settings: ExecutionSettings) -> ContextManager[None]:
    """The grad mode to load and run under: inference mode unless disabled.

    Inference mode is the cheaper of the two; some models need plain
    `no_grad` (tensors they create are later used in autograd-aware code).
    """
    import torch

    if settings.inference_mode:
        return torch.inference_mode()
    return torch.no_grad()


def after_execution(settings: ExecutionSettings, device: Optional[torch.device]) -> None:
    """Give cached CUDA memory back after a batch when the model asks for it."""
    if not settings.enable_cache_cleaning or device is None:
        return
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


__all__ = [
    "COMPILE_MODES", "CompileSettings", "ExecutionError", "ExecutionSettings", "ModelLoadError",
    "after_execution", "apply_process_settings", "compile_settings", "grad_context",
    "model_settings", "parse_parameters",
]
