"""Triton's rules for naming model tensors, shared by every model format.

Which argument a config input feeds and which returned value a config output
reads is decided the same way whether the model is TorchScript
(`worker/torchscript.py`), a torch.export program (`worker/exported.py`) or
an AOTInductor package (`worker/aoti.py`); only where the argument names and
the outputs come from differs. Inputs are bound by the first of three
conventions that fits: FORWARD_ARGUMENT (config names are the argument
names), NAMED_INDEX (every name is `<anything>__<digits>`),
STRICT_CONFIG_ORDERING (config order). Outputs use the last two. Error texts
are Triton's (libtorch.cc), word for word where its users look for them.
"""
from __future__ import annotations

import logging
import re
from enum import Enum
from typing import Iterable, Optional

from torchpool.config.model_config import CONFIG_TO_WIRE, ModelConfig, SequenceState, TensorSpec
from torchpool.protocol import datatypes
from torchpool.protocol.errors import INTERNAL, INVALID_ARG
from torchpool.worker.settings import ModelLoadError

logger = logging.getLogger(__name__)

_NAMED_INDEX = re.compile(r"^(.*)__([0-9]+)$", re.DOTALL)


class NamingConvention(Enum):
    """How config tensor names map to positions (libtorch.cc's enum)."""

    FORWARD_ARGUMENT = "FORWARD_ARGUMENT"
    NAMED_INDEX = "NAMED_INDEX"
    STRICT_CONFIG_ORDERING = "STRICT_CONFIG_ORDERING"


def named_index(name: str) -> Optional[int]:
    """The `<digits>` of `<anything>__<digits>`, else None."""
    match = _NAMED_INDEX.match(name)
    return int(match.group(2)) if match else None


def require_named_index(name: str, what: str) -> int:
    index = named_index(name)
    if index is None:
        raise ModelLoadError(
            f"{what} '{name}' does not follow <name>__<index> naming convention.", INTERNAL
        )
    return index


# --- conventions -----------------------------------------------------------------

def input_convention(config: ModelConfig, argument_names: list[str]) -> NamingConvention:
    """GetNamingConvention for inputs: argument names, then `__<index>`, then order."""
    if all(spec.name in argument_names for spec in config.inputs):
        return NamingConvention.FORWARD_ARGUMENT
    return _index_or_order(config.name, [s.name for s in config.inputs], "input")


def output_convention(config: ModelConfig) -> NamingConvention:
    return _index_or_order(config.name, [s.name for s in config.outputs], "output")


def _index_or_order(model_name: str, names: list[str], io_kind: str) -> NamingConvention:
    """NAMED_INDEX when every name ends in `__<digits>`, else strict ordering.

    As in Triton, a name with `__` but a non-integer suffix is worth a
    warning (the user probably meant NAMED_INDEX); a name without `__` is not.
    """
    for name in names:
        if "__" not in name:
            return NamingConvention.STRICT_CONFIG_ORDERING
        if named_index(name) is None:
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


def check_state_naming(
    model_name: str,
    inputs: Optional[NamingConvention],
    outputs: NamingConvention,
) -> None:
    """State tensors are bound by `__<index>`; strict ordering would collide."""
    if NamingConvention.STRICT_CONFIG_ORDERING in (inputs, outputs):
        raise ModelLoadError(
            f"PyTorch model '{model_name}' is using sequence batching with state but "
            "not all inputs and outputs follow the <name>__<index> naming convention.",
            INVALID_ARG,
        )


# --- what the worker feeds -------------------------------------------------------

def batch_input_targets(config: ModelConfig) -> list[str]:
    """`batch_input` target names, in config order (AddInputToMap's order)."""
    return [str(name) for entry in config.batch_inputs for name in entry.get("target_name", ())]


def control_input_names(config: ModelConfig) -> list[str]:
    """Sequence control tensors (CONTROL_SEQUENCE_START, ...), config order."""
    batching = config.sequence_batching or {}
    names = [str(entry["name"]) for entry in batching.get("control_input", ()) if entry.get("name")]
    return list(dict.fromkeys(names))


def extra_input_names(config: ModelConfig) -> list[str]:
    """Tensors the worker feeds beyond the config inputs, in argument-count order."""
    return (
        batch_input_targets(config)
        + control_input_names(config)
        + [s.input_name for s in config.sequence_states()]
    )


def check_argument_count(config: ModelConfig, provided: int) -> None:
    """One argument per config input, batch input, sequence control and state."""
    expected = len(config.inputs) + len(extra_input_names(config))
    if provided != expected:
        raise ModelLoadError(
            f"unable to load model '{config.name}', configuration expects {expected} "
            f"inputs, model provides {provided}",
            INVALID_ARG,
        )


def check_not_empty(config: ModelConfig) -> None:
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


def dict_input_index(config: ModelConfig) -> dict[str, int]:
    """For a dict input the names are the keys; positions only record order."""
    names = [spec.name for spec in config.inputs] + extra_input_names(config)
    return {name: position for position, name in enumerate(names)}


def positional_input_index(
    config: ModelConfig, argument_names: list[str], convention: NamingConvention
) -> dict[str, int]:
    """AddInputToMap for every tensor the worker feeds, then a range check."""
    index: dict[str, int] = {}
    config_names = [spec.name for spec in config.inputs]
    for position, name in enumerate(config_names + batch_input_targets(config)):
        if convention is NamingConvention.FORWARD_ARGUMENT:
            if name not in argument_names:
                raise ModelLoadError(
                    f"batch input '{name}' is not an argument of the forward method of "
                    f"model '{config.name}'",
                    INVALID_ARG,
                )
            index[name] = argument_names.index(name)
        elif convention is NamingConvention.NAMED_INDEX:
            index[name] = require_named_index(name, "input")
        else:
            index[name] = position
    # Sequence controls and states are always bound by their `__<index>`.
    for name in control_input_names(config) + [s.input_name for s in config.sequence_states()]:
        index[name] = require_named_index(name, "input")
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


# --- datatypes and shapes --------------------------------------------------------

# Config datatypes torch has but Triton's PyTorch backend cannot bind
# (ModelConfigDataTypeToTorchType): a model using one fails to load, as in
# Triton. BF16 is torchpool's addition (SEMANTICS.md: users asked for it).
NOT_BOUND_BY_TRITON = frozenset({"TYPE_UINT16", "TYPE_UINT32", "TYPE_UINT64"})


def wire_datatype(model_name: str, data_type: str, what: str, name: str) -> str:
    """The wire name of a config datatype that the model may take or return,
    else a load error (Triton's text)."""
    wire = None if data_type in NOT_BOUND_BY_TRITON else CONFIG_TO_WIRE.get(data_type)
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


def config_name_of(dtype: object) -> str:
    """A torch dtype as a config datatype (TYPE_FP32), unknown ones by their name."""
    try:
        wire = datatypes.wire_from_torch(dtype)
    except KeyError:
        wire = str(dtype).removeprefix("torch.").upper()
    return datatypes.wire_to_config(wire)


def _check_string_rank(
    config: ModelConfig, name: str, data_type: str, dims: Iterable[int], what: str
) -> None:
    """Strings travel as a TorchScript List[str]: one dimension, batch included."""
    if data_type != "TYPE_STRING":
        return
    rank = len(tuple(dims)) + (1 if config.max_batch_size > 0 else 0)
    if rank > 1:
        # Triton's words, then how to write it: one string per batch item is
        # dims [ 1 ] with reshape { shape: [ ] }; or no batching at all
        raise ModelLoadError(
            f"Triton only supports 1 dimensional List of String as {what} for '{name}' "
            f"for model '{config.name}' (with max_batch_size > 0 the batch is the list's "
            f"one dimension: give '{name}' dims: [ 1 ] and reshape: {{ shape: [ ] }}, or set "
            f"max_batch_size: 0)",
            INTERNAL,
        )


def model_dims(spec: TensorSpec) -> tuple[int, ...]:
    """The shape the model sees, without the batch dimension: `reshape` when
    given (even empty), else `dims`."""
    return spec.reshape if spec.reshape is not None else spec.dims


def check_control_types(config: ModelConfig) -> None:
    """A typed sequence control (CONTROL_SEQUENCE_CORRID) must have a datatype
    the model can take: ValidateTypedSequenceControl's check and text."""
    batching = config.sequence_batching or {}
    for entry in batching.get("control_input", ()):
        for control in entry.get("control") or ():
            if control.get("kind") != "CONTROL_SEQUENCE_CORRID":
                continue
            data_type = str(control.get("data_type", "TYPE_INVALID"))      # the proto default
            if data_type in NOT_BOUND_BY_TRITON or CONFIG_TO_WIRE.get(data_type) in (None, "BYTES"):
                raise ModelLoadError(
                    f"input '{entry.get('name')}' type '{data_type}' is not supported by PyTorch.",
                    INTERNAL,
                )


def check_input_tensors(config: ModelConfig) -> None:
    check_control_types(config)
    for spec in config.inputs:
        wire_datatype(config.name, spec.data_type, "input", spec.name)
        _check_string_rank(config, spec.name, spec.data_type, model_dims(spec), "input")
    # A TYPE_STRING state travels as one flat List[str] of the batch's
    # elements whatever its dims (Triton never checks an input state's rank),
    # so Triton's QA string-state repositories load, batched or not.
    for state in config.sequence_states():
        wire_datatype(config.name, state.data_type, "input state", state.input_name)


def output_bindings(
    config: ModelConfig, convention: NamingConvention, states: list[SequenceState],
    keys: Optional[tuple[str, ...]] = None,
) -> tuple[dict[str, int], dict[str, str]]:
    """ValidateOutputs: each config output's (and state output's) index and type.

    `keys` are the keys of a model that returns a dict: every output (and
    state output) is then the value of the key that is its name.
    """
    index: dict[str, int] = {}
    datatype: dict[str, str] = {}
    for position, spec in enumerate(config.outputs):
        datatype[spec.name] = wire_datatype(config.name, spec.data_type, "output", spec.name)
        _check_string_rank(config, spec.name, spec.data_type, model_dims(spec), "output")
        if keys is not None:
            index[spec.name] = _key_position(config.name, keys, spec.name, "output")
        elif convention is NamingConvention.NAMED_INDEX:
            index[spec.name] = named_index(spec.name)  # type: ignore[assignment]
        else:
            index[spec.name] = position
    for state in states:
        datatype[state.output_name] = wire_datatype(
            config.name, state.data_type, "state", state.output_name
        )
        if keys is not None:
            index[state.output_name] = _key_position(config.name, keys, state.output_name, "state")
        else:
            index[state.output_name] = require_named_index(state.output_name, "state")
    return index, datatype


def _key_position(model_name: str, keys: tuple[str, ...], name: str, what: str) -> int:
    if name not in keys:
        raise ModelLoadError(
            f"{what} '{name}' of model '{model_name}' is not a key of the dict the model "
            f"returns (its keys: {', '.join(repr(k) for k in keys)})",
            INVALID_ARG,
        )
    return keys.index(name)


__all__ = [
    "NamingConvention", "batch_input_targets", "check_argument_count", "check_input_tensors",
    "check_not_empty", "check_state_naming", "config_name_of", "control_input_names",
    "dict_input_index", "extra_input_names", "input_convention", "model_dims", "named_index",
    "output_bindings", "output_convention", "positional_input_index", "require_named_index",
    "wire_datatype",
]
