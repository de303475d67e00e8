"""ModelInferRequest -> what `Backend.infer` takes, as Triton reads it.

No grpc here (only the protobuf classes): the helper process (offload.py)
runs `infer_call_of_bytes` for a request whose non-tensor part is large,
and turns typed `contents` into tensor bytes there. Inputs whose bytes are
in raw_input_contents say which entry (`InputTensor.raw_index`); the
server gives them the entries (`attach_raw`). Every entry must be taken by
an input: Triton's clients send one per input that has no other data.
"""
from __future__ import annotations

from typing import Mapping, Optional, Sequence, Union

from ..protocol.names import check_model_name
from .backend import InputTensor, KServeInfer, OutputRequest, bad, check_counts, check_dims, input_bytes
from .proto import grpc_service_pb2 as pb

# The `contents` field of each datatype, and the datatype Triton names for a
# field given with the wrong datatype. FP16/BF16 have none: only raw bytes.
_CONTENTS_FIELD = {"BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents",
                   "INT32": "int_contents", "INT64": "int64_contents", "UINT8": "uint_contents",
                   "UINT16": "uint_contents", "UINT32": "uint_contents", "UINT64": "uint64_contents",
                   "FP32": "fp32_contents", "FP64": "fp64_contents", "BYTES": "bytes_contents"}
_FIELD_DATATYPE = {"bool_contents": "BOOL", "int_contents": "INT32", "int64_contents": "INT64",
                   "uint_contents": "UINT32", "uint64_contents": "UINT64", "fp32_contents": "FP32",
                   "fp64_contents": "FP64", "bytes_contents": "BYTES"}


# --- request parameters ------------------------------------------------------------------

def _param(params: Mapping[str, pb.InferParameter], key: str, kinds: tuple[str, ...],
           where: str = "") -> Optional[tuple[pb.InferParameter, str]]:
    """Parameter `key` and which of its InferParameter oneof fields is set
    (None if absent), which must be one of `kinds`; Triton's error text otherwise."""
    if key not in params:        # not params[key]: that would insert an entry
        return None
    value = params[key]
    which = value.WhichOneof("parameter_choice")
    if which not in kinds:
        raise bad(f"invalid value type for '{key}' parameter{where}, expected {' or '.join(kinds)}.")
    return value, which


def _int_param(params: Mapping[str, pb.InferParameter], key: str,
               kinds: tuple[str, ...] = ("int64_param",), where: str = "") -> Optional[int]:
    """`_param`'s value, of int64_param or uint64_param."""
    found = _param(params, key, kinds, where)
    if found is None:
        return None
    value, which = found
    return value.uint64_param if which == "uint64_param" else value.int64_param


def _str_param(params: Mapping[str, pb.InferParameter], key: str, where: str = "") -> Optional[str]:
    found = _param(params, key, ("string_param",), where)
    return None if found is None else found[0].string_param


def _bool_param(params: Mapping[str, pb.InferParameter], key: str) -> Optional[bool]:
    found = _param(params, key, ("bool_param",))
    return None if found is None else found[0].bool_param


def _region(tensor: Union[pb.ModelInferRequest.InferInputTensor, pb.ModelInferRequest.InferRequestedOutputTensor]
            ) -> Optional[tuple[str, int, int]]:
    """(region, byte_size, offset) of a tensor in system shared memory, or None."""
    where = f" for tensor '{tensor.name}'"
    params = tensor.parameters
    region = _str_param(params, "shared_memory_region", where)
    offset = _int_param(params, "shared_memory_offset", where=where)
    size = _int_param(params, "shared_memory_byte_size", where=where)
    if region is None:
        for key, value in (("shared_memory_offset", offset), ("shared_memory_byte_size", size)):
            if value is not None:
                raise bad(f"'{key}' can not be specified without 'shared_memory_region' "
                          f"parameter for tensor '{tensor.name}'")
        return None
    if size is None:
        raise bad(f"'shared_memory_byte_size' must be specified along with 'shared_memory_region' "
                  f"parameter for tensor '{tensor.name}'")
    return region, size, offset or 0


def _read_parameters(params: Mapping[str, pb.InferParameter], call: KServeInfer) -> None:
    """The request's parameters Triton reads (sequence, priority, timeout) into `call`."""
    sequence = _param(params, "sequence_id", ("int64_param", "string_param"))
    if sequence is not None:
        value, which = sequence
        call.sequence_id = value.string_param if which == "string_param" else value.int64_param
    call.sequence_start = _bool_param(params, "sequence_start") is True
    call.sequence_end = _bool_param(params, "sequence_end") is True
    priority = _int_param(params, "priority", ("int64_param", "uint64_param"))
    if priority is not None:
        if priority < 0:
            raise bad("invalid value for 'priority', expected value >= 0.")
        call.priority = priority
    timeout = _int_param(params, "timeout")
    if timeout:
        call.timeout_us = max(timeout, 0)


# --- tensors --------------------------------------------------------------------------------

def _typed_values(tensor: pb.ModelInferRequest.InferInputTensor, model: str) -> list:
    """The elements of an input given in `contents`, checked as Triton does."""
    given = [field.name for field, _ in tensor.contents.ListFields()]
    if not given:
        return []
    where = f"input tensor '{tensor.name}' for model '{model}'"
    if len(given) > 1:
        raise bad(f"unexpected explicit tensor data for {where}, binary data was already supplied.")
    if _CONTENTS_FIELD.get(tensor.datatype) != given[0]:
        raise bad(f"unexpected explicit tensor data for {where} of type "
                  f"'{_FIELD_DATATYPE[given[0]]}', expected datatype '{tensor.datatype}'")
    return list(getattr(tensor.contents, given[0]))


def _inputs(request: pb.ModelInferRequest, raw_count: int, convert: bool = False) -> list[InputTensor]:
    model = request.model_name
    inputs = []
    next_raw = 0
    check_counts(model, len(request.inputs), len(request.outputs))
    for t in request.inputs:
        check_dims(model, t.name, len(t.shape))
        parsed = InputTensor(t.name, t.datatype, list(t.shape))
        region = _region(t)
        if region is not None:
            if t.HasField("contents"):
                raise bad(f"unexpected 'content' provided when using shared memory for input "
                          f"tensor '{t.name}' for model '{model}'")
            parsed.region, parsed.byte_size, parsed.offset = region
        elif t.HasField("contents"):
            if raw_count:
                raise bad(f"contents field must not be specified when using raw_input_contents "
                          f"for '{t.name}' for model '{model}'")
            parsed.values = _typed_values(t, model)
            if convert:
                parsed.raw, parsed.values = input_bytes(parsed, model), None
        elif next_raw < raw_count:
            # raw entries are taken in order by the inputs that have no other data
            parsed.raw_index = next_raw
            next_raw += 1
        else:
            raise bad(f"unable to find data for input tensor '{t.name}' for model '{model}' in request.")
        inputs.append(parsed)
    if next_raw != raw_count:
        # Triton would ignore them; a client that sent them meant something else
        raise bad(f"raw_input_contents has {raw_count} entries but {next_raw} of the inputs of the "
                  f"request for model '{model}' take raw data")
    return inputs


def _outputs(request: pb.ModelInferRequest) -> Optional[list[OutputRequest]]:
    if not request.outputs:
        return None                 # every output of the model
    wanted = []
    for o in request.outputs:
        region = _region(o)
        classes = _int_param(o.parameters, "classification")
        if region is not None and classes is not None:
            raise bad("output can't set both 'shared_memory_region' and 'classification'")
        if classes is not None and classes <= 0:
            raise bad("invalid value for 'classification' parameter, expected >= 0")
        out = OutputRequest(o.name, binary=True, classification=classes or 0)
        if region is not None:
            out.region, out.byte_size, out.offset = region
        wanted.append(out)
    return wanted


def infer_call(request: pb.ModelInferRequest, raw_count: int, convert: bool = False) -> KServeInfer:
    """The request (its raw_input_contents counted, not given); with
    `convert`, typed contents become tensor bytes. Outputs not asked
    otherwise are sent binary (raw_output_contents)."""
    check_model_name(request.model_name)      # before any error that would name it
    call = KServeInfer(request.model_name, request.model_version, _inputs(request, raw_count, convert),
                       _outputs(request), request.id, binary_default=True)
    _read_parameters(request.parameters, call)
    return call


def infer_call_of_bytes(message: bytes, raw_count: int) -> KServeInfer:
    """In the helper process: a request without its raw_input_contents."""
    from google.protobuf.message import DecodeError

    try:
        request = pb.ModelInferRequest.FromString(message)
    except DecodeError as exc:
        raise bad(f"unable to parse the inference request: {exc}") from None
    return infer_call(request, raw_count, convert=True)


def attach_raw(call: KServeInfer, raws: Sequence[Union[bytes, memoryview]]) -> KServeInfer:
    for t in call.inputs:
        if t.raw_index is not None:
            t.raw, t.raw_index = raws[t.raw_index], None
    return call
