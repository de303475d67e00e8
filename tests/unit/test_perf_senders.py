"""`torchpool perf`'s protocols without a server: options per protocol, what
each request carries, Triton's inputs and statistics in torchpool's forms."""
from __future__ import annotations

import argparse
from types import SimpleNamespace

import numpy as np
import pytest

from torchpool.perf.cli import DEFAULT_URLS, UsageError, _check_options, add_arguments
from torchpool.perf.control import STAT_PARTS, grpc_statistics, json_statistics
from torchpool.perf.inputs import InputSpec, ModelInputs, build_arrays, build_requests
from torchpool.perf.senders import GRPC, HTTP, Plan, triton_array, triton_options

ADDSUB = ModelInputs("addsub", 8, (InputSpec("INPUT0", "FP32", (16,)), InputSpec("INPUT1", "FP32", (16,))))


def options(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(["-m", "addsub", *argv])


def test_a_plain_run_asks_no_request_timeout() -> None:
    args = options()
    assert args.request_timeout is None and args.timeout == 30 and args.protocol == "zmq"
    _check_options(args)
    assert args.url == DEFAULT_URLS["zmq"]


@pytest.mark.parametrize("protocol, url", [("grpc", "localhost:8001"), ("http", "localhost:8000")])
def test_perf_analyzers_default_addresses(protocol: str, url: str) -> None:
    pytest.importorskip(f"tritonclient.{protocol}")
    args = options("-i", protocol)
    _check_options(args)
    assert args.url == url
    args = options("-i", protocol, "-u", "gpu-host:9001", "--async", "--request-rate-range", "10")
    assert _check_options(args) == ("request_rate", [10.0]) and args.url == "gpu-host:9001"


@pytest.mark.parametrize("argv, says", [
    (["-i", "grpc", "-u", "tcp://host:8001"], "-i grpc takes the gateway's HOST:PORT"),
    (["-i", "http", "-u", "http://host:8000"], "-i http takes the gateway's HOST:PORT"),
    (["-u", "localhost:8001"], "(-i grpc and -i http take HOST:PORT)"),
    (["-i", "http", "--shared-client"], "--shared-client: only with -i zmq"),
    (["-i", "grpc", "--server-key", "k", "--client-key", "s"], "--server-key, --client-key: only with -i zmq"),
    (["--request-timeout", "0"], "--request-timeout must be a positive number of seconds"),
    (["--request-timeout", "nan"], "--request-timeout must be a positive number of seconds"),
])
def test_options_that_do_not_fit_the_protocol(argv: list, says: str) -> None:
    pytest.importorskip("tritonclient.grpc")
    pytest.importorskip("tritonclient.http")
    with pytest.raises(UsageError) as caught:
        _check_options(options(*argv))
    assert says in str(caught.value)


def test_triton_request_options() -> None:
    plan = Plan("addsub", None, ADDSUB, [], None)
    assert triton_options(HTTP, plan, 30.0) == {"model_version": ""}
    assert triton_options(GRPC, plan, 30.0) == {"model_version": "", "client_timeout": 30.0}
    timed = Plan("addsub", "2", ADDSUB, [], 0.25)
    assert triton_options(HTTP, timed, 30.0) == {"model_version": "2", "timeout": 250000}
    assert triton_options(GRPC, timed, 5.0) == {"model_version": "2", "timeout": 250000, "client_timeout": 5.0}


def test_arrays_and_torchpools_wire_values_are_the_same_inputs() -> None:
    (arrays,) = build_arrays(ADDSUB, 2, "random", {})
    (wire,) = build_requests(ADDSUB, 2, "random", {})
    for name in ("INPUT0", "INPUT1"):
        np.testing.assert_array_equal(arrays[name], wire[name])


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_bf16_bits_as_tritonclient_takes_them(protocol: str) -> None:
    tc = pytest.importorskip(f"tritonclient.{protocol}")
    values = np.array([1.0, -2.5, 0.15625, 3.0e38], np.float32)
    bits = (values.view(np.uint32) >> 16).astype(np.uint16)
    tensor = tc.InferInput("H", [4], "BF16")
    if protocol == "http":
        tensor.set_data_from_numpy(triton_array("BF16", bits), binary_data=True)
        sent = tensor._get_binary_data()
    else:
        tensor.set_data_from_numpy(triton_array("BF16", bits))
        sent = tensor._get_content()
    assert bytes(sent) == bits.tobytes()          # the bits themselves, nothing rounded
    same = np.arange(3, dtype=np.float32)
    assert triton_array("FP32", same) is same


def _part(count: int, ns: int) -> SimpleNamespace:
    return SimpleNamespace(count=count, ns=ns)


def test_statistics_of_either_gateway_in_one_form() -> None:
    stats = SimpleNamespace(**{p: _part(i + 1, 100 * (i + 1)) for i, p in enumerate(STAT_PARTS)})
    answer = SimpleNamespace(model_stats=[SimpleNamespace(name="addsub", version="1", inference_count=7,
                                                          execution_count=5, inference_stats=stats)])
    expected = {"model_stats": [{"name": "addsub", "version": "1", "inference_count": 7, "execution_count": 5,
                                 "inference_stats": {p: {"count": i + 1, "ns": 100 * (i + 1)}
                                                     for i, p in enumerate(STAT_PARTS)}}]}
    assert grpc_statistics(answer) == expected
    # Triton's JSON, a part left out and a number as a string: the same form
    document = {"model_stats": [{"name": "addsub", "version": "1", "inference_count": "7", "execution_count": 5,
                                 "inference_stats": {p: {"count": i + 1, "ns": 100 * (i + 1)}
                                                     for i, p in enumerate(STAT_PARTS) if p != "fail"}}]}
    expected["model_stats"][0]["inference_stats"]["fail"] = {"count": 0, "ns": 0}
    assert json_statistics(document) == expected
