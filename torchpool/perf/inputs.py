"""The inputs of the requests: made from the model's metadata, or read.

`--input-data`:
    zero      every element 0 (BYTES: strings of '0' of --string-length)
    random    uniform values, seeded (BYTES: random letters of --string-length)
    FILE.json perf_analyzer's format: {"data": [{NAME: [values...] or
              {"content": [values...], "shape": [d1, ...]}, ...}, ...]}; each
              entry is one batch item (the whole tensor for a model without
              batching); request j takes the next `batch` entries in turn
    DIR       NAME.npy per input: one batch item (tiled to the batch) or the
              whole tensor with its batch dimension

Shapes exclude the batch dimension, as in Triton's config and perf_analyzer's
--shape; a dynamic dimension (-1) must be given with --shape NAME:d1,d2 unless
the data file says it. Values become numpy arrays (`build_arrays`); for
torchpool's client BYTES and BF16 are encoded once as RawTensors
(`build_requests`), and senders.py makes Triton's client's inputs once, so a
request costs the client no encoding.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence, Union

import numpy as np

from ..client import RawTensor
from ..protocol import datatypes

ZERO, RANDOM = "zero", "random"


class InputError(Exception):
    """Inputs that cannot be made: the message names the model, the tensor
    and what was expected."""


@dataclass(frozen=True)
class InputSpec:
    name: str
    datatype: str
    dims: tuple            # without the batch dimension; -1 = dynamic


@dataclass(frozen=True)
class ModelInputs:
    model: str
    max_batch_size: int
    specs: tuple

    def spec(self, name: str) -> InputSpec:
        for s in self.specs:
            if s.name == name:
                return s
        raise InputError(f"model '{self.model}' has no input '{name}' "
                         f"(its inputs: {', '.join(s.name for s in self.specs)})")


def model_inputs(model: str, metadata: dict, config: dict) -> ModelInputs:
    """Inputs from `Client.model_metadata` (Triton datatype names; the shape
    has a leading -1 for a batching model) and `model_config` (max_batch_size)."""
    batching = int(config.get("max_batch_size", 0) or 0)
    specs = []
    for entry in metadata.get("inputs", []):
        shape = [int(d) for d in entry["shape"]]
        specs.append(InputSpec(entry["name"], entry["datatype"], tuple(shape[1:] if batching else shape)))
    return ModelInputs(model, batching, tuple(specs))


def parse_shape(text: str) -> tuple[str, list[int]]:
    """`NAME:d1,d2,...` -> (NAME, [d1, d2, ...]), each d a positive integer."""
    name, sep, dims = text.rpartition(":")
    try:
        shape = [int(d) for d in dims.split(",")] if sep and name else None
    except ValueError:
        shape = None
    if not shape or any(d < 1 for d in shape):
        raise InputError(f"--shape expects NAME:d1,d2,... with positive integer sizes, got {text!r}")
    return name, shape


def check_shape(inputs: ModelInputs, spec: InputSpec, shape: Sequence[int], where: str) -> list[int]:
    """`shape` (no batch dimension) if it fits the spec's dims, else an InputError."""
    shape = [int(d) for d in shape]
    fits = len(shape) == len(spec.dims) and all(d == -1 or d == s for d, s in zip(spec.dims, shape))
    if not fits or any(s < 0 for s in shape):
        raise InputError(f"{where}: input '{spec.name}' of model '{inputs.model}' has dims "
                         f"{list(spec.dims)}{' (without the batch dimension)' if inputs.max_batch_size else ''}"
                         f", got shape {shape}")
    return shape


def concrete_shape(inputs: ModelInputs, spec: InputSpec, shapes: dict) -> list[int]:
    """The spec's dims with --shape's sizes for the dynamic ones."""
    if spec.name in shapes:
        return check_shape(inputs, spec, shapes[spec.name], "--shape")
    if -1 in spec.dims:
        example = ",".join("N" if d == -1 else str(d) for d in spec.dims)
        raise InputError(f"input '{spec.name}' of model '{inputs.model}' has dynamic dims "
                         f"{list(spec.dims)}: give its shape with --shape {spec.name}:{example}")
    return list(spec.dims)


def _batch_shape(inputs: ModelInputs, shape: list[int], batch: int) -> list[int]:
    return [batch] + shape if inputs.max_batch_size else shape


def _strings(rng: Optional[np.random.Generator], count: int, length: int) -> list[bytes]:
    if rng is None:
        return [b"0" * length] * count
    letters = rng.integers(ord("a"), ord("z") + 1, size=(count, length), dtype=np.uint8)
    return [row.tobytes() for row in letters]


def _generated(spec: InputSpec, shape: list[int], rng: Optional[np.random.Generator],
               string_length: int) -> np.ndarray:
    count = int(np.prod(shape))
    if spec.datatype == "BYTES":
        return np.array(_strings(rng, count, string_length), dtype=object).reshape(shape)
    dtype = datatypes.numpy_dtype(spec.datatype)
    if rng is None:
        return np.zeros(shape, dtype)
    if spec.datatype == "BF16":       # the top half of float32 bits in [0, 1)
        return (rng.random(shape, dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)
    if dtype.kind == "f":
        return rng.random(shape).astype(dtype)
    if dtype.kind == "b":
        return rng.integers(0, 2, size=shape).astype(bool)
    return rng.integers(0, 100, size=shape).astype(dtype)


def wire_value(spec: InputSpec, array: np.ndarray) -> Union[np.ndarray, RawTensor]:
    """What `Client.infer` is given: the array, or for BYTES and BF16 its
    bytes in the wire layout (encoded once, not per request)."""
    if spec.datatype == "BYTES":
        return RawTensor("BYTES", array.shape, datatypes.encode_bytes(array.reshape(-1).tolist()))
    if spec.datatype == "BF16":
        return RawTensor("BF16", array.shape, np.ascontiguousarray(array, np.uint16).tobytes())
    return np.ascontiguousarray(array)


# kinds of values a file may give for each kind of tensor: numbers widen,
# nothing is rounded (no float into an integer tensor)
_FITS = {"f": "biuf", "i": "biu", "u": "biu", "b": "b"}


def _as_array(inputs: ModelInputs, spec: InputSpec, values: object, where: str) -> np.ndarray:
    """Values read from a file, as the spec's datatype (numbers cast within their kind)."""
    if spec.datatype == "BYTES":
        array = np.asarray(values, dtype=object)
        flat = [v.encode() if isinstance(v, str) else v for v in array.reshape(-1).tolist()]
        if not all(isinstance(v, (bytes, np.bytes_)) for v in flat):
            raise InputError(f"{where}: input '{spec.name}' of model '{inputs.model}' is BYTES: "
                             "expected strings")
        return np.array(flat, dtype=object).reshape(array.shape)
    if spec.datatype == "BF16":           # numbers -> bfloat16 bits, rounded to nearest even
        try:
            bits = np.asarray(values, dtype=np.float32).view(np.uint32).astype(np.uint64)
        except (TypeError, ValueError):
            raise InputError(f"{where}: input '{spec.name}' of model '{inputs.model}' is BF16: "
                             "expected numbers") from None
        return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    target = datatypes.numpy_dtype(spec.datatype)
    array = np.asarray(values)
    if array.dtype.kind not in _FITS.get(target.kind, ""):
        raise InputError(f"{where}: input '{spec.name}' of model '{inputs.model}' is {spec.datatype}: "
                         f"values of type {array.dtype} do not fit")
    return array.astype(target)


def _json_item(inputs: ModelInputs, spec: InputSpec, value: object, shapes: dict, where: str) -> np.ndarray:
    """One entry's tensor for `spec` (one batch item, or the whole tensor without batching)."""
    shape = None
    if isinstance(value, dict):
        if "content" not in value:
            raise InputError(f"{where}: input '{spec.name}': an object needs \"content\" (and \"shape\")")
        shape = value.get("shape")
        value = value["content"]
    if shape is None:
        shape = concrete_shape(inputs, spec, shapes) if -1 in spec.dims or spec.name in shapes \
            else list(spec.dims)
    shape = check_shape(inputs, spec, shape, where)
    array = _as_array(inputs, spec, value, where)
    if array.size != int(np.prod(shape)):
        raise InputError(f"{where}: input '{spec.name}' of model '{inputs.model}' with shape {shape} "
                         f"needs {int(np.prod(shape))} values, got {array.size}")
    return array.reshape(shape)


def _from_json(inputs: ModelInputs, path: Path, batch: int, shapes: dict) -> list[dict]:
    try:
        document = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise InputError(f"--input-data {path}: cannot read it as JSON: {exc}") from None
    entries = document.get("data") if isinstance(document, dict) else None
    if not isinstance(entries, list) or not entries or not all(isinstance(e, dict) for e in entries):
        raise InputError(f"--input-data {path}: expected {{\"data\": [{{INPUT: values, ...}}, ...]}}")
    items = []
    for i, entry in enumerate(entries):
        where = f"--input-data {path} entry {i}"
        missing = [s.name for s in inputs.specs if s.name not in entry]
        if missing:
            raise InputError(f"{where}: no value for input {', '.join(map(repr, missing))} of model "
                             f"'{inputs.model}'")
        items.append({s.name: _json_item(inputs, s, entry[s.name], shapes, where) for s in inputs.specs})
    requests = []
    for j in range(len(items)):
        if inputs.max_batch_size:
            picked = [items[(j * batch + b) % len(items)] for b in range(batch)]
            try:
                arrays = {s.name: np.stack([p[s.name] for p in picked]) for s in inputs.specs}
            except ValueError:
                raise InputError(f"--input-data {path}: entries {j * batch}..{j * batch + batch - 1} "
                                 f"make one batch of {batch} and must have the same shapes") from None
        else:
            arrays = items[j]
        requests.append(arrays)
    return requests


def _from_directory(inputs: ModelInputs, path: Path, batch: int) -> list[dict]:
    arrays = {}
    for spec in inputs.specs:
        file = path / f"{spec.name}.npy"
        where = f"--input-data {file}"
        try:
            # never a pickle: loading one runs whatever code the file holds
            # (BYTES come from numpy's own string dtypes, as torchpool infer takes them)
            array = np.load(file, allow_pickle=False)
        except (OSError, ValueError) as exc:
            raise InputError(f"{where}: cannot read input '{spec.name}' of model '{inputs.model}': "
                             f"{exc}") from None
        array = _as_array(inputs, spec, array, where)
        if inputs.max_batch_size and array.ndim == len(spec.dims) + 1:
            if array.shape[0] != batch:
                raise InputError(f"{where}: its batch dimension is {array.shape[0]}, but -b is {batch}")
            check_shape(inputs, spec, array.shape[1:], where)
        else:
            check_shape(inputs, spec, array.shape, where)
            if inputs.max_batch_size:
                array = np.stack([array] * batch)
        arrays[spec.name] = array
    return [arrays]


def build_requests(inputs: ModelInputs, batch: int, source: str, shapes: dict,
                   string_length: int = 128, seed: int = 0) -> list[dict]:
    """The inputs of the requests (one or more sets, used in turn), as
    `Client.infer` takes them."""
    return wire_requests(inputs, build_arrays(inputs, batch, source, shapes, string_length, seed))


def wire_requests(inputs: ModelInputs, sets: Sequence[dict]) -> list[dict]:
    """`build_arrays`' sets as `Client.infer` takes them (BYTES and BF16 encoded once)."""
    specs = {s.name: s for s in inputs.specs}
    return [{name: wire_value(specs[name], array) for name, array in arrays.items()} for arrays in sets]


def build_arrays(inputs: ModelInputs, batch: int, source: str, shapes: dict,
                 string_length: int = 128, seed: int = 0) -> list[dict]:
    """The inputs of the requests (one or more sets, used in turn) as numpy
    arrays: BYTES an object array of bytes, BF16 the uint16 bits."""
    if batch < 1:
        raise InputError(f"-b/--batch-size must be at least 1, got {batch}")
    if not inputs.max_batch_size and batch != 1:
        raise InputError(f"model '{inputs.model}' does not batch (max_batch_size 0): -b must be 1, got {batch}")
    if inputs.max_batch_size and batch > inputs.max_batch_size:
        raise InputError(f"model '{inputs.model}' takes batches of at most {inputs.max_batch_size}, "
                         f"got -b {batch}")
    for name in shapes:
        inputs.spec(name)                   # --shape naming no input is an error
    if source in (ZERO, RANDOM):
        rng = np.random.default_rng(seed) if source == RANDOM else None
        arrays = {s.name: _generated(s, _batch_shape(inputs, concrete_shape(inputs, s, shapes), batch),
                                     rng, string_length)
                  for s in inputs.specs}
        sets = [arrays]
    else:
        path = Path(source)
        if path.is_dir():
            sets = _from_directory(inputs, path, batch)
        elif path.is_file():
            sets = _from_json(inputs, path, batch, shapes)
        else:
            raise InputError(f"--input-data: expected zero, random, a JSON file or a directory of "
                             f"NAME.npy files, got {source!r} (no such file or directory)")
    return sets
