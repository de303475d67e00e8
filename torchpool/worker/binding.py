"""Load a TorchScript model, bind its configuration to `forward`, run it.

Triton's PyTorch backend decides at load time which `forward` argument each
configured input feeds and which returned value each configured output
reads; this module makes the same decisions (`bind`) and applies them to one
batch at a time (`Binding.run`):

    config inputs ──input_index──► forward(*args) or forward({name: tensor})
                                        │
    config outputs ◄──output_index── Tensor | List[str] | tuple of those

Inputs are bound by the first of three naming conventions that fits:
FORWARD_ARGUMENT (config names are `forward`'s argument names), NAMED_INDEX
(every name is `<anything>__<digits>`), STRICT_CONFIG_ORDERING (config order).
Outputs use the last two. A single `Dict[str, Tensor]` argument takes every
input by name instead. Error texts are Triton's, word for word where its users
look for them.
"""
from __future__ import annotations

import logging
import re
import warnings
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Sequence, Union

import torch

from torchpool.config.model_config import CONFIG_TO_WIRE, ModelConfig, SequenceState, TensorSpec
from torchpool.protocol import datatypes
from torchpool.protocol.errors import INTERNAL, INVALID_ARG, UNAVAILABLE
from torchpool.worker.settings import (
    ExecutionError,
    ExecutionSettings,
    ModelLoadError,
    grad_context,
)

logger = logging.getLogger(__name__)

Value = Union[torch.Tensor, list]   # a tensor, or a list of str for BYTES

_NAMED_INDEX = re.compile(r"^(.*)__([0-9]+)$", re.DOTALL)
_EXECUTE_FAILURE = "PyTorch execute failure: "
_JIT_LOAD_DEPRECATION = r".*torch\.jit\.load.* is deprecated"


class NamingConvention(Enum):
    """How config tensor names map to positions (libtorch.cc's enum)."""

    FORWARD_ARGUMENT = "FORWARD_ARGUMENT"
    NAMED_INDEX = "NAMED_INDEX"
    STRICT_CONFIG_ORDERING = "STRICT_CONFIG_ORDERING"


# --- loading -----------------------------------------------------------------

def load_model(
    config: ModelConfig,
    model_path: Path,
    device: Optional[torch.device],
    instance_name: str,
    settings: ExecutionSettings,
) -> tuple[torch.jit.ScriptModule, "Binding"]:
    """Load `model_path` onto `device` and bind it to `config`.

    `device` None loads without a map location (KIND_MODEL: the model places
    its own tensors). Loading runs under the model's grad mode, as Triton
    does, so that tensors created while loading are inference tensors when
    inference mode is on.
    """
    model_path = Path(model_path)
    if not model_path.is_file():
        raise ModelLoadError(
            f"unable to find '{model_path}' for model instance '{instance_name}'",
            UNAVAILABLE,
        )
    try:
        with grad_context(settings), warnings.catch_warnings():
            # TorchScript is the format this server exists for; torch's
            # deprecation notice would only repeat once per instance.
            warnings.filterwarnings("ignore", _JIT_LOAD_DEPRECATION, DeprecationWarning)
            module = torch.jit.load(str(model_path), map_location=device)
    except Exception as exc:  # torch raises RuntimeError, ValueError, pickle errors...
        raise ModelLoadError(f"failed to load model '{config.name}': {exc}", INTERNAL) from exc
    module.eval()
    return module, bind(module, config)


# --- the binding ---------------------------------------------------------------

@dataclass(frozen=True)
class Binding:
    """Where each config tensor goes in `forward`, and how to read the result.

    `input_index` maps every tensor the worker feeds (config inputs, batch
    inputs, sequence controls and states) to its position in `forward`'s
    arguments (without `self`), or for a dict input to its config position.
    `output_index` maps config outputs (and state outputs) to their position
    among the returned values; `output_datatype` gives their wire datatypes.
    """

    model_name: str
    is_dict_input: bool
    input_index: dict[str, int]
    output_index: dict[str, int]
    output_datatype: dict[str, str]
    input_convention: Optional[NamingConvention]   # None for a dict input
    output_convention: NamingConvention
    output_names: tuple[str, ...]                   # config outputs, config order
    arity: int                                      # forward's arguments, without self
    required_inputs: frozenset[str]
    return_type: Any = field(default=None, repr=False, compare=False)  # forward's, for messages

    def run(
        self,
        module: Any,
        inputs: Mapping[str, Value],
        requested: Optional[Sequence[str]] = None,
    ) -> dict[str, Value]:
        """Execute one batch and return the requested outputs.

        The caller wraps this in `grad_context` and hands CPU tensors already
        shaped as the model sees them; they are passed on without copies.
        Returned tensors are contiguous CPU tensors; string outputs stay
        `list[str]`. `requested` None means every config output.
        """
        wanted = self.output_names if requested is None else self._check_requested(requested)
        self._check_inputs(inputs)
        try:
            result = module(*self._arguments(inputs))
        except Exception as exc:
            raise ExecutionError(_EXECUTE_FAILURE + str(exc), INTERNAL) from exc
        values = self._unpack(result)
        self._check_outputs(values)
        return {name: _to_host(values[self.output_index[name]]) for name in wanted}

    # -- inputs --

    def _check_requested(self, requested: Sequence[str]) -> Sequence[str]:
        for name in requested:
            if name not in self.output_index:
                raise ExecutionError(
                    f"unexpected inference output '{name}' for model '{self.model_name}'",
                    INVALID_ARG,
                )
        return requested

    def _check_inputs(self, inputs: Mapping[str, Value]) -> None:
        """Every given input must be bound, every required one given."""
        names = inputs.keys()
        unexpected = names - self.input_index.keys()
        if unexpected:
            raise ExecutionError(
                f"unexpected inference input '{sorted(unexpected)[0]}' for model "
                f"'{self.model_name}'",
                INVALID_ARG,
            )
        if not names >= self.required_inputs:
            missing = sorted(self.required_inputs - names)
            raise ExecutionError(
                f"expected {len(self.required_inputs)} inputs but got {len(inputs)} inputs "
                f"for model '{self.model_name}'. Got input(s) {sorted(names)}, but missing "
                f"required input(s) {missing}. Please provide all required input(s).",
                INVALID_ARG,
            )

    def _arguments(self, inputs: Mapping[str, Value]) -> list[Any]:
        """`forward`'s arguments: positions from `input_index`, or one dict.

        A position with no input is None: only an Optional argument can be
        left out (`_check_inputs` has made sure of that).
        """
        if self.is_dict_input:
            return [dict(inputs)]
        args: list[Any] = [None] * self.arity
        for name, value in inputs.items():
            args[self.input_index[name]] = value
        return args

    # -- outputs --

    def _unpack(self, result: Any) -> list[Value]:
        """The model's return value as a list of Tensors and string lists."""
        if isinstance(result, torch.Tensor):
            return [result]
        if isinstance(result, tuple):
            return [self._tuple_element(i, value) for i, value in enumerate(result)]
        if isinstance(result, list):
            element = _list_element_name(result, _static_list_element(self.return_type))
            if element != "str":
                raise ExecutionError(
                    f"{_EXECUTE_FAILURE}output must be of type Tensor or List[str], "
                    f"received List[{element}]",
                    INTERNAL,
                )
            return [result]
        raise ExecutionError(
            f"{_EXECUTE_FAILURE}output must be of type Tensor, List[str] or Tuple "
            "containing one of these two types. It should not be a List / Dictionary "
            "of Tensors or a Scalar",
            INTERNAL,
        )

    def _tuple_element(self, index: int, value: Any) -> Value:
        if isinstance(value, torch.Tensor):
            return value
        if isinstance(value, list):
            static = _static_tuple_element(self.return_type, index)
            element = _list_element_name(value, _static_list_element(static))
            if element == "str":
                return value
            received = f"List[{element}]"
        else:
            received = _python_type_name(value)
        raise ExecutionError(
            f"{_EXECUTE_FAILURE}output at index {index} must be of type Tensor or "
            f"List[str], received {received}",
            INTERNAL,
        )

    def _check_outputs(self, values: list[Value]) -> None:
        """Triton's checks on every bound output: index, datatype, not a scalar."""
        for name, index in self.output_index.items():
            if index >= len(values):
                raise ExecutionError(
                    f"The output {name} in the model configuration refers to an output "
                    f"index which doesn't exist. This model has {len(values)} outputs",
                    INVALID_ARG,
                )
        for name, index in self.output_index.items():
            self._check_output(name, values[index])

    def _check_output(self, name: str, value: Value) -> None:
        expected = self.output_datatype[name]
        provided = _wire_name(value)
        if provided != expected:
            raise ExecutionError(
                f"configuration expects datatype {datatypes.wire_to_config(expected)} for "
                f"output '{name}', model provides {datatypes.wire_to_config(provided)}",
                INVALID_ARG,
            )
        if isinstance(value, torch.Tensor) and value.dim() == 0:
            raise ExecutionError(
                f"output '{name}' is a scalar which is not supported.", INVALID_ARG
            )


def _to_host(value: Value) -> Value:
    """Outputs leave as contiguous CPU tensors (no copy when already so)."""
    if isinstance(value, torch.Tensor):
        value = value.contiguous()
        return value if value.is_cpu else value.cpu()
    return value


def _wire_name(value: Value) -> str:
    """The wire datatype of an output value; unknown torch dtypes by their name."""
    if isinstance(value, list):
        return "BYTES"
    try:
        return datatypes.wire_from_torch(value.dtype)
    except KeyError:
        return str(value.dtype).removeprefix("torch.").upper()


def _static_list_element(type_: Any) -> Optional[str]:
    """`str` for a TorchScript `List[str]` type, the element's name for any list."""
    if type_ is not None and type_.kind() == "ListType":
        return str(type_.getElementType())
    return None


def _static_tuple_element(type_: Any, index: int) -> Any:
    if type_ is not None and type_.kind() == "TupleType":
        elements = type_.elements()
        if index < len(elements):
            return elements[index]
    return None


def _list_element_name(values: list, static: Optional[str]) -> str:
    """The element type of a returned list, from the schema when it says.

    The schema is exact (and knows the type of an empty list); a module whose
    schema does not say is judged by its elements.
    """
    if static is not None:
        return static
    if all(isinstance(v, str) for v in values):
        return "str"
    return _python_type_name(next(v for v in values if not isinstance(v, str)))


def _python_type_name(value: Any) -> str:
    """TorchScript's name for a value's type, for error messages."""
    if isinstance(value, torch.Tensor):
        return "Tensor"
    if isinstance(value, list):
        return "List"
    if isinstance(value, dict):
        return "Dict"
    return type(value).__name__


# --- bind ----------------------------------------------------------------------

@dataclass(frozen=True)
class _ForwardArgument:
    name: str
    type: Any           # torch._C.JitType

    @property
    def kind(self) -> str:
        return self.type.kind()

    @property
    def optional(self) -> bool:
        return self.kind == "OptionalType"


def bind(module: Any, config: ModelConfig) -> Binding:
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
        _check_argument_count(config, len(arguments))
    _check_not_empty(config)
    states = config.sequence_states()
    if is_dict_input:
        input_convention = None
        input_index = _dict_input_index(config)
    else:
        argument_names = [a.name for a in arguments]
        input_convention = _input_convention(config, argument_names)
        input_index = _positional_input_index(config, argument_names, input_convention)
    _check_input_tensors(config)
    output_convention = _output_convention(config)
    if states:
        _check_state_naming(config.name, input_convention, output_convention)
    output_index, output_datatype = _output_bindings(config, output_convention, states)
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


def _forward_signature(module: Any, model_name: str) -> tuple[list[_ForwardArgument], Any]:
    """`forward`'s arguments without `self`, and its return type."""
    try:
        schema = module.forward.schema
    except AttributeError:
        try:
            schema = module._c._get_method("forward").schema
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


def _check_argument_count(config: ModelConfig, provided: int) -> None:
    """One argument per config input, batch input, sequence control and state."""
    expected = len(config.inputs) + len(_extra_input_names(config))
    if provided != expected:
        raise ModelLoadError(
            f"unable to load model '{config.name}', configuration expects {expected} "
            f"inputs, model provides {provided}",
            INVALID_ARG,
        )


def _check_not_empty(config: ModelConfig) -> None:
    if not config.inputs:
        raise ModelLoadError(
            "model configuration must contain at least one input, none were specified.",
            INTERNAL,
        )
    if not config.outputs:
        raise ModelLoadError(
            "model configuration must contain at least one output, none were specified.",
            INTERNAL,
        )


def _check_state_naming(
    model_name: str,
    input_convention: Optional[NamingConvention],
    output_convention: NamingConvention,
) -> None:
    """State tensors are bound by `__<index>`; strict ordering would collide."""
    if NamingConvention.STRICT_CONFIG_ORDERING in (input_convention, output_convention):
        raise ModelLoadError(
            f"PyTorch model '{model_name}' is using sequence batching with state but "
            "not all inputs and outputs follow the <name>__<index> naming convention.",
            INVALID_ARG,
        )


def _is_string_list(type_: Any) -> bool:
    return type_.kind() == "ListType" and type_.getElementType().kind() == "StringType"


def _is_tensor_dict(type_: Any) -> bool:
    return (
        type_.kind() == "DictType"
        and type_.getKeyType().kind() == "StringType"
        and type_.getValueType().kind() == "TensorType"
    )


def _is_accepted_argument(type_: Any) -> bool:
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


def _named_index(name: str) -> Optional[int]:
    """The `<digits>` of `<anything>__<digits>`, else None."""
    match = _NAMED_INDEX.match(name)
    return int(match.group(2)) if match else None


def _input_convention(config: ModelConfig, argument_names: list[str]) -> NamingConvention:
    """GetNamingConvention for inputs: argument names, then `__<index>`, then order."""
    if all(spec.name in argument_names for spec in config.inputs):
        return NamingConvention.FORWARD_ARGUMENT
    return _index_or_order(config.name, [s.name for s in config.inputs], "input")


def _output_convention(config: ModelConfig) -> NamingConvention:
    return _index_or_order(config.name, [s.name for s in config.outputs], "output")


def _index_or_order(model_name: str, names: list[str], io_kind: str) -> NamingConvention:
    """NAMED_INDEX when every name ends in `__<digits>`, else strict ordering.

    As in Triton, a name with `__` but a non-integer suffix is worth a
    warning (the user probably meant NAMED_INDEX); a name without `__` is not.
    """
    for name in names:
        if "__" not in name:
            return NamingConvention.STRICT_CONFIG_ORDERING
        if _named_index(name) is None:
            logger.warning(_fallback_warning(model_name, name, io_kind))
            return NamingConvention.STRICT_CONFIG_ORDERING
    return NamingConvention.NAMED_INDEX


def _fallback_warning(model_name: str, name: str, io_kind: str) -> str:
    if io_kind == "input":
        return (
            f"input '{name}' or previous input(s) are neither an input argument to the "
            f"model '{model_name}' nor do they follow the <name>__<index> naming "
            "convention. Falling back to enforcing strict ordering from model "
            "configuration."
        )
    return (
        f"output '{name}' or previous output(s) of the model '{model_name}' do not "
        "follow the <name>__<index> naming convention. Falling back to enforcing strict "
        "ordering from model configuration."
    )


def _batch_input_targets(config: ModelConfig) -> list[str]:
    """`batch_input` target names, in config order (AddInputToMap's order)."""
    return [str(name) for entry in config.batch_inputs for name in entry.get("target_name", ())]


def _control_input_names(config: ModelConfig) -> list[str]:
    """Sequence control tensors (CONTROL_SEQUENCE_START, ...), config order."""
    batching = config.sequence_batching or {}
    names = [str(entry["name"]) for entry in batching.get("control_input", ()) if entry.get("name")]
    return list(dict.fromkeys(names))


def _extra_input_names(config: ModelConfig) -> list[str]:
    """Tensors the worker feeds beyond the config inputs, in argument-count order."""
    return (
        _batch_input_targets(config)
        + _control_input_names(config)
        + [s.input_name for s in config.sequence_states()]
    )


def _require_named_index(name: str, what: str) -> int:
    index = _named_index(name)
    if index is None:
        raise ModelLoadError(
            f"{what} '{name}' does not follow <name>__<index> naming convention.", INTERNAL
        )
    return index


def _dict_input_index(config: ModelConfig) -> dict[str, int]:
    """For a dict input the names are the keys; positions only record order."""
    names = [spec.name for spec in config.inputs] + _extra_input_names(config)
    return {name: position for position, name in enumerate(names)}


def _positional_input_index(
    config: ModelConfig, argument_names: list[str], convention: NamingConvention
) -> dict[str, int]:
    """AddInputToMap for every tensor the worker feeds, then a range check."""
    index: dict[str, int] = {}
    config_names = [spec.name for spec in config.inputs]
    batch_targets = _batch_input_targets(config)
    for position, name in enumerate(config_names + batch_targets):
        if convention is NamingConvention.FORWARD_ARGUMENT:
            if name not in argument_names:
                raise ModelLoadError(
                    f"batch input '{name}' is not an argument of the forward method of "
                    f"model '{config.name}'",
                    INVALID_ARG,
                )
            index[name] = argument_names.index(name)
        elif convention is NamingConvention.NAMED_INDEX:
            index[name] = _require_named_index(name, "input")
        else:
            index[name] = position
    # Sequence controls and states are always bound by their `__<index>`.
    for name in _control_input_names(config) + [s.input_name for s in config.sequence_states()]:
        index[name] = _require_named_index(name, "input")
    _check_positions(config.name, index, len(argument_names))
    return index


def _check_positions(model_name: str, index: dict[str, int], arity: int) -> None:
    """Each argument fed exactly once: Triton would fail (or crash) at execution."""
    taken: dict[int, str] = {}
    for name, position in index.items():
        if position >= arity:
            raise ModelLoadError(
                f"input '{name}' of model '{model_name}' refers to argument index "
                f"{position}, but forward takes {arity} arguments",
                INVALID_ARG,
            )
        if position in taken:
            raise ModelLoadError(
                f"inputs '{taken[position]}' and '{name}' of model '{model_name}' both "
                f"refer to argument index {position}",
                INVALID_ARG,
            )
        taken[position] = name


def _wire_datatype(model_name: str, data_type: str, what: str, name: str) -> str:
    """The wire name of a config datatype that torch can carry, else a load error."""
    wire = CONFIG_TO_WIRE.get(data_type)
    if wire is not None and wire != "BYTES":
        try:
            datatypes.torch_dtype(wire)
        except (KeyError, AttributeError):
            wire = None
    if wire is None:
        raise ModelLoadError(
            f"unsupported datatype {data_type} for {what} '{name}' for model '{model_name}'",
            INTERNAL,
        )
    return wire


def _check_string_rank(
    config: ModelConfig, name: str, data_type: str, dims: Iterable[int], what: str
) -> None:
    """Strings travel as a TorchScript List[str]: one dimension, batch included."""
    if data_type != "TYPE_STRING":
        return
    rank = len(tuple(dims)) + (1 if config.max_batch_size > 0 else 0)
    if rank > 1:
        raise ModelLoadError(
            f"Triton only supports 1 dimensional List of String as {what} for '{name}' "
            f"for model '{config.name}'",
            INTERNAL,
        )


def _model_dims(spec: TensorSpec) -> tuple[int, ...]:
    """The shape the model sees: `reshape` when given (even empty), else `dims`."""
    return spec.reshape if spec.reshape is not None else spec.dims


def _check_input_tensors(config: ModelConfig) -> None:
    for spec in config.inputs:
        _wire_datatype(config.name, spec.data_type, "input", spec.name)
        _check_string_rank(config, spec.name, spec.data_type, _model_dims(spec), "input")
    # A TYPE_STRING state travels as one flat List[str] of the batch's
    # elements whatever its dims (Triton never checks an input state's rank),
    # so Triton's QA string-state repositories load, batched or not.
    for state in config.sequence_states():
        _wire_datatype(config.name, state.data_type, "input state", state.input_name)


def _output_bindings(
    config: ModelConfig, convention: NamingConvention, states: list[SequenceState]
) -> tuple[dict[str, int], dict[str, str]]:
    """ValidateOutputs: each config output's (and state output's) index and type."""
    index: dict[str, int] = {}
    datatype: dict[str, str] = {}
    for position, spec in enumerate(config.outputs):
        datatype[spec.name] = _wire_datatype(config.name, spec.data_type, "output", spec.name)
        _check_string_rank(config, spec.name, spec.data_type, _model_dims(spec), "output")
        if convention is NamingConvention.NAMED_INDEX:
            index[spec.name] = _named_index(spec.name)  # type: ignore[assignment]
        else:
            index[spec.name] = position
    for state in states:
        datatype[state.output_name] = _wire_datatype(
            config.name, state.data_type, "state", state.output_name
        )
        index[state.output_name] = _require_named_index(state.output_name, "state")
    return index, datatype


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


__all__ = [
    "Binding", "ExecutionError", "ModelLoadError", "NamingConvention", "bind", "load_model",
]
