"""End to end: Triton-compatibility of issue 41, over ZeroMQ (torchpool's
client and raw messages), HTTP (tritonclient.http) and gRPC
(tritonclient.grpc) against one daemon in the default model control mode
(none): duplicate requested outputs, load / unload outside explicit mode."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from torchpool import Client, InferenceError
from torchpool.protocol import errors

from ..support.daemon import Daemon, RawConnection, free_tcp_port, wait_for
from ..support.http_gateway import error_of, request

httpclient = pytest.importorskip("tritonclient.http")
grpcclient = pytest.importorskip("tritonclient.grpc")
from tritonclient.utils import InferenceServerException  # noqa: E402

A = np.arange(16, dtype=np.float32).reshape(1, 16)
ADDSUB = {"INPUT0": A, "INPUT1": A}
POLLING = "explicit model load / unload is not allowed if polling is enabled"


@pytest.fixture(scope="module")
def tdaemon(small_repository: Path, tmp_path_factory: pytest.TempPathFactory):
    http_port, grpc_port, metrics_port = free_tcp_port(), free_tcp_port(), free_tcp_port()
    d = Daemon(small_repository, tmp_path_factory.mktemp("compat"), "--http-port", str(http_port),
               "--grpc-port", str(grpc_port), "--metrics-port", str(metrics_port)).start()
    d.http_port, d.grpc_url, d.metrics_port = http_port, f"127.0.0.1:{grpc_port}", metrics_port
    with grpcclient.InferenceServerClient(d.grpc_url) as c:
        wait_for(lambda: _live(c), 30, "the gRPC endpoint")
    yield d
    assert d.stop() == 0, d.log()


def _live(c) -> bool:
    try:
        return c.is_server_live()
    except InferenceServerException:
        return False


def raw_call(url: str, op: str, **fields) -> dict:
    with RawConnection(url) as rc:
        return rc.call(rc.pack({"v": 1, "op": op, "id": 1, **fields}), timeout=60)[0]


def http_inputs() -> list:
    out = []
    for name in ("INPUT0", "INPUT1"):
        t = httpclient.InferInput(name, [1, 16], "FP32")
        t.set_data_from_numpy(A)
        out.append(t)
    return out


def grpc_inputs() -> list:
    out = []
    for name in ("INPUT0", "INPUT1"):
        t = grpcclient.InferInput(name, [1, 16], "FP32")
        t.set_data_from_numpy(A)
        out.append(t)
    return out


# --- 1. duplicate requested outputs: Triton's INVALID_ARG ------------------------------

DUPLICATE = "output 'OUTPUT0' already exists in request"


@pytest.mark.parametrize("local", [False, True])
def test_duplicate_output_names_refused_over_zeromq(tdaemon: Daemon, local: bool) -> None:
    # local=True goes by the worker's direct path where the daemon offers one
    with Client(tdaemon.url, local=local, timeout=60) as c:
        for _ in range(2):          # the second one after a first, so a direct path is open
            with pytest.raises(InferenceError) as exc:
                c.infer("addsub", ADDSUB, outputs=["OUTPUT0", "OUTPUT1", "OUTPUT0"])
            assert exc.value.code == errors.INVALID_ARG and DUPLICATE in exc.value.message, exc.value
            assert set(c.infer("addsub", ADDSUB, outputs=["OUTPUT1"])) == {"OUTPUT1"}


def test_duplicate_output_names_refused_over_http(tdaemon: Daemon) -> None:
    with httpclient.InferenceServerClient(f"127.0.0.1:{tdaemon.http_port}") as c:
        outputs = [httpclient.InferRequestedOutput("OUTPUT0") for _ in range(2)]
        with pytest.raises(InferenceServerException) as exc:
            c.infer("addsub", http_inputs(), outputs=outputs)
        assert exc.value.status() == "400" and DUPLICATE in exc.value.message(), exc.value
        assert c.is_server_live()
        np.testing.assert_array_equal(c.infer("addsub", http_inputs()).as_numpy("OUTPUT0"), A + A)
    # Triton's L0_http test, by hand: JSON outputs
    body = {"inputs": [{"name": n, "datatype": "FP32", "shape": [1, 16], "data": A.ravel().tolist()}
                       for n in ("INPUT0", "INPUT1")],
            "outputs": [{"name": "OUTPUT0"} for _ in range(2)]}
    status, _, answer = request(tdaemon.http_port, "POST", "/v2/models/addsub/infer",
                                json.dumps(body).encode(), {"Content-Type": "application/json"})
    assert status == 400 and DUPLICATE in error_of(answer), answer


def test_duplicate_output_names_refused_over_grpc(tdaemon: Daemon) -> None:
    with grpcclient.InferenceServerClient(tdaemon.grpc_url) as c:
        outputs = [grpcclient.InferRequestedOutput("OUTPUT0") for _ in range(2)]
        with pytest.raises(InferenceServerException) as exc:
            c.infer("addsub", grpc_inputs(), outputs=outputs)
        assert exc.value.status() == "StatusCode.INVALID_ARGUMENT", exc.value
        assert DUPLICATE in exc.value.message(), exc.value
        assert c.is_server_live()
        np.testing.assert_array_equal(c.infer("addsub", grpc_inputs()).as_numpy("OUTPUT0"), A + A)


# --- 5. load / unload outside explicit mode: Triton's UNAVAILABLE ----------------------

def test_load_unload_without_explicit_mode_over_zeromq(tdaemon: Daemon) -> None:
    for op in ("load", "unload"):
        answer = raw_call(tdaemon.url, op, model="addsub")
        assert answer["error"] == {"code": errors.UNAVAILABLE, "message": POLLING}, answer


def test_load_unload_without_explicit_mode_over_http(tdaemon: Daemon) -> None:
    with httpclient.InferenceServerClient(f"127.0.0.1:{tdaemon.http_port}") as c:
        for call in (c.load_model, c.unload_model):
            with pytest.raises(InferenceServerException) as exc:
                call("addsub")
            assert (exc.value.status(), exc.value.message()) == ("503", POLLING), exc.value
        assert c.is_model_ready("addsub")


def test_load_unload_without_explicit_mode_over_grpc(tdaemon: Daemon) -> None:
    with grpcclient.InferenceServerClient(tdaemon.grpc_url) as c:
        for call in (c.load_model, c.unload_model):
            with pytest.raises(InferenceServerException) as exc:
                call("addsub")
            assert exc.value.status() == "StatusCode.UNAVAILABLE", exc.value
            assert exc.value.message() == POLLING, exc.value
        assert c.is_model_ready("addsub")


# --- 4. a version the model has but cannot serve: Triton's "is not at ready state" -----

def test_version_not_ready_is_unavailable_and_only_unknown_ones_not_found(
        test_repository: Path, tmp_path: Path) -> None:
    """L0_lifecycle's test_dynamic_version_load_unload (libtorch): a version
    removed from a polled repository is "not at ready state" (UNAVAILABLE),
    as is one that failed to load; one the model never had is "not found"."""
    import shutil
    import signal

    repo = tmp_path / "repo"
    shutil.copytree(test_repository / "versioned_all", repo / "versioned_all")
    shutil.copytree(test_repository / "versioned_all", repo / "half_broken")
    (repo / "half_broken" / "config.pbtxt").write_text(
        (repo / "half_broken" / "config.pbtxt").read_text().replace("versioned_all", "half_broken"))
    (repo / "half_broken" / "2" / "model.pt").unlink()             # version 2 fails to load
    http_port = free_tcp_port()
    d = Daemon(repo, tmp_path / "d", "--model-control-mode", "poll", "--repository-poll-secs", "3600",
               "--http-port", str(http_port)) if (tmp_path / "d").mkdir() is None else None
    d.start()
    x = {"INPUT0": np.ones((1, 4), np.float32)}
    try:
        with Client(d.url, local=False, timeout=60) as c, \
                httpclient.InferenceServerClient(f"127.0.0.1:{http_port}") as h:
            wait_for(lambda: h.is_server_live(), 30, "the HTTP endpoint")
            assert c.infer("versioned_all", x, version=1)["OUTPUT0"][0, 0] == 1.0
            shutil.rmtree(repo / "versioned_all" / "1")
            d.proc.send_signal(signal.SIGHUP)                      # rescan now
            wait_for(lambda: not c.model_ready("versioned_all", 1), 30, "version 1 to go")
            assert c.model_ready("versioned_all", 2) and c.model_ready("versioned_all", 3)
            for model, version, why in (("versioned_all", 1, "unloaded"), ("half_broken", 2, "unable to find")):
                text = f"Request for unknown model: '{model}' version {version} is not at ready state"
                with pytest.raises(InferenceError) as exc:
                    c.infer(model, x, version=version)
                assert exc.value.code == errors.UNAVAILABLE and exc.value.message.startswith(text), exc.value
                assert why in exc.value.message, exc.value
                t = httpclient.InferInput("INPUT0", [1, 4], "FP32")
                t.set_data_from_numpy(x["INPUT0"])
                with pytest.raises(InferenceServerException) as hexc:
                    h.infer(model, [t], model_version=str(version))
                assert hexc.value.status() == "503" and text in hexc.value.message(), hexc.value
            with pytest.raises(InferenceError) as exc:
                c.infer("versioned_all", x, version=9)
            assert (exc.value.code, exc.value.message) == (
                errors.NOT_FOUND, "Request for unknown model: 'versioned_all' version 9 is not found")
            assert c.infer("half_broken", x, version=3)["OUTPUT0"][0, 0] == 3.0
    finally:
        assert d.stop() == 0, d.log()



def test_a_removed_model_is_not_found_and_loads_again_when_put_back(test_repository: Path, tmp_path: Path) -> None:
    """L0_lifecycle's test_dynamic_model_load_unload: once a model is removed from a
    polled repository, a request for its latest version is Triton's NOT_FOUND
    "Request for unknown model: '<m>' has no available versions"
    (ModelLifeCycle::GetModel), over ZeroMQ, HTTP (404) and gRPC; put back
    unchanged, the next scan loads it again."""
    import shutil
    import signal

    repo = tmp_path / "repo"
    shutil.copytree(test_repository / "versioned_all", repo / "versioned_all")
    http_port, grpc_port = free_tcp_port(), free_tcp_port()
    (tmp_path / "d").mkdir()
    d = Daemon(repo, tmp_path / "d", "--model-control-mode", "poll", "--repository-poll-secs", "3600",
               "--http-port", str(http_port), "--grpc-port", str(grpc_port)).start()
    x = {"INPUT0": np.ones((1, 4), np.float32)}
    text = "Request for unknown model: 'versioned_all' has no available versions"
    try:
        with Client(d.url, local=False, timeout=60) as c, \
                httpclient.InferenceServerClient(f"127.0.0.1:{http_port}") as h, \
                grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}") as g:
            wait_for(lambda: _live(g), 30, "the gRPC endpoint")
            assert c.infer("versioned_all", x)["OUTPUT0"][0, 0] == 3.0
            shutil.rmtree(repo / "versioned_all")
            d.proc.send_signal(signal.SIGHUP)                      # rescan now
            wait_for(lambda: not c.model_ready("versioned_all"), 30, "the model to be unloaded")
            with pytest.raises(InferenceError) as exc:
                c.infer("versioned_all", x)
            assert (exc.value.code, exc.value.message) == (errors.NOT_FOUND, text)
            t = httpclient.InferInput("INPUT0", [1, 4], "FP32")
            t.set_data_from_numpy(x["INPUT0"])
            with pytest.raises(InferenceServerException) as hexc:
                h.infer("versioned_all", [t])
            assert (hexc.value.status(), hexc.value.message()) == ("404", text), hexc.value
            gt = grpcclient.InferInput("INPUT0", [1, 4], "FP32")
            gt.set_data_from_numpy(x["INPUT0"])
            with pytest.raises(InferenceServerException) as gexc:
                g.infer("versioned_all", [gt])
            assert gexc.value.status() == "StatusCode.NOT_FOUND" and text in gexc.value.message(), gexc.value
            # a version it had is still "not at ready state", as in Triton
            with pytest.raises(InferenceError) as exc:
                c.infer("versioned_all", x, version=3)
            assert exc.value.code == errors.UNAVAILABLE and "version 3 is not at ready state" in exc.value.message
            # put back unchanged, it loads again at the next scan, as in Triton
            shutil.copytree(test_repository / "versioned_all", repo / "versioned_all")
            d.proc.send_signal(signal.SIGHUP)
            wait_for(lambda: c.model_ready("versioned_all"), 60, "the model put back to load")
            assert c.infer("versioned_all", x)["OUTPUT0"][0, 0] == 3.0
            assert h.is_model_ready("versioned_all", "3") and g.is_model_ready("versioned_all", "3")
    finally:
        assert d.stop() == 0, d.log()


# --- 2. the BYTES element bound: Triton's own 10,485,760 pass, one more does not -------

def test_one_bytes_element_past_the_default_bound_is_refused_over_grpc(tdaemon: Daemon) -> None:
    """The default --max-bytes-elements is 10,485,760, what L0_grpc's
    python_unit_test.py sends (tests/unit/test_bytescan.py checks that many
    pass validation); one more is refused on its shape alone."""
    import grpc
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    request = service_pb2.ModelInferRequest(model_name="strings")
    t = request.inputs.add(name="INPUT__0", datatype="BYTES", shape=[10 * 1024 * 1024 + 1])
    request.raw_input_contents.append(b"\1\0\0\0A" * 4)
    with grpc.insecure_channel(tdaemon.grpc_url) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as exc:
            stub.ModelInfer(request, timeout=60)
        assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc.value
        assert exc.value.details() == ("input 'INPUT__0' for model 'strings' has 10485761 BYTES elements; this "
                                       "server accepts at most 10485760 per tensor (--max-bytes-elements)")
        t.shape[0] = 4                                               # the same, within the bound
        answer = stub.ModelInfer(request, timeout=60)
        assert list(answer.outputs[0].shape) == [4]


# --- 6. requests refused before they are queued count in no model statistic ----------

def test_refused_requests_are_not_counted_as_failures(tdaemon: Daemon) -> None:
    """Triton counts a failure against a model only once the request is queued
    (InferenceRequest::RespondIfError: REJECTED for a queue timeout, CANCELED,
    BACKEND, OTHER); one refused by validation (PrepareForInference, before
    InferAsync) or a full queue (Enqueue) is answered with the error and
    counted nowhere, and a request for an unknown model cannot be. The same
    here: through the daemon, the worker's direct path and HTTP."""
    import re
    import urllib.request

    def counts() -> tuple:
        with Client(tdaemon.url, local=False, timeout=60) as c:    # first: it catches up on reports
            inference = c.statistics("addsub")["model_stats"][0]["inference_stats"]
        text = urllib.request.urlopen(f"http://127.0.0.1:{tdaemon.metrics_port}/metrics", timeout=10).read()
        samples = {}
        for m in re.finditer(r'^(nv_inference_request_(?:success|failure))\{([^}]*)\} (\S+)$', text.decode(),
                             re.M):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
            if labels.get("model") == "addsub":
                samples[(m.group(1), labels.get("reason", ""))] = float(m.group(3))
        return samples, inference["success"]["count"], inference["fail"]["count"]

    before_samples, before_success, before_fail = counts()
    refused = 0
    for local in (False, True):
        with Client(tdaemon.url, local=local, timeout=60) as c:
            c.infer("addsub", ADDSUB)
            for bad in ({"INPUT0": A},                                        # an input missing
                        {"INPUT0": A, "INPUT1": A[:, :8]}):                   # a wrong shape
                with pytest.raises(InferenceError) as exc:
                    c.infer("addsub", bad)
                assert exc.value.code == errors.INVALID_ARG, exc.value
                refused += 1
            with pytest.raises(InferenceError):
                c.infer("addsub", ADDSUB, outputs=["OUTPUT0", "OUTPUT0"])
            refused += 1
    with httpclient.InferenceServerClient(f"127.0.0.1:{tdaemon.http_port}") as h:
        with pytest.raises(InferenceServerException):
            h.infer("addsub", http_inputs()[:1])
        with pytest.raises(InferenceServerException):
            h.infer("addsub", http_inputs(), outputs=[httpclient.InferRequestedOutput("OUTPUT0")] * 2)
        refused += 2
        h.infer("addsub", http_inputs())
    assert refused == 8
    # the direct path reports what it answered before it answers: the three
    # successes are counted when the statistics call has caught up
    samples, success, fail = counts()
    assert (success - before_success, fail - before_fail) == (3, 0)
    assert samples[("nv_inference_request_success", "")] - before_samples[("nv_inference_request_success", "")] \
        == 3
    for reason in ("REJECTED", "CANCELED", "BACKEND", "OTHER"):
        key = ("nv_inference_request_failure", reason)
        assert samples[key] == before_samples[key], (reason, samples)
