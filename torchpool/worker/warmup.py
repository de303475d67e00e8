"""Model warm-up: batches a worker runs before it reports READY.

Two kinds, both run through `Binding.run` exactly as a request's batch is
(same grad mode, same checks), so the first real request finds compiled
code, filled caches and touched memory:

* Triton's `model_warmup` samples (`config.warmup`): each sample's inputs
  are zeros, random values or the raw bytes of a file in the model's
  `warmup/` directory, shaped `dims` (without the batch dimension) and
  repeated `batch_size` times for a batching model; the sample runs
  `max(count, 1)` times. A failure fails the load with its reason.
* for TORCH_COMPILE, `compile_batches`: synthetic zeros shaped from the
  config (and the program's ranges), batch 2 with every open dimension
  marked dynamic, then batch 1 (torch.compile specialises sizes 0 and 1),
  so the compiled code serves every shape the config allows.

Inputs the config's samples cannot give — sequence controls and implicit
state — are zeros of the right type and shape, as for a slot that holds
no sequence.
"""
from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Callable, Iterable, Mapping, Optional

import torch

from torchpool.config.model_config import CONFIG_TO_WIRE, ModelConfig, TensorSpec, WarmupInput, WarmupSample
from torchpool.protocol import datatypes
from torchpool.protocol.errors import INVALID_ARG
from torchpool.worker.binding import Binding, Value
from torchpool.worker.naming import batch_input_targets, model_dims
from torchpool.worker.settings import ModelLoadError
from torchpool.worker.texts import client_text

log = logging.getLogger("torchpool.worker")

WARMUP_DIR = "warmup"
_CONTROL_TYPES = {"int32_false_true": "TYPE_INT32", "fp32_false_true": "TYPE_FP32",
                  "bool_false_true": "TYPE_BOOL"}


def run_warmup(config: ModelConfig, model_dir: Path, module: Callable[..., object], binding: Binding,
               device: Optional[torch.device] = None) -> int:
    """Run the config's warm-up samples on `device` (None: CPU); returns how
    many batches ran.

    The caller runs this under the model's grad mode. Raises ModelLoadError
    (naming the sample) when a sample cannot be built or fails.
    """
    ran = 0
    for sample in config.warmup:
        what = f"warm-up sample '{sample.name}'"
        try:
            inputs = sample_inputs(config, model_dir, sample)
        except ModelLoadError as exc:
            raise _failed(config, what, exc.message) from None
        count = max(int(sample.count), 1)
        run_batches(config, module, binding, [inputs] * count, what, device)
        ran += count
    return ran


def _failed(config: ModelConfig, what: str, why: str) -> ModelLoadError:
    return ModelLoadError(f"failed to load model '{config.name}': {what} failed: {client_text(why)}",
                          INVALID_ARG)


def sample_inputs(config: ModelConfig, model_dir: Path, sample: WarmupSample) -> dict[str, Value]:
    """The inputs of one `model_warmup` sample, as the model sees them."""
    batching = config.max_batch_size > 0
    batch = max(int(sample.batch_size), 1)    # the config checked it against max_batch_size
    inputs: dict[str, Value] = {}
    for name, given in sample.inputs.items():
        # a config input, or a sequence control input (the config checked which)
        one = _sample_value(name, given, model_dir)
        inputs[name] = _as_model_sees(config.input(name), one, batch if batching else None)
    inputs.update(filler_inputs(config, batch if batching else None, exclude=inputs))
    return inputs


def _sample_value(name: str, given: WarmupInput, model_dir: Path) -> Value:
    """One sample's tensor (or string list) of `dims`, without the batch dimension."""
    dims = tuple(int(d) for d in given.dims)
    if any(d < 0 for d in dims):
        raise ModelLoadError(f"input '{name}' has dims {list(dims)}: warm-up dims must be sizes, "
                             f"not -1", INVALID_ARG)
    wire = CONFIG_TO_WIRE.get(given.data_type)
    if wire is None:
        raise ModelLoadError(f"input '{name}' has unknown data_type {given.data_type}", INVALID_ARG)
    count = math.prod(dims)
    source = given.source
    if source == "file":
        assert given.file is not None       # the config's check: a file source names its file
        return _from_file(name, wire, dims, count, model_dir / WARMUP_DIR / given.file)
    if wire == "BYTES":
        return [("" if source == "zero" else str(i)) for i in range(count)]
    dtype = datatypes.torch_dtype(wire)
    if source == "zero":
        return torch.zeros(dims, dtype=dtype)
    return random_tensor(dims, dtype)


def random_tensor(shape: Iterable[int], dtype: torch.dtype) -> torch.Tensor:
    shape = tuple(shape)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape).bool()
    if dtype.is_floating_point:
        return torch.rand(shape, dtype=torch.float32).to(dtype)
    return torch.randint(0, 16, shape).to(dtype)


def _from_file(name: str, wire: str, dims: tuple[int, ...], count: int, path: Path) -> Value:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ModelLoadError(f"input '{name}': cannot read warm-up file '{path.name}' in "
                             f"{WARMUP_DIR}/: {exc.strerror or exc}", INVALID_ARG) from None
    if wire == "BYTES":
        try:
            items = datatypes.decode_bytes(memoryview(data), count)
            return [item.decode("utf-8") for item in items]
        except (ValueError, UnicodeDecodeError) as exc:
            raise ModelLoadError(f"input '{name}': warm-up file '{path.name}' does not hold {count} "
                                 f"length-prefixed UTF-8 strings: {exc}", INVALID_ARG) from None
    needed = count * datatypes.element_size(wire)
    if len(data) < needed:      # Triton reads the bytes it needs and ignores the rest
        raise ModelLoadError(f"input '{name}': warm-up file '{path.name}' holds {len(data)} bytes, "
                             f"but {wire} {list(dims)} needs {needed}", INVALID_ARG)
    if needed == 0:
        return torch.empty(dims, dtype=datatypes.torch_dtype(wire))
    tensor = torch.frombuffer(bytearray(data[:needed]), dtype=datatypes.torch_dtype(wire), count=count)
    return tensor.view(dims).clone()


def _as_model_sees(spec: Optional[TensorSpec], value: Value, batch: Optional[int]) -> Value:
    """Repeat one sample `batch` times (a batching model) and apply `reshape`
    (`spec` None: a sequence control input, never reshaped)."""
    if isinstance(value, list):
        return value * (batch or 1)
    if batch is not None:
        value = value.unsqueeze(0).expand(batch, *value.shape).contiguous()
    if spec is not None and spec.reshape is not None:
        value = value.reshape(((batch,) if batch is not None else ()) + tuple(spec.reshape))
    return value


def filler_inputs(config: ModelConfig, batch: Optional[int],
                  exclude: Mapping[str, object] = {}) -> dict[str, Value]:
    """Zeros for the sequence controls and implicit states a batch carries."""
    rows = [batch] if batch is not None else []
    out: dict[str, Value] = {}
    for entry in (config.sequence_batching or {}).get("control_input", ()):
        name = str(entry.get("name"))
        if name in exclude:
            continue
        control = (entry.get("control") or [{}])[0]
        data_type = next((t for key, t in _CONTROL_TYPES.items() if control.get(key)),
                         control.get("data_type", "TYPE_UINT64"))
        out[name] = torch.zeros(rows + [1], dtype=datatypes.torch_dtype(CONFIG_TO_WIRE[data_type]))
    for state in config.sequence_states():
        if state.input_name in exclude:
            continue
        dims = [d if d >= 0 else 1 for d in state.dims]
        wire = CONFIG_TO_WIRE[state.data_type]
        if wire == "BYTES":
            out[state.input_name] = [""] * math.prod(rows + dims)
        else:
            out[state.input_name] = torch.zeros(rows + dims, dtype=datatypes.torch_dtype(wire))
    return out


def compile_batches(config: ModelConfig, binding: Binding) -> Optional[list[dict[str, Value]]]:
    """Synthetic batches that make torch.compile build code for every shape the
    config allows: open dimensions at 2 and marked dynamic, then at 1. None
    when the model takes inputs the worker cannot make up (batch inputs,
    strings)."""
    if batch_input_targets(config) or any(s.data_type == "TYPE_STRING" for s in config.inputs):
        return None
    batching = config.max_batch_size > 0
    sizes = [2, 1] if batching and config.max_batch_size >= 2 else [1]
    batches = []
    for size in sizes:
        inputs: dict[str, Value] = {}
        for spec in config.inputs:
            inputs[spec.name] = _synthetic(spec, binding, size if batching else None, mark=size == 2)
        inputs.update(filler_inputs(config, size if batching else None, exclude=inputs))
        batches.append(inputs)
    return batches


def _synthetic(spec: TensorSpec, binding: Binding, batch: Optional[int], mark: bool) -> torch.Tensor:
    dims = ([batch] if batch is not None else []) + list(model_dims(spec))
    open_axes = [i for i, d in enumerate(dims) if d == -1] + ([0] if batch is not None else [])
    wanted = 2 if mark else 1
    shape = []
    for axis, size in enumerate(dims):
        if axis in open_axes and size == -1:
            size = wanted
        if binding.shapes is not None:
            size = binding.shapes.sample_size(spec.name, axis, size)
        shape.append(size)
    tensor = torch.zeros(shape, dtype=datatypes.torch_dtype(spec.datatype))
    if mark:
        for axis in open_axes:
            if shape[axis] >= 2:
                torch._dynamo.mark_dynamic(tensor, axis)
    return tensor


def run_batches(config: ModelConfig, module: Callable[..., object], binding: Binding,
                batches: list[dict[str, Value]], what: str,
                device: Optional[torch.device] = None) -> None:
    """Run each batch as a request's would run (its tensors on the worker's
    `device`, as the worker puts a request's); the first failure fails the load."""
    for inputs in batches:
        if device is not None and device.type != "cpu":
            inputs = {name: _on(value, device) for name, value in inputs.items()}
        try:
            binding.run(module, inputs)
        except Exception as exc:
            raise _failed(config, what, getattr(exc, "message", None) or str(exc)) from exc


def _on(value: Value, device: torch.device) -> Value:
    if not isinstance(value, torch.Tensor):
        return value
    moved = value.to(device)
    for axis in getattr(value, "_dynamo_dynamic_indices", ()):
        torch._dynamo.mark_dynamic(moved, axis)      # the copy keeps the original's marks
    return moved


__all__ = ["compile_batches", "filler_inputs", "random_tensor", "run_batches", "run_warmup",
           "sample_inputs"]
