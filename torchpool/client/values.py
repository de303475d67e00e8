"""User values <-> tensor bytes: what `infer` accepts and what it returns.

Inputs may be numpy arrays, torch tensors (viewed through numpy, no copy on
the CPU) or lists of str/bytes (BYTES). Outputs come back as read-only numpy
views of the bytes they arrived in; BYTES as object arrays of bytes; BF16 as
torch tensors when torch is installed (numpy has no bfloat16), else as the
raw uint16 bits. torch is imported only when the caller hands us a torch
tensor or a BF16 output arrives: a client-only install has no torch.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence, Union, cast

import numpy as np

from ..protocol import datatypes, errors, tensors
from ..protocol.errors import InferenceError
from .types import InputValue, RawTensor, Tensor

if TYPE_CHECKING:
    import torch
    from typing_extensions import Buffer

# A prepared input's bytes: a numpy array (maybe not contiguous, maybe not
# native byte order), or bytes / a view to send as they are.
Source = Union[np.ndarray, bytes, memoryview]


# The wire datatype of each numpy dtype met so far that needs no conversion
# (native byte order, fixed size): a numpy array input costs one lookup.
_PLAIN_DTYPES: dict[np.dtype, str] = {}


def prepare_input(name: str, value: InputValue) -> tuple[str, list[int], Source]:
    """(datatype, shape, source): source is a numpy array (maybe not
    contiguous, maybe not native byte order) or the encoded bytes of a BYTES
    tensor. Torch tensors are viewed through numpy (no copy when on the CPU);
    a RawTensor's bytes are taken as they are."""
    if type(value) is np.ndarray:
        datatype = _PLAIN_DTYPES.get(value.dtype)
        if datatype is not None:
            return datatype, list(value.shape), value
    if isinstance(value, RawTensor):
        return value.datatype, list(value.shape), memoryview(value.data).cast("B")
    module = type(value).__module__
    if module == "torch" or module.startswith("torch."):
        import torch  # the caller already has torch loaded

        t = cast("torch.Tensor", value).detach()
        if t.device.type != "cpu":
            t = t.cpu()
        t = t.resolve_conj().resolve_neg()
        if t.dtype == torch.bfloat16:
            return "BF16", list(t.shape), t.view(torch.int16).numpy().view(np.uint16)
        value = t.numpy()
    if isinstance(value, (list, tuple)):
        if value and all(isinstance(v, (str, bytes, bytearray)) for v in value):
            return "BYTES", [len(value)], datatypes.encode_bytes(value)
        value = np.asarray(value)
    if not isinstance(value, np.ndarray):
        value = np.asarray(value)
    if value.dtype.kind in ("O", "S", "U"):
        flat = value.reshape(-1)
        return "BYTES", list(value.shape), datatypes.encode_bytes(flat.tolist())
    try:
        datatype = datatypes.wire_from_numpy(value.dtype)
    except TypeError:
        raise InferenceError(errors.INVALID_ARG,
                             f"input '{name}': numpy dtype {value.dtype} is not supported") from None
    if value.dtype.isnative:
        _PLAIN_DTYPES[value.dtype] = datatype
    return datatype, list(value.shape), value


def nbytes_of(src: Source) -> int:
    """Bytes of a prepared source."""
    return src.nbytes if isinstance(src, np.ndarray) else len(src)


def as_value(datatype: str, shape: Sequence[int], data: Buffer) -> Tensor:
    """Tensor bytes as what `infer` returns (see the module doc)."""
    arr = tensors.decode_array(datatype, shape, data)
    if datatype != "BF16":
        return arr
    try:
        import torch
    except ImportError:
        return arr
    return torch.from_numpy(arr.view(np.int16).copy()).view(torch.bfloat16)


def output_array(entry: tensors.Entry, frames: Sequence[Buffer]) -> Tensor:
    """An output that came as bytes (inline or a payload frame): a read-only
    view that keeps the frame alive (no copy); see `as_value`."""
    # the daemon's own answer: it wrote a datatype string and a list of ints
    return as_value(cast(str, entry[tensors.DATATYPE]), cast("list[int]", entry[tensors.SHAPE]),
                    tensors.tensor_payload(entry, frames))
