"""`torchpool infer --input`: from the command line to the values `Client.infer` takes.

    NAME=JSON              the model's declared datatype (from its metadata)
    NAME=JSON:DATATYPE     a Triton datatype name: FP32, INT64, BYTES, BF16, ...
    NAME=@FILE.npy         a numpy file, with its own dtype and shape
    NAME=@FILE.npy:DATATYPE  ... converted to DATATYPE

JSON strings make a BYTES tensor. Every problem is a CliError naming the
--input and what was expected; nothing here raises anything else.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping, Optional, Union

import numpy as np

from ..protocol.datatypes import WIRE_DATATYPES, numpy_dtype
from .errors import USAGE, CliError

if TYPE_CHECKING:
    import torch

    from ..client import RawTensor

SYNTAX = "NAME=JSON[:DATATYPE] or NAME=@FILE.npy[:DATATYPE]"
# Triton's order, for messages (the same set as protocol.datatypes.WIRE_DATATYPES)
DATATYPE_NAMES = ("BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64",
                  "FP16", "BF16", "FP32", "FP64", "BYTES")


@dataclass(frozen=True)
class InputSpec:
    """One --input as written: the name, the JSON text or the .npy path, and an explicit datatype."""

    text: str                  # the whole argument, for messages
    name: str
    json_text: Optional[str]   # NAME=JSON...
    path: Optional[str]        # NAME=@FILE...
    datatype: Optional[str]    # from :DATATYPE

    @property
    def needs_metadata(self) -> bool:
        """JSON numbers with no :DATATYPE take the model's declared datatype."""
        return self.json_text is not None and self.datatype is None


def parse_spec(text: str) -> InputSpec:
    name, sep, value = text.partition("=")
    if not sep or not name or not value:
        raise CliError(USAGE, f"--input {text}: expected {SYNTAX}")
    datatype = None
    head, colon, tail = value.rpartition(":")
    if colon and tail.isalnum() and head:     # a trailing :FP32; JSON never ends that way
        datatype = tail.upper()
        if datatype not in WIRE_DATATYPES:
            raise CliError(USAGE, f"--input {text}: unknown datatype '{tail}' "
                                  f"(Triton's names: {', '.join(DATATYPE_NAMES)})")
        value = head
    if value.startswith("@"):
        return InputSpec(text, name, None, value[1:], datatype)
    return InputSpec(text, name, value, None, datatype)


def parse_specs(texts: list[str]) -> list[InputSpec]:
    specs = [parse_spec(t) for t in texts]
    seen: set[str] = set()
    for spec in specs:
        if spec.name in seen:
            raise CliError(USAGE, f"--input {spec.name}: given twice")
        seen.add(spec.name)
    return specs


def input_value(spec: InputSpec, declared: Mapping[str, str]) -> Union[np.ndarray, RawTensor]:
    """The value for Client.infer. `declared`: input name -> the model's datatype."""
    if spec.path is not None:
        return _from_file(spec, spec.path)
    assert spec.json_text is not None       # parse_spec gives one of path and json_text
    try:
        data = json.loads(spec.json_text)
    except json.JSONDecodeError as exc:
        raise CliError(USAGE, f"--input {spec.text}: not valid JSON ({exc.msg} at column {exc.colno}); "
                              f"quote it for the shell, e.g. --input '{spec.name}=[[1,2,3]]'") from None
    datatype = spec.datatype or declared.get(spec.name) or _guess(data)
    return _from_json(spec, data, datatype)


def _leaves(data: object) -> list[object]:
    """The scalars of nested JSON lists, in order (ragged or not)."""
    if not isinstance(data, list):
        return [data]
    return [leaf for item in data for leaf in _leaves(item)]


def _guess(data: object) -> str:
    """No :DATATYPE and the model does not declare the input (the server will
    say so): strings make BYTES, numbers FP32."""
    leaves = _leaves(data)
    return "BYTES" if leaves and all(isinstance(x, str) for x in leaves) else "FP32"


def _from_json(spec: InputSpec, data: object, datatype: str) -> Union[np.ndarray, RawTensor]:
    what = f"--input {spec.text}"
    strings = [isinstance(x, str) for x in _leaves(data)]
    if datatype == "BYTES" and not all(strings):
        raise CliError(USAGE, f"{what}: a BYTES tensor is made of JSON strings")
    if datatype != "BYTES" and any(strings):
        raise CliError(USAGE, f"{what}: {datatype} expects numbers, not strings")
    try:
        if datatype == "BYTES":
            return np.array(data, dtype=object)      # str elements: the client encodes them
        if datatype == "BF16":
            return _bf16(np.asarray(data, dtype=np.float32))
        exact = np.asarray(data)
        target = numpy_dtype(datatype)
        if target.kind in "iu" and exact.dtype.kind == "f" and not np.all(np.mod(exact, 1) == 0):
            raise CliError(USAGE, f"{what}: {datatype} expects whole numbers")
        if target.kind == "b" and exact.dtype.kind != "b":
            raise CliError(USAGE, f"{what}: BOOL expects true or false")
        return np.asarray(data, dtype=target)
    except (ValueError, TypeError, OverflowError) as exc:
        why = "the nested lists are not all the same length" if "inhomogeneous" in str(exc) else str(exc)
        raise CliError(USAGE, f"{what}: cannot make a tensor of {datatype} from it: {why}") from None


def _from_file(spec: InputSpec, path: str) -> Union[np.ndarray, RawTensor]:
    """`spec`'s value from its .npy file `path` (spec.path)."""
    what = f"--input {spec.text}"
    try:
        arr = np.load(path, allow_pickle=False)
    except OSError as exc:
        raise CliError(USAGE, f"{what}: cannot read {path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        # object arrays need pickle, which would run code from the file
        raise CliError(USAGE, f"{what}: {path} is not a plain .npy array ({exc}); for BYTES "
                              f"give a JSON list of strings") from None
    if not isinstance(arr, np.ndarray):
        raise CliError(USAGE, f"{what}: {path} holds several arrays (.npz); give one .npy file")
    if spec.datatype is None:
        return arr
    try:
        if spec.datatype == "BF16":
            return _bf16(arr.astype(np.float32))
        if spec.datatype == "BYTES":
            return arr.astype(str).astype(object)
        return arr.astype(numpy_dtype(spec.datatype))
    except (ValueError, TypeError) as exc:
        raise CliError(USAGE, f"{what}: cannot convert {arr.dtype} to {spec.datatype}: {exc}") from None


def _bf16(values: np.ndarray) -> RawTensor:
    """float32 -> bfloat16 bits, rounded to nearest even, as a RawTensor
    (numpy has no bfloat16; the client sends a RawTensor's bytes as they are)."""
    from ..client import RawTensor

    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    rounded[np.isnan(values)] = 0x7FC0
    return RawTensor("BF16", values.shape, rounded.tobytes())


def output_row(name: str, value: Union[np.ndarray, torch.Tensor]) -> dict:
    """One output as a JSON line: its Triton datatype, shape and values."""
    from ..protocol.datatypes import wire_from_numpy

    if not isinstance(value, np.ndarray):       # a BF16 output comes as a torch tensor
        return {"name": name, "datatype": "BF16", "shape": list(value.shape),
                "data": value.float().reshape(-1).tolist()}
    data = [v.decode("utf-8", "replace") if isinstance(v, bytes) else v for v in value.reshape(-1).tolist()]
    return {"name": name, "datatype": wire_from_numpy(value.dtype), "shape": list(value.shape), "data": data}


__all__ = ["DATATYPE_NAMES", "SYNTAX", "InputSpec", "input_value", "output_row", "parse_spec", "parse_specs"]
