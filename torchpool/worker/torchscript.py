"""TorchScript models: load `model.pt` and bind its `forward` schema to the config.

Triton's PyTorch backend decides at load time which `forward` argument each
configured input feeds and which returned value each configured output
reads; `bind` makes the same decisions from the TorchScript schema, with the
naming rules of `worker/naming.py`. A single `Dict[str, Tensor]` argument
takes every input by name instead.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional, cast

import torch

from torchpool.config.model_config import ModelConfig
from torchpool.protocol.errors import INTERNAL, INVALID_ARG
from torchpool.worker import naming
from torchpool.worker.binding import Binding
from torchpool.worker.settings import ExecutionSettings, ModelLoadError, grad_context

if TYPE_CHECKING:
    from torch._C import DictType, FunctionSchema, JitType, ScriptMethod, ScriptModule

_JIT_LOAD_DEPRECATION = r".*torch\.jit\.load.* is deprecated"


def load_torchscript(
    config: ModelConfig,
    model_path: Path,
    device: Optional[torch.device],
    settings: ExecutionSettings,
) -> tuple[torch.jit.ScriptModule, Binding]:
    """Load a TorchScript file onto `device` and bind it to `config`.

    `device` None loads without a map location (KIND_MODEL: the model places
    its own tensors). Loading runs under the model's grad mode, as Triton
    does, so that tensors created while loading are inference tensors when
    inference mode is on.
    """
    try:
        with grad_context(settings), warnings.catch_warnings():
            # TorchScript is a format this server exists for; torch's
            # deprecation notice would only repeat once per instance.
            warnings.filterwarnings("ignore", _JIT_LOAD_DEPRECATION, DeprecationWarning)
            module = torch.jit.load(str(model_path), map_location=device)
    except Exception as exc:  # torch raises RuntimeError, ValueError, pickle errors...
        raise ModelLoadError(f"failed to load model '{config.name}': {exc}", INTERNAL) from exc
    module.eval()
    return module, bind(module, config)


@dataclass(frozen=True)
class _ForwardArgument:
    name: str
    type: JitType

    @property
    def kind(self) -> str:
        return self.type.kind()

    @property
    def optional(self) -> bool:
        return self.kind == "OptionalType"


def bind(module: torch.nn.Module, config: ModelConfig) -> Binding:
    """Validate `config` against `module.forward` and decide the binding.

    Raises ModelLoadError with Triton's texts when they do not fit. The
    checks mirror libtorch.cc's ValidateInputs / ValidateOutputs, with these
    differences: argument counts and positions are checked even where Triton
    would only fail (or crash) at execution; `Optional[Tensor]` arguments are
    accepted (None is passed when the input is left out); names are matched
    against `<anything>__<digits>` with the last `__`; sequence state needs
    only that neither inputs nor outputs fall back to strict ordering.
    """
    arguments, return_type = _forward_signature(module, config.name)
    is_dict_input = _check_argument_types(arguments)
    if not is_dict_input:
        naming.check_argument_count(config, len(arguments))
    naming.check_not_empty(config)
    states = config.sequence_states()
    if is_dict_input:
        input_convention = None
        input_index = naming.dict_input_index(config)
    else:
        argument_names = [a.name for a in arguments]
        input_convention = naming.input_convention(config, argument_names)
        input_index = naming.positional_input_index(config, argument_names, input_convention)
    naming.check_input_tensors(config)
    output_convention = naming.output_convention(config)
    if states:
        naming.check_state_naming(config.name, input_convention, output_convention)
    output_index, output_datatype = naming.output_bindings(config, output_convention, states)
    return Binding(
        model_name=config.name,
        is_dict_input=is_dict_input,
        input_index=input_index,
        output_index=output_index,
        output_datatype=output_datatype,
        input_convention=input_convention,
        output_convention=output_convention,
        output_names=tuple(o.name for o in config.outputs),
        arity=len(arguments),
        required_inputs=_required_inputs(config, arguments, input_index, is_dict_input),
        return_type=return_type,
    )


def _forward_signature(module: torch.nn.Module, model_name: str
                       ) -> tuple[list[_ForwardArgument], Optional[JitType]]:
    """`forward`'s arguments without `self`, and its return type."""
    schema: FunctionSchema
    try:        # a ScriptModule's forward is a ScriptMethod; an eager module's has no schema
        schema = cast("ScriptMethod[..., object]", module.forward).schema
    except AttributeError:
        try:
            schema = cast("ScriptModule", module._c)._get_method("forward").schema
        except Exception:
            raise ModelLoadError(
                f"model '{model_name}' is not a TorchScript module with a 'forward' method",
                INVALID_ARG,
            ) from None
    arguments = [_ForwardArgument(a.name, a.type) for a in schema.arguments]
    if arguments and arguments[0].kind == "ClassType":
        arguments = arguments[1:]
    return_type = schema.returns[0].type if len(schema.returns) == 1 else None
    return arguments, return_type


def _is_string_list(type_: JitType) -> bool:
    return type_.kind() == "ListType" and type_.getElementType().kind() == "StringType"


def _is_tensor_dict(type_: JitType) -> bool:
    return (
        type_.kind() == "DictType"
        and cast("DictType", type_).getKeyType().kind() == "StringType"
        and cast("DictType", type_).getValueType().kind() == "TensorType"
    )


def _is_accepted_argument(type_: JitType) -> bool:
    """Tensor, List[str] or Optional[Tensor]: what a worker can hand over."""
    kind = type_.kind()
    if kind == "OptionalType":
        return type_.getElementType().kind() == "TensorType"
    return kind == "TensorType" or _is_string_list(type_)


def _check_argument_types(arguments: list[_ForwardArgument]) -> bool:
    """Validate argument types; True when forward takes a single tensor dict."""
    if len(arguments) == 1 and arguments[0].kind == "DictType":
        if _is_tensor_dict(arguments[0].type):
            return True
    elif any(a.kind == "DictType" for a in arguments):
        raise ModelLoadError(
            "Multiple inputs of kind DictType were detected. Only a single input of "
            "type Dict(str, Tensor) is supported.",
            INTERNAL,
        )
    for argument in arguments:
        if not _is_accepted_argument(argument.type):
            raise ModelLoadError(
                f"An input of type '{argument.type}' was detected in the model. Only a "
                "single input of type Dict(str, Tensor) or input(s) of type Tensor are "
                "supported.",
                INTERNAL,
            )
    return False


def _required_inputs(
    config: ModelConfig,
    arguments: list[_ForwardArgument],
    input_index: dict[str, int],
    is_dict_input: bool,
) -> frozenset[str]:
    """Inputs a batch must carry.

    Positional: all but those feeding an Optional argument (None goes in
    their place). Dict: all but config inputs marked `optional` (their key is
    then absent from the dict).
    """
    if is_dict_input:
        optional = {spec.name for spec in config.inputs if spec.optional}
        return frozenset(name for name in input_index if name not in optional)
    return frozenset(
        name for name, position in input_index.items() if not arguments[position].optional
    )


__all__ = ["bind", "load_torchscript"]
