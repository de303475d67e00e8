"""Names that reach the OS, from every way in (issue 31, part 1).

posix_ipc 1.3 ends the process with SIGSEGV when `shm_open`'s name holds a
NUL byte, and a register call hands the client's key to it. Before the fix a
key of "a\\0b" killed the broker (from a ZeroMQ client), or the gateway (over
HTTP and gRPC). Each way in is tried here against one real daemon with its
gateway; afterwards the daemon and the gateway keep their pids and another
client is answered. A fuzz then sends every string field of every operation
with a NUL, an overlong value, bytes that are not UTF-8 and path-like
values, over ZeroMQ and over the gateway, with the same checks.
"""
from __future__ import annotations

import json
import os
import socket
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import msgpack
import numpy as np
import pytest

from torchpool.protocol.names import MAX_NAME_BYTES, check_os_name, is_path_component
from torchpool.protocol.errors import TorchpoolError

from ..support.daemon import Daemon, RawConnection, descendants, free_tcp_port, wait_for
from .test_e2e_shm_protocol import Session, _make_segment, register

httpclient = pytest.importorskip("tritonclient.http")
grpcclient = pytest.importorskip("tritonclient.grpc")

A = np.arange(16, dtype=np.float32).reshape(1, 16)
NUL_KEY = "a\x00b"


# --- the rule itself ---------------------------------------------------------

@pytest.mark.parametrize("value,problem", [
    ("a\x00b", "NUL"), ("/a\x00", "NUL"), ("", "empty"), ("/", "empty"), ("a/b", "'/' after"),
    ("/../x", "'/' after"), ("..", "'..'"), ("x" * (MAX_NAME_BYTES + 1), "bytes long"),
    ("é" * 128, "bytes long"), ("a\udcff", "not valid UTF-8"), (7, "must be a string"), (None, "must be a string"),
])
def test_names_the_os_refuses_are_invalid_arg(value: Any, problem: str) -> None:
    assert not is_path_component(value)
    with pytest.raises(TorchpoolError) as info:
        check_os_name("region 'r': key", value)
    assert info.value.code == "INVALID_ARG"
    assert info.value.message.startswith("region 'r': key ") and problem in info.value.message


@pytest.mark.parametrize("value,name", [("a", "a"), ("/a", "a"), ("x" * MAX_NAME_BYTES, "x" * MAX_NAME_BYTES),
                                        ("model-1.v2", "model-1.v2"), ("/é", "é")])
def test_single_names_pass_without_their_leading_slash(value: str, name: str) -> None:
    assert is_path_component(value) and check_os_name("key", value) == name


# --- a daemon with its gateway -------------------------------------------------

@pytest.fixture(scope="module")
def served(small_repository: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    http, grpc = free_tcp_port(), free_tcp_port()
    d = Daemon(small_repository, tmp_path_factory.mktemp("names"), "--http-port", str(http),
               "--grpc-port", str(grpc), "--model-control-mode", "explicit", "--load-model", "*",
               "--allow-client-shm=true")      # its callers register system shared memory
    d.http, d.grpc = http, grpc
    d.start()
    wait_for(lambda: _http_ready(http), 60, "the gateway's HTTP port")
    yield d
    assert d.stop() == 0, d.log()


def _http_ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/health/ready", timeout=2) as r:
            return r.status == 200
    except (OSError, urllib.error.URLError):
        return False


def _gateway_pid(d: Daemon) -> int:
    for pid in descendants(d.pid()):
        try:
            if b"gateway" in Path(f"/proc/{pid}/cmdline").read_bytes():
                return pid
        except OSError:
            continue
    raise AssertionError("no gateway process under the daemon")


def _pids(d: Daemon) -> tuple[int, int]:
    return d.pid(), _gateway_pid(d)


def assert_unharmed(d: Daemon, pids: tuple[int, int]) -> None:
    """Same daemon and gateway processes; a ZeroMQ client and an HTTP client are answered."""
    assert d.proc.poll() is None, d.log()
    assert _pids(d) == pids
    with RawConnection(d.url) as rc:
        answer, _ = rc.call(rc.pack({"v": 1, "op": "infer", "id": 1, "model": "addsub", "version": "",
                                     "inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 16],
                                                 "data": A.tobytes()},
                                                {"name": "INPUT1", "datatype": "FP32", "shape": [1, 16],
                                                 "data": A.tobytes()}]}))
    assert answer["ok"], answer
    out = {o["name"]: o for o in answer["outputs"]}
    np.testing.assert_array_equal(np.frombuffer(out["OUTPUT0"]["data"], np.float32), (A + A).ravel())
    client = httpclient.InferenceServerClient(f"127.0.0.1:{d.http}")
    try:
        assert client.is_model_ready("addsub")
    finally:
        client.close()


# --- a NUL in a region key, from each way in ---------------------------------

def test_a_nul_key_from_a_zeromq_client_is_refused(served: Daemon) -> None:
    pids = _pids(served)
    s = Session(served.url)
    try:
        answer = s.call("register_system_shared_memory", name="r", key=NUL_KEY, byte_size=64, offset=0)
        assert answer["ok"] is False and answer["error"]["code"] == "INVALID_ARG", answer
        assert "NUL" in answer["error"]["message"] and "region 'r'" in answer["error"]["message"]
        for key in ("/" + NUL_KEY, "x" * 300, "../../etc/passwd"):
            answer = s.call("register_system_shared_memory", name="r", key=key, byte_size=64, offset=0)
            assert answer["error"]["code"] == "INVALID_ARG", (key, answer)
        # a good key still registers on the same session
        key, mm = _make_segment()
        try:
            assert register(s, "good", key, mm, 4096)["ok"]
        finally:
            s.call("unregister_system_shared_memory", name=None)
            mm.close()
            os.unlink(f"/dev/shm/{key}")
    finally:
        s.call("goodbye")
        s.close()
    assert_unharmed(served, pids)


def test_a_nul_key_over_http_is_refused(served: Daemon) -> None:
    pids = _pids(served)
    body = json.dumps({"key": NUL_KEY, "offset": 0, "byte_size": 64}).encode()     # "\u0000" in JSON
    request = urllib.request.Request(f"http://127.0.0.1:{served.http}/v2/systemsharedmemory/region/r/register",
                                     data=body, method="POST", headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request, timeout=30)
    assert info.value.code == 400
    assert "NUL" in json.loads(info.value.read())["error"]
    client = httpclient.InferenceServerClient(f"127.0.0.1:{served.http}")
    try:
        with pytest.raises(Exception) as refused:
            client.register_system_shared_memory("r2", NUL_KEY, 64)
        assert "NUL" in str(refused.value)
        assert client.get_system_shared_memory_status() == []
    finally:
        client.close()
    assert_unharmed(served, pids)


def test_a_nul_key_over_grpc_is_refused(served: Daemon) -> None:
    pids = _pids(served)
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{served.grpc}")
    try:
        with pytest.raises(Exception) as refused:
            client.register_system_shared_memory("r", NUL_KEY, 64)
        assert "NUL" in str(refused.value)
        assert "INVALID_ARG" in str(refused.value) or "StatusCode.INVALID_ARGUMENT" in str(refused.value)
    finally:
        client.close()
    assert_unharmed(served, pids)


# --- every string field of every operation ----------------------------------

BAD_TEXTS = ["a\x00b", "\x00", "x" * 70_000, "../../../../etc/passwd", "/dev/shm/../../etc/shadow",
             "torchpool.00000000.1.in0", "%s%n{}", "\udcff"]
NOT_UTF8 = "\x01not-utf8\x01"          # replaced by bytes that are not UTF-8, after packing

OPERATIONS: dict[str, dict] = {
    "infer": {"model": "addsub", "version": "", "id": "x",
              "inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 16], "data": A.tobytes(),
                          "parameters": {"p": "v"}},
                         {"name": "INPUT1", "datatype": "FP32", "shape": [1, 16], "data": A.tobytes()}],
              "outputs": [{"name": "OUTPUT0", "parameters": {"classification": 1}}],
              "parameters": {"sequence_id": "s", "priority": 1}},
    "server_live": {}, "server_ready": {},
    "model_ready": {"model": "addsub", "version": "1"},
    "model_metadata": {"model": "addsub", "version": "1"},
    "model_config": {"model": "addsub", "version": "1"},
    "repository_index": {"ready": True},
    "server_metadata": {},
    "statistics": {"model": "addsub", "version": "1"},
    "load": {"model": "no-such-model", "config": '{"name": "no-such-model"}'},
    "unload": {"model": "no-such-model"},
    "hello": {"local": True, "client": "fuzz"},
    "goodbye": {"session": "s"},
    "arena_grow": {"session": "s", "bytes": 4096},
    "direct": {"session": "s", "model": "addsub", "version": ""},
    "register_system_shared_memory": {"name": "r", "key": "k", "offset": 0, "byte_size": 64},
    "unregister_system_shared_memory": {"name": "r"},
    "get_system_shared_memory_status": {"name": "r"},
}


def _string_paths(obj: Any, path: tuple = ()) -> Iterator[tuple]:
    """Where the strings are, keys included: ("op",), ("inputs", 0, "name"), ..."""
    if isinstance(obj, str):
        yield path
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _string_paths(v, path + (k,))
            yield path + ((k,),)            # the key itself
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _string_paths(v, path + (i,))


def _replaced(obj: Any, path: tuple, value: str) -> Any:
    if not path:
        return value
    head, rest = path[0], path[1:]
    if isinstance(head, tuple):                    # rename a key
        return {(value if k == head[0] else k): v for k, v in obj.items()}
    if isinstance(obj, dict):
        return {k: (_replaced(v, rest, value) if k == head else v) for k, v in obj.items()}
    return [(_replaced(v, rest, value) if i == head else v) for i, v in enumerate(obj)]


def _pack(header: dict) -> bytes:
    data = msgpack.packb(header, use_bin_type=True, unicode_errors="surrogatepass")
    return data.replace(NOT_UTF8.encode(), b"\xff\xfe\xc0\x80not\xff\xfe\x80\x80")


def fuzz_headers(session: str) -> Iterator[bytes]:
    for op, fields in OPERATIONS.items():
        header = {"v": 1, "op": op, "id": 1, "session": session, **fields}
        for path in _string_paths(header):
            for value in BAD_TEXTS + [NOT_UTF8]:
                yield _pack(_replaced(header, path, value))


def test_every_string_field_of_every_operation_fuzzed_over_zeromq(served: Daemon) -> None:
    pids = _pids(served)
    s = Session(served.url)                    # a real local session: the region ops reach posix_ipc
    sent = answered = 0
    try:
        for frame in fuzz_headers(s.token):
            s.rc.send(frame)
            sent += 1
            reply, _ = s.rc.recv(timeout=30)
            answered += 1
            assert isinstance(reply.get("ok"), bool), reply
            assert served.proc.poll() is None, f"the daemon died on {frame[:200]!r}\n{served.log()}"
        assert s.call("get_system_shared_memory_status", name=None)["result"] == []
    finally:
        s.call("goodbye")
        s.close()
    assert sent == answered and sent > 1000
    assert_unharmed(served, pids)


def _http(port: int, method: str, path: str, body: bytes = b"") -> int:
    """Send one request by hand (any bytes in the path); its status, or 0 when refused outright."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        head = f"{method} ".encode() + path.encode("utf-8", "surrogateescape") + \
            f" HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
        sock.sendall(head + body)
        reply = b""
        while b"\r\n" not in reply:
            chunk = sock.recv(4096)
            if not chunk:
                return 0
            reply += chunk
    return int(reply.split(b" ", 2)[1])


def refused(status: int) -> bool:
    """The caller's error (4xx), or the unknown model's 503: never a 500, never a dropped connection."""
    return 400 <= status < 500 or status == 503


def test_every_string_of_the_gateways_requests_fuzzed(served: Daemon) -> None:
    """Model names, versions, region names and keys, JSON fields: over HTTP
    (in the path and the body) and gRPC, with the same bad strings."""
    pids = _pids(served)
    port = served.http
    texts = ["a\x00b", "x" * 5000, "../../../../etc/passwd", "%00", "%2e%2e%2f%2e%2e", "\udcff"]
    for t in texts:
        quoted = urllib.request.quote(t.encode("utf-8", "surrogateescape"), safe="")
        for path in (f"/v2/models/{quoted}", f"/v2/models/{quoted}/ready", f"/v2/models/{quoted}/config",
                     f"/v2/models/addsub/versions/{quoted}/stats",
                     f"/v2/systemsharedmemory/region/{quoted}/status"):
            assert refused(_http(port, "GET", path)), path
        for path, body in ((f"/v2/repository/models/{quoted}/load", b"{}"),
                           (f"/v2/repository/models/{quoted}/unload", b"{}"),
                           (f"/v2/systemsharedmemory/region/{quoted}/unregister", b""),
                           (f"/v2/models/{quoted}/infer", json.dumps({"inputs": []}).encode())):
            status = _http(port, "POST", path, body)      # unloading what is not there is fine (Triton)
            assert refused(status) or (status == 200 and path.endswith(("/unregister", "/unload"))), path
        for field in ("key", "name"):
            region = {"key": "k", "offset": 0, "byte_size": 64, field: t}
            body = json.dumps(region).encode()
            assert refused(_http(port, "POST", "/v2/systemsharedmemory/region/r/register", body))
        infer = {"inputs": [{"name": t, "datatype": "FP32", "shape": [1, 16], "data": A.ravel().tolist()},
                            {"name": "INPUT1", "datatype": t, "shape": [1, 16], "data": A.ravel().tolist()}],
                 "outputs": [{"name": t, "parameters": {"binary_data": False, t: t}}], "id": t}
        assert refused(_http(port, "POST", "/v2/models/addsub/infer", json.dumps(infer).encode()))
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{served.grpc}")
    try:
        for t in texts[:4]:
            for call in (lambda: client.is_model_ready(t), lambda: client.get_model_metadata(t),
                         lambda: client.get_model_config(t), lambda: client.unregister_system_shared_memory(t),
                         lambda: client.register_system_shared_memory("r", t, 64),
                         lambda: client.register_system_shared_memory(t, "k", 64),
                         lambda: client.get_inference_statistics(t), lambda: client.load_model(t)):
                try:
                    call()
                except grpcclient.InferenceServerException as exc:     # an error answer is what we want
                    assert exc.status() != "StatusCode.UNAVAILABLE" or "model" in exc.message(), exc
    finally:
        client.close()
    assert_unharmed(served, pids)


def test_a_load_of_a_name_that_is_a_path_is_refused(served: Daemon) -> None:
    with RawConnection(served.url) as rc:
        for name in ("../etc", "a\x00b", "x" * 300, "/abs", "."):
            answer, _ = rc.call(rc.pack({"v": 1, "op": "load", "id": 1, "model": name}))
            assert answer["ok"] is False, (name, answer)
            assert answer["error"]["code"] in ("INVALID_ARG", "UNAVAILABLE"), answer
            assert "invalid model name" in answer["error"]["message"], answer


# --- a NUL in a model name, from each way in ----------------------------------

MODEL_NAME_REFUSED = ("invalid model name: it holds a NUL byte; a model name is a single directory name of "
                      "1 to 255 bytes with no NUL, '/' or backslash, not beginning with '.'")


def test_a_nul_in_a_model_name_is_invalid_arg_and_never_echoed(served: Daemon) -> None:
    """`model_ready("addsub\\0")` answered as for a model that is not ready,
    and errors echoed the name, NUL and all: every op that names a model
    answers INVALID_ARG with the one rule's text, over ZeroMQ, HTTP and gRPC."""
    from torchpool.client import Client, InferenceError

    pids = _pids(served)
    name = "addsub\x00"
    with Client(served.url, timeout=30) as c:
        for call in (lambda: c.model_ready(name), lambda: c.model_metadata(name), lambda: c.model_config(name),
                     lambda: c.statistics(name), lambda: c.infer(name, {"INPUT0": A, "INPUT1": A}),
                     lambda: c.load(name), lambda: c.unload(name)):
            with pytest.raises(InferenceError) as info:
                call()
            assert (info.value.code, info.value.message) == ("INVALID_ARG", MODEL_NAME_REFUSED)
    for method, path, body in (("GET", "/v2/models/addsub%00/ready", None), ("GET", "/v2/models/addsub%00", None),
                               ("GET", "/v2/models/addsub%00/config", None),
                               ("GET", "/v2/models/addsub%00/stats", None),
                               ("POST", "/v2/models/addsub%00/infer", b'{"inputs": [{"name": "INPUT0"}]}'),
                               ("POST", "/v2/repository/models/addsub%00/load", None),
                               ("POST", "/v2/repository/models/addsub%00/unload", None)):
        req = urllib.request.Request(f"http://127.0.0.1:{served.http}{path}", data=body, method=method)
        with pytest.raises(urllib.error.HTTPError) as http_info:
            urllib.request.urlopen(req, timeout=30)
        assert (http_info.value.code, json.loads(http_info.value.read())) == (400, {"error": MODEL_NAME_REFUSED})
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{served.grpc}")
    try:
        x = grpcclient.InferInput("INPUT0", [1, 16], "FP32")
        x.set_data_from_numpy(A)
        for call in (lambda: client.is_model_ready(name), lambda: client.get_model_metadata(name),
                     lambda: client.get_model_config(name), lambda: client.get_inference_statistics(name),
                     lambda: client.infer(name, [x]), lambda: client.load_model(name),
                     lambda: client.unload_model(name)):
            with pytest.raises(grpcclient.InferenceServerException) as grpc_info:
                call()
            assert (grpc_info.value.status(), grpc_info.value.message()) == (
                "StatusCode.INVALID_ARGUMENT", MODEL_NAME_REFUSED)
    finally:
        client.close()
    assert_unharmed(served, pids)
