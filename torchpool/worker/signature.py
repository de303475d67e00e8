"""The call signature of a PyTorch 2 program, and its binding to the config.

torch.export programs and AOTInductor packages both describe how they are
called with two pytree specs: `in_spec` = (args, kwargs) and `out_spec`.
Torchpool feeds what Triton's rules allow — positional tensor arguments,
keyword tensor arguments, or one `Dict[str, Tensor]` argument — and reads a
tensor, or a tuple, list or dict of tensors:

    in_spec  (tuple: (args: (t, t, ...) | ({k: t, ...},), kwargs: {k: t, ...}))
    out_spec t | (t, ...) | [t, ...] | {k: t, ...}

`ProgramSignature` is that description (with the argument names where the
format keeps them: an ExportedProgram does, an AOTInductor package only
knows keyword and dict keys). `bind_program` applies Triton's naming rules
(`worker/naming.py`) to it; outputs of a dict bind by key.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from torchpool.config.model_config import ModelConfig
from torchpool.protocol.errors import INVALID_ARG
from torchpool.worker import naming
from torchpool.worker.binding import Binding
from torchpool.worker.settings import ModelLoadError

if TYPE_CHECKING:
    from torch.utils._pytree import TreeSpec


@dataclass(frozen=True)
class ProgramSignature:
    """How a program is called, flattened.

    `names` has one entry per tensor the program takes, in its flat order
    (positional arguments, then keyword arguments; for a dict argument its
    keys); a positional argument whose name the format does not keep is "".
    `keywords` are the trailing names passed by keyword. `output_keys` are
    the keys of a returned dict (None otherwise); `output_count` the number
    of returned tensors.
    """

    names: tuple[str, ...]
    keywords: tuple[str, ...]
    dict_argument: bool
    output_keys: Optional[tuple[str, ...]]
    output_count: int


def _is_leaf(spec: TreeSpec) -> bool:
    return spec.is_leaf()


def _type_name(spec: TreeSpec) -> str:
    return getattr(spec.type, "__name__", str(spec.type))


def read_signature(model_name: str, in_spec: TreeSpec, out_spec: TreeSpec,
                   positional_names: Optional[list[str]] = None,
                   what: str = "the exported program") -> ProgramSignature:
    """The signature of a program from its specs; a structure torchpool cannot
    feed or read fails the load, naming what it found."""
    if in_spec.type is not tuple or in_spec.num_children != 2:
        raise _unsupported(model_name, what, f"takes inputs shaped {in_spec}")
    args, kwargs = in_spec.children()
    children = list(args.children())
    dict_argument = len(children) == 1 and children[0].type is dict
    if dict_argument:
        keys = tuple(str(k) for k in children[0].context)
        for key, child in zip(keys, children[0].children()):
            if not _is_leaf(child):
                raise _unsupported(model_name, what, f"takes a dict whose '{key}' is a "
                                                     f"{_type_name(child)}, not a tensor")
        names: list[str] = list(keys)
    else:
        given = list(positional_names or [])
        names = []
        for position, child in enumerate(children):
            name = given[position] if position < len(given) else ""
            if not _is_leaf(child):
                label = f"argument '{name}'" if name else f"argument {position}"
                raise _unsupported(model_name, what, f"takes a {_type_name(child)} as its {label}; "
                                   f"torchpool passes tensors, or one Dict[str, Tensor]")
            names.append(name)
    keywords = tuple(str(k) for k in (kwargs.context or ()))
    for key, child in zip(keywords, kwargs.children()):
        if not _is_leaf(child):
            raise _unsupported(model_name, what, f"takes a {_type_name(child)} as its keyword "
                               f"argument '{key}'; torchpool passes tensors")
    output_keys, output_count = _read_outputs(model_name, out_spec, what)
    return ProgramSignature(tuple(names) + keywords, keywords, dict_argument, output_keys, output_count)


def _read_outputs(model_name: str, out_spec: TreeSpec, what: str) -> tuple[Optional[tuple[str, ...]], int]:
    if _is_leaf(out_spec):
        return None, 1
    if out_spec.type not in (tuple, list, dict) or not all(
            _is_leaf(child) for child in out_spec.children()):
        raise _unsupported(model_name, what, f"returns {out_spec}; torchpool reads a tensor, or a "
                           f"tuple, list or dict of tensors")
    keys = tuple(str(k) for k in out_spec.context) if out_spec.type is dict else None
    return keys, out_spec.num_children


def _unsupported(model_name: str, what: str, why: str) -> ModelLoadError:
    return ModelLoadError(f"failed to load model '{model_name}': {what} {why}", INVALID_ARG)


def bind_program(config: ModelConfig, signature: ProgramSignature) -> Binding:
    """Triton's binding rules over a program's signature, for a runner that
    takes the flat list of input tensors and returns the flat outputs.

    Positions are those of the flat list: a dict argument's keys and keyword
    arguments are names of positions, so config inputs bind to them by name
    (FORWARD_ARGUMENT); the outputs of a dict bind by key. A program has no
    optional arguments: every input must be fed, and a dict argument's keys
    are fixed at export, so the config must name them all.
    """
    naming.check_not_empty(config)
    naming.check_input_tensors(config)
    _check_no_strings(config)
    names = list(signature.names)
    states = config.sequence_states()
    if signature.dict_argument:
        _check_dict_keys(config, names)
    naming.check_argument_count(config, len(names))
    input_convention = naming.input_convention(config, names)
    input_index = naming.positional_input_index(config, names, input_convention)
    output_convention = naming.output_convention(config)
    if states:
        naming.check_state_naming(config.name, input_convention, output_convention)
    output_index, output_datatype = naming.output_bindings(
        config, output_convention, states, keys=signature.output_keys)
    for name, index in output_index.items():
        if index >= signature.output_count:
            raise ModelLoadError(
                f"The output {name} in the model configuration refers to an output index which "
                f"doesn't exist. This model has {signature.output_count} outputs", INVALID_ARG)
    return Binding(
        model_name=config.name,
        is_dict_input=False,
        input_index=input_index,
        output_index=output_index,
        output_datatype=output_datatype,
        input_convention=input_convention,
        output_convention=output_convention,
        output_names=tuple(o.name for o in config.outputs),
        arity=len(names),
        required_inputs=frozenset(input_index),
        flat_outputs=True,
    )


def _check_dict_keys(config: ModelConfig, keys: list[str]) -> None:
    """A dict argument's keys are fixed at export: the config must name them all."""
    index = naming.dict_input_index(config)
    unknown = sorted(set(index) - set(keys))
    if unknown:
        raise ModelLoadError(f"failed to load model '{config.name}': input '{unknown[0]}' is not a "
                             f"key of the dict the program takes (its keys: {keys})", INVALID_ARG)
    missing = [k for k in keys if k not in index]
    if missing:
        raise ModelLoadError(f"failed to load model '{config.name}': the program's dict argument "
                             f"has key '{missing[0]}', which the configuration has no input for",
                             INVALID_ARG)


def _check_no_strings(config: ModelConfig) -> None:
    for spec in list(config.inputs) + list(config.outputs):
        if spec.data_type == "TYPE_STRING":
            raise ModelLoadError(f"failed to load model '{config.name}': '{spec.name}' is "
                                 f"TYPE_STRING, but PyTorch 2 programs take and return tensors "
                                 f"only (serve string models as TorchScript)", INVALID_ARG)


__all__ = ["ProgramSignature", "bind_program", "read_signature"]
