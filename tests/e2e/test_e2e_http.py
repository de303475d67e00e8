"""End to end: Triton's own HTTP client (tritonclient.http) against the
daemon's HTTP endpoint (`torchpool serve --http-port`): every call, JSON and
binary tensors, Triton's error texts and status codes, system shared memory
through tritonclient's helpers, sequences, statistics, model control."""
from __future__ import annotations

import base64

import json
import uuid
from pathlib import Path

import numpy as np
import pytest

from ..support.daemon import Daemon, free_tcp_port
from ..support.http_gateway import error_of, request

httpclient = pytest.importorskip("tritonclient.http")
shm = pytest.importorskip("tritonclient.utils.shared_memory")
from tritonclient.utils import InferenceServerException  # noqa: E402

F32 = "libtorch_float32_float32_float32"
A = np.arange(16, dtype=np.float32).reshape(1, 16)
B = np.full((1, 16), 0.5, np.float32)


@pytest.fixture(scope="module")
def http_port(test_repository: Path, tmp_path_factory: pytest.TempPathFactory):
    port = free_tcp_port()
    # its callers register system shared memory: off unless the operator says so
    d = Daemon(test_repository, tmp_path_factory.mktemp("http"), "--http-port", str(port),
               "--allow-client-shm=true").start()
    yield port
    assert d.stop() == 0, d.log()


@pytest.fixture
def client(http_port: int):
    c = httpclient.InferenceServerClient(f"127.0.0.1:{http_port}", network_timeout=60)
    yield c
    c.close()


def tensor(name: str, array: np.ndarray, binary: bool = True, datatype: str = "") -> "httpclient.InferInput":
    t = httpclient.InferInput(name, list(array.shape), datatype or _datatype(array))
    t.set_data_from_numpy(array, binary_data=binary)
    return t


def _datatype(array: np.ndarray) -> str:
    from tritonclient.utils import np_to_triton_dtype
    return np_to_triton_dtype(array.dtype)


def fails(call, *args, **kwargs) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as exc:
        call(*args, **kwargs)
    return exc.value


def addsub_inputs(binary: bool = True) -> list:
    return [tensor("INPUT__0", A, binary), tensor("INPUT__1", B, binary)]


# --- health and metadata ----------------------------------------------------------

def test_health(client, http_port: int) -> None:
    assert client.is_server_live() is True
    # the test repository holds models that fail to load: Triton's readiness is strict
    assert client.is_server_ready() is False
    assert request(http_port, "GET", "/v2/health/live")[0] == 200
    assert request(http_port, "GET", "/v2/health/ready")[0] == 400
    assert client.is_model_ready(F32) is True
    assert client.is_model_ready("versioned_all", "2") is True
    assert client.is_model_ready("versioned", "1") is False     # only the latest version loads
    assert client.is_model_ready("no_such_model") is False
    status, _, body = request(http_port, "GET", "/v2/models/no_such_model/ready")
    assert (status, error_of(body)) == (400, "Model version not ready")


def test_server_and_model_metadata(client) -> None:
    meta = client.get_server_metadata()
    assert meta["name"] == "torchpool" and meta["version"]
    assert {"binary_tensor_data", "system_shared_memory", "model_repository", "statistics",
            "classification", "sequence"} <= set(meta["extensions"])
    model = client.get_model_metadata(F32)
    assert model["name"] == F32 and model["versions"] == ["1"] and model["platform"] == "pytorch_libtorch"
    assert [(i["name"], i["datatype"], i["shape"]) for i in model["inputs"]] == \
        [("INPUT__0", "FP32", [-1, 16]), ("INPUT__1", "FP32", [-1, 16])]
    assert client.get_model_metadata("versioned_all")["versions"] == ["1", "2", "3"]
    assert client.get_model_metadata("versioned_all", "2")["name"] == "versioned_all"
    exc = fails(client.get_model_metadata, "no_such_model")
    assert exc.status() == "404"
    assert "Request for unknown model: 'no_such_model' is not found" in exc.message()


def test_model_config(client) -> None:
    config = client.get_model_config(F32)
    assert config["name"] == F32 and config["max_batch_size"] == 8
    assert [i["name"] for i in config["input"]] == ["INPUT__0", "INPUT__1"]
    assert client.get_model_config("versioned_all", "1")["name"] == "versioned_all"
    assert fails(client.get_model_config, "no_such_model").status() == "404"


# --- inference --------------------------------------------------------------------------

@pytest.mark.parametrize("binary_in, binary_out", [(True, True), (False, False), (True, False), (False, True)])
def test_infer_fp32(client, binary_in: bool, binary_out: bool) -> None:
    outputs = [httpclient.InferRequestedOutput("OUTPUT__0", binary_data=binary_out),
               httpclient.InferRequestedOutput("OUTPUT__1", binary_data=not binary_out)]
    result = client.infer(F32, addsub_inputs(binary_in), outputs=outputs, request_id="req-7")
    response = result.get_response()
    assert (response["id"], response["model_name"], response["model_version"]) == ("req-7", F32, "1")
    out0, out1 = response["outputs"]
    assert (out0["name"], out0["datatype"], out0["shape"]) == ("OUTPUT__0", "FP32", [1, 16])
    assert ("parameters" in out0) == binary_out and ("data" in out0) == (not binary_out)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT__0"), A + B)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT__1"), A - B)


def test_infer_without_outputs_answers_all_in_binary(client) -> None:
    result = client.infer(F32, addsub_inputs())
    outs = result.get_response()["outputs"]
    assert [o["parameters"] for o in outs] == [{"binary_data_size": 64}] * 2
    np.testing.assert_array_equal(result.as_numpy("OUTPUT__1"), A - B)
    # a subset of the outputs
    only = client.infer(F32, addsub_inputs(), outputs=[httpclient.InferRequestedOutput("OUTPUT__1")])
    assert [o["name"] for o in only.get_response()["outputs"]] == ["OUTPUT__1"]


ALL_DTYPES = {
    "BOOL": np.array([True, False, True]),
    "UINT8": np.array([0, 7, 255], np.uint8),
    "INT8": np.array([-128, 0, 127], np.int8),
    "INT16": np.array([-32768, 1, 32767], np.int16),
    "INT32": np.array([-2 ** 31, 5, 2 ** 31 - 1], np.int32),
    "INT64": np.array([-2 ** 63, 3, 2 ** 63 - 1], np.int64),
    "FP16": np.array([-1.5, 0.0009765625, 65504.0], np.float16),
    "FP32": np.array([-1.25, 3.5e-8, 1e30], np.float32),
    "FP64": np.array([-1e-300, 2.5, 1e300], np.float64),
}


@pytest.mark.parametrize("binary", [True, False])
def test_every_datatype_round_trips_exactly(client, binary: bool) -> None:
    inputs = [tensor(name, value, binary) for name, value in ALL_DTYPES.items()]
    outputs = [httpclient.InferRequestedOutput(f"{name}_OUT", binary_data=binary) for name in ALL_DTYPES]
    result = client.infer("all_dtypes", inputs, outputs=outputs)
    for name, value in ALL_DTYPES.items():
        got = result.as_numpy(f"{name}_OUT")
        assert got.dtype == value.dtype and got.tolist() == value.tolist(), name
    # empty tensors too
    empty = [tensor(name, value[:0], binary) for name, value in ALL_DTYPES.items()]
    result = client.infer("all_dtypes", empty, outputs=outputs)
    assert all(result.as_numpy(f"{n}_OUT").shape == (0,) for n in ALL_DTYPES)


@pytest.mark.parametrize("binary", [True, False])
def test_bytes_tensors(client, binary: bool) -> None:
    words = np.array([b"abc", b"", b"hello world"], dtype=object)
    outputs = [httpclient.InferRequestedOutput("OUTPUT__0", binary_data=binary),
               httpclient.InferRequestedOutput("OUTPUT__1", binary_data=binary)]
    result = client.infer("string_io", [tensor("INPUT__0", words, binary, "BYTES")], outputs=outputs)
    # tritonclient gives JSON strings back as str, binary ones as bytes
    got = [w.encode() if isinstance(w, str) else w for w in result.as_numpy("OUTPUT__0").tolist()]
    assert got == [b"cba", b"", b"dlrow olleh"]
    assert result.as_numpy("OUTPUT__1").tolist() == [3, 0, 11]


def test_a_16_mib_tensor_both_ways(client) -> None:
    x = np.random.default_rng(0).standard_normal(4 << 20).astype(np.float32)
    result = client.infer("identity_fp32", [tensor("INPUT__0", x)])
    np.testing.assert_array_equal(result.as_numpy("OUTPUT__0"), x)


def test_versions(client) -> None:
    x = np.array([[1, 2, 3, 4]], np.float32)
    for version in ("1", "2", "3"):
        result = client.infer("versioned_all", [tensor("INPUT0", x)], model_version=version)
        assert result.get_response()["model_version"] == version
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), x * int(version))
    latest = client.infer("versioned_all", [tensor("INPUT0", x)])
    assert latest.get_response()["model_version"] == "3"
    np.testing.assert_array_equal(latest.as_numpy("OUTPUT0"), x * 3)
    exc = fails(client.infer, "versioned", [tensor("INPUT0", x)], model_version="1")
    assert exc.status() in ("400", "404", "503") and "'versioned'" in exc.message()


def test_classification(client) -> None:
    x = np.array([[0.5, 3.0, -1.0, 2.0] + [0.0] * 12], np.float32)
    outputs = [httpclient.InferRequestedOutput("OUTPUT__0", class_count=2)]
    result = client.infer(F32, [tensor("INPUT__0", x), tensor("INPUT__1", np.zeros_like(x))], outputs=outputs)
    assert result.as_numpy("OUTPUT__0").tolist() == [[b"3.000000:1", b"2.000000:3"]]


def test_compressed_requests_and_responses(client) -> None:
    for request_alg in ("gzip", "deflate", None):
        for response_alg in ("gzip", "deflate", None):
            result = client.infer(F32, addsub_inputs(), request_compression_algorithm=request_alg,
                                  response_compression_algorithm=response_alg)
            np.testing.assert_array_equal(result.as_numpy("OUTPUT__0"), A + B)


def test_sequences(client) -> None:
    def step(seq: int, value: int, start: bool = False, end: bool = False) -> int:
        x = np.array([value], np.int32)
        result = client.infer("sequence_accumulate", [tensor("INPUT__0", x)], sequence_id=seq,
                              sequence_start=start, sequence_end=end)
        return int(result.as_numpy("OUTPUT__0")[0])

    seq_a, seq_b = 4000 + uuid.uuid4().int % 1000, 5000 + uuid.uuid4().int % 1000
    assert step(seq_a, 1, start=True) == 1
    assert step(seq_a, 2) == 3
    assert step(seq_a, 3, end=True) == 6
    assert step(seq_b, 10, start=True) == 10
    assert step(seq_b, 20, end=True) == 30
    assert step(seq_a, 5, start=True, end=True) == 5         # a new sequence starts from zero
    exc = fails(step, seq_a, 1)                                # ended: the next needs START
    assert exc.status() == "400" and "must specify the START flag" in exc.message()


# --- errors ------------------------------------------------------------------------

def test_unknown_model(client) -> None:
    exc = fails(client.infer, "no_such_model", addsub_inputs())
    assert exc.status() == "404"
    assert exc.message() == "Request for unknown model: 'no_such_model' is not found"


@pytest.mark.parametrize("binary", [True, False])
def test_wrong_shape_and_datatype(client, binary: bool) -> None:
    short = [tensor("INPUT__0", np.ones((1, 8), np.float32), binary), tensor("INPUT__1", B, binary)]
    exc = fails(client.infer, F32, short)
    assert exc.status() == "400"
    assert f"unexpected shape for input 'INPUT__0' for model '{F32}'. Expected [-1,16], got [1,8]" \
        in exc.message()
    wrong = [tensor("INPUT__0", np.ones((1, 16), np.float64), binary), tensor("INPUT__1", B, binary)]
    exc = fails(client.infer, F32, wrong)
    assert exc.status() == "400"
    assert f"inference input 'INPUT__0' data-type is 'FP64', but model '{F32}' expects 'FP32'" \
        in exc.message()


def test_model_error_is_500_and_the_model_keeps_serving(client) -> None:
    x = np.array([[1.0, 2.0, 3.0, 4.0]], np.float32)
    exc = fails(client.infer, "raise_on_negative", [tensor("INPUT__0", -x)])
    assert exc.status() == "500" and exc.message().startswith("PyTorch execute failure: ")
    assert "boom: input sum is negative" in exc.message()
    ok = client.infer("raise_on_negative", [tensor("INPUT__0", x)])
    np.testing.assert_array_equal(ok.as_numpy("OUTPUT__0"), x)


def test_bad_requests_name_what_is_wrong(http_port: int) -> None:
    def post(doc: object, model: str = F32) -> tuple[int, str]:
        status, headers, body = request(http_port, "POST", f"/v2/models/{model}/infer", json.dumps(doc).encode())
        assert headers["content-type"] == "application/json"
        return status, error_of(body)

    good = {"name": "INPUT__0", "shape": [1, 16], "datatype": "FP32", "data": A.ravel().tolist()}
    # Triton's answer to a negative dimension: TritonJson's INTERNAL error, 500
    assert post({"inputs": [dict(good, shape=[1, -16])]}) == \
        (500, "Unable to parse 'shape': attempt to access JSON non-unsigned-integer as unsigned-integer")
    assert post({"inputs": "x"})[1] == "Unable to parse 'inputs': expected an array, got \"x\""
    # Triton's size checks before "data", in its words (http_test.py test_buffer_size_overflow)
    assert post({"inputs": [dict(good, shape=[16, 2**60 + 2], data=[1.0])]}) == (400, (
        "invalid shape for input 'INPUT__0': shape [16,1152921504606846978] causes total element count to "
        "exceed maximum size of 9223372036854775807"))
    assert post({"inputs": [dict(good, shape=[4, 2**60 + 2], data=[1.0])]}) == (400, (
        "byte size overflow for input 'INPUT__0': element count (4611686018427387912) * data type size (4) "
        "exceeds maximum allowed size (9223372036854775807)"))
    assert post({"inputs": [dict(good, data=[1.0, 2.0])]})[1].startswith(
        f"unable to parse 'data' of input 'INPUT__0' for model '{F32}': shape [1, 16] has 16 elements, got 2")
    both = dict(good, parameters={"binary_data_size": 64})
    assert post({"inputs": [both]})[1] == (
        "Input must set only one of the following fields: 'data', 'binary_data_size' in 'parameters', "
        "'shared_memory_region' in 'parameters'. But set 'data' 'binary_data_size'")
    assert post({"inputs": [good], "parameters": {"sequence_start": "yes"}})[1] == \
        "Unable to parse 'sequence_start': expected a boolean, got \"yes\""
    assert post({"inputs": [good], "parameters": {"triton_x": 1}})[1].startswith(
        "parameter keys starting with 'triton_' are reserved")
    status, message = post({"inputs": [dict(good, datatype="FP33")]})
    assert status == 400 and "FP33" in message and "INPUT__0" in message
    assert post({"inputs": [good], "outputs": [
        {"name": "OUTPUT__0", "parameters": {"shared_memory_region": "r", "binary_data": True}}]})[1] == \
        "Output can't set both 'shared_memory_region' and 'binary_data'"


# --- statistics ----------------------------------------------------------------------

def test_statistics(client) -> None:
    model = "libtorch_int32_int32_int32"

    def count() -> int:
        stats = client.get_inference_statistics(model)["model_stats"]
        assert [(s["name"], s["version"]) for s in stats] == [(model, "1")]
        return stats[0]["inference_count"]

    before = count()
    x = np.ones((2, 16), np.int32)
    for _ in range(3):
        client.infer(model, [tensor("INPUT0", x), tensor("INPUT1", x)])
    assert count() == before + 6                                # 3 requests of batch 2
    assert client.get_inference_statistics(model, "1")["model_stats"][0]["execution_count"] >= 3
    everything = client.get_inference_statistics()["model_stats"]
    assert {model, F32, "versioned_all"} <= {s["name"] for s in everything}
    assert fails(client.get_inference_statistics, "no_such_model").status() == "404"


# --- system shared memory ---------------------------------------------------------------

@pytest.fixture
def regions():
    made = []

    def make(name: str, size: int):
        key = f"/tpt_http_{uuid.uuid4().hex[:10]}"
        handle = shm.create_shared_memory_region(name, key, size)
        made.append(handle)
        return key, handle

    yield make
    for handle in made:
        shm.destroy_shared_memory_region(handle)


def test_system_shared_memory(client, regions) -> None:
    client.unregister_system_shared_memory()
    in_key, in_handle = regions("http_in", 128)
    out_key, out_handle = regions("http_out", 256)
    shm.set_shared_memory_region(in_handle, [A, B])
    client.register_system_shared_memory("http_in", in_key, 128)
    client.register_system_shared_memory("http_out", out_key, 128, offset=64)
    status = {r["name"]: r for r in client.get_system_shared_memory_status()}
    # the daemon reports the key without its leading '/' (Triton: as registered)
    assert status["http_in"]["key"].lstrip("/") == in_key.lstrip("/")
    assert status["http_in"]["byte_size"] == 128
    assert status["http_out"]["offset"] == 64
    assert [r["name"] for r in client.get_system_shared_memory_status("http_in")] == ["http_in"]

    inputs = [httpclient.InferInput("INPUT__0", [1, 16], "FP32"), httpclient.InferInput("INPUT__1", [1, 16], "FP32")]
    inputs[0].set_shared_memory("http_in", 64)
    inputs[1].set_shared_memory("http_in", 64, offset=64)
    outputs = [httpclient.InferRequestedOutput("OUTPUT__0"), httpclient.InferRequestedOutput("OUTPUT__1")]
    outputs[0].set_shared_memory("http_out", 64)
    outputs[1].set_shared_memory("http_out", 64, offset=64)
    result = client.infer(F32, inputs, outputs=outputs)
    for out in result.get_response()["outputs"]:
        assert set(out) == {"name", "datatype", "shape"} and out["shape"] == [1, 16]
    # the region starts 64 bytes into the segment
    np.testing.assert_array_equal(shm.get_contents_as_numpy(out_handle, np.float32, [1, 16], offset=64), A + B)
    np.testing.assert_array_equal(shm.get_contents_as_numpy(out_handle, np.float32, [1, 16], offset=128), A - B)
    # a shared-memory input beside a binary one, output as JSON
    mixed = [inputs[0], tensor("INPUT__1", A)]
    np.testing.assert_array_equal(client.infer(F32, mixed).as_numpy("OUTPUT__0"), A + A)

    client.unregister_system_shared_memory("http_out")
    assert [r["name"] for r in client.get_system_shared_memory_status()] == ["http_in"]
    exc = fails(client.infer, F32, inputs, outputs=outputs)
    assert exc.status() == "404" and "Unable to find shared memory region: 'http_out'" in exc.message()
    client.unregister_system_shared_memory()
    assert client.get_system_shared_memory_status() == []


def test_system_shared_memory_errors(client, regions, http_port: int) -> None:
    key, _ = regions("http_small", 64)
    # one answer, Triton's words, whether the segment is missing or too small
    exc = fails(client.register_system_shared_memory, "http_missing", "/tpt_http_no_such_key", 64)
    assert (exc.status(), exc.message()) == ("400", "failed to register shared memory region 'http_missing': "
                                                    "invalid args")
    exc = fails(client.register_system_shared_memory, "http_big", key, 4096)      # larger than the segment
    assert (exc.status(), exc.message()) == ("400", "failed to register shared memory region 'http_big': "
                                                    "invalid args")
    # the daemon's own segments are not a client's to name
    exc = fails(client.register_system_shared_memory, "http_own", "/torchpool.x.1.arena", 64)
    assert exc.status() == "400" and "http_own" in exc.message()
    status, _, body = request(http_port, "POST", "/v2/systemsharedmemory/region/r/register",
                              json.dumps({"key": key}).encode())
    assert (status, error_of(body)) == (400, "Shared memory register request has no 'byte_size' field")
    status, _, body = request(http_port, "POST", "/v2/systemsharedmemory/register",
                              json.dumps({"key": key, "byte_size": 64}).encode())
    assert (status, error_of(body)) == (400, "'region name' is necessary to register system shared memory region")
    status, _, body = request(http_port, "GET", "/v2/systemsharedmemory/register")
    assert (status, error_of(body)) == (405, "Method Not Allowed")
    exc = fails(client.get_system_shared_memory_status, "http_nope")
    assert exc.status() == "404" and exc.message() == "Unable to find system shared memory region: 'http_nope'"
    client.unregister_system_shared_memory("http_nope")         # Triton: unregistering nothing succeeds


def test_registering_a_name_twice_is_refused_in_tritons_words(client, regions) -> None:
    """Triton's qa/L0_shared_memory test_reregister_after_register asserts the text."""
    key, _ = regions("http_twice", 64)
    client.register_system_shared_memory("http_twice", key, 64)
    try:
        exc = fails(client.register_system_shared_memory, "http_twice", key, 64)
        assert exc.status() == "400"
        assert "shared memory region 'http_twice' already in manager" in exc.message()
        assert [r["name"] for r in client.get_system_shared_memory_status()] == ["http_twice"]
    finally:
        client.unregister_system_shared_memory("http_twice")


def test_shared_memory_keys_and_bounds_in_tritons_words(client, regions) -> None:
    """qa/L0_shared_memory's texts: keys of slashes alone and keys under
    Triton's reserved prefix (leading slashes or not) are refused; a region
    out of its segment's bounds is 'invalid args'; an output out of its
    region's bounds, with HTTP's uint64 offsets and byte sizes (2^64 - 32
    included), gets Triton's three texts."""
    for key in ("/", "///"):
        exc = fails(client.register_system_shared_memory, "my_test_shm_name", key, 10000)
        assert (exc.status(), exc.message()) == (
            "400", f"cannot register shared memory region 'my_test_shm_name' - invalid shm key '{key}'")
    prefix = "triton_python_backend_shm_region_"
    for key in (f"{prefix}_k", f"/{prefix}_k", f"///{prefix}_k"):
        exc = fails(client.register_system_shared_memory, "my_test_shm_name", key, 10000)
        assert (exc.status(), exc.message()) == (
            "400", f"cannot register shared memory region 'my_test_shm_name' with key '{key}' as the key "
                   f"contains the reserved prefix '{prefix}'")
    key, _ = regions("http_bounds", 64)
    for byte_size, offset in ((65, 0), (64, 1), (1, 64), (0, 65)):
        exc = fails(client.register_system_shared_memory, "http_bounds", key, byte_size, offset=offset)
        assert (exc.status(), exc.message()) == ("400", "failed to register shared memory region "
                                                        "'http_bounds': invalid args")
    assert client.get_system_shared_memory_status() == []

    client.register_system_shared_memory("http_bounds", key, 64)
    try:
        inputs = [tensor("INPUT__0", A), tensor("INPUT__1", B)]
        for byte_size, offset, text in (
                (64, 2**64 - 32, "Invalid offset for shared memory region: 'http_bounds'"),
                (64, 64, "Invalid offset for shared memory region: 'http_bounds'"),
                (64, 1, "Invalid offset + byte size for shared memory region: 'http_bounds'"),
                (2**64 - 32, 32, "Integer overflow detected: byte_size (18446744073709551584) + offset (32) "
                                 "exceeds maximum value (18446744073709551615) for region 'http_bounds'")):
            output = httpclient.InferRequestedOutput("OUTPUT__0")
            output.set_shared_memory("http_bounds", byte_size, offset=offset)
            exc = fails(client.infer, F32, inputs, outputs=[output])
            assert (exc.status(), exc.message()) == ("400", text), (byte_size, offset)
        # 2^64 is past uint64: the parser refuses it
        output = httpclient.InferRequestedOutput("OUTPUT__0")
        output.set_shared_memory("http_bounds", 64, offset=2**64)
        exc = fails(client.infer, F32, inputs, outputs=[output])
        assert exc.status() == "400" and "Unable to parse 'shared_memory_offset': expected an unsigned " \
                                         "integer" in exc.message()
    finally:
        client.unregister_system_shared_memory("http_bounds")


def test_cuda_shared_memory_on_a_host_without_gpus(client, http_port: int) -> None:
    """The body is read as Triton reads it, in its words; a well-formed
    registration is refused as Triton without GPU support refuses it."""
    assert client.get_cuda_shared_memory_status() == []
    client.unregister_cuda_shared_memory()
    client.unregister_cuda_shared_memory("anything")
    exc = fails(client.get_cuda_shared_memory_status, "anything")
    assert (exc.status(), exc.message()) == ("404", "Unable to find cuda shared memory region: 'anything'")
    handle = base64.b64encode(bytes(range(64)))
    for raw, text in ((b"aGFuZGxl", "'raw_handle' must be a valid base64 encoded cudaIpcMemHandle_t"),
                      (b"not base64!", "'raw_handle' must be a valid base64 encoded cudaIpcMemHandle_t"),
                      (handle, "failed to register CUDA shared memory region: 'gpu_region', GPUs not supported")):
        exc = fails(client.register_cuda_shared_memory, "gpu_region", raw, 0, 64)
        assert (exc.status(), exc.message()) == ("400", text)
    path = "/v2/cudasharedmemory/region/r/register"
    status, _, body = request(http_port, "POST", path, b'{"device_id": 0, "byte_size": 64}')
    assert (status, error_of(body)) == (400, "Shared memory register request has no 'raw_handle' field")
    doc = {"raw_handle": {"b64": handle.decode()}, "device_id": -1, "byte_size": 64}
    status, _, body = request(http_port, "POST", path, json.dumps(doc).encode())
    assert (status, error_of(body)) == (400, "Unable to parse 'device_id': expected an unsigned integer")
    assert client.get_cuda_shared_memory_status() == []


# --- what torchpool does not have, paths, methods ---------------------------------------------

def test_trace_and_logging_are_unavailable(client) -> None:
    for call, args in ((client.get_trace_settings, ()), (client.update_trace_settings, (F32, {"trace_rate": "1"})),
                       (client.get_log_settings, ()), (client.update_log_settings, ({"log_info": True},))):
        exc = fails(call, *args)
        assert exc.status() == "503" and exc.message() in ("the server does not support tracing",
                                                          "the server does not support dynamic logging")


def test_unknown_paths_and_methods(http_port: int) -> None:
    for path in ("/", "/v3", "/v2/models", "/v2/models/x/versions/abc", "/v2/models/x/nope",
                 "/v2/repository/index/extra", "/v2/models/x/versions/1/trace/setting"):
        status, headers, body = request(http_port, "GET", path)
        assert (status, error_of(body)) == (404, "Not Found"), path
    for method, path in (("POST", "/v2/health/live"), ("GET", f"/v2/models/{F32}/infer"),
                         ("POST", f"/v2/models/{F32}"), ("GET", "/v2/repository/index"),
                         ("DELETE", "/v2"), ("POST", "/v2/models/stats")):
        status, _, body = request(http_port, method, path)
        assert (status, error_of(body)) == (405, "Method Not Allowed"), (method, path)
    # a model name with characters that must be quoted in a URL
    status, _, body = request(http_port, "GET", "/v2/models/no%20such%20model")
    assert (status, error_of(body)) == (404, "Request for unknown model: 'no such model' is not found")
    # one no model can have (a '/' in a directory name) is a bad argument, not echoed
    status, _, body = request(http_port, "GET", "/v2/models/no%2Fmodel")
    assert (status, error_of(body)) == (400, "invalid model name: it holds a '/' after the leading one; a "
                                             "model name is a single directory name of 1 to 255 bytes with "
                                             "no NUL, '/' or backslash, not beginning with '.'")


# --- model control (explicit mode) -------------------------------------------------------

def test_repository_index_load_unload(small_repository: Path, tmp_path: Path) -> None:
    port = free_tcp_port()
    d = Daemon(small_repository, tmp_path, "--model-control-mode", "explicit", "--load-model", "addsub",
               "--http-port", str(port)).start()
    client = httpclient.InferenceServerClient(f"127.0.0.1:{port}", network_timeout=120)
    try:
        assert client.is_server_ready() is True
        index = client.get_model_repository_index()
        assert [(m["name"], m["state"]) for m in index if m.get("state") == "READY"] == [("addsub", "READY")]
        assert [m["name"] for m in client.get_model_repository_index(headers=None)] == [m["name"] for m in index]
        status, _, body = request(port, "POST", "/v2/repository/index", json.dumps({"ready": True}).encode())
        assert status == 200 and [m["name"] for m in json.loads(body)] == ["addsub"]
        status, _, body = request(port, "POST", "/v2/repository/index", json.dumps({"ready": "yes"}).encode())
        assert (status, error_of(body)) == (400, "Invalid value for 'ready': expected a boolean")
        # nested 250,000 deep (Triton's http_test.py): the same answer, not the nesting limit's
        deep = b"[" * 250_000 + b"true" + b"]" * 250_000
        status, _, body = request(port, "POST", "/v2/repository/index", b'{"ready":' + deep + b"}")
        assert (status, error_of(body)) == (400, "Invalid value for 'ready': expected a boolean")
        status, _, body = request(port, "POST", "/v2/repository/models/identity/load",
                                  b'{"parameters": {"config": ' + deep + b"}}")
        assert (status, error_of(body)) == (400, "Unable to parse load parameter 'config' for model "
                                                 "'identity': expected a string")
        assert client.is_server_live() is True

        client.load_model("identity")
        assert client.is_model_ready("identity") is True
        x = np.arange(5, dtype=np.float32)
        np.testing.assert_array_equal(client.infer("identity", [tensor("INPUT__0", x)]).as_numpy("OUTPUT__0"), x)
        client.unload_model("identity")
        assert client.is_model_ready("identity") is False
        exc = fails(client.infer, "identity", [tensor("INPUT__0", x)])
        assert exc.status() in ("400", "404", "503") and "'identity'" in exc.message()

        # a config given with the load replaces the repository's
        config = client.get_model_config("addsub")
        config["instance_group"] = [{"kind": "KIND_CPU", "count": 2}]
        client.load_model("addsub", config=json.dumps(config))
        assert client.get_model_config("addsub")["instance_group"][0]["count"] == 2
        a = np.ones((1, 16), np.float32)
        result = client.infer("addsub", [tensor("INPUT0", a), tensor("INPUT1", a)])
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + a)

        exc = fails(client.load_model, "no_such_model")
        assert exc.status() != "200" and "no_such_model" in exc.message()
        exc = fails(client.load_model, "identity", config="{}", files={"file:1/model.pt": b"x"})
        assert exc.status() == "501" and "file overrides" in exc.message()
        status, _, body = request(port, "POST", "/v2/repository/myrepo/models/identity/load")
        assert (status, error_of(body)) == (501, "'repository_name' specification is not supported")
    finally:
        client.close()
        assert d.stop() == 0, d.log()
