"""The HTTP gateway's answers of large outputs, made a chunk per turn of the
event loop (chunks.py), are the same bytes one go would make."""
from __future__ import annotations

import asyncio
import json

import numpy as np

from torchpool.gateway.backend import InferResponse, OutputTensor
from torchpool.gateway.chunks import CHUNK_ELEMENTS
from torchpool.gateway.http_binary import encode_infer
from torchpool.protocol import datatypes


def encoded(outputs: list[OutputTensor], request_id: str = "r") -> tuple[dict, bytes]:
    response = asyncio.run(encode_infer(InferResponse("m", "1", request_id, outputs), None))
    return dict(response.headers), b"".join(bytes(c) for c in response.chunks)


def test_large_json_outputs_beside_small_ones() -> None:
    n = 3 * CHUNK_ELEMENTS + 5
    big = np.arange(n, dtype=np.float32)
    strings = np.array([f"s{i}".encode() for i in range(n)] + [b"\xff"], dtype=object)
    small = np.array([1.5, -2.0], np.float32)
    _, body = encoded([OutputTensor("A", "FP32", [n], big), OutputTensor("S", "BYTES", [n + 1], strings),
                       OutputTensor("C", "FP32", [2], small)], request_id="tp-values-00")
    doc = json.loads(body)
    assert doc["id"] == "tp-values-00"
    assert doc["outputs"][0]["data"] == big.tolist()
    assert doc["outputs"][1]["data"] == [f"s{i}" for i in range(n)] + ["\ufffd"]
    assert doc["outputs"][2]["data"] == [1.5, -2.0]


def test_a_large_binary_bytes_output() -> None:
    items = [b"x" * (i % 7) for i in range(2 * CHUNK_ELEMENTS + 1)]
    headers, body = encoded([OutputTensor("S", "BYTES", [len(items)], np.array(items, dtype=object), binary=True)])
    start = int(headers["Inference-Header-Content-Length"])
    assert datatypes.decode_bytes(body[start:]) == items
