"""The dimensions a torch.export program accepts, held against the config and
checked against each batch before the model runs.

An exported program records every input's shape: a dimension is either
static (an int) or a symbol with a range (`torch.export.Dim("batch", min=1,
max=64)`); inputs that share a symbol must agree on it. Two checks follow
from that:

* at load (`check_config`): a config that promises what the program cannot
  do fails to load — a rank that differs, a fixed size the program does not
  take, `-1` where the program is static, `max_batch_size` beyond the batch
  dimension's range, a program that cannot run a batch of one;
* per batch (`check`): only the dimensions the config leaves open (`-1`)
  can still be out of range, so only those are checked, with an error that
  names the tensor, the dimension and the allowed range. The broker has
  already checked everything the config fixes.

As torch itself does (torch._export.utils._check_symint), a lower bound of 2
or less is not enforced: export assumes sizes 0 and 1 are not special, so a
range starting at 2 usually only means "not specialised".
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping, Optional, Sequence

import torch

from torchpool.config.model_config import ModelConfig
from torchpool.protocol.errors import INVALID_ARG
from torchpool.worker.naming import model_dims
from torchpool.worker.settings import ExecutionError, ModelLoadError

if TYPE_CHECKING:
    from torch.utils._sympy.value_ranges import ValueRanges

_UNBOUNDED = None


@dataclass(frozen=True)
class Dim:
    """One dimension of a program input: static `size`, or `symbol` within
    [low, high] (high None = unbounded). `symbol` None and `size` None: an
    expression of symbols (2*s0) that only the program itself checks."""

    size: Optional[int] = None
    symbol: Optional[str] = None
    low: int = 0
    high: Optional[int] = _UNBOUNDED

    def allows(self, value: int) -> bool:
        if self.size is not None:
            return value == self.size
        if self.symbol is None:
            return True
        return (self.low <= 2 or value >= self.low) and (self.high is None or value <= self.high)

    def describe(self) -> str:
        """What sizes it takes, in words (a lower bound of 2 or less is not enforced)."""
        if self.size is not None:
            return f"exactly {self.size}"
        if self.symbol is None:
            return "a size derived from other dimensions"
        if self.low > 2:
            return f"{self.low} to {self.high}" if self.high is not None else f"at least {self.low}"
        return f"at most {self.high}" if self.high is not None else "any size"

    def short(self) -> str:
        """For a shape list: `4`, `1..64`, `0..inf`, `?` (derived)."""
        if self.size is not None:
            return str(self.size)
        if self.symbol is None:
            return "?"
        return f"{self.low if self.low > 2 else 0}..{'inf' if self.high is None else self.high}"


def dims_of(fake: torch.Tensor, range_constraints: Mapping[object, ValueRanges]) -> tuple[Dim, ...]:
    """The `Dim`s of one program input, from its placeholder's fake tensor."""
    dims = []
    for size in fake.shape:
        if isinstance(size, int):
            dims.append(Dim(size=size))
            continue
        expr = size.node.expr
        if getattr(expr, "is_Symbol", False):
            low, high = _bounds(range_constraints.get(expr))
            dims.append(Dim(symbol=str(expr), low=low, high=high))
        elif getattr(expr, "is_number", False):
            dims.append(Dim(size=int(expr)))
        else:
            dims.append(Dim())
    return tuple(dims)


def _bounds(value_range: Optional[ValueRanges]) -> tuple[int, Optional[int]]:
    if value_range is None:
        return 0, None
    low, high = value_range.lower, value_range.upper
    low = int(low) if math.isfinite(float(low)) else 0
    try:
        high_value = float(high)
    except TypeError:
        return low, None
    return low, int(high) if math.isfinite(high_value) else None


def _shape_text(shape: Sequence[object]) -> str:
    return "[" + ",".join(str(d) for d in shape) + "]"


@dataclass(frozen=True)
class _Check:
    name: str
    axis: int
    dim: Dim


class ShapeRules:
    """The program's dimensions per bound input name, and the per-batch checks."""

    def __init__(self, model_name: str, inputs: Mapping[str, tuple[Dim, ...]],
                 what: str = "the exported program", exact_rank: bool = True) -> None:
        self.model_name = model_name
        self.inputs = dict(inputs)
        self.what = what
        self.exact_rank = exact_rank     # False: `inputs` may miss trailing dimensions
        self._checks: tuple[_Check, ...] = ()

    # -- at load --

    def check_config(self, config: ModelConfig) -> None:
        """Fail the load when the config promises shapes the program cannot take;
        then keep, for each batch, the checks the broker cannot make."""
        batching = config.max_batch_size > 0
        variable: list[_Check] = []
        for spec in config.inputs:
            dims = self.inputs.get(spec.name)
            if dims is None:
                continue
            expected = ((-1,) if batching else ()) + tuple(model_dims(spec))
            if len(expected) != len(dims) and (self.exact_rank or len(expected) < len(dims)):
                raise self._load_error(
                    spec.name, f"the configuration gives it {len(expected)} dimensions "
                    f"({_shape_text(expected)}{', with the batch dimension' if batching else ''}) "
                    f"but {self.what} takes {len(dims)} ({_shape_text([d.short() for d in dims])})")
            for axis, (config_size, dim) in enumerate(zip(expected, dims)):
                if batching and axis == 0:
                    self._check_batch_dim(spec.name, config.max_batch_size, dim)
                elif config_size == -1:
                    if dim.size is not None:
                        raise self._load_error(
                            spec.name, f"dimension {axis} is -1 (any size) in the configuration, but "
                            f"{self.what} only takes {dim.size}; set it to {dim.size} in 'dims', or "
                            f"export the model with a torch.export.Dim for it")
                    variable.append(_Check(spec.name, axis, dim))
                elif not dim.allows(config_size):
                    raise self._load_error(
                        spec.name, f"dimension {axis} is {config_size} in the configuration "
                        f"({_shape_text(expected)}{', the batch dimension first' if batching else ''}), "
                        f"but {self.what} takes {dim.describe()}")
        self._checks = tuple(variable) + self._shared_symbol_checks(variable)

    def _check_batch_dim(self, name: str, max_batch_size: int, dim: Dim) -> None:
        if dim.size is not None:
            if max_batch_size == 1 and dim.size == 1:
                return
            raise self._load_error(
                name, f"max_batch_size is {max_batch_size} but {self.what} was exported with a "
                f"fixed batch size of {dim.size} (dimension 0); export it with "
                f"dynamic_shapes={{'{name}': {{0: torch.export.Dim('batch', min=1, "
                f"max={max_batch_size})}}}} or set max_batch_size: 0 and dims to its full shape")
        if dim.symbol is None:
            return
        if dim.high is not None and dim.high < max_batch_size:
            raise self._load_error(
                name, f"max_batch_size is {max_batch_size} but {self.what} accepts batches of "
                f"{dim.describe()} in dimension 0; lower max_batch_size to {dim.high} or export "
                f"with a larger max for the batch Dim")
        if dim.low > 2:
            raise self._load_error(
                name, f"a batch may hold a single request but {self.what} needs at least "
                f"{dim.low} in dimension 0; export with torch.export.Dim('batch', min=1)")

    def _shared_symbol_checks(self, variable: list[_Check]) -> tuple[_Check, ...]:
        """Every other place of a symbol some open dimension carries: inputs
        tied at export must agree, and only the program knows they are tied."""
        symbols = {c.dim.symbol for c in variable if c.dim.symbol is not None}
        seen = {(c.name, c.axis) for c in variable}
        extra = []
        for name, dims in self.inputs.items():
            for axis, dim in enumerate(dims):
                if dim.symbol in symbols and (name, axis) not in seen:
                    extra.append(_Check(name, axis, dim))
        return tuple(extra)

    def _load_error(self, name: str, why: str) -> ModelLoadError:
        return ModelLoadError(f"failed to load model '{self.model_name}': input '{name}': {why}",
                              INVALID_ARG)

    # -- per batch --

    def check(self, inputs: Mapping[str, object]) -> None:
        """Raise ExecutionError (INVALID_ARG) when an open dimension of the
        batch is outside the program's range, or tied dimensions differ."""
        if not self._checks:
            return
        bound: dict[str, tuple[str, int, int]] = {}
        for check in self._checks:
            value = inputs.get(check.name)
            if not isinstance(value, torch.Tensor) or check.axis >= value.dim():
                continue
            size = value.shape[check.axis]
            dim = check.dim
            if not dim.allows(size):
                raise ExecutionError(
                    f"unexpected shape for input '{check.name}' for model '{self.model_name}': "
                    f"dimension {check.axis} is {size}, but {self.what} accepts {dim.describe()} "
                    f"(got shape {_shape_text(value.shape)})", INVALID_ARG)
            if dim.symbol is None:
                continue
            first = bound.setdefault(dim.symbol, (check.name, check.axis, size))
            if first[2] != size:
                raise ExecutionError(
                    f"unexpected shape for input '{check.name}' for model '{self.model_name}': "
                    f"dimension {check.axis} is {size}, but {self.what} requires it to equal "
                    f"dimension {first[1]} of input '{first[0]}' ({first[2]})", INVALID_ARG)

    # -- for warm-up --

    def sample_size(self, name: str, axis: int, wanted: int) -> int:
        """A size for a synthetic input: `wanted`, moved into the program's range."""
        dims = self.inputs.get(name)
        if dims is None or axis >= len(dims):
            return wanted
        dim = dims[axis]
        if dim.size is not None:
            return dim.size
        if dim.symbol is None:
            return wanted
        if dim.low > 2:
            wanted = max(wanted, dim.low)
        return min(wanted, dim.high) if dim.high is not None else wanted


__all__ = ["Dim", "ShapeRules", "dims_of"]
