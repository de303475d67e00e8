"""End to end: every quoted error, with its code, and the daemon survives each.

Load failures (repository index + requests), execution failures, request
validation (through the client and by hand with zmq + msgpack), malformed
messages. After every bad input the daemon and that model still answer.
"""
from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from torchpool.client import Client
from torchpool.protocol import errors
from torchpool.protocol.errors import InferenceError

from ..support.daemon import Daemon, RawConnection
from ..support.models.load_failures import expected_load_errors

F32 = "libtorch_float32_float32_float32"
I32 = "libtorch_int32_int32_int32"


def good_f32(n: int = 1) -> dict:
    a = np.arange(16 * n, dtype=np.float32).reshape(n, 16)
    return {"INPUT__0": a, "INPUT__1": np.ones((n, 16), np.float32)}


def assert_f32_still_right(client: Client) -> None:
    inputs = good_f32(2)
    result = client.infer(F32, inputs)
    assert np.array_equal(result["OUTPUT__0"], inputs["INPUT__0"] + 1)
    assert np.array_equal(result["OUTPUT__1"], inputs["INPUT__0"] - 1)


def raises(client: Client, code: str, model: str, inputs: dict, **kwargs) -> str:
    with pytest.raises(InferenceError) as exc:
        client.infer(model, inputs, **kwargs)
    assert exc.value.code == code, exc.value
    return exc.value.message


# ----------------------------------------------------------- load failures

def load_cases(root: Path) -> dict:
    cases = dict(expected_load_errors(root))
    if not torch.cuda.is_available():
        cases["gpu_instance"] = "GPU"
    return cases


def test_every_broken_model_is_unavailable_with_its_reason(daemon: Daemon, test_repository: Path) -> None:
    with Client(daemon.url, timeout=30) as client:
        index = client.repository_index()
        by_name: dict[str, list[dict]] = {}
        for row in index:
            by_name.setdefault(row["name"], []).append(row)
        for model, text in load_cases(test_repository).items():
            rows = by_name.get(model)
            if model == "broken_no_config" and rows is None:
                continue   # allowed: absent from the index
            assert rows, f"{model} missing from the repository index"
            assert all(r["state"] == "UNAVAILABLE" for r in rows), rows
            if text is not None:
                assert any(text in r["reason"] for r in rows), (model, text, rows)
            else:
                assert all(r["reason"] for r in rows), rows
            assert client.model_ready(model) is False
            assert client.model_ready(model, 1) is False


@pytest.mark.parametrize("model", sorted(expected_load_errors(Path("/"))) + ["gpu_instance"])
def test_requests_to_a_broken_model_are_unavailable(client: Client, test_repository: Path,
                                                    model: str) -> None:
    if model == "gpu_instance" and torch.cuda.is_available():
        pytest.skip("CUDA is present: gpu_instance loads")
    message = raises(client, errors.UNAVAILABLE, model,
                     {"INPUT__0": np.zeros((1, 4), np.float32)})
    assert f"'{model}'" in message
    text = load_cases(test_repository)[model]
    if text is not None:
        assert text in message
    assert_f32_still_right(client)


def test_one_broken_model_does_not_stop_the_others(client: Client) -> None:
    ready = [r for r in client.repository_index() if r["state"] == "READY"]
    names = {r["name"] for r in ready}
    assert {"libtorch_int8_int8_int8", "string_io", "slow", "versioned_all", "naming_strict"} <= names
    assert len(ready) >= 40


# ------------------------------------------------------- execution failures

def test_exception_in_forward(client: Client) -> None:
    x = np.array([[1.0, 2.0, 3.0, 4.0]], np.float32)
    assert np.array_equal(client.infer("raise_on_negative", {"INPUT__0": x})["OUTPUT__0"], x)
    message = raises(client, errors.INTERNAL, "raise_on_negative", {"INPUT__0": -x})
    assert message.startswith("PyTorch execute failure: ")
    assert "boom: input sum is negative" in message
    # before and after: the same instance keeps serving
    assert np.array_equal(client.infer("raise_on_negative", {"INPUT__0": x * 2})["OUTPUT__0"], x * 2)


@pytest.mark.parametrize("model, inputs, code, text", [
    ("bad_output_index",
     {"INPUT__0": np.ones((1, 4), np.float32), "INPUT__1": np.ones((1, 4), np.float32)},
     errors.INVALID_ARG,
     "The output OUTPUT__2 in the model configuration refers to an output index which doesn't "
     "exist. This model has 2 outputs"),
    ("bad_output_dtype", {"INPUT__0": np.ones((1, 4), np.float32)}, errors.INVALID_ARG,
     "configuration expects datatype TYPE_INT32 for output 'OUTPUT__0', model provides TYPE_FP32"),
    ("bad_scalar_output", {"INPUT__0": np.ones(4, np.float32)}, errors.INVALID_ARG,
     "output 'OUTPUT__0' is a scalar which is not supported."),
    ("bad_list_tensor_output", {"INPUT__0": np.ones(4, np.float32)}, errors.INTERNAL,
     "PyTorch execute failure: output must be of type Tensor or List[str], received List[Tensor]"),
])
def test_bad_outputs_fail_every_request(client: Client, model: str, inputs: dict, code: str,
                                        text: str) -> None:
    for _ in range(2):    # the worker survives its own failure
        assert text in raises(client, code, model, inputs)
    assert client.model_ready(model) is True
    assert_f32_still_right(client)


# ------------------------------------------------------ request validation

def test_unknown_model(client: Client) -> None:
    message = raises(client, errors.NOT_FOUND, "no_such_model", good_f32())
    assert "'no_such_model'" in message
    assert client.model_ready("no_such_model") is False


def test_invalid_version_string(client: Client) -> None:
    message = raises(client, errors.INVALID_ARG, F32, good_f32(), version="latest")
    assert f"'{F32}'" in message and "'latest'" in message
    assert_f32_still_right(client)


BAD_REQUESTS = {
    "missing input": (F32, {"INPUT__0": np.ones((1, 16), np.float32)},
                      ["expected 2 inputs but got 1 inputs", f"'{F32}'", "INPUT__1"]),
    "unexpected input": (F32, {**good_f32(), "INPUT__7": np.ones((1, 16), np.float32)},
                         [f"unexpected inference input 'INPUT__7' for model '{F32}'"]),
    "wrong datatype": (F32, {"INPUT__0": np.ones((1, 16), np.float64),
                             "INPUT__1": np.ones((1, 16), np.float32)},
                       [f"inference input 'INPUT__0' data-type is 'FP64', but model '{F32}' "
                        "expects 'FP32'"]),
    "wrong shape": (F32, {"INPUT__0": np.ones((1, 8), np.float32),
                          "INPUT__1": np.ones((1, 16), np.float32)},
                    [f"unexpected shape for input 'INPUT__0' for model '{F32}'. "
                     "Expected [-1,16], got [1,8]"]),
    "missing batch dimension": (F32, {"INPUT__0": np.ones(16, np.float32),
                                      "INPUT__1": np.ones(16, np.float32)},
                                # [16] reads as a batch of 16: Triton's answer too
                                ["'INPUT__0'", f"'{F32}'", "batch-size must be <= 8"]),
    "extra dimension without batching": (
        "libtorch_nobatch_float32_float32_float32",
        {"INPUT__0": np.ones((1, 16), np.float32), "INPUT__1": np.ones((1, 16), np.float32)},
        ["unexpected shape for input 'INPUT__0' for model "
         "'libtorch_nobatch_float32_float32_float32'. Expected [16], got [1,16]"]),
    "batch above max_batch_size": (F32, good_f32(9),
                                   [f"inference request batch-size must be <= 8 for '{F32}'",
                                    "INPUT__0"]),
    "batch above max_batch_size 4": ("identity_batched", {"INPUT__0": np.ones((5, 2, 3), np.float32)},
                                     ["batch-size must be <= 4 for 'identity_batched'"]),
    "mismatched batch sizes": (F32, {"INPUT__0": np.ones((2, 16), np.float32),
                                     "INPUT__1": np.ones((3, 16), np.float32)},
                               ["'INPUT__1'", f"'{F32}'", "batch size 3", "2"]),
    "string for a tensor": (F32, {"INPUT__0": ["a", "b"], "INPUT__1": np.ones((1, 16), np.float32)},
                            ["'INPUT__0'", "'BYTES'", "'FP32'"]),
    "tensor for a string": ("string_io", {"INPUT__0": np.ones(3, np.float32)},
                            ["'INPUT__0'", "'string_io'", "'FP32'", "'BYTES'"]),
    "2-D strings": ("string_io", {"INPUT__0": np.array([[b"a"], [b"b"]], dtype=object)},
                    ["unexpected shape for input 'INPUT__0' for model 'string_io'. "
                     "Expected [-1], got [2,1]"]),
    "dict input missing key": ("dict_input", {"x": np.ones((1, 4), np.float32)},
                               ["'dict_input'", "'y'"]),
}


@pytest.mark.parametrize("case", sorted(BAD_REQUESTS))
def test_request_validation(client: Client, case: str) -> None:
    model, inputs, texts = BAD_REQUESTS[case]
    message = raises(client, errors.INVALID_ARG, model, inputs)
    for text in texts:
        assert text in message, (text, message)
    # the daemon and that model still answer correctly
    assert client.server_live() is True
    assert client.model_ready(model) is True
    assert_f32_still_right(client)


def test_unknown_requested_output(client: Client) -> None:
    message = raises(client, errors.INVALID_ARG, F32, good_f32(), outputs=["OUTPUT__0", "NOPE"])
    assert f"unexpected inference output 'NOPE' for model '{F32}'" in message
    assert_f32_still_right(client)


def test_unsupported_numpy_dtype_is_refused_by_the_client(client: Client) -> None:
    with pytest.raises(InferenceError) as exc:
        client.infer(F32, {"INPUT__0": np.ones((1, 16), np.complex64),
                           "INPUT__1": np.ones((1, 16), np.float32)})
    assert exc.value.code == errors.INVALID_ARG and "INPUT__0" in exc.value.message


# -------------------------------------------------- hand-made messages (raw zmq)

def infer_header(model: str, inputs: list, request_id: object = 1, **extra) -> dict:
    return {"v": 1, "op": "infer", "id": request_id, "model": model, "version": "",
            "inputs": inputs, "outputs": None, "timeout_us": 0, **extra}


def tensor(name: str, datatype: str, shape: list, data: object) -> dict:
    return {"name": name, "datatype": datatype, "shape": shape, "data": data}


def error_of(header: dict) -> tuple[str, str]:
    assert header["ok"] is False, header
    assert header["v"] == 1
    return header["error"]["code"], header["error"]["message"]


@pytest.fixture
def raw(url: str):
    with RawConnection(url) as conn:
        yield conn


def test_raw_good_request_inline_and_in_frames(raw: RawConnection) -> None:
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    b = np.full((1, 16), 3, np.int32)
    header, frames = raw.call(raw.pack(infer_header(I32, [
        tensor("INPUT0", "INT32", [1, 16], a.tobytes()),
        tensor("INPUT1", "INT32", [1, 16], 1)], request_id="req-1")), b.tobytes())
    assert header["ok"] is True and header["id"] == "req-1"
    assert header["model_name"] == I32 and header["model_version"] == "1"
    outs = {o["name"]: o for o in header["outputs"]}
    assert set(outs) == {"OUTPUT0", "OUTPUT1"}

    def payload(o):
        return o["data"] if isinstance(o["data"], bytes) else frames[o["data"] - 1]
    assert outs["OUTPUT0"]["datatype"] == "INT32" and outs["OUTPUT0"]["shape"] == [1, 16]
    assert np.frombuffer(payload(outs["OUTPUT0"]), np.int32).tolist() == (a + b).reshape(-1).tolist()
    assert np.frombuffer(payload(outs["OUTPUT1"]), np.int32).tolist() == (a - b).reshape(-1).tolist()


@pytest.mark.parametrize("short_by", [4, -4, 64])
def test_byte_size_mismatch(raw: RawConnection, client: Client, short_by: int) -> None:
    good = np.zeros(16, np.int32).tobytes()
    bad = good[:len(good) - short_by] if short_by > 0 else good + b"\0" * -short_by
    header, _ = raw.call(raw.pack(infer_header(I32, [
        tensor("INPUT0", "INT32", [1, 16], bad), tensor("INPUT1", "INT32", [1, 16], good)])))
    code, message = error_of(header)
    assert code == errors.INVALID_ARG
    assert (f"input byte size mismatch for input 'INPUT0' for model '{I32}'. "
            f"Expected 64, got {64 - short_by}") in message
    assert header["id"] == 1
    assert_f32_still_right(client)


@pytest.mark.parametrize("payload, shape", [
    (b"\x05\x00\x00\x00ab", [1]),                       # length beyond the end
    (b"\x02\x00", [1]),                                 # truncated length prefix
    (struct.pack("<I", 1) + b"a", [2]),                 # fewer elements than the shape
    (struct.pack("<I", 1) + b"a" + struct.pack("<I", 0), [1]),   # more elements
])
def test_malformed_bytes_payload(raw: RawConnection, client: Client, payload: bytes,
                                 shape: list) -> None:
    header, _ = raw.call(raw.pack(infer_header("string_io", [
        tensor("INPUT__0", "BYTES", shape, payload)])))
    code, message = error_of(header)
    assert code == errors.INVALID_ARG
    assert "'INPUT__0'" in message and "'string_io'" in message
    result = client.infer("string_io", {"INPUT__0": ["still", "works"]})
    assert result["OUTPUT__0"].tolist() == [b"llits", b"skrow"]


def test_bytes_that_are_not_utf8(raw: RawConnection, client: Client) -> None:
    header, _ = raw.call(raw.pack(infer_header("string_io", [
        tensor("INPUT__0", "BYTES", [1], struct.pack("<I", 2) + b"\xff\xfe")])))
    code, message = error_of(header)
    assert code == errors.INVALID_ARG
    assert "'INPUT__0'" in message and "'string_io'" in message and "UTF-8" in message
    assert client.infer("string_io", {"INPUT__0": ["ok"]})["OUTPUT__0"].tolist() == [b"ko"]


@pytest.mark.parametrize("frames, code, text", [
    ([b"\xc1\xc1"], errors.INVALID_ARG, "malformed request header"),
    ([b""], errors.INVALID_ARG, "malformed request header"),
    ([RawConnection.pack([1, 2, 3])], errors.INVALID_ARG, "malformed request header"),
    ([RawConnection.pack({"v": 2, "op": "server_live", "id": 5})], errors.INVALID_ARG,
     "unsupported protocol version 2"),
    ([RawConnection.pack({"op": "server_live", "id": 5})], errors.INVALID_ARG,
     "unsupported protocol version"),
    ([RawConnection.pack({"v": 1, "op": "frobnicate", "id": 5})], errors.UNSUPPORTED,
     "unknown operation 'frobnicate'"),
    ([RawConnection.pack({"v": 1, "id": 5})], errors.UNSUPPORTED, "unknown operation"),
    ([RawConnection.pack({"v": 1, "op": ["infer"], "id": 5})], errors.UNSUPPORTED,
     "unknown operation"),
])
def test_malformed_messages(raw: RawConnection, client: Client, frames: list, code: str,
                            text: str) -> None:
    header, _ = raw.call(*frames)
    got_code, message = error_of(header)
    assert got_code == code and text in message, header
    assert client.server_live() is True
    assert_f32_still_right(client)


def x16(value: int = 0) -> bytes:
    return np.full(16, value, np.int32).tobytes()


@pytest.mark.parametrize("case", [
    "inputs not a list", "input entry not a map", "input name not a string",
    "outputs not a list", "output name not a string", "no data", "data frame missing",
    "shape not a list", "negative dimension", "float dimension", "input given twice",
    "datatype not a string", "version not an integer", "id is a map",
])
def test_malformed_infer_fields(raw: RawConnection, client: Client, case: str) -> None:
    good = [tensor("INPUT0", "INT32", [1, 16], x16()), tensor("INPUT1", "INT32", [1, 16], x16())]
    bad = {
        "inputs not a list": infer_header(I32, {"INPUT0": 1}),
        "input entry not a map": infer_header(I32, [1, 2]),
        "input name not a string": infer_header(I32, [tensor(["INPUT0"], "INT32", [1, 16], x16()),
                                                      good[1]]),
        "outputs not a list": infer_header(I32, good, outputs="OUTPUT0"),
        "output name not a string": infer_header(I32, good, outputs=[["OUTPUT0"]]),
        "no data": infer_header(I32, [tensor("INPUT0", "INT32", [1, 16], None), good[1]]),
        "data frame missing": infer_header(I32, [tensor("INPUT0", "INT32", [1, 16], 1), good[1]]),
        "shape not a list": infer_header(I32, [tensor("INPUT0", "INT32", 16, x16()), good[1]]),
        "negative dimension": infer_header(I32, [tensor("INPUT0", "INT32", [-1, 16], x16()), good[1]]),
        "float dimension": infer_header(I32, [tensor("INPUT0", "INT32", [1, 16.0], x16()), good[1]]),
        "input given twice": infer_header(I32, [good[0], good[0], good[1]]),
        "datatype not a string": infer_header(I32, [tensor("INPUT0", ["INT32"], [1, 16], x16()),
                                                    good[1]]),
        "version not an integer": infer_header(I32, good, version="v1"),
        "id is a map": None,
    }[case]
    if case == "id is a map":
        # not an error: any msgpack id is echoed as it came
        header, _ = raw.call(raw.pack(infer_header(I32, good, request_id={"a": [1, "b"]})))
        assert header["ok"] is True and header["id"] == {"a": [1, "b"]}
        return
    header, _ = raw.call(raw.pack(bad))
    code, message = error_of(header)
    assert code == errors.INVALID_ARG, header
    assert header["id"] == 1
    assert I32 in message or "INPUT0" in message, message
    # the same connection and the daemon still work
    header, _ = raw.call(raw.pack(infer_header(I32, good, request_id=2)))
    assert header["ok"] is True and header["id"] == 2
    assert_f32_still_right(client)


def test_control_calls_with_bad_fields(raw: RawConnection) -> None:
    header, _ = raw.call(raw.pack({"v": 1, "op": "model_ready", "id": 3, "model": ["x"],
                                   "version": ""}))
    assert error_of(header) == (errors.INVALID_ARG, "invalid model name: it must be a string, not list; a "
                                                    "model name is a single directory name of 1 to 255 "
                                                    "bytes with no NUL, '/' or backslash, not beginning "
                                                    "with '.'")
    header, _ = raw.call(raw.pack({"v": 1, "op": "model_metadata", "id": 4, "model": "versioned",
                                   "version": {}}))
    assert error_of(header)[0] == errors.INVALID_ARG
    header, _ = raw.call(raw.pack({"v": 1, "op": "model_config", "id": 5, "model": "nope"}))
    code, message = error_of(header)
    assert code == errors.NOT_FOUND and "'nope'" in message
    header, _ = raw.call(raw.pack({"v": 1, "op": "server_live", "id": 6}))
    assert header == {"v": 1, "id": 6, "ok": True, "result": True}
