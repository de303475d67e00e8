"""Triton's raw binary request (Inference-Header-Content-Length: 0) as
`raw_call` makes it from a model's config: the rules of Triton's core
(InferenceRequest::Normalize) on configs the example models lack."""
from __future__ import annotations

import numpy as np
import pytest

from torchpool.gateway.http_binary import header_length, is_raw, raw_call
from torchpool.protocol.errors import TorchpoolError


def config(data_type: str, dims: list, mbs: int = 0, inputs: int = 1) -> dict:
    return {"name": "m", "max_batch_size": mbs,
            "input": [{"name": f"IN{i}", "data_type": data_type, "dims": dims} for i in range(inputs)]}


def refused(body: bytes, cfg: dict) -> str:
    with pytest.raises(TorchpoolError) as exc:
        raw_call(body, cfg, "m")
    assert exc.value.code == "INVALID_ARG"
    return exc.value.message


def test_which_bodies_are_raw() -> None:
    assert is_raw({"inference-header-content-length": "0"}, 16)
    assert is_raw({}, 0)                # no header: its length is the body's
    assert not is_raw({}, 16)
    assert header_length({"inference-header-content-length": "4"}, 16) == 4


@pytest.mark.parametrize("data_type, dims, mbs, body, shape", [
    ("TYPE_FP32", [-1], 0, np.ones(5, np.float32).tobytes(), [5]),
    ("TYPE_FP32", [-1, 3], 4, np.ones(6, np.float32).tobytes(), [1, 2, 3]),
    ("TYPE_INT64", [2, -1], 0, np.ones(6, np.int64).tobytes(), [2, 3]),
    ("TYPE_FP16", [4], 8, np.ones(4, np.float16).tobytes(), [1, 4]),
    ("TYPE_BF16", [-1], 0, b"\0" * 6, [3]),
    ("TYPE_UINT8", [-1], 0, b"", [0]),
    ("TYPE_FP32", [0, -1], 0, b"", [0, 0]),
])
def test_shape_from_the_config(data_type: str, dims: list, mbs: int, body: bytes, shape: list) -> None:
    call = raw_call(body, config(data_type, dims, mbs), "m")
    (t,) = call.inputs
    assert (t.name, t.datatype, t.shape, bytes(t.raw)) == ("IN0", data_type[5:], shape, body)
    assert call.outputs is None and call.binary_default and call.id == "" and call.model == "m"


@pytest.mark.parametrize("dims, mbs, shape", [([1], 0, [1]), ([], 8, [1]), ([1], 8, [1, 1]),
                                              ([1, 1], 0, [1, 1])])
def test_bytes_one_element(dims: list, mbs: int, shape: list) -> None:
    (t,) = raw_call(b"427", config("TYPE_STRING", dims, mbs), "m").inputs
    assert (t.datatype, t.shape, t.raw) == ("BYTES", shape, b"\x03\x00\x00\x00" + b"427")


@pytest.mark.parametrize("dims, mbs", [([-1], 0), ([2], 0), ([-1], 8), ([1, 2], 0)])
def test_bytes_more_than_one_element(dims: list, mbs: int) -> None:
    assert "For BYTE datatype raw input 'IN0', the model must have input shape [1]" in \
        refused(b"427", config("TYPE_STRING", dims, mbs))


def test_errors() -> None:
    assert ("Raw request must only have 1 input (found 1) to be deduced but got 3 inputs in 'm' model "
            "configuration") in refused(b"\0" * 12, config("TYPE_FP32", [4], inputs=3))
    assert "but got 0 inputs in 'm'" in refused(b"", config("TYPE_FP32", [4], inputs=0))
    assert ("The shape of the raw input 'IN0' can not be deduced because there are more than one "
            "variable-sized dimension") in refused(b"\0" * 16, config("TYPE_FP16", [-1, -1]))
    assert "input byte size mismatch for input 'raw_input' for model 'm'. Expected 32, got 16" in \
        refused(b"\0" * 16, config("TYPE_FP32", [8], 4))
    assert "input byte size mismatch for input 'raw_input' for model 'm'. Expected 8, got 10" in \
        refused(b"\0" * 10, config("TYPE_FP32", [-1]))
