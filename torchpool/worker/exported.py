"""torch.export programs: `model.pt2` written by `torch.export.save`.

The program is loaded with `torch.export.load` and run by `ProgramRunner`:
its graph called with the flat list of tensors, weights first. (`.module()`
wraps the same graph in pytree flattening, Python guards and a shape-check
hook that cost about 100 us a call here, ten times the graph's own cost for
a small model; the broker and `ShapeRules` already make those checks.) A
program the runner does not handle (effect tokens, inputs it mutates) runs
through `.module()` with a flat-argument adapter. Everything the
binding needs is in the program itself: argument names (for Triton's
FORWARD_ARGUMENT rule), the input and output structure (`call_spec`), the
dtype and shape of every input and output (its placeholders' fake tensors)
and the range of every dynamic dimension (`range_constraints`). So, beyond
TorchScript's checks, a config that disagrees with the program on a dtype or
a dimension fails to load here, and an open (`-1`) dimension is checked
against the program's range before each batch runs (`worker/shapes.py`).
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Mapping, Optional, Sequence, cast

import torch

from torchpool.config.model_config import ModelConfig
from torchpool.protocol.errors import INTERNAL, INVALID_ARG
from torchpool.worker import naming
from torchpool.worker.binding import Binding
from torchpool.worker.settings import ExecutionSettings, ModelLoadError, grad_context
from torchpool.worker.shapes import ShapeRules, dims_of
from torchpool.worker.signature import ProgramSignature, bind_program, read_signature

if TYPE_CHECKING:
    from torch.export import ExportedProgram
    from torch.utils._pytree import TreeSpec

WHAT = "the exported program"


def load_exported(
    config: ModelConfig,
    model_path: Path,
    device: Optional[torch.device],
    settings: ExecutionSettings,
) -> tuple[torch.nn.Module, Binding]:
    """Load an ExportedProgram onto `device` (None: where it was exported) and
    bind it to `config`. Returns the runnable module and the binding."""
    try:
        with grad_context(settings):
            program = torch.export.load(str(model_path))
    except Exception as exc:
        raise ModelLoadError(f"failed to load model '{config.name}': torch.export.load could not "
                             f"read '{model_path.name}': {exc}", INTERNAL) from exc
    binding = bind_exported(config, program)
    try:
        with grad_context(settings):
            if device is not None and device.type != "cpu":
                from torch.export.passes import move_to_device_pass

                program = move_to_device_pass(program, device)
            runner = ProgramRunner.of(program)
    except Exception as exc:
        raise ModelLoadError(f"failed to load model '{config.name}': {WHAT} could not be "
                             f"prepared to run on {device or 'its device'}: {exc}", INTERNAL) from exc
    # no .eval(): the program was captured in one mode (torch.export traces in
    # the mode the module was in); its graph has no train/eval switch
    return runner, binding


class ProgramRunner(torch.nn.Module):
    """Runs a program's graph on the flat list of user inputs; returns the flat
    user outputs. Its weights are this module's parameters and buffers (one
    tensor object each, shared with the argument list), so ENABLE_WEIGHT_SHARING
    and torch.compile see them as a module's weights."""

    def __init__(self, program: ExportedProgram) -> None:
        super().__init__()
        from torch.export.graph_signature import InputKind, OutputKind

        self.graph_module = program.graph_module
        self.state = torch.nn.Module()
        lifted: list[torch.Tensor] = []
        for position, spec in enumerate(program.graph_signature.input_specs):
            if spec.kind == InputKind.USER_INPUT:
                continue
            if spec.kind == InputKind.PARAMETER:
                parameter = torch.nn.Parameter(program.state_dict[spec.target], requires_grad=False)
                self.state.register_parameter(f"p{position}", parameter)
                value: torch.Tensor = parameter
            elif spec.kind == InputKind.BUFFER and spec.persistent:
                value = program.state_dict[spec.target]
                self.state.register_buffer(f"b{position}", value)
            elif spec.kind in (InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
                value = program.constants[spec.target]
                self.state.register_buffer(f"c{position}", value, persistent=False)
            else:
                raise _NotFlat(spec.kind)
            lifted.append(value)
        kinds = [spec.kind for spec in program.graph_signature.input_specs]
        if any(k == InputKind.USER_INPUT for k in kinds[:len(lifted)]):
            raise _NotFlat("user inputs before weights")
        self.lifted = lifted
        buffers = dict(zip((s.target for s in program.graph_signature.input_specs
                            if s.kind != InputKind.USER_INPUT), lifted))
        outputs = program.graph_signature.output_specs
        self.mutated = [buffers[s.target] for s in outputs if s.kind == OutputKind.BUFFER_MUTATION]
        if any(s.kind not in (OutputKind.USER_OUTPUT, OutputKind.BUFFER_MUTATION) for s in outputs) \
                or outputs[:len(self.mutated)] != [s for s in outputs if s.kind == OutputKind.BUFFER_MUTATION]:
            raise _NotFlat("outputs other than user outputs and buffer mutations")

    @classmethod
    def of(cls, program: ExportedProgram) -> torch.nn.Module:
        try:
            return cls(program)
        except _NotFlat:
            return _FlatModule(program.module(), program.call_spec.in_spec)

    def forward(self, *inputs: torch.Tensor) -> Sequence[torch.Tensor]:
        outputs = self.graph_module(*self.lifted, *inputs)
        if not self.mutated:
            return outputs
        for buffer, value in zip(self.mutated, outputs):
            buffer.copy_(value)           # the program's new state (a counter, running stats)
        return outputs[len(self.mutated):]


class _NotFlat(Exception):
    """A program ProgramRunner does not run; `.module()` does."""


class _FlatModule(torch.nn.Module):
    """`.module()` called with the flat list of inputs, returning flat outputs."""

    def __init__(self, module: torch.nn.Module, in_spec: TreeSpec) -> None:
        super().__init__()
        self.module = module
        self.in_spec = in_spec

    def forward(self, *inputs: torch.Tensor) -> list[torch.Tensor]:
        from torch.utils import _pytree as pytree

        args, kwargs = pytree.tree_unflatten(list(inputs), self.in_spec)
        return pytree.tree_leaves(self.module(*args, **kwargs))


def bind_exported(config: ModelConfig, program: ExportedProgram) -> Binding:
    """The binding of `program` to `config`, with its dtypes and shapes checked."""
    call_spec = program.call_spec
    signature = read_signature(config.name, call_spec.in_spec, call_spec.out_spec,
                               _forward_arg_names(program), WHAT)
    binding = bind_program(config, signature)
    inputs = _user_inputs(program)
    if len(inputs) != len(signature.names):
        raise ModelLoadError(f"failed to load model '{config.name}': {WHAT} declares "
                             f"{len(signature.names)} inputs but its graph takes {len(inputs)}",
                             INVALID_ARG)
    fakes = {name: inputs[position] for name, position in binding.input_index.items()}
    _check_input_dtypes(config, fakes)
    _check_output_dtypes(config, binding, signature, _user_outputs(program))
    # (fake tensors: a config input that is none failed the dtype check above)
    shapes = ShapeRules(config.name, {name: dims_of(cast(torch.Tensor, fake), program.range_constraints)
                                      for name, fake in fakes.items()}, WHAT)
    shapes.check_config(config)
    return replace(binding, shapes=shapes)


def _forward_arg_names(program: ExportedProgram) -> list[str]:
    """`forward`'s argument names, as recorded at export (empty if not)."""
    try:
        return list(program.module_call_graph[0].signature.forward_arg_names or ())
    except (AttributeError, IndexError):
        return []


def _user_inputs(program: ExportedProgram) -> list[object]:
    """The fake tensors of the program's user inputs, in flat order."""
    from torch.export.graph_signature import InputKind

    placeholders = {node.name: node for node in program.graph.nodes if node.op == "placeholder"}
    return [placeholders[spec.arg.name].meta.get("val")
            for spec in program.graph_signature.input_specs if spec.kind == InputKind.USER_INPUT]


def _user_outputs(program: ExportedProgram) -> list[object]:
    """The fake values of the program's user outputs, in flat order."""
    from torch.export.graph_signature import OutputKind

    output = next(node for node in program.graph.nodes if node.op == "output")
    values = list(output.args[0])
    return [_meta(values[i]) for i, spec in enumerate(program.graph_signature.output_specs)
            if spec.kind == OutputKind.USER_OUTPUT]


def _meta(value: object) -> object:
    return value.meta.get("val") if isinstance(value, torch.fx.Node) else value


def _check_input_dtypes(config: ModelConfig, fakes: Mapping[str, object]) -> None:
    wanted = {spec.name: spec.data_type for spec in config.inputs}
    wanted.update({state.input_name: state.data_type for state in config.sequence_states()})
    for name, fake in fakes.items():
        if name not in wanted:
            continue      # sequence controls and batch inputs: the broker makes them to the config
        if not isinstance(fake, torch.Tensor):
            raise ModelLoadError(f"failed to load model '{config.name}': input '{name}' is not a "
                                 f"tensor in {WHAT} (it takes {fake!r})", INVALID_ARG)
        provided = naming.config_name_of(fake.dtype)
        if provided != wanted[name]:
            raise ModelLoadError(f"configuration expects datatype {wanted[name]} for input "
                                 f"'{name}', model takes {provided}", INVALID_ARG)


def _check_output_dtypes(config: ModelConfig, binding: Binding, signature: ProgramSignature,
                         outputs: list[object]) -> None:
    if len(outputs) != signature.output_count:
        return          # an unusual graph: the checks at run time still apply
    for name, index in binding.output_index.items():
        value = outputs[index]
        if not isinstance(value, torch.Tensor):
            raise ModelLoadError(f"failed to load model '{config.name}': output '{name}' is "
                                 f"{type(value).__name__} in {WHAT}, not a tensor", INVALID_ARG)
        expected = _output_type(config, name)
        provided = naming.config_name_of(value.dtype)
        if provided != expected:
            raise ModelLoadError(f"configuration expects datatype {expected} for "
                                 f"output '{name}', model provides {provided}", INVALID_ARG)
        if value.dim() == 0:
            raise ModelLoadError(f"output '{name}' is a scalar which is not supported.", INVALID_ARG)


def _output_type(config: ModelConfig, name: str) -> str:
    spec = config.output(name)
    if spec is not None:
        return spec.data_type
    return next(s.data_type for s in config.sequence_states() if s.output_name == name)


__all__ = ["bind_exported", "load_exported"]
