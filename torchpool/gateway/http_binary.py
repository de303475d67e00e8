"""Triton's inference request and response over HTTP: the JSON document and
the binary tensor data extension, and HTTP compression of both.

A request body is `Inference-Header-Content-Length` bytes of JSON followed by
the binary inputs in input order (each declares `binary_data_size`); without
that header the body is all JSON. Inputs become `InputTensor`s whose `raw` is
a memoryview slice of the body (no copy: the backend copies once, into shared
memory). A large JSON document is parsed in the helper process (offload.py),
which also turns its "data" lists into tensor bytes: `infer_call` is the
part that runs there, `parse_infer` the whole parse. A response is JSON,
then the binary outputs in output order, written from the worker's shared
memory; `Inference-Header-Content-Length` says where the JSON ends; large
outputs are converted a chunk per turn of the event loop (chunks.py).
A raw binary request (`Inference-Header-Content-Length: 0`, or an empty body
without that header) is the model's one input and nothing else: `raw_call`
makes it from the model's config as Triton's core does (its
InferenceRequest::Normalize), and every output comes back binary.
Messages follow Triton's http_server.cc wording.
"""
from __future__ import annotations

import asyncio
import json
import math
import re
import secrets
import struct
import zlib
from typing import Callable, Optional, Union

from ..protocol import datatypes, errors
from ..protocol.errors import TorchpoolError
from .backend import InferResponse, InputTensor, KServeInfer, OutputRequest, bad, check_counts, check_dims, input_bytes
from .chunks import CHUNK_ELEMENTS, Chunk, json_values, tensor_bytes
from .defaults import MAX_INPUT_BYTES
from .http_bodies import Body, body_buffer
from .http_messages import Response
from .offload import OFFLOAD_BYTES, Offload

# (containers, deepest, stop) of a document: json_scan
JsonScan = Callable[[Body, int, int], tuple[int, int, int]]
# (document, max_depth, replacement) -> the document with what opens deeper replaced: _prune_deep
JsonPrune = Callable[[Body, int, bytes], bytes]
try:
    from ..protocol import _bytescan
    # (an extension built before these were added has none)
    _json_scan_c: Optional[JsonScan] = getattr(_bytescan, "json_scan", None)
    _json_prune_c: Optional[JsonPrune] = getattr(_bytescan, "json_prune", None)
except ImportError:         # built without a C compiler: the regular-expression walks below
    _json_scan_c = _json_prune_c = None

INFER_HEADER = "inference-header-content-length"
# Triton's default --http-max-input-size for the JSON document, whatever the
# body's limit: parsed into Python objects it takes several times its size,
# so it is checked first
MAX_JSON_BYTES = MAX_INPUT_BYTES
# Triton's limit on how deep a JSON document nests, and its words for it
MAX_JSON_DEPTH = 100
DEPTH_MESSAGE = f"JSON nesting depth exceeds maximum allowed limit ({MAX_JSON_DEPTH})"
# Arrays and objects in one document. json.loads makes a Python object of
# each (72-80 bytes, tracked by the garbage collector): 60 MiB of "[]," took
# the helper process from 40 to 1,603 MiB and 16-44 s before this limit.
# Tensor data is flat in what tritonclient sends; nested, this is rows of
# it (224x224 RGB images nested: 50,401 per image).
MAX_JSON_CONTAINERS = 1 << 20
_RESERVED_PREFIX = "triton_"


# Compressed bodies, and responses to compress, from this size are
# (de)compressed in a thread: zlib lets go of the GIL, the loop serves on.
THREAD_BYTES = 64 << 10


# --- JSON field checks (TritonJson's AsUInt / AsBool / AsString) ------------------

def _uint(value: object, what: str, bits: int = 63) -> int:
    """An unsigned integer below 2^bits: 63 for most fields, 64 for the
    shared-memory offsets and byte sizes (Triton's uint64; the daemon checks
    them against the region in Triton's words)."""
    if type(value) is not int or value < 0 or value >= 1 << bits:
        raise bad(f"Unable to parse '{what}': expected an unsigned integer, got {_short(value)}")
    return value


def _bool(value: object, what: str) -> bool:
    if type(value) is not bool:
        raise bad(f"Unable to parse '{what}': expected a boolean, got {_short(value)}")
    return value


def _str(value: object, what: str) -> str:
    if not isinstance(value, str):
        raise bad(f"Unable to parse '{what}': expected a string, got {_short(value)}")
    return value


def _obj(value: object, what: str) -> dict:
    if not isinstance(value, dict):
        raise bad(f"Unable to parse '{what}': expected an object, got {_short(value)}")
    return value


def _list(value: object, what: str) -> list:
    if not isinstance(value, list):
        raise bad(f"Unable to parse '{what}': expected an array, got {_short(value)}")
    return value


def _short(value: object) -> str:
    """A value as the client wrote it, cut short (an integer too long to
    print whole is shown by its digits' count)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"an integer of {value.bit_length()} bits"
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def check_json_size(size: int, what: str = "request") -> None:
    if size > MAX_JSON_BYTES:
        raise bad(f"{what} JSON size of {size} bytes exceeds the maximum allowed input size of "
                  f"{MAX_JSON_BYTES} bytes")


# the bytes of an HTTP body (or a slice of it) as the parsers get them
Buffer = Union[bytes, bytearray, memoryview]


def _json_scan_re(data: Body, max_depth: int, max_containers: int) -> tuple[int, int, int]:
    """json_scan without the C extension: strings (skipped whole) and brackets
    found by a regular expression, the rest passed over by its engine (60 MiB
    of numbers in about 1.5 s, of "[]," to the limit 1.6 s, against 0.01 s
    in C)."""
    containers = depth = deepest = 0
    for m in _JSON_TOKEN.finditer(data):
        c = data[m.start()]
        if c in b"[{":
            containers += 1
            depth += 1
            deepest = max(deepest, depth)
            if depth > max_depth or containers > max_containers:
                return containers, deepest, m.start()
        elif c in b"]}":
            depth = max(depth - 1, 0)
    return containers, deepest, len(data)


_JSON_TOKEN = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"?|[\[\]{}]', re.S)


def json_scan(data: Body, max_depth: int, max_containers: int) -> tuple[int, int, int]:
    """(containers, deepest, stop): the arrays and objects of a JSON document
    and how deep they nest, counted before anything is made of it, until one
    is deeper than `max_depth` or more than `max_containers` (`stop`: the
    byte where the walk stopped; len(data) when it walked it all). In C
    (_bytescan.json_scan: 60 MiB of numbers in 6 ms, a small request in
    0.4 us), else `_json_scan_re`."""
    return (_json_scan_c or _json_scan_re)(data, max_depth, max_containers)


def _refuse_json_shape(containers: int, deepest: int, stop: int, what: str) -> None:
    # (the walk stops at the first limit passed; a control document walked whole
    # for its deep values may pass both: the count is said)
    if deepest > MAX_JSON_DEPTH and containers <= MAX_JSON_CONTAINERS:
        raise bad(f"{DEPTH_MESSAGE}: the {what} JSON nests deeper at byte {stop}")
    raise bad(f"the {what} JSON has more than {MAX_JSON_CONTAINERS} arrays and objects (the "
              f"limit: each takes about 80 bytes as a Python object): send tensor data as "
              f"flat arrays, or as binary data")


# what a value nested too deeply becomes in a control request's document (no
# field of one is a container, so it is a wrong value whatever its field);
# only in documents up to DEEP_VALUES_BYTES, larger ones are refused. The walk
# that cuts them out runs in the gateway's loop: in C (_bytescan.json_prune)
# about 1 ms for a 1 MiB document; without the extension, the regular
# expression below, 0.1-0.2 s.
DEEP_VALUE = b"NaN"
DEEP_VALUES_BYTES = 1 << 20


def _prune_deep(data: Body) -> bytes:
    """The document with each array or object that opens deeper than
    MAX_JSON_DEPTH replaced, whole, by DEEP_VALUE (strings passed over)."""
    if _json_prune_c is not None:
        return _json_prune_c(data, MAX_JSON_DEPTH, DEEP_VALUE)
    return _prune_deep_re(data)


def _prune_deep_re(data: Body) -> bytes:
    """_prune_deep without the C extension."""
    out, depth, cut = bytearray(), 0, None
    kept = 0
    for m in _JSON_TOKEN.finditer(data):
        c = data[m.start()]
        if c in b"[{":
            depth += 1
            if depth == MAX_JSON_DEPTH + 1:
                cut = m.start()
        elif c in b"]}":
            depth = max(depth - 1, 0)
            if depth == MAX_JSON_DEPTH and cut is not None:
                out += data[kept:cut]
                out += DEEP_VALUE
                kept, cut = m.end(), None
    out += data[kept:cut if cut is not None else len(data)]
    return bytes(out)


def load_json(data: Body, what: str = "request", deep_values: bool = False) -> object:
    """A JSON document from bytes; a clear 400 for anything else (including
    nesting deeper than MAX_JSON_DEPTH, more arrays and objects than
    MAX_JSON_CONTAINERS, and integers longer than Python converts). With
    `deep_values` (control requests, whose fields hold no arrays or objects),
    a value nested too deeply is not refused here but read as DEEP_VALUE, so
    that its field's check answers, as Triton's does after parsing it all."""
    check_json_size(len(data), what)
    # before json.loads makes a Python object of each array and object
    containers, deepest, stop = (_json_scan_c or _json_scan_re)(data, MAX_JSON_DEPTH, MAX_JSON_CONTAINERS)
    if deep_values and deepest > MAX_JSON_DEPTH and len(data) <= DEEP_VALUES_BYTES:
        # every array and object counted first (the limit on them holds for what is cut out too)
        containers, deepest, stop = (_json_scan_c or _json_scan_re)(data, len(data) + 1, MAX_JSON_CONTAINERS)
        if containers <= MAX_JSON_CONTAINERS:
            data = _prune_deep(data)
            containers, deepest, stop = (_json_scan_c or _json_scan_re)(data, MAX_JSON_DEPTH,
                                                                         MAX_JSON_CONTAINERS)
    if deepest > MAX_JSON_DEPTH or containers > MAX_JSON_CONTAINERS:
        _refuse_json_shape(containers, deepest, stop, what)
    try:
        return json.loads(bytes(data))
    except json.JSONDecodeError as exc:
        raise bad(f"failed to parse the {what} JSON buffer: {exc.msg} at {exc.pos}") from None
    except UnicodeDecodeError as exc:
        raise bad(f"failed to parse the {what} JSON buffer: not UTF-8 at {exc.start}") from None
    except RecursionError:
        raise bad(f"failed to parse the {what} JSON buffer: nested too deeply") from None
    except ValueError:
        # Python's limit on the digits of an integer (sys.get_int_max_str_digits)
        raise bad(f"failed to parse the {what} JSON buffer: a number has too many digits") from None


# --- the request ---------------------------------------------------------------

def header_length(headers: dict, body_size: int) -> Optional[int]:
    """Where the JSON ends: None if the whole body is JSON, 0 for a raw
    binary request (Triton's GetInferenceHeaderLength: without the header
    the length is the body's, so an empty body is a raw request too)."""
    text = headers.get(INFER_HEADER)
    if text is None:
        return 0 if body_size == 0 else None
    try:
        value = int(text.strip())
    except ValueError:
        raise bad(f"Unable to parse Inference-Header-Content-Length, got: {text[:40]}") from None
    if value < 0 or value > body_size:
        raise bad(f"inference header size should be in range (0, {body_size}), got: {text[:40]}")
    return value


def is_raw(headers: dict, body_size: int) -> bool:
    """Whether the body is a raw binary request (the header checked first)."""
    return header_length(headers, body_size) == 0


# Triton's name for the input of a raw request until its config names it: its
# core's byte-size check still says this name (the request's map key)
RAW_INPUT = "raw_input"
_BYTES_LENGTH = struct.Struct("<I")


def raw_call(body: Body, config: dict, model: str, version: str = "") -> KServeInfer:
    """A raw binary request: the whole body is the model's one input, its
    name, datatype and shape the config's (Triton's core, Normalize):
    batch dimension 1 when max_batch_size is not 0; one variable-size
    dimension at most, deduced from the body's size; BYTES only for a
    one-element input, the body being that one string (its length is
    prepended). No id, no parameters; every output, binary."""
    inputs = config.get("input") or []
    if len(inputs) != 1:
        raise bad(f"Raw request must only have 1 input (found 1) to be deduced but got {len(inputs)} "
                  f"inputs in '{model}' model configuration")
    spec = inputs[0]
    name = str(spec.get("name", ""))
    datatype = datatypes.config_to_wire(str(spec.get("data_type", "")))
    if datatype not in datatypes.WIRE_DATATYPES:
        raise bad(f"invalid datatype '{datatype}' of input '{name}' for model '{model}'")
    shape = [1] if int(config.get("max_batch_size", 0) or 0) != 0 else []
    variable, count = None, 1
    for dim in (int(d) for d in spec.get("dims", ()) or ()):
        if dim == -1:
            if variable is not None:
                raise bad(f"The shape of the raw input '{name}' can not be deduced because there are "
                          f"more than one variable-sized dimension")
            variable = len(shape)
        else:
            count *= dim
        shape.append(dim)
    size = len(body)
    if datatype == "BYTES":
        if variable is not None or count != 1:
            raise bad(f"For BYTE datatype raw input '{name}', the model must have input shape [1]")
        data: Buffer = _BYTES_LENGTH.pack(size) + bytes(body)
    else:
        item = datatypes.element_size(datatype)
        if variable is not None:
            shape[variable] = size // count // item if count else 0
        expected = math.prod(shape) * item
        if expected != size:
            raise bad(f"input byte size mismatch for input '{RAW_INPUT}' for model '{model}'. "
                      f"Expected {expected}, got {size}")
        data = memoryview(body)
    return KServeInfer(model, version, [InputTensor(name, datatype, shape, raw=data)], binary_default=True)


def parse_infer(body: Body, headers: dict, model: str, version: str = "") -> KServeInfer:
    """The whole request, parsed here (small documents, tests)."""
    document, json_end = json_document(body, headers)
    return attach_binary(infer_call(document, json_end, len(body), model, version), body)


# A control document comes back from the helper with at most this many array
# and object entries in all (control_document)
CONTROL_ITEMS = 4096


def control_document(data: Body, deep_values: bool = False) -> object:
    """A control request's JSON document (load_json), with at most
    CONTROL_ITEMS array and object entries in all: an array or object that
    would take it past that is read as NaN, as a value nested too deeply is.
    No control field takes one (a field that expects a boolean, a string or
    an object of a few parameters answers that it got a wrong value), and
    parsed in the helper process, such a document (up to 64 MiB of numbers,
    in one array or in thousands of arrays each short) would come back as
    millions of objects for the event loop to unpickle."""
    left = CONTROL_ITEMS

    def bounded(value: object) -> object:
        nonlocal left
        if not isinstance(value, (list, dict)):
            return value
        if len(value) > left:
            return math.nan
        left -= len(value)
        if isinstance(value, list):
            return [bounded(v) for v in value]
        return {k: bounded(v) for k, v in value.items()}

    return bounded(load_json(data, deep_values=deep_values))


async def control_document_off_loop(body: Body, offload: Offload, deep_values: bool = False) -> object:
    """`control_document`, in the helper process when the body is large
    (json.loads of 64 MiB of numbers holds the event loop for about 1.5 s)."""
    if len(body) < OFFLOAD_BYTES:
        return control_document(body, deep_values)
    check_json_size(len(body))               # before the copy to the helper
    return await offload.run(control_document, bytes(body), deep_values)


async def parse_infer_off_loop(body: Body, headers: dict, model: str, version: str,
                               offload: Offload) -> KServeInfer:
    """The request, its JSON parsed in the helper process when it is large."""
    document, json_end = json_document(body, headers)
    if len(document) < OFFLOAD_BYTES:
        call = infer_call(document, json_end, len(body), model, version)
    else:
        check_json_size(len(document))       # before the copy to the helper
        call = await offload.run(infer_call, bytes(document), json_end, len(body), model, version, True)
    return attach_binary(call, body)


def json_document(body: Body, headers: dict) -> tuple[memoryview, Optional[int]]:
    """The JSON part of a body, and where it ends (None: the whole body)."""
    json_end = header_length(headers, len(body))
    view = memoryview(body)
    return (view[:json_end] if json_end is not None else view), json_end


def infer_call(document: Union[memoryview, bytes], json_end: Optional[int], size: int, model: str,
               version: str = "", convert: bool = False) -> KServeInfer:
    """The request's JSON document as a KServeInfer; binary inputs point into
    the body (`raw_at`); with `convert`, "data" lists become tensor bytes
    (what the helper process hands back instead of Python lists)."""
    doc = _obj(load_json(document), "request")
    call = KServeInfer(model, version, [])
    if "id" in doc:
        call.id = _str(doc["id"], "id")
    _parse_params(doc.get("parameters"), call)
    offset = json_end if json_end is not None else size
    inputs = _list(doc.get("inputs"), "inputs")
    check_counts(model, len(inputs), len(doc["outputs"]) if isinstance(doc.get("outputs"), list) else 0)
    for i, item in enumerate(inputs):
        tensor, offset = _parse_input(_obj(item, f"inputs[{i}]"), size, offset, json_end, model)
        if convert and tensor.values is not None:
            tensor.raw, tensor.values = input_bytes(tensor, model), None
        call.inputs.append(tensor)
    if offset != size:
        raise bad(f"unexpected additional input data for model '{model}'")
    if "outputs" in doc:
        call.outputs = [_parse_output(_obj(o, "outputs"), model) for o in _list(doc["outputs"], "outputs")]
    return call


def attach_binary(call: KServeInfer, body: Body) -> KServeInfer:
    """Binary inputs as views of the body (no copy)."""
    view = memoryview(body)
    for t in call.inputs:
        if t.raw_at is not None:
            start, end = t.raw_at
            t.raw, t.raw_at = view[start:end], None
    return call


def _parse_params(params: object, call: KServeInfer) -> None:
    if params is None:
        return
    for key, value in _obj(params, "parameters").items():
        if key == "sequence_id":
            if not (isinstance(value, str) or (type(value) is int and 0 <= value < 1 << 64)):
                raise bad(f"Unable to parse 'sequence_id': expected an unsigned integer or a string, "
                          f"got {_short(value)}")
            call.sequence_id = value
        elif key == "sequence_start":
            call.sequence_start = _bool(value, key)
        elif key == "sequence_end":
            call.sequence_end = _bool(value, key)
        elif key == "priority":
            call.priority = _uint(value, key)
        elif key == "timeout":
            call.timeout_us = _uint(value, key)
        elif key == "binary_data_output":
            call.binary_default = _bool(value, key)
        elif key.startswith(_RESERVED_PREFIX):
            raise bad("parameter keys starting with 'triton_' are reserved for Triton usage and "
                      "should not be specified.")
        # other parameters are the model's: TorchScript models take none


def _content_kind(item: dict, params: dict) -> str:
    kinds = [k for k, present in (("data", "data" in item),
                                  ("binary_data_size", "binary_data_size" in params),
                                  ("shared_memory_region", "shared_memory_region" in params)) if present]
    if len(kinds) != 1:
        found = " no field is set" if not kinds else " set " + " ".join(f"'{k}'" for k in kinds)
        raise bad("Input must set only one of the following fields: 'data', 'binary_data_size' in "
                  "'parameters', 'shared_memory_region' in 'parameters'. But" + found)
    return kinds[0]


INT64_MAX = (1 << 63) - 1
# TritonJson's IndexAsUInt on anything but an unsigned integer: an INTERNAL
# error (HTTP 500) under "Unable to parse 'shape'", as Triton answers
_NOT_UINT = "attempt to access JSON non-unsigned-integer as unsigned-integer"


def _shape(dims: list, name: str) -> list[int]:
    """Triton's shape parse: each dimension an unsigned integer (else 500 and
    TritonJson's text); one of 2^63 or more, which Triton keeps as a negative
    int64, is an invalid dimension (400)."""
    shape = []
    for d in dims:
        if type(d) is not int or d < 0 or d >= 1 << 64:
            raise TorchpoolError(errors.INTERNAL, f"Unable to parse 'shape': {_NOT_UINT}")
        shape.append(d)
    if any(d > INT64_MAX for d in shape):
        raise bad(f"invalid shape for input '{name}': shape {_shape_text(shape)} contains one or more "
                  f"invalid dimensions")
    return shape


def _shape_text(shape: list[int]) -> str:
    """Triton's ShapeToString: [a,b,c], each dimension as an int64."""
    return "[" + ",".join(str(d - (1 << 64) if d > INT64_MAX else d) for d in shape) + "]"


def _check_data_size(shape: list[int], datatype: str, name: str) -> None:
    """Triton's checks before it reads "data": the element count, then the
    byte size, within int64."""
    count = 1
    for d in shape:
        if d == 0:
            return
        count *= d
        if count > INT64_MAX:
            raise bad(f"invalid shape for input '{name}': shape {_shape_text(shape)} causes total element "
                      f"count to exceed maximum size of {INT64_MAX}")
    item = datatypes.element_size(datatype) if datatype in datatypes.WIRE_DATATYPES else 0
    if item > 1 and count > INT64_MAX // item:
        raise bad(f"byte size overflow for input '{name}': element count ({count}) * data type size "
                  f"({item}) exceeds maximum allowed size ({INT64_MAX})")


def _parse_input(item: dict, size: int, offset: int, json_end: Optional[int],
                 model: str) -> tuple[InputTensor, int]:
    name = _str(item.get("name"), "name")
    datatype = _str(item.get("datatype"), f"datatype' of '{name}")
    dims = _list(item.get("shape"), f"shape' of '{name}")
    check_dims(model, name, len(dims))
    shape = _shape(dims, name)
    params = _obj(item.get("parameters", {}), f"parameters' of '{name}")
    tensor = InputTensor(name, datatype, shape)
    kind = _content_kind(item, params)
    if kind == "data":
        _check_data_size(shape, datatype, name)
        tensor.values = _list(item["data"], f"data' of '{name}")
    elif kind == "shared_memory_region":
        tensor.region = _str(params["shared_memory_region"], "shared_memory_region")
        tensor.byte_size = _uint(params.get("shared_memory_byte_size", 0), "shared_memory_byte_size", 64)
        tensor.offset = _uint(params.get("shared_memory_offset", 0), "shared_memory_offset", 64)
    else:
        n = _uint(params["binary_data_size"], f"binary_data_size' of '{name}")
        if json_end is None and n:
            raise bad("must specify valid 'Infer-Header-Content-Length' in request header and "
                      "'binary_data_size' when passing inputs in binary data format")
        if offset + n > size:
            raise bad(f"unexpected size for input '{name}', expecting {offset + n - size} "
                      f"additional bytes for model '{model}'")
        tensor.raw_at = (offset, offset + n)
        offset += n
    return tensor, offset


def _parse_output(item: dict, model: str) -> OutputRequest:
    name = _str(item.get("name"), "name")
    params = _obj(item.get("parameters", {}), f"parameters' of output '{name}")
    out = OutputRequest(name)
    if "binary_data" in params:
        out.binary = _bool(params["binary_data"], "binary_data")
    if "classification" in params:
        out.classification = _uint(params["classification"], "classification")
    if "shared_memory_region" in params:
        if "classification" in params:
            raise bad("Output can't set both 'shared_memory_region' and 'classification'")
        if out.binary:
            raise bad("Output can't set both 'shared_memory_region' and 'binary_data'")
        out.region = _str(params["shared_memory_region"], "shared_memory_region")
        out.byte_size = _uint(params.get("shared_memory_byte_size", 0), "shared_memory_byte_size", 64)
        out.offset = _uint(params.get("shared_memory_offset", 0), "shared_memory_offset", 64)
    return out


# --- the response --------------------------------------------------------------

def _nbytes(chunk: Chunk) -> int:
    return chunk.nbytes if isinstance(chunk, memoryview) else len(chunk)


async def encode_infer(result: InferResponse, accept_encoding: Optional[str]) -> Response:
    """The response document and the binary outputs after it, as views of
    the worker's memory (compressed only if the client asked). A large
    output's JSON values are made a chunk per turn of the loop and put in
    place of a marker no client can guess."""
    outputs, binaries = [], []
    values: dict[str, bytes] = {}
    for t in result.outputs:
        out: dict = {"name": t.name, "datatype": t.datatype, "shape": t.shape}
        if t.region is not None:
            pass                            # Triton says nothing more of an output in a region
        elif t.binary:
            raw = await tensor_bytes(t)
            out["parameters"] = {"binary_data_size": _nbytes(raw)}
            if _nbytes(raw):
                binaries.append(raw)
        elif t.data().size <= CHUNK_ELEMENTS:
            out["data"] = t.values()
        else:
            marker = f"tp-values-{secrets.token_hex(8)}"
            values[json.dumps(marker)] = await json_values(t)
            out["data"] = marker
        outputs.append(out)
    doc: dict = {"id": result.id} if result.id else {}
    doc.update(model_name=result.model_name, model_version=result.model_version, outputs=outputs)
    head = json.dumps(doc, separators=(",", ":")).encode()
    for marker, data in values.items():
        before, _, after = head.partition(marker.encode())
        head = b"".join((before, data, after))
    headers: tuple = ()
    content_type = "application/json"
    if binaries:
        content_type = "application/octet-stream"
        headers = (("Inference-Header-Content-Length", str(len(head))),)
    chunks = [head, *binaries]
    encoding = response_encoding(accept_encoding)
    if encoding != "identity":
        whole = b"".join(chunks)
        if len(whole) < THREAD_BYTES:
            chunks = [compress(whole, encoding)]
        else:
            chunks = [await asyncio.get_running_loop().run_in_executor(None, compress, whole, encoding)]
        headers += (("Content-Encoding", encoding),)
    return Response(200, chunks, content_type, headers)


# --- compression -------------------------------------------------------------------

def response_encoding(accept: Optional[str]) -> str:
    """gzip, deflate or identity: the highest q among those (Triton's
    CompressionTypeUsed)."""
    best, weight = "identity", 0.0
    for part in (accept or "").split(","):
        kind, _, q = part.strip().partition(";q=")
        try:
            w = float(q) if q else 1.0
        except ValueError:
            continue
        if kind in ("identity", "gzip", "deflate") and w > weight:
            best, weight = kind, w
    return best


def compress(data: bytes, encoding: str) -> bytes:
    if encoding == "gzip":
        c = zlib.compressobj(wbits=31)      # the gzip container
        return c.compress(data) + c.flush()
    return zlib.compress(data)              # HTTP "deflate" is the zlib format (tritonclient's too)


# deflate makes at most about 1032 bytes of 1 (RFC 1951's longest match):
# what a body can decompress to, whatever its header says
_MAX_RATIO = 1032
_PIECE = 1 << 20                # decompressed at a time


def decompressed_bound(compressed: int, limit: int) -> int:
    """The most a body of `compressed` bytes can decompress to, within `limit`."""
    return min(limit, compressed * _MAX_RATIO + 64)


def decompress(body: Body, encoding: str, limit: int) -> memoryview:
    """The body of a request sent with Content-Encoding, never more than
    `limit` bytes however small the compressed body (a bomb stops there).
    Written a piece at a time into a buffer whose memory is taken as it is
    written: what it costs is what it makes, never twice that."""
    d = zlib.decompressobj(wbits=31 if encoding == "gzip" else 15)
    size = decompressed_bound(len(body), limit)
    out = body_buffer(size + 1)
    filled = 0
    data: Body = body
    try:
        while True:
            piece = d.decompress(data, _PIECE)
            data = d.unconsumed_tail
            if filled + len(piece) > min(size, limit):
                raise bad(f"the decompressed request body exceeds the limit of {limit} bytes "
                          f"(--http-max-input-size)")
            out[filled:filled + len(piece)] = piece
            filled += len(piece)
            if d.eof or not (piece or data):
                break
    except zlib.error as exc:
        raise bad(f"unable to decompress the {encoding} request body: {exc}") from None
    if not d.eof:
        raise bad(f"unable to decompress the {encoding} request body: it is truncated")
    return memoryview(out)[:filled]


async def decompress_off_loop(body: Body, encoding: str, limit: int) -> memoryview:
    """`decompress`, in a thread for a body worth it (zlib lets go of the GIL)."""
    if len(body) < THREAD_BYTES:
        return decompress(body, encoding, limit)
    return await asyncio.get_running_loop().run_in_executor(None, decompress, body, encoding, limit)
