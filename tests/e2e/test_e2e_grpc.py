"""End to end: Triton's own gRPC client (tritonclient.grpc, sync and asyncio)
against a daemon started with --grpc-port: every RPC of
inference.GRPCInferenceService, tensors of each datatype raw and as typed
contents, BYTES, classification, system shared memory registered with
tritonclient's helpers, sequences, streaming, repository control and
statistics, and the errors with Triton's texts and gRPC status codes."""
from __future__ import annotations

import base64

import asyncio
import json
import queue
import shutil
import uuid
from pathlib import Path

import numpy as np
import pytest

grpcclient = pytest.importorskip("tritonclient.grpc")

import grpc  # noqa: E402
import tritonclient.grpc.aio as aioclient  # noqa: E402
import tritonclient.utils.shared_memory as shm  # noqa: E402
from tritonclient.grpc import model_config_pb2 as mc  # noqa: E402
from tritonclient.grpc import service_pb2, service_pb2_grpc  # noqa: E402
from tritonclient.utils import InferenceServerException, deserialize_bytes_tensor  # noqa: E402
from tritonclient.utils import np_to_triton_dtype, triton_to_np_dtype  # noqa: E402

from ..support.daemon import Daemon, free_tcp_port, wait_for  # noqa: E402
from ..support.models.basic import Identity  # noqa: E402
from ..support.models.core import config, serialize, tensor  # noqa: E402

F32 = "libtorch_float32_float32_float32"        # INPUT__0/1 FP32 [16], mbs 8 -> sum, difference
COPIED = [F32, "all_dtypes", "string_io", "sequence_accumulate", "multi_instance",
          "versioned_all", "identity_fp32", "batch_probe"]
LABELS = ["cat", "dog", "bird", "fish"]


@pytest.fixture(scope="module")
def grpc_repository(test_repository: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("grpc_repository")
    for name in COPIED:
        shutil.copytree(test_repository / name, root / name)
    classify = root / "classify"
    (classify / "1").mkdir(parents=True)
    (classify / "1" / "model.pt").write_bytes(serialize(Identity()))
    (classify / "labels.txt").write_text("".join(f"{label}\n" for label in LABELS))
    (classify / "config.pbtxt").write_text(config(
        "classify", inputs=[tensor("INPUT__0", "FP32", [4])], max_batch_size=0,
        outputs=[tensor("OUTPUT__0", "FP32", [4], extra='label_filename: "labels.txt"')]))
    return root


@pytest.fixture(scope="module")
def gdaemon(grpc_repository: Path, tmp_path_factory: pytest.TempPathFactory):
    port = free_tcp_port()
    d = Daemon(grpc_repository, tmp_path_factory.mktemp("grpc_daemon"), "--grpc-port", str(port),
               "--model-control-mode", "explicit", "--load-model", "*",
               "--allow-client-shm=true")      # its callers register system shared memory
    d.grpc_url = f"127.0.0.1:{port}"
    d.start()
    with grpcclient.InferenceServerClient(d.grpc_url) as c:
        wait_for(lambda: _live(c), 30, "the gRPC endpoint")
    yield d
    assert d.stop() == 0, d.log()


def _live(c) -> bool:
    try:
        return c.is_server_live()
    except InferenceServerException:
        return False


@pytest.fixture
def client(gdaemon):
    with grpcclient.InferenceServerClient(gdaemon.grpc_url) as c:
        yield c


@pytest.fixture
def stub(gdaemon):
    """The bare service, for requests tritonclient would not send."""
    with grpc.insecure_channel(gdaemon.grpc_url) as channel:
        yield service_pb2_grpc.GRPCInferenceServiceStub(channel)


def infer_input(name: str, array: np.ndarray, datatype: str = ""):
    t = grpcclient.InferInput(name, list(array.shape), datatype or np_to_triton_dtype(array.dtype))
    t.set_data_from_numpy(array)
    return t


def addsub_inputs(a: np.ndarray, b: np.ndarray) -> list:
    return [infer_input("INPUT__0", a), infer_input("INPUT__1", b)]


def failure(call, *args, **kwargs) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as exc:
        call(*args, **kwargs)
    return exc.value


def rpc_failure(call, request) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as exc:
        call(request)
    return exc.value


# --- health, metadata, configuration ------------------------------------------------------

def test_health_and_metadata(client) -> None:
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready(F32) and client.is_model_ready("versioned_all", "2")
    assert not client.is_model_ready("no_such_model")
    assert not client.is_model_ready("versioned_all", "7")
    meta = client.get_server_metadata()
    assert meta.name == "torchpool" and meta.version
    assert {"system_shared_memory", "classification", "sequence", "model_repository",
            "statistics"} <= set(meta.extensions)
    model = client.get_model_metadata(F32)
    assert (model.name, list(model.versions), model.platform) == (F32, ["1"], "pytorch_libtorch")
    assert [(t.name, t.datatype, list(t.shape)) for t in model.inputs] == \
        [("INPUT__0", "FP32", [-1, 16]), ("INPUT__1", "FP32", [-1, 16])]
    assert [t.name for t in model.outputs] == ["OUTPUT__0", "OUTPUT__1"]
    assert client.get_model_metadata("versioned_all", as_json=True)["versions"] == ["1", "2", "3"]
    assert client.get_model_metadata("versioned_all", "2").name == "versioned_all"


def test_model_config_fields_survive(client) -> None:
    cfg = client.get_model_config(F32).config
    assert (cfg.name, cfg.platform, cfg.max_batch_size) == (F32, "pytorch_libtorch", 8)
    assert [(i.name, i.data_type, list(i.dims)) for i in cfg.input] == \
        [("INPUT__0", mc.TYPE_FP32, [16]), ("INPUT__1", mc.TYPE_FP32, [16])]
    assert cfg.version_policy.latest.num_versions == 1
    group = client.get_model_config("multi_instance").config.instance_group
    assert [(g.count, g.kind) for g in group] == [(2, mc.ModelInstanceGroup.KIND_CPU)]
    assert client.get_model_config("versioned_all").config.version_policy.HasField("all")
    seq = client.get_model_config("sequence_accumulate").config
    assert seq.WhichOneof("scheduling_choice") == "sequence_batching"
    state = seq.sequence_batching.state[0]
    assert (state.input_name, state.output_name, state.data_type, list(state.dims)) == \
        ("STATE_IN__2", "STATE_OUT__1", mc.TYPE_INT32, [1])
    assert state.initial_state[0].zero_data
    control = seq.sequence_batching.control_input[0]
    assert control.name == "START__1" and list(control.control[0].int32_false_true) == [0, 1]
    strings = client.get_model_config("string_io").config
    assert strings.input[0].data_type == mc.TYPE_STRING and list(strings.input[0].dims) == [-1]
    assert client.get_model_config("classify").config.output[0].label_filename == "labels.txt"
    as_json = client.get_model_config(F32, as_json=True)["config"]
    assert as_json["max_batch_size"] == 8 and as_json["input"][0]["dims"] == ["16"]


# --- inference ----------------------------------------------------------------------------

def test_infer_fp32_with_id_and_output_subset(client) -> None:
    a = np.arange(32, dtype=np.float32).reshape(2, 16)
    b = np.full((2, 16), 0.5, np.float32)
    result = client.infer(F32, addsub_inputs(a, b), request_id="req-7")
    np.testing.assert_array_equal(result.as_numpy("OUTPUT__0"), a + b)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT__1"), a - b)
    response = result.get_response()
    assert (response.model_name, response.model_version, response.id) == (F32, "1", "req-7")
    gzipped = client.infer(F32, addsub_inputs(a, b), compression_algorithm="gzip")
    np.testing.assert_array_equal(gzipped.as_numpy("OUTPUT__0"), a + b)
    subset = client.infer(F32, addsub_inputs(a, b), outputs=[grpcclient.InferRequestedOutput("OUTPUT__1")])
    assert [o.name for o in subset.get_response().outputs] == ["OUTPUT__1"]
    np.testing.assert_array_equal(subset.as_numpy("OUTPUT__1"), a - b)
    x = np.array([[1, 2, 3, 4]], np.float32)
    for version in ("1", "3"):
        r = client.infer("versioned_all", [infer_input("INPUT0", x)], model_version=version)
        np.testing.assert_array_equal(r.as_numpy("OUTPUT0"), x * int(version))
        assert r.get_response().model_version == version
    assert client.infer("versioned_all", [infer_input("INPUT0", x)]).get_response().model_version == "3"


def test_infer_every_datatype_bit_for_bit(client) -> None:
    arrays = {"BOOL": np.array([True, False, True]), "UINT8": np.array([0, 7, 255], np.uint8),
              "INT8": np.array([-128, 0, 127], np.int8), "INT16": np.array([-300, 0, 300], np.int16),
              "INT32": np.array([-(2**31), 0, 2**31 - 1], np.int32),
              "INT64": np.array([-(2**63), 1, 2**63 - 1], np.int64),
              "FP16": np.array([0.5, -2.25, 65504], np.float16),
              "FP32": np.array([1.5, -0.0, np.inf], np.float32),
              "FP64": np.array([np.pi, -1e300, 5e-324], np.float64)}
    result = client.infer("all_dtypes", [infer_input(k, v) for k, v in arrays.items()])
    for name, array in arrays.items():
        out = result.as_numpy(f"{name}_OUT")
        assert out.dtype == array.dtype and out.tobytes() == array.tobytes(), name
        assert result.get_output(f"{name}_OUT").datatype == name


def test_infer_bytes(client) -> None:
    texts = np.array([b"abc", b"", b"hello", b"a\x00b"], dtype=object)
    result = client.infer("string_io", [infer_input("INPUT__0", texts, "BYTES")])
    assert result.as_numpy("OUTPUT__0").tolist() == [b"cba", b"", b"olleh", b"b\x00a"]
    assert result.as_numpy("OUTPUT__1").tolist() == [3, 0, 5, 3]
    assert result.get_output("OUTPUT__0").datatype == "BYTES"
    empty = client.infer("string_io", [infer_input("INPUT__0", np.array([], dtype=object), "BYTES")])
    assert empty.as_numpy("OUTPUT__0").shape == (0,) and empty.as_numpy("OUTPUT__1").shape == (0,)


def test_large_tensor_round_trip(client) -> None:
    x = np.random.default_rng(0).standard_normal(4 * 1024 * 1024).astype(np.float32)   # 16 MiB
    result = client.infer("identity_fp32", [infer_input("INPUT__0", x)])
    assert result.as_numpy("OUTPUT__0").tobytes() == x.tobytes()


def test_typed_contents(stub) -> None:
    """Inputs as typed `contents` (what other clients send); Triton answers
    them in raw_output_contents too."""
    request = service_pb2.ModelInferRequest(model_name=F32)
    for name, value in (("INPUT__0", 2.0), ("INPUT__1", 0.5)):
        t = request.inputs.add(name=name, datatype="FP32", shape=[1, 16])
        t.contents.fp32_contents.extend([value] * 16)
    response = stub.ModelInfer(request)
    assert [o.name for o in response.outputs] == ["OUTPUT__0", "OUTPUT__1"]
    assert np.frombuffer(response.raw_output_contents[0], np.float32).tolist() == [2.5] * 16
    assert np.frombuffer(response.raw_output_contents[1], np.float32).tolist() == [1.5] * 16

    request = service_pb2.ModelInferRequest(model_name="all_dtypes")
    typed = {"BOOL": ("bool_contents", [True, False]), "UINT8": ("uint_contents", [1, 255]),
             "INT8": ("int_contents", [-5, 5]), "INT16": ("int_contents", [-300, 300]),
             "INT32": ("int_contents", [-7, 7]), "INT64": ("int64_contents", [-(2**40), 2**40]),
             "FP32": ("fp32_contents", [0.25, -1.0]), "FP64": ("fp64_contents", [1e-300, 2.0])}
    for name, (field, values) in typed.items():
        getattr(request.inputs.add(name=name, datatype=name, shape=[2]).contents, field).extend(values)
    # FP16 has no contents field: raw bytes beside typed contents are refused, as by Triton
    request.inputs.add(name="FP16", datatype="FP16", shape=[2])
    request.raw_input_contents.append(np.array([1.5, 2.5], np.float16).tobytes())
    error = rpc_failure(stub.ModelInfer, request)
    assert (error.code(), error.details()) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "contents field must not be specified when using raw_input_contents for 'BOOL' for model 'all_dtypes'")
    del request.raw_input_contents[:]
    request.inputs[-1].contents.fp32_contents.extend([1.5, 2.5])
    error = rpc_failure(stub.ModelInfer, request)
    assert error.details() == "unexpected explicit tensor data for input tensor 'FP16' for model " \
                              "'all_dtypes' of type 'FP32', expected datatype 'FP16'"
    request.inputs[-1].contents.Clear()             # present and empty: zero elements
    request.inputs[-1].shape[:] = [0]
    response = stub.ModelInfer(request)
    outputs = {o.name: (o.datatype, raw) for o, raw in zip(response.outputs, response.raw_output_contents)}
    for name, (_field, values) in typed.items():
        datatype, raw = outputs[f"{name}_OUT"]
        assert datatype == name and np.frombuffer(raw, triton_to_np_dtype(name)).tolist() == values
    assert outputs["FP16_OUT"] == ("FP16", b"")

    strings = service_pb2.ModelInferRequest(model_name="string_io")
    t = strings.inputs.add(name="INPUT__0", datatype="BYTES", shape=[2])
    t.contents.bytes_contents.extend([b"xy", b"pqr"])
    response = stub.ModelInfer(strings)
    assert deserialize_bytes_tensor(response.raw_output_contents[0]).tolist() == [b"yx", b"rqp"]


def test_classification_with_labels(client) -> None:
    x = np.array([0.1, 0.9, 0.3, 0.5], np.float32)
    result = client.infer("classify", [infer_input("INPUT__0", x)],
                          outputs=[grpcclient.InferRequestedOutput("OUTPUT__0", class_count=3)])
    assert result.get_output("OUTPUT__0").datatype == "BYTES"
    assert result.as_numpy("OUTPUT__0").tolist() == [b"0.900000:1:dog", b"0.500000:3:fish",
                                                     b"0.300000:2:bird"]


def test_sequences(client) -> None:
    def step(seq, x: int, **flags) -> int:
        r = client.infer("sequence_accumulate", [infer_input("INPUT__0", np.array([x], np.int32))],
                         sequence_id=seq, **flags)
        assert [o.name for o in r.get_response().outputs] == ["OUTPUT__0"]     # never the state
        return int(r.as_numpy("OUTPUT__0")[0])

    # one instance without batching has one sequence slot: one sequence at a time
    a, b = 9001, "seq-b-" + uuid.uuid4().hex[:6]           # int64 and string correlation ids
    assert [step(a, 1, sequence_start=True), step(a, 2), step(a, 3, sequence_end=True)] == [1, 3, 6]
    assert [step(b, 10, sequence_start=True), step(b, 20, sequence_end=True)] == [10, 30]
    assert step(a, 5, sequence_start=True, sequence_end=True) == 5      # a new sequence starts at 0
    error = failure(step, 4242, 1)
    assert error.status() == "StatusCode.INVALID_ARGUMENT"
    assert error.message() == "inference request for sequence 4242 to model 'sequence_accumulate' " \
                              "must specify the START flag on the first request of the sequence"


def test_priority_and_timeout_parameters(client, stub) -> None:
    a = np.ones((1, 16), np.float32)
    r = client.infer(F32, addsub_inputs(a, a), priority=1, timeout=30_000_000)
    np.testing.assert_array_equal(r.as_numpy("OUTPUT__0"), a + a)
    request = service_pb2.ModelInferRequest(model_name=F32)
    request.parameters["priority"].int64_param = -1
    error = rpc_failure(stub.ModelInfer, request)
    assert (error.code(), error.details()) == (grpc.StatusCode.INVALID_ARGUMENT,
                                               "invalid value for 'priority', expected value >= 0.")
    request = service_pb2.ModelInferRequest(model_name=F32)
    request.parameters["sequence_id"].bool_param = True
    error = rpc_failure(stub.ModelInfer, request)
    assert error.details() == "invalid value type for 'sequence_id' parameter, expected " \
                              "int64_param or string_param."


# --- errors ---------------------------------------------------------------------------------

def test_errors_have_tritons_texts_and_codes(client, stub) -> None:
    a = np.ones((1, 16), np.float32)
    cases = [
        (lambda: client.infer("no_such_model", addsub_inputs(a, a)), "StatusCode.NOT_FOUND",
         "Request for unknown model: 'no_such_model' is not found"),
        (lambda: client.get_model_metadata("no_such_model"), "StatusCode.NOT_FOUND",
         "Request for unknown model: 'no_such_model' is not found"),
        (lambda: client.get_model_config("no_such_model"), "StatusCode.NOT_FOUND",
         "Request for unknown model: 'no_such_model' is not found"),
        (lambda: client.infer(F32, [infer_input("INPUT__0", a)]), "StatusCode.INVALID_ARGUMENT",
         f"expected 2 inputs but got 1 inputs for model '{F32}'"),
        (lambda: client.get_trace_settings(), "StatusCode.UNIMPLEMENTED", "the server does not support trace"),
        (lambda: client.update_log_settings({"log_verbose_level": 1}), "StatusCode.UNIMPLEMENTED",
         "the server does not support dynamic logging"),
        (lambda: client.register_cuda_shared_memory("gpu", base64.b64encode(b"\0" * 64), 0, 64),
         "StatusCode.INVALID_ARGUMENT", "failed to register CUDA shared memory region: 'gpu', GPUs not supported"),
    ]
    for call, status, text in cases:
        error = failure(call)
        assert error.status() == status and text in error.message(), (status, text, error)
    wrong_shape = failure(client.infer, F32, addsub_inputs(np.ones((1, 3), np.float32), np.ones((1, 3), np.float32)))
    assert wrong_shape.status() == "StatusCode.INVALID_ARGUMENT" and "INPUT__0" in wrong_shape.message()

    request = service_pb2.ModelInferRequest(model_name=F32)
    request.inputs.add(name="INPUT__0", datatype="FP32", shape=[1, 16])
    request.inputs.add(name="INPUT__1", datatype="FP32", shape=[1, 16])
    request.raw_input_contents.append(a.tobytes())
    error = rpc_failure(stub.ModelInfer, request)
    assert (error.code(), error.details()) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        f"unable to find data for input tensor 'INPUT__1' for model '{F32}' in request.")
    request.inputs[0].parameters["shared_memory_offset"].int64_param = 0
    error = rpc_failure(stub.ModelInfer, request)
    assert error.details() == "'shared_memory_offset' can not be specified without " \
                              "'shared_memory_region' parameter for tensor 'INPUT__0'"
    index = service_pb2.RepositoryIndexRequest(repository_name="elsewhere")
    error = rpc_failure(stub.RepositoryIndex, index)
    assert (error.code(), error.details()) == (grpc.StatusCode.UNIMPLEMENTED,
                                               "'repository_name' specification is not supported")
    # what Triton's clients do before they start: both succeed with nothing to do
    assert not client.get_cuda_shared_memory_status(as_json=True).get("regions")
    client.unregister_cuda_shared_memory()


# --- system shared memory -------------------------------------------------------------------

@pytest.fixture
def regions(client):
    """System shared-memory regions made with tritonclient's helpers, removed after."""
    made = []

    def make(name: str, size: int):
        key = f"/tpgrpc_{name}_{uuid.uuid4().hex[:8]}"
        handle = shm.create_shared_memory_region(name, key, size)
        made.append(handle)
        return key, handle
    yield make
    client.unregister_system_shared_memory()
    for handle in made:
        shm.destroy_shared_memory_region(handle)


def test_system_shared_memory_inputs_and_outputs(client, regions) -> None:
    a = np.arange(32, dtype=np.float32).reshape(2, 16)
    b = np.full((2, 16), 3.0, np.float32)
    in_key, in_handle = regions("grpc_in", 256)
    out_key, out_handle = regions("grpc_out", 256 + 64)
    shm.set_shared_memory_region(in_handle, [a, b])
    client.register_system_shared_memory("grpc_in", in_key, 256)
    client.register_system_shared_memory("grpc_out", out_key, 256, offset=64)
    status = client.get_system_shared_memory_status(as_json=True)["regions"]
    assert status["grpc_out"]["name"] == "grpc_out" and int(status["grpc_out"]["byte_size"]) == 256
    assert int(status["grpc_out"]["offset"]) == 64 and status["grpc_out"]["key"].lstrip("/") == out_key[1:]
    assert list(client.get_system_shared_memory_status("grpc_in").regions) == ["grpc_in"]

    inputs = addsub_inputs(a, b)
    inputs[0].set_shared_memory("grpc_in", 128)
    inputs[1].set_shared_memory("grpc_in", 128, offset=128)
    outputs = [grpcclient.InferRequestedOutput("OUTPUT__0"), grpcclient.InferRequestedOutput("OUTPUT__1")]
    outputs[0].set_shared_memory("grpc_out", 128)
    outputs[1].set_shared_memory("grpc_out", 128, offset=128)
    result = client.infer(F32, inputs, outputs=outputs)
    response = result.get_response()
    assert [(o.name, o.datatype, list(o.shape)) for o in response.outputs] == \
        [("OUTPUT__0", "FP32", [2, 16]), ("OUTPUT__1", "FP32", [2, 16])]
    assert list(response.raw_output_contents) == [b"", b""]        # the data is in the region
    # the region starts 64 bytes into the segment
    np.testing.assert_array_equal(shm.get_contents_as_numpy(out_handle, np.float32, [2, 16], 64), a + b)
    np.testing.assert_array_equal(shm.get_contents_as_numpy(out_handle, np.float32, [2, 16], 192), a - b)

    # an input region and a raw input side by side
    mixed = addsub_inputs(a, b)
    mixed[0].set_shared_memory("grpc_in", 128)
    np.testing.assert_array_equal(client.infer(F32, mixed).as_numpy("OUTPUT__1"), a - b)

    client.unregister_system_shared_memory("grpc_in")
    assert list(client.get_system_shared_memory_status(as_json=True).get("regions", {})) == ["grpc_out"]
    error = failure(client.infer, F32, inputs)
    # Triton: NOT_FOUND "Unable to find shared memory region: 'grpc_in'"; the daemon's
    # own words and code (INVALID_ARG) come through here
    assert "'grpc_in'" in error.message()
    assert error.status() in ("StatusCode.NOT_FOUND", "StatusCode.INVALID_ARGUMENT")
    error = failure(client.get_system_shared_memory_status, "grpc_in")
    assert (error.status(), error.message()) == ("StatusCode.NOT_FOUND",
                                                 "Unable to find system shared memory region: 'grpc_in'")


def test_shared_memory_keys_and_bounds_in_tritons_words(client, regions) -> None:
    """qa/L0_shared_memory's texts over gRPC (its int64 fields: no 2^64 - 32 here)."""
    for key in ("/", "///"):
        error = failure(client.register_system_shared_memory, "my_test_shm_name", key, 10000)
        assert (error.status(), error.message()) == (
            "StatusCode.INVALID_ARGUMENT",
            f"cannot register shared memory region 'my_test_shm_name' - invalid shm key '{key}'")
    prefix = "triton_python_backend_shm_region_"
    for key in (f"{prefix}_k", f"/{prefix}_k", f"///{prefix}_k"):
        error = failure(client.register_system_shared_memory, "my_test_shm_name", key, 10000)
        assert (error.status(), error.message()) == (
            "StatusCode.INVALID_ARGUMENT",
            f"cannot register shared memory region 'my_test_shm_name' with key '{key}' as the key contains "
            f"the reserved prefix '{prefix}'")
    key, _ = regions("grpc_bounds", 64)
    for byte_size, offset in ((65, 0), (64, 1), (1, 64), (0, 65)):
        error = failure(client.register_system_shared_memory, "grpc_bounds", key, byte_size, offset=offset)
        assert (error.status(), error.message()) == (
            "StatusCode.INVALID_ARGUMENT", "failed to register shared memory region 'grpc_bounds': invalid args")
    assert not client.get_system_shared_memory_status().regions

    client.register_system_shared_memory("grpc_bounds", key, 64)
    a = np.arange(16, dtype=np.float32).reshape(1, 16)
    for byte_size, offset, text in ((64, 64, "Invalid offset for shared memory region: 'grpc_bounds'"),
                                    (64, 1, "Invalid offset + byte size for shared memory region: "
                                            "'grpc_bounds'")):
        output = grpcclient.InferRequestedOutput("OUTPUT__0")
        output.set_shared_memory("grpc_bounds", byte_size, offset=offset)
        error = failure(client.infer, F32, addsub_inputs(a, a), outputs=[output])
        assert (error.status(), error.message()) == ("StatusCode.INVALID_ARGUMENT", text), (byte_size, offset)


# --- repository and statistics ---------------------------------------------------------------

def test_repository_index_load_unload(client) -> None:
    index = {m.name: m for m in client.get_model_repository_index().models}
    assert set(index) == set(COPIED) | {"classify"}
    assert index[F32].state == "READY" and index[F32].version == "1"

    client.unload_model("identity_fp32")
    assert not client.is_model_ready("identity_fp32")
    state = {m.name: m.state for m in client.get_model_repository_index().models}
    assert state["identity_fp32"] == "UNAVAILABLE"
    x = np.array([1.0, 2.0], np.float32)
    error = failure(client.infer, "identity_fp32", [infer_input("INPUT__0", x)])
    assert error.status() in ("StatusCode.UNAVAILABLE", "StatusCode.NOT_FOUND")

    client.load_model("identity_fp32")
    assert client.is_model_ready("identity_fp32")
    np.testing.assert_array_equal(client.infer("identity_fp32", [infer_input("INPUT__0", x)]).as_numpy("OUTPUT__0"), x)

    # a load with a config of the caller's: Triton's JSON form
    override = client.get_model_config("identity_fp32", as_json=True)["config"]
    override["parameters"] = {"NOTE": {"string_value": "from-grpc"}}
    client.load_model("identity_fp32", config=json.dumps(override))
    cfg = client.get_model_config("identity_fp32").config
    assert cfg.parameters["NOTE"].string_value == "from-grpc"

    error = failure(client.load_model, "identity_fp32", config="{}", files={"file:1/model.pt": b"x"})
    assert error.status() == "StatusCode.UNIMPLEMENTED" and "file:1/model.pt" in error.message()
    # (a name no other test uses: a failed load leaves the name in the index)
    error = failure(client.load_model, "not_in_repository")
    assert "not_in_repository" in error.message()
    index = {m.name: m for m in client.get_model_repository_index().models}
    assert "not_in_repository" not in index or index["not_in_repository"].state != "READY"


def test_statistics(client) -> None:
    before = client.get_inference_statistics(F32).model_stats[0].inference_count
    a = np.ones((2, 16), np.float32)
    for _ in range(3):
        client.infer(F32, addsub_inputs(a, a))
    stats = client.get_inference_statistics(F32).model_stats
    assert [(s.name, s.version) for s in stats] == [(F32, "1")]
    assert stats[0].inference_count == before + 6                   # 3 requests of 2 items
    assert stats[0].inference_stats.success.count >= 3 and stats[0].inference_stats.success.ns > 0
    assert stats[0].last_inference > 0
    every = client.get_inference_statistics(as_json=True)["model_stats"]
    assert {F32, "string_io", "classify"} <= {s["name"] for s in every}
    error = failure(client.get_inference_statistics, "no_such_model")
    assert error.status() == "StatusCode.NOT_FOUND"


# --- streaming and the asyncio client ---------------------------------------------------------

def test_stream_infer_in_order_with_errors(client, stub) -> None:
    answers: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        for i in range(3):
            x = np.full((1, 16), float(i), np.float32)
            client.async_stream_infer(F32, addsub_inputs(x, x), request_id=f"s{i}")
        client.async_stream_infer("no_such_model", addsub_inputs(x, x), request_id="bad")
        got = [answers.get(timeout=30) for _ in range(4)]
    finally:
        client.stop_stream()
    for i, (result, error) in enumerate(got[:3]):
        assert error is None and result.get_response().id == f"s{i}"
        np.testing.assert_array_equal(result.as_numpy("OUTPUT__0"), np.full((1, 16), 2.0 * i, np.float32))
    result, error = got[3]
    assert result is None and error.message() == "Request for unknown model: 'no_such_model' is not found"
    # an error response carries the failed request's id, as Triton's does
    (raw,) = stub.ModelStreamInfer(iter([service_pb2.ModelInferRequest(model_name="no_such_model", id="r9")]))
    assert (raw.error_message, raw.infer_response.id) == (
        "Request for unknown model: 'no_such_model' is not found", "r9")


def _stream(client, send) -> list:
    """The responses of one stream: `send()` writes every request at once,
    before any answer is read (as Triton's own QA streams them)."""
    answers: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        n = send()
        return [answers.get(timeout=30) for _ in range(n)]
    finally:
        client.stop_stream()


def test_a_stream_has_all_its_requests_in_flight(client) -> None:
    """Eight requests written at once reach the dynamic batcher together (it
    waits 0.1 s for a batch): a stream read one answer at a time would run
    eight batches of one."""
    def send() -> int:
        for i in range(8):
            client.async_stream_infer(
                "batch_probe", [infer_input("INPUT__0", np.array([[float(i)]], np.float32))],
                request_id=f"p{i}")
        return 8
    got = _stream(client, send)
    assert [error for _, error in got] == [None] * 8
    assert [result.get_response().id for result, _ in got] == [f"p{i}" for i in range(8)]
    assert [float(result.as_numpy("OUTPUT__1")[0, 0]) for result, _ in got] == [float(i) for i in range(8)]
    sizes = [int(result.as_numpy("OUTPUT__0")[0, 0]) for result, _ in got]
    assert max(sizes) > 1, f"every request ran alone: {sizes}"


def test_a_streams_sequences_reach_the_batcher_in_order(client) -> None:
    """Two interleaved sequences written at once on one stream: each
    request goes to the daemon after the one before it, so the running sums
    come out as if sent one by one, and a bad request between them fails
    alone."""
    def one(x: int, seq: int, **flags) -> None:
        client.async_stream_infer("sequence_accumulate",
                                  [infer_input("INPUT__0", np.array([x], np.int32))],
                                  sequence_id=seq, request_id=f"{seq}:{x}", **flags)

    def send() -> int:
        one(1, 71, sequence_start=True)
        one(10, 72, sequence_start=True)
        one(2, 71)
        client.async_stream_infer("no_such_model", [infer_input("INPUT__0", np.array([0], np.int32))],
                                  request_id="bad")
        one(20, 72, sequence_end=True)
        one(3, 71, sequence_end=True)
        return 6
    got = _stream(client, send)
    sums = [None if error else int(result.as_numpy("OUTPUT__0")[0]) for result, error in got]
    assert sums == [1, 10, 3, None, 30, 6]
    assert got[3][1].message() == "Request for unknown model: 'no_such_model' is not found"


def test_a_stream_cancelled_with_requests_in_flight_leaves_the_gateway_serving(client, gdaemon) -> None:
    """Eight requests held by the batcher's 0.1 s delay when the client
    cancels its stream: the gateway drops them, and the same peer's next
    stream and calls are served (its share of the daemon came back)."""
    for _ in range(3):
        client.start_stream(callback=lambda result, error: None)
        for i in range(8):
            client.async_stream_infer(
                "batch_probe", [infer_input("INPUT__0", np.array([[float(i)]], np.float32))])
        client.stop_stream(cancel_requests=True)
    def send_one() -> int:
        client.async_stream_infer("batch_probe", [infer_input("INPUT__0", np.array([[7.0]], np.float32))],
                                  request_id="after")
        return 1
    got = _stream(client, send_one)
    assert got[0][1] is None and got[0][0].get_response().id == "after"
    x = np.ones((1, 16), np.float32)
    np.testing.assert_array_equal(client.infer(F32, addsub_inputs(x, x)).as_numpy("OUTPUT__0"), 2 * x)
    assert "Traceback" not in gdaemon.log()


def test_asyncio_client(gdaemon) -> None:
    async def main() -> None:
        async with aioclient.InferenceServerClient(gdaemon.grpc_url) as c:
            assert await c.is_model_ready(F32)
            xs = [np.full((1, 16), float(i), np.float32) for i in range(20)]
            inputs = []
            for x in xs:
                pair = [aioclient.InferInput("INPUT__0", [1, 16], "FP32"),
                        aioclient.InferInput("INPUT__1", [1, 16], "FP32")]
                pair[0].set_data_from_numpy(x)
                pair[1].set_data_from_numpy(np.ones((1, 16), np.float32))
                inputs.append(pair)
            results = await asyncio.gather(*(c.infer(F32, pair) for pair in inputs))
            for x, r in zip(xs, results):
                np.testing.assert_array_equal(r.as_numpy("OUTPUT__0"), x + 1)
            with pytest.raises(InferenceServerException) as exc:
                await c.get_model_metadata("no_such_model")
            assert exc.value.status() == "StatusCode.NOT_FOUND"
    asyncio.run(main())
