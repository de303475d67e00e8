"""ModelInfer's tensor bytes read and written around protobuf.

protobuf's Python API copies a `bytes` field twice on the way in (into its own
arena, then into a new Python object on access) and twice on the way out. For
a 16 MiB tensor that is most of the gateway's time, so the infer RPC splits
its messages here instead: `raw_input_contents` (field 7 of ModelInferRequest)
becomes views of the received message, and `raw_output_contents` (field 6 of
ModelInferResponse) is appended to the serialized header straight from the
worker's shared memory. Everything else is parsed and written by protobuf. A
repeated field may sit anywhere in a message, so the split loses nothing.

The split walks the message's top-level fields in Python, so it stops at
`MAX_FIELDS`: a request of more is refused before anything is made of it
(a 16 MiB message of two-byte fields is 8M of them; a real request has a
few per input). Fields next to each other are kept as one slice of the
message, not one object per field.
"""
from __future__ import annotations

from typing import Sequence, Union

from . import grpc_service_pb2 as pb

# an output's bytes (gateway/chunks.py's Chunk)
Chunk = Union[bytes, memoryview]

RAW_INPUT_FIELD = 7     # ModelInferRequest.raw_input_contents
RAW_OUTPUT_FIELD = 6    # ModelInferResponse.raw_output_contents
_LEN = 2                # wire type of bytes, strings and messages
# Below this a message is parsed whole: protobuf's copies cost less than a
# field walk in Python (and its worst case, tiny fields, about 1 ms).
SPLIT_MIN_BYTES = 64 * 1024
# Top-level fields of a ModelInferRequest split here: model, version, id,
# a few parameters, and per input its tensor and raw bytes, per output one.
MAX_FIELDS = 4096


class WireError(ValueError):
    """A message that is not valid protobuf."""


def _varint(data: Union[bytes, memoryview], pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(data) or shift > 63:
            raise WireError("truncated or overlong varint")
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, pos
        shift += 7


def _skip(data: Union[bytes, memoryview], pos: int, wire_type: int) -> int:
    """Where the value of a field of `wire_type` starting at `pos` ends."""
    if wire_type == 0:
        return _varint(data, pos)[1]
    if wire_type == 1:
        return pos + 8
    if wire_type == 5:
        return pos + 4
    if wire_type == _LEN:
        size, pos = _varint(data, pos)
        return pos + size
    raise WireError(f"unsupported wire type {wire_type}")


def encode_varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def split_infer_request(data: bytes) -> tuple[bytes, list[memoryview]]:
    """(the message without its raw_input_contents, those as views of `data`)."""
    view = memoryview(data)
    end = len(data)
    runs: list[memoryview] = []     # consecutive fields other than raw_input_contents
    raws: list[memoryview] = []
    run_start = pos = 0
    fields = 0
    while pos < end:
        fields += 1
        if fields > MAX_FIELDS:
            raise WireError(f"the request has more than {MAX_FIELDS} fields")
        start = pos
        key, pos = _varint(view, pos)
        if key >> 3 == RAW_INPUT_FIELD and key & 7 == _LEN:
            size, pos = _varint(view, pos)
            if pos + size > end:
                raise WireError("a field runs past the end of the message")
            if start > run_start:
                runs.append(view[run_start:start])
            raws.append(view[pos:pos + size])
            pos += size
            run_start = pos
        else:
            pos = _skip(view, pos, key & 7)
            if pos > end:
                raise WireError("a field runs past the end of the message")
    if end > run_start:
        runs.append(view[run_start:end])
    return b"".join(runs), raws


def serialize_infer_response(answer: tuple[pb.ModelInferResponse, Sequence[Chunk]]) -> bytes:
    """A ModelInferResponse without its raw outputs, then one
    raw_output_contents entry per chunk, copied once."""
    header, chunks = answer
    tag = bytes([RAW_OUTPUT_FIELD << 3 | _LEN])
    parts: list[Chunk] = [header.SerializeToString()]
    for chunk in chunks:
        parts += (tag, encode_varint(memoryview(chunk).nbytes), chunk)
    return b"".join(parts)
