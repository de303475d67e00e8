"""End to end: every ready model of the test repository computes the right values.

Real daemon (session fixture), real workers, real sockets and shared memory.
Most tests run twice, over ipc:// and tcp:// (the `url` fixture).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from torchpool.client import Client
from torchpool.protocol import errors
from torchpool.protocol.errors import InferenceError

RNG = np.random.default_rng(1234)

# name -> (input names, output names, numpy dtype, max_batch_size > 0)
ADDSUB = {
    "libtorch_int8_int8_int8": (("INPUT__0", "INPUT__1"), ("OUTPUT__0", "OUTPUT__1"), np.int8, True),
    "libtorch_int16_int16_int16": (("INPUT0", "INPUT1"), ("OUTPUT0", "OUTPUT1"), np.int16, True),
    "libtorch_int32_int32_int32": (("INPUT0", "INPUT1"), ("OUTPUT0", "OUTPUT1"), np.int32, True),
    "libtorch_float32_float32_float32": (("INPUT__0", "INPUT__1"), ("OUTPUT__0", "OUTPUT__1"),
                                         np.float32, True),
    "libtorch_nobatch_float32_float32_float32": (("INPUT__0", "INPUT__1"), ("OUTPUT__0", "OUTPUT__1"),
                                                 np.float32, False),
    "libtorch_json_config": (("INPUT0", "INPUT1"), ("OUTPUT0", "OUTPUT1"), np.int32, True),
    "custom_filename": (("INPUT__0", "INPUT__1"), ("OUTPUT__0", "OUTPUT__1"), np.float32, True),
    "multi_instance": (("INPUT__0", "INPUT__1"), ("OUTPUT__0", "OUTPUT__1"), np.float32, True),
}


def addsub_inputs(dtype, shape):
    # int8 wraps: keep every sum and difference inside [-120, 120]
    a = RNG.integers(-60, 61, size=shape).astype(dtype)
    b = RNG.integers(-60, 61, size=shape).astype(dtype)
    if np.dtype(dtype).kind == "f":
        a = a + np.asarray(0.25, dtype)
    return a, b


def assert_exact(got: np.ndarray, want: np.ndarray) -> None:
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    assert got.shape == want.shape, (got.shape, want.shape)
    assert np.array_equal(got, want), (got, want)


# --------------------------------------------------------------- add / sub

@pytest.mark.parametrize("model", sorted(ADDSUB))
def test_addsub_models(client: Client, model: str) -> None:
    ins, outs, dtype, batching = ADDSUB[model]
    shapes = [(1, 16), (3, 16), (8, 16)] if batching else [(16,)]
    for shape in shapes:
        a, b = addsub_inputs(dtype, shape)
        result = client.infer(model, {ins[0]: a, ins[1]: b})
        assert sorted(result) == sorted(outs)
        assert_exact(result[outs[0]], (a + b).astype(dtype))
        assert_exact(result[outs[1]], (a - b).astype(dtype))


def test_multi_instance_serves_many_requests(client: Client) -> None:
    """Both instances answer (round robin or not), every answer its own."""
    for i in range(12):
        a = np.full((1, 16), float(i), np.float32)
        b = np.arange(16, dtype=np.float32).reshape(1, 16)
        result = client.infer("multi_instance", {"INPUT__0": a, "INPUT__1": b})
        assert_exact(result["OUTPUT__0"], a + b)
        assert_exact(result["OUTPUT__1"], a - b)


def test_requesting_a_subset_of_outputs(client: Client) -> None:
    a, b = addsub_inputs(np.float32, (2, 16))
    inputs = {"INPUT__0": a, "INPUT__1": b}
    only_second = client.infer("libtorch_float32_float32_float32", inputs, outputs=["OUTPUT__1"])
    assert list(only_second) == ["OUTPUT__1"]
    assert_exact(only_second["OUTPUT__1"], a - b)
    only_first = client.infer("libtorch_float32_float32_float32", inputs, outputs=["OUTPUT__0"])
    assert list(only_first) == ["OUTPUT__0"]
    assert_exact(only_first["OUTPUT__0"], a + b)
    # named outputs from a STRICT-ordered model, in the reverse of config order
    p, q = np.array([[5.0, 1.0, 2.0, 0.0]], np.float32), np.array([[2.0, 4.0, 2.0, 3.0]], np.float32)
    result = client.infer("naming_strict", {"ZETA": p, "ALPHA": q}, outputs=["MUL"])
    assert list(result) == ["MUL"]
    assert_exact(result["MUL"], p * q)


def test_torch_tensor_inputs(client: Client) -> None:
    a = torch.arange(32, dtype=torch.float32).reshape(2, 16)
    b = torch.full((2, 16), 0.5)
    result = client.infer("libtorch_float32_float32_float32", {"INPUT__0": a, "INPUT__1": b})
    assert_exact(result["OUTPUT__0"], (a + b).numpy())
    assert_exact(result["OUTPUT__1"], (a - b).numpy())
    ints = torch.tensor([[-3, 4] * 8], dtype=torch.int32)
    result = client.infer("libtorch_int32_int32_int32", {"INPUT0": ints, "INPUT1": ints * 2})
    assert_exact(result["OUTPUT0"], (ints * 3).numpy())
    assert_exact(result["OUTPUT1"], (-ints).numpy())
    # a non-contiguous tensor is sent in its logical (row-major) order
    t = torch.arange(32, dtype=torch.float32).reshape(16, 2).t()
    result = client.infer("libtorch_float32_float32_float32", {"INPUT__0": t, "INPUT__1": t})
    assert_exact(result["OUTPUT__0"], (t * 2).numpy())


# --------------------------------------------------------------- versions

X4 = np.array([[1.0, 2.0, 3.0, 4.0], [-1.0, 0.5, 0.0, 8.0]], np.float32)

VERSIONS = {
    "versioned": (3,),
    "versioned_latest_2": (2, 3),
    "versioned_all": (1, 2, 3),
    "versioned_specific_1_3": (1, 3),
    "versioned_numeric_order": (10,),
}
ON_DISK = {"versioned_numeric_order": (2, 10)}


@pytest.mark.parametrize("model", sorted(VERSIONS))
def test_version_policies(client: Client, model: str) -> None:
    ready = VERSIONS[model]
    on_disk = ON_DISK.get(model, (1, 2, 3))
    # the default is the highest ready version
    default = client.infer(model, {"INPUT0": X4})["OUTPUT0"]
    assert_exact(default, X4 * max(ready))
    assert client.model_ready(model) is True
    for v in on_disk:
        if v in ready:
            assert client.model_ready(model, v) is True
            assert client.model_ready(model, str(v)) is True
            assert_exact(client.infer(model, {"INPUT0": X4}, version=v)["OUTPUT0"], X4 * v)
        else:
            assert client.model_ready(model, v) is False
            with pytest.raises(InferenceError) as exc:
                client.infer(model, {"INPUT0": X4}, version=v)
            assert exc.value.code == errors.NOT_FOUND
            assert f"'{model}'" in exc.value.message and f"version {v}" in exc.value.message
    assert client.model_metadata(model)["versions"] == [str(v) for v in ready]


def test_version_that_never_existed(client: Client) -> None:
    assert client.model_ready("versioned_all", 7) is False
    with pytest.raises(InferenceError) as exc:
        client.infer("versioned_all", {"INPUT0": X4}, version=7)
    assert exc.value.code == errors.NOT_FOUND
    assert "'versioned_all'" in exc.value.message and "version 7" in exc.value.message


# --------------------------------------------------------- naming conventions

P = np.array([[5.0, 1.0, 2.0, 0.0]], np.float32)
Q = np.array([[2.0, 4.0, 2.0, 3.0]], np.float32)


def test_forward_argument_binding(client: Client) -> None:
    # forward(b, a) -> a - b; the config lists a, then b: bound by argument name
    result = client.infer("naming_forward_argument", {"a": P, "b": Q})
    assert_exact(result["OUTPUT__0"], P - Q)


def test_named_index_out_of_order(client: Client) -> None:
    result = client.infer("naming_named_index", {"INPUT__0": P, "INPUT__1": Q})
    assert_exact(result["OUTPUT__0"], P - Q)
    assert_exact(result["OUTPUT__1"], P * Q)


def test_strict_config_ordering(client: Client) -> None:
    result = client.infer("naming_strict", {"ALPHA": Q, "ZETA": P})
    assert_exact(result["SUB"], P - Q)
    assert_exact(result["MUL"], P * Q)


def test_non_integer_suffix_falls_back_to_strict(client: Client) -> None:
    result = client.infer("naming_bad_suffix", {"INPUT__a": Q, "INPUT__1": P})
    assert_exact(result["OUTPUT__0"], P - Q)
    assert_exact(result["OUTPUT__1"], P * Q)


def test_dict_input(client: Client) -> None:
    x = np.array([[1.0, 2.0, 3.0, 4.0], [0.0, -1.0, 0.5, 2.0]], np.float32)
    y = np.array([[10.0, 20.0, 30.0, 40.0], [1.0, 1.0, 1.0, 1.0]], np.float32)
    result = client.infer("dict_input", {"y": y, "x": x})
    assert_exact(result["OUTPUT__0"], x * 2 + y)


# ------------------------------------------------------------------ strings

def test_strings_in_and_out(client: Client) -> None:
    texts = ["abc", "", "hello", "a", "x" * 1000, "Hello, World!", " spaced out "]
    result = client.infer("string_io", {"INPUT__0": texts})
    reversed_ = result["OUTPUT__0"]
    assert isinstance(reversed_, np.ndarray) and reversed_.dtype == object
    assert reversed_.shape == (len(texts),)
    assert all(isinstance(item, bytes) for item in reversed_)
    assert reversed_.tolist() == [t[::-1].encode() for t in texts]
    assert_exact(result["OUTPUT__1"], np.array([len(t) for t in texts], np.int64))


def test_strings_as_numpy_bytes_and_empty_list(client: Client) -> None:
    result = client.infer("string_io", {"INPUT__0": np.array([b"abc", b"", b"hello"], dtype=object)})
    assert result["OUTPUT__0"].tolist() == [b"cba", b"", b"olleh"]
    assert_exact(result["OUTPUT__1"], np.array([3, 0, 5], np.int64))
    empty = client.infer("string_io", {"INPUT__0": np.array([], dtype=object)})
    assert empty["OUTPUT__0"].shape == (0,) and empty["OUTPUT__0"].dtype == object
    assert_exact(empty["OUTPUT__1"], np.zeros(0, np.int64))


def test_many_strings_each_element_right(client: Client) -> None:
    texts = [f"item-{i}-" + "z" * (i % 7) for i in range(500)]
    result = client.infer("string_io", {"INPUT__0": texts})
    assert result["OUTPUT__0"].tolist() == [t[::-1].encode() for t in texts]
    assert result["OUTPUT__1"].tolist() == [len(t) for t in texts]


def test_batched_strings_single_request(client: Client) -> None:
    texts = np.array([[b"abc"], [b""], [b"hello"]], dtype=object)
    result = client.infer("string_batched", {"INPUT__0": texts})
    assert result["OUTPUT__0"].reshape(-1).tolist() == [b"cba", b"", b"olleh"]
    assert result["OUTPUT__0"].shape[0] == 3
    assert result["OUTPUT__1"].reshape(-1).tolist() == [3, 0, 5]
    assert result["OUTPUT__1"].shape == (3, 1)


# ------------------------------------------------------ shapes and reshape

@pytest.mark.parametrize("length", [0, 1, 7, 1000])
def test_identity_any_length(client: Client, length: int) -> None:
    x = RNG.standard_normal(length).astype(np.float32)
    assert_exact(client.infer("identity_fp32", {"INPUT__0": x})["OUTPUT__0"], x)


def test_identity_batched_variable_dims(client: Client) -> None:
    for n, k in [(1, 1), (4, 5), (2, 0), (3, 17)]:
        x = RNG.standard_normal((n, k, 3)).astype(np.float32)
        assert_exact(client.infer("identity_batched", {"INPUT__0": x})["OUTPUT__0"], x)


def test_reshape(client: Client) -> None:
    x = np.arange(12, dtype=np.float32).reshape(2, 6)
    result = client.infer("reshape_model", {"INPUT__0": x})
    assert_exact(result["OUTPUT__0"], np.array([3, 4], np.int64))           # what the model saw
    assert_exact(result["OUTPUT__1"], np.arange(12, dtype=np.float32).reshape(4, 3))


def test_reshape_with_batch(client: Client) -> None:
    for n in (1, 3, 4):
        x = np.zeros((n, 2, 6), np.float32)
        result = client.infer("reshape_batched", {"INPUT__0": x})
        assert_exact(result["OUTPUT__0"], np.array([[n, 3, 4]] * n, np.int64))


def test_reshape_with_a_variable_dimension(client: Client) -> None:
    """dims [-1, 6], reshape [-1, 2, 3]: the reshape's -1 is the request's
    (it failed every request with 'negative dimensions are not allowed')."""
    for n, k in ((1, 1), (2, 4), (3, 0)):
        x = np.zeros((n, k, 6), np.float32)
        result = client.infer("reshape_variable", {"INPUT__0": x})
        assert_exact(result["OUTPUT__0"], np.array([[n, k, 2, 3]] * n, np.int64))


def test_batch_probe_single_request(client: Client) -> None:
    x = np.array([[1.0], [2.0], [3.0]], np.float32)
    result = client.infer("batch_probe", {"INPUT__0": x})
    assert_exact(result["OUTPUT__0"], np.array([[3]] * 3, np.int64))
    assert_exact(result["OUTPUT__1"], x)


# ------------------------------------------------------------------ dtypes

def test_bf16_round_trip(client: Client) -> None:
    x = torch.tensor([1.5, -2.0, 0.0, 3.140625, -1e-3, 65280.0], dtype=torch.bfloat16)
    out = client.infer("identity_bf16", {"INPUT__0": x})["OUTPUT__0"]
    assert isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16
    assert out.shape == x.shape
    assert torch.equal(out.view(torch.int16), x.view(torch.int16))   # bit for bit


def test_all_dtypes_bit_for_bit(client: Client) -> None:
    samples = {
        "BOOL": np.array([True, False, True]),
        "UINT8": np.array([0, 255, 7], np.uint8),
        "INT8": np.array([-128, 127, 0], np.int8),
        "INT16": np.array([-32768, 32767, 2], np.int16),
        "INT32": np.array([-(2 ** 31), 2 ** 31 - 1, 5], np.int32),
        "INT64": np.array([-(2 ** 62), 2 ** 62, -1], np.int64),
        "FP16": np.array([0.5, -1.0, 65504.0], np.float16),
        "FP32": np.array([0.5, -1.0, np.float32(1e-30)], np.float32),
        "FP64": np.array([0.1, -1.0, 1e300], np.float64),
    }
    result = client.infer("all_dtypes", samples)
    assert sorted(result) == sorted(f"{n}_OUT" for n in samples)
    for name, sent in samples.items():
        got = result[f"{name}_OUT"]
        assert_exact(got, sent)
        assert got.tobytes() == sent.tobytes(), name


def test_all_dtypes_zero_size(client: Client) -> None:
    samples = {n: np.zeros(0, dt) for n, dt in [
        ("BOOL", np.bool_), ("UINT8", np.uint8), ("INT8", np.int8), ("INT16", np.int16),
        ("INT32", np.int32), ("INT64", np.int64), ("FP16", np.float16), ("FP32", np.float32),
        ("FP64", np.float64)]}
    result = client.infer("all_dtypes", samples)
    for name, sent in samples.items():
        assert_exact(result[f"{name}_OUT"], sent)


# ----------------------------------------------------------- big tensors

def test_large_tensor_exact(client: Client) -> None:
    """16 MiB through the model and back (inline frames over tcp, same over ipc)."""
    x = np.random.default_rng(7).standard_normal(4 * 1024 * 1024).astype(np.float32)
    for _ in range(2):   # the second time reuses the arenas' space
        out = client.infer("identity_fp32", {"INPUT__0": x})["OUTPUT__0"]
        assert out.shape == x.shape and out.dtype == np.float32
        assert out.tobytes() == x.tobytes()
    y = x[::-1].copy()
    assert client.infer("identity_fp32", {"INPUT__0": y})["OUTPUT__0"].tobytes() == y.tobytes()


def test_just_over_the_inline_limit(client: Client) -> None:
    for length in (16 * 1024 - 1, 16 * 1024, 16 * 1024 + 1):   # 64 KiB of FP32 +- 4 bytes
        x = np.arange(length, dtype=np.float32)
        assert_exact(client.infer("identity_fp32", {"INPUT__0": x})["OUTPUT__0"], x)


def test_large_outputs_kept_while_next_request_runs(client: Client) -> None:
    """An output array stays valid after the next request (no reuse under the reader)."""
    first = np.full(1 << 20, 1.0, np.float32)
    second = np.full(1 << 20, 2.0, np.float32)
    out1 = client.infer("identity_fp32", {"INPUT__0": first})["OUTPUT__0"]
    out2 = client.infer("identity_fp32", {"INPUT__0": second})["OUTPUT__0"]
    assert np.array_equal(out1, first) and np.array_equal(out2, second)


# ------------------------------------------------------------- parameters

def test_inference_mode_parameter(client: Client) -> None:
    one = np.ones(1, np.float32)
    off = client.infer("params", {"INPUT__0": one})
    assert off["INFERENCE_MODE"].tolist() == [False] and off["GRAD_ENABLED"].tolist() == [False]
    default = client.infer("params_default", {"INPUT__0": one})
    assert default["INFERENCE_MODE"].tolist() == [True] and default["GRAD_ENABLED"].tolist() == [False]


def test_ragged_sum_single_request(url: str) -> None:
    with Client(url, timeout=10) as client:
        result = client.infer("ragged_sum", {"INPUT__0": np.array([[1.0, 2.0, 3.0]], np.float32)})
    assert_exact(result["OUTPUT__0"], np.array([[6.0]], np.float32))
