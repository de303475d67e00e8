"""End to end: Triton's raw binary requests over HTTP (issue 41).

The body is the raw bytes of the model's one input, with
`Inference-Header-Content-Length: 0`: the gateway takes the input's name,
datatype and shape from the model's config as Triton's core does
(InferenceRequest::Normalize) and answers every output in binary. The cases
and texts of Triton's qa/L0_http/http_test.py (test_raw_binary,
test_raw_binary_longer, test_byte, test_byte_too_many_elements,
test_multi_variable_dimensions, test_multi_inputs,
test_content_encoding_chunked_manually), on the example models.
"""
from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from ..support.daemon import Daemon, free_tcp_port
from ..support.http_gateway import error_of, request

RAW = {"Inference-Header-Content-Length": "0"}


@pytest.fixture(scope="module")
def port(small_repository: Path, tmp_path_factory: pytest.TempPathFactory):
    port = free_tcp_port()
    d = Daemon(small_repository, tmp_path_factory.mktemp("http_raw"), "--model-control-mode", "explicit",
               "--load-model", "identity", "--load-model", "addsub", "--load-model", "strings",
               "--load-model", "mlp", "--http-port", str(port)).start()
    yield port
    assert "Traceback" not in d.log(), d.log()
    assert d.stop() == 0, d.log()


def infer(port: int, model: str, body: bytes, headers: dict = RAW) -> tuple[int, dict, bytes]:
    return request(port, "POST", f"/v2/models/{model}/infer", body, headers)


def split(response: tuple[int, dict, bytes]) -> tuple[dict, bytes]:
    """The response's JSON document and the binary data after it."""
    status, headers, body = response
    assert status == 200, body
    size = int(headers["inference-header-content-length"])
    return json.loads(body[:size]), body[size:]


def load(port: int, model: str, config: dict | None = None) -> None:
    doc = {"parameters": {"config": json.dumps(config)}} if config else {}
    status, _, body = request(port, "POST", f"/v2/repository/models/{model}/load", json.dumps(doc).encode())
    assert status == 200, body


@pytest.mark.parametrize("count", [8, 32])
def test_raw_binary(port: int, count: int) -> None:
    x = np.arange(count, dtype=np.float32)
    doc, data = split(infer(port, "identity", x.tobytes()))
    assert data == x.tobytes()
    # every output, binary; the model's name and version; no id (there is no JSON to carry one)
    assert doc == {"model_name": "identity", "model_version": "1",
                   "outputs": [{"name": "OUTPUT__0", "datatype": "FP32", "shape": [count],
                                "parameters": {"binary_data_size": 4 * count}}]}


def test_batch_dimension_and_fixed_shape(port: int) -> None:
    # max_batch_size 32, dims [256]: the body is one batch of [1, 256]
    x = np.linspace(-1, 1, 256, dtype=np.float32)
    doc, data = split(infer(port, "mlp", x.tobytes()))
    assert [(o["name"], o["shape"]) for o in doc["outputs"]] == [("OUTPUT__0", [1, 10])]
    # the same as the JSON path gives
    body = json.dumps({"inputs": [{"name": "INPUT__0", "datatype": "FP32", "shape": [1, 256],
                                   "data": x.tolist()}]}).encode()
    status, _, answer = infer(port, "mlp", body, {})
    assert status == 200, answer
    expected = np.asarray(json.loads(answer)["outputs"][0]["data"], np.float32)
    np.testing.assert_allclose(np.frombuffer(data, np.float32), expected, rtol=1e-6)


def test_size_that_does_not_fit(port: int) -> None:
    # Triton's core names the input by its request key, 'raw_input', in this one message
    status, _, body = infer(port, "mlp", b"\0" * 1000)
    assert (status, error_of(body)) == (400, "input byte size mismatch for input 'raw_input' for model "
                                             "'mlp'. Expected 1024, got 1000")
    # a variable dimension is the body's size over the element's, rounded down
    status, _, body = infer(port, "identity", b"\0" * 6)
    assert (status, error_of(body)) == (400, "input byte size mismatch for input 'raw_input' for model "
                                             "'identity'. Expected 4, got 6")


def test_empty_body(port: int) -> None:
    for headers in (RAW, {}):       # without the header its length is the body's: 0, a raw request too
        status, hdrs, body = infer(port, "identity", b"", headers)
        assert status == 200, body
        doc = json.loads(body[:int(hdrs.get("inference-header-content-length", len(body)))])
        assert doc["outputs"][0]["shape"] == [0]


def test_multi_inputs(port: int) -> None:
    x = np.arange(32, dtype=np.float32)
    status, _, body = infer(port, "addsub", x.tobytes())
    assert (status, error_of(body)) == (400, "Raw request must only have 1 input (found 1) to be deduced "
                                             "but got 2 inputs in 'addsub' model configuration")


def test_byte_too_many_elements(port: int) -> None:
    status, _, body = infer(port, "strings", b"427")
    assert (status, error_of(body)) == (400, "For BYTE datatype raw input 'INPUT__0', the model must have "
                                             "input shape [1]")


def test_byte_and_multi_variable_dimensions_after_a_load(port: int) -> None:
    """A load through the gateway drops the config it kept: the next raw
    request follows the new one."""
    strings = {"name": "strings", "platform": "pytorch_libtorch", "max_batch_size": 0,
               "input": [{"name": "INPUT__0", "data_type": "TYPE_STRING", "dims": [1]}],
               "output": [{"name": "OUTPUT__0", "data_type": "TYPE_STRING", "dims": [1]}]}
    identity = {"name": "identity", "platform": "pytorch_libtorch", "max_batch_size": 0,
                "input": [{"name": "INPUT__0", "data_type": "TYPE_FP32", "dims": [-1, -1]}],
                "output": [{"name": "OUTPUT__0", "data_type": "TYPE_FP32", "dims": [-1, -1]}]}
    assert infer(port, "strings", b"427")[0] == 400
    assert infer(port, "identity", b"\0" * 16)[0] == 200
    try:
        load(port, "strings", strings)
        doc, data = split(infer(port, "strings", b"427 abc"))
        assert doc["outputs"] == [{"name": "OUTPUT__0", "datatype": "BYTES", "shape": [1],
                                   "parameters": {"binary_data_size": 11}}]
        # BYTES come back as Triton sends them: each element's length first
        assert data == (7).to_bytes(4, "little") + b"427 ABC"
        load(port, "identity", identity)
        status, _, body = infer(port, "identity", np.ones([2, 2], np.float32).tobytes())
        assert (status, error_of(body)) == (400, "The shape of the raw input 'INPUT__0' can not be deduced "
                                                 "because there are more than one variable-sized dimension")
    finally:
        load(port, "strings")
        load(port, "identity")
    assert infer(port, "strings", b"427")[0] == 400
    assert infer(port, "identity", b"\0" * 16)[0] == 200


def test_content_encoding_chunked_manually(port: int) -> None:
    x = np.arange(8, dtype=np.float32).tobytes()
    chunked = f"{len(x):X}\r\n".encode() + x + b"\r\n0\r\n\r\n"
    _, data = split(infer(port, "identity", chunked, {**RAW, "Transfer-Encoding": "chunked"}))
    assert data == x


def test_compressed_raw_body(port: int) -> None:
    x = np.arange(100, dtype=np.float32).tobytes()
    _, data = split(infer(port, "identity", gzip.compress(x), {**RAW, "Content-Encoding": "gzip"}))
    assert data == x


def test_unknown_model(port: int) -> None:
    status, _, body = infer(port, "no_such_model", b"\0" * 4)
    assert status == 404 and "'no_such_model'" in error_of(body)
