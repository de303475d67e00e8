"""The frontend wire format: one msgpack header frame, then raw payload frames.

A request is the multipart message `[header, payload_1, ..., payload_n]`.
The header is a msgpack map:

    {"v": 1, "op": "infer", "id": 7, "model": "addsub", "version": 0,
     "inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 16],
                 "data": <bytes inline> | <int: index of a payload frame>}],
     "outputs": ["OUTPUT0"] | None, "timeout_us": 0}

Small tensors travel inline in the header (one frame is cheapest); large ones
as separate frames, so nobody copies them into the msgpack buffer: the tensor
entry and that rule belong to protocol/tensors.py. A response
has the same shape: {"v": 1, "id": 7, "ok": True, "outputs": [...]} or
{"v": 1, "id": 7, "ok": False, "error": {"code": ..., "message": ...}}; control
calls answer {"ok": True, "result": ...}. See docs/protocol.md.
"""
from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING, Any, Optional, Union

import msgpack

from .errors import INVALID_ARG, RESOURCE_EXHAUSTED, TorchpoolError
from . import tensors as _tensors

if TYPE_CHECKING:
    from typing_extensions import Buffer

# A header (msgpack map) of a request or an answer.
Header = dict[str, object]

# The tensor entry's rules live in tensors.py; these names stay importable here
# for callers that still look for them in this module.
INLINE_LIMIT = _tensors.INLINE_LIMIT
LOCAL_MIN_BYTES = _tensors.LOCAL_MIN_BYTES
tensor_payload = _tensors.tensor_payload

PROTOCOL_VERSION = 1

# The largest header frame the daemon decodes (--max-header-bytes). Decoding
# runs on the broker's one thread and costs up to ~0.12 s per MiB of small
# objects (12 MiB of empty maps: 1.7 s on the development VM), so a bigger
# header is refused unread. What a header legitimately holds is small fields
# and inline tensors of at most INLINE_LIMIT each: this is 16 of them.
MAX_HEADER_BYTES = 16 * INLINE_LIMIT
# What a client puts inline in one request: past it, tensors travel as payload
# frames however small, so that many small inputs never make a header too big.
INLINE_BUDGET = MAX_HEADER_BYTES // 2

OP_INFER = "infer"
OP_SERVER_LIVE = "server_live"
OP_SERVER_READY = "server_ready"
OP_MODEL_READY = "model_ready"
OP_MODEL_METADATA = "model_metadata"
OP_MODEL_CONFIG = "model_config"
OP_REPOSITORY_INDEX = "repository_index"
OP_SERVER_METADATA = "server_metadata"
OP_STATISTICS = "statistics"
OP_LOAD = "load"
OP_UNLOAD = "unload"

# The ownership proof of a registered region: random bytes the client writes
# at the region's offset for the daemon to read back: REGION_TOKEN_BYTES, or
# as many as the segment has from that offset when fewer, but never under
# REGION_TOKEN_MIN_BYTES (a shorter nonce could be guessed). A region may be
# smaller than the nonce: the client puts back what it overwrote.
REGION_TOKEN_BYTES = 16
REGION_TOKEN_MIN_BYTES = 8


def region_token_bytes(segment_size: int, offset: int) -> int:
    """How long the ownership nonce of a region at `offset` of a segment of
    `segment_size` bytes is (under REGION_TOKEN_MIN_BYTES: no proof fits)."""
    return min(REGION_TOKEN_BYTES, segment_size - offset)

OP_HELLO = "hello"
OP_GOODBYE = "goodbye"
OP_ARENA_GROW = "arena_grow"
OP_DIRECT = "direct"          # a path to a model's instance (over a session's lane only)
OP_REGISTER = "register_system_shared_memory"
OP_UNREGISTER = "unregister_system_shared_memory"
OP_SHM_STATUS = "get_system_shared_memory_status"
OP_CUDA_REGISTER = "register_cuda_shared_memory"
CUDA_IPC_HANDLE_BYTES = 64          # a CUDA region's handle: sizeof(cudaIpcMemHandle_t)
# Triton's words for a handle that is not one (the gateway's base64, the daemon's length)
BAD_CUDA_HANDLE = "'raw_handle' must be a valid base64 encoded cudaIpcMemHandle_t"
OP_CUDA_UNREGISTER = "unregister_cuda_shared_memory"
OP_CUDA_STATUS = "get_cuda_shared_memory_status"

SESSION_OPS = frozenset({OP_HELLO, OP_GOODBYE, OP_ARENA_GROW, OP_REGISTER, OP_UNREGISTER, OP_SHM_STATUS,
                         OP_CUDA_REGISTER, OP_CUDA_UNREGISTER, OP_CUDA_STATUS})

CONTROL_OPS = SESSION_OPS | frozenset({
    OP_SERVER_LIVE, OP_SERVER_READY, OP_MODEL_READY, OP_MODEL_METADATA, OP_MODEL_CONFIG,
    OP_REPOSITORY_INDEX, OP_SERVER_METADATA, OP_STATISTICS, OP_LOAD, OP_UNLOAD})

_packer = msgpack.Packer(use_bin_type=True)


def pack(obj: object) -> bytes:
    raw: bytes = _packer.pack(obj)
    return raw


def unpack(buf: Buffer) -> Any:
    return msgpack.unpackb(buf, raw=False, use_list=True, strict_map_key=False)


class HeaderError(TorchpoolError):
    """A header the daemon cannot serve (not a msgpack map, or a protocol
    version it does not speak), with the request's `id` when the header was
    readable: the error answer echoes it like every other answer."""

    def __init__(self, message: str, request_id: object = None) -> None:
        super().__init__(INVALID_ARG, message)
        self.request_id = request_id


def decode_header(frame: Union[bytes, bytearray, memoryview], max_bytes: int = 0) -> Header:
    """Decode and sanity-check a header; HeaderError (INVALID_ARG, with the
    request's id when there is one) if malformed. One over `max_bytes` (0: no
    limit) is RESOURCE_EXHAUSTED before any of it is decoded."""
    if max_bytes and len(frame) > max_bytes:
        raise TorchpoolError(RESOURCE_EXHAUSTED, f"request header of {len(frame)} bytes is larger than "
                                                 f"this server takes ({max_bytes} bytes: --max-header-bytes); "
                                                 f"send tensors over {INLINE_LIMIT} bytes as payload frames")
    try:
        header = unpack(frame)
    except Exception as exc:  # msgpack raises several types
        raise HeaderError(f"malformed request header: {exc or type(exc).__name__} "
                          f"(expected a msgpack map)") from None
    if not isinstance(header, dict):
        raise HeaderError("malformed request header: not a map")
    if header.get("v") != PROTOCOL_VERSION or isinstance(header.get("v"), bool):
        raise HeaderError(f"unsupported protocol version {header.get('v')!r}; "
                          f"this server speaks {PROTOCOL_VERSION}", header.get("id"))
    return header


# an absolute path of two components or more, not inside a word ("1/2" or "N/A" are not paths)
_ABSOLUTE_PATH = re.compile(r"(?<![\w.~/-])/(?:[\w.+@%~-]+/)+([\w.+@%~-]*)")


def hide_paths(text: str, root: Optional[str] = None) -> str:
    """`text` as a client may see it: no file-system path of the server's.
    A path inside `root` (the model repository) is shown relative to it
    ("addsub/config.pbtxt:3"), any other absolute path by its last component
    only ("libcustom_op.so"). The daemon's log keeps the full text."""
    if "/" not in text:
        return text
    if root:
        for form in sorted({root, os.path.abspath(root), os.path.realpath(root)}, key=len, reverse=True):
            form = form.rstrip("/")
            if form:
                itself = r"(?<![\w.+@%~/-])" + re.escape(form) + r"(?![\w.+@%~-])"   # not within a name
                text = re.sub(itself + r"/(?=[^\s/])", "", re.sub(itself + r"/?(?=\s|$|['\")])", ".", text))
    return _ABSOLUTE_PATH.sub(lambda m: m.group(1) or m.group(0).rstrip("/").rsplit("/", 1)[-1], text)


def ok_response(request_id: object, **fields: object) -> Header:
    return {"v": PROTOCOL_VERSION, "id": request_id, "ok": True, **fields}


def error_response(request_id: object, err: TorchpoolError) -> Header:
    """An error answer; its message never shows a path of the server's (hide_paths)."""
    return {"v": PROTOCOL_VERSION, "id": request_id, "ok": False,
            "error": {"code": err.code, "message": hide_paths(err.message)}}

