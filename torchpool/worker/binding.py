"""Run one batch through a loaded model, the way its binding says.

A binding is decided once, at load, by the loader of the model's format
(`worker/torchscript.py`, `worker/exported.py`, `worker/aoti.py`, with the
naming rules of `worker/naming.py`); this module applies it to one batch at
a time (`Binding.run`):

    config inputs ──input_index──► model(*args) or model({name: tensor})
                                        │
    config outputs ◄──output_index── Tensor | List[str] | tuple of those | flat list (PyTorch 2)

Error texts are Triton's, word for word where its users look for them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterable, Mapping, Optional, Sequence, Union, cast

import torch

from torchpool.protocol import datatypes
from torchpool.protocol.errors import INTERNAL, INVALID_ARG
from torchpool.worker.naming import NamingConvention
from torchpool.worker.settings import ExecutionError, ModelLoadError

if TYPE_CHECKING:
    from torch._C import JitType, TupleType

    from torchpool.worker.shapes import ShapeRules

Value = Union[torch.Tensor, list]   # a tensor, or a list of str for BYTES
# One of forward's arguments: an input, the one dict of a dict input, None for one left out
Argument = Union[Value, dict[str, Value], None]
# What an output must be to pass at once: `list` for BYTES, a torch dtype, None when none fits
_Kind = Union[type, torch.dtype, None]

EXECUTE_FAILURE = "PyTorch execute failure: "


@dataclass(frozen=True)
class Binding:
    """Where each config tensor goes among the model's arguments, and how to
    read the result.

    `input_index` maps every tensor the worker feeds (config inputs, batch
    inputs, sequence controls and states) to its position among the
    arguments (without `self`), or for a dict input to its config position.
    `output_index` maps config outputs (and state outputs) to their
    position among the returned values; `output_datatype` gives their wire datatypes.
    `flat_outputs` is set for PyTorch 2 programs, whose runners return the
    flat list of output tensors (their loaders checked the structure);
    TorchScript's rules (a Tensor, a List[str] or a tuple of those) apply
    otherwise. `shapes` are the dimensions a PyTorch 2 program accepts,
    checked before it runs; `explain` may turn a
    model's failure into the request's error, naming the config tensor.
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
    return_type: Optional[JitType] = field(default=None, repr=False, compare=False)  # TorchScript's, for messages
    flat_outputs: bool = False
    shapes: Optional["ShapeRules"] = field(default=None, repr=False, compare=False)
    explain: Optional[Callable[[str], Optional[ExecutionError]]] = field(default=None, repr=False, compare=False)
    # Facts derived once from the fields above, so that `run` does per
    # request only what depends on the request (filled in __post_init__).
    _bound_inputs: frozenset[str] = field(init=False, repr=False, compare=False)
    _output_count: int = field(init=False, repr=False, compare=False)
    _output_checks: tuple[tuple[str, int, _Kind], ...] = field(init=False, repr=False, compare=False)
    _all_outputs: tuple[tuple[str, int], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # What an output must be to pass `_check_output` without a look at
        # its wire name: a tensor of exactly this dtype (or a list for
        # BYTES); anything else goes the slow way, which decides.
        checks = tuple((name, index, _expected_kind(self.output_datatype[name]))
                       for name, index in self.output_index.items())
        object.__setattr__(self, "_bound_inputs", frozenset(self.input_index))
        object.__setattr__(self, "_output_count", 1 + max(self.output_index.values(), default=-1))
        object.__setattr__(self, "_output_checks", checks)
        object.__setattr__(self, "_all_outputs",
                           tuple((name, self.output_index[name]) for name in self.output_names))

    def run(
        self,
        module: Callable[..., object],
        inputs: Mapping[str, Value],
        requested: Optional[Sequence[str]] = None,
    ) -> dict[str, Value]:
        """Execute one batch and return the requested outputs.

        The caller wraps this in `grad_context` and hands CPU tensors already
        shaped as the model sees them; they are passed on without copies.
        Returned tensors are contiguous CPU tensors; string outputs stay
        `list[str]`. `requested` None means every config output.
        """
        if requested is None:
            wanted = self._all_outputs
        else:
            index = self.output_index
            wanted = tuple((name, index[name]) for name in self._check_requested(requested))
        if not (self._bound_inputs.issuperset(inputs) and inputs.keys() >= self.required_inputs):
            self._check_inputs(inputs)   # raises the error that fits
        if self.shapes is not None:
            self.shapes.check(inputs)
        try:
            result = module(*self.arguments(inputs))
        except Exception as exc:
            explained = self.explain(str(exc)) if self.explain is not None else None
            raise explained or ExecutionError(EXECUTE_FAILURE + str(exc), INTERNAL) from exc
        values = self._unpack(result)
        self._check_outputs(values)
        outputs: dict[str, Value] = {}
        for name, position in wanted:
            value = values[position]
            if isinstance(value, torch.Tensor):
                # contiguous CPU tensors leave as they are (no copy)
                value = value.contiguous()
                if not value.is_cpu:
                    value = value.cpu()
            outputs[name] = value
        return outputs

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

    def arguments(self, inputs: Mapping[str, Value]) -> list[Argument]:
        """`forward`'s arguments: positions from `input_index`, or one dict.

        A position with no input is None: only an Optional argument can be
        left out (`_check_inputs` has made sure of that).
        """
        if self.is_dict_input:
            return [dict(inputs)]
        args: list[Argument] = [None] * self.arity
        for name, value in inputs.items():
            args[self.input_index[name]] = value
        return args

    # -- outputs --

    def _unpack(self, result: object) -> Sequence[Value]:
        """The model's return value as a sequence of Tensors and string lists."""
        if self.flat_outputs:
            # its loader checked the structure: a flat list (or tuple) of values
            return result if type(result) is list else list(cast("Iterable[Value]", result))
        if isinstance(result, torch.Tensor):
            return (result,)
        if isinstance(result, tuple):
            for value in result:
                if not isinstance(value, torch.Tensor):
                    return [self._tuple_element(i, value) for i, value in enumerate(result)]
            return result   # all tensors: nothing to look at element by element
        if isinstance(result, list):
            element = _list_element_name(result, _static_list_element(self.return_type))
            if element != "str":
                raise ExecutionError(
                    f"{EXECUTE_FAILURE}output must be of type Tensor or List[str], "
                    f"received List[{element}]",
                    INTERNAL,
                )
            return [result]
        raise ExecutionError(
            f"{EXECUTE_FAILURE}output must be of type Tensor, List[str] or Tuple "
            "containing one of these two types. It should not be a List / Dictionary "
            "of Tensors or a Scalar",
            INTERNAL,
        )

    def _tuple_element(self, index: int, value: object) -> Value:
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
            f"{EXECUTE_FAILURE}output at index {index} must be of type Tensor or "
            f"List[str], received {received}",
            INTERNAL,
        )

    def _check_outputs(self, values: Sequence[Value]) -> None:
        """Triton's checks on every bound output: index, datatype, not a scalar.

        An output that is plainly right (a non-scalar tensor of the expected
        dtype, a list for BYTES) passes at once; any other goes through
        `_check_output`, which owns the rules and the texts.
        """
        if len(values) < self._output_count:
            self._check_output_indexes(values)
        for name, index, kind in self._output_checks:
            value = values[index]
            if kind is list:
                if isinstance(value, list):
                    continue
            elif isinstance(value, torch.Tensor) and value.dtype is kind and value.dim() != 0:
                continue
            self._check_output(name, value)

    def _check_output_indexes(self, values: Sequence[Value]) -> None:
        for name, index in self.output_index.items():
            if index >= len(values):
                raise ExecutionError(
                    f"The output {name} in the model configuration refers to an output "
                    f"index which doesn't exist. This model has {len(values)} outputs",
                    INVALID_ARG,
                )

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


def _expected_kind(wire: str) -> _Kind:
    """`list` for BYTES, else the torch dtype of `wire` (None when it has none)."""
    if wire == "BYTES":
        return list
    try:
        return datatypes.torch_dtype(wire)
    except KeyError:
        return None


def _wire_name(value: object) -> str:
    """The wire datatype of an output value; unknown torch dtypes by their name."""
    if isinstance(value, list):
        return "BYTES"
    if not isinstance(value, torch.Tensor):
        return _python_type_name(value).upper()
    try:
        return datatypes.wire_from_torch(value.dtype)
    except KeyError:
        return str(value.dtype).removeprefix("torch.").upper()


def _static_list_element(type_: Optional[JitType]) -> Optional[str]:
    """`str` for a TorchScript `List[str]` type, the element's name for any list."""
    if type_ is not None and type_.kind() == "ListType":
        return str(type_.getElementType())
    return None


def _static_tuple_element(type_: Optional[JitType], index: int) -> Optional[JitType]:
    if type_ is not None and type_.kind() == "TupleType":
        elements = cast("TupleType", type_).elements()
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


def _python_type_name(value: object) -> str:
    """TorchScript's name for a value's type, for error messages."""
    if isinstance(value, torch.Tensor):
        return "Tensor"
    if isinstance(value, list):
        return "List"
    if isinstance(value, dict):
        return "Dict"
    return type(value).__name__


__all__ = ["Binding", "EXECUTE_FAILURE", "ExecutionError", "ModelLoadError", "NamingConvention", "Value"]
