"""End to end: remote callers of the HTTP/gRPC gateway kept apart (issue 32,
items 7, 8 and 9).

- Item 8: system shared memory is off for remote callers unless the
  operator turns it on (--allow-client-shm=true, Triton's), and then only
  for the key prefixes allowed: a segment of another user (a real second
  uid, made here) cannot be registered through the gateway, which opens
  segments with the daemon's rights.
- Item 7: each HTTP connection and each gRPC peer is a caller with its own
  share of the daemon; its regions are its user's (one uid's connections
  share them, perf_analyzer's pattern: issue 41), no other user's, and stay
  after the user's last connection closes until they are unregistered, as
  Triton's do; one caller's thousand calls to a slow model do not hold back
  another's.
- Item 9: a 5,000-digit integer, extra raw_input_contents and
  `Transfer-Encoding: gzip, chunked` get clear errors.
"""
from __future__ import annotations

import base64

import http.client
import json
import os
import pwd
import random
import re
import signal
import time
import traceback
import urllib.request
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import pytest

httpclient = pytest.importorskip("tritonclient.http")
grpcclient = pytest.importorskip("tritonclient.grpc")

import grpc  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

from ..support.daemon import Daemon, free_tcp_port, wait_for  # noqa: E402
from ..support.http_gateway import ResponseReader, connect, error_of, gateway_pid, request  # noqa: E402

IDENTITY = "/v2/models/identity/infer"
X = np.arange(16, dtype=np.float32)
ALLOWED = "tpt-allowed-"


def start(root: Path, workdir: Path, *extra: str) -> Daemon:
    http, grpc_port = free_tcp_port(), free_tcp_port()
    d = Daemon(root, workdir, "--http-port", str(http), "--grpc-port", str(grpc_port), *extra).start()
    d.http, d.grpc = http, grpc_port
    d.gateway = wait_for(lambda: gateway_pid(d), 30, "the gateway process")
    return d


@pytest.fixture(scope="module")
def plain(small_repository: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """The defaults: remote callers get no system shared memory."""
    metrics = free_tcp_port()
    d = start(small_repository, tmp_path_factory.mktemp("gateway_plain"), "--metrics-port", str(metrics))
    d.metrics = metrics
    yield d
    assert gateway_pid(d) == d.gateway, "the gateway was restarted"
    assert d.stop() == 0, d.log()


@pytest.fixture(scope="module")
def shm_on(small_repository: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """System shared memory on, for keys with one prefix; small limits."""
    d = start(small_repository, tmp_path_factory.mktemp("gateway_shm"), "--allow-client-shm=true",
              "--allow-client-shm-prefix", ALLOWED, "--max-regions-per-session", "4",
              "--max-sessions-per-peer", "8")
    yield d
    assert gateway_pid(d) == d.gateway, "the gateway was restarted"
    assert d.stop() == 0, d.log()


def http_client(d: Daemon) -> "httpclient.InferenceServerClient":
    return httpclient.InferenceServerClient(f"127.0.0.1:{d.http}", network_timeout=60)


def grpc_client(d: Daemon) -> "grpcclient.InferenceServerClient":
    """A client on a connection of its own (grpc shares one between
    channels of a process unless told not to)."""
    return grpcclient.InferenceServerClient(f"127.0.0.1:{d.grpc}",
                                            channel_args=[("grpc.use_local_subchannel_pool", 1)])


def fails(call, *args, **kwargs) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as exc:
        call(*args, **kwargs)
    return exc.value


# --- segments: ours, and another user's --------------------------------------------

class Segment:
    """A POSIX shared-memory segment (/dev/shm/<key>) of 64 bytes, mode
    0600, made by the process of `uid` (None: this one)."""

    def __init__(self, key: str, uid: int | None = None, data: bytes = bytes(64)) -> None:
        self.key, self.path = key, Path("/dev/shm", key)
        if uid is None:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            os.write(fd, data)
            os.close(fd)
            return
        pid = os.fork()
        if pid == 0:                        # the child only makes system calls, then goes
            code = 1
            try:
                if uid is not None:
                    os.setgroups([])
                    os.setgid(uid)
                    os.setuid(uid)
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
                os.write(fd, data)
                os.close(fd)
                code = 0
            finally:
                os._exit(code)
        assert os.waitpid(pid, 0)[1] == 0
        assert self.path.stat().st_uid == (os.getuid() if uid is None else uid)

    def read(self) -> bytes:
        return self.path.read_bytes()

    def write(self, data: bytes) -> None:
        with open(self.path, "r+b") as f:
            f.write(data)

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)


def unused_uid() -> int:
    """A uid no account has: a second user that is only a number."""
    while True:
        uid = random.randint(40000, 59999)
        try:
            pwd.getpwuid(uid)
        except KeyError:
            return uid


@pytest.fixture
def segments() -> Iterator:
    made: list[Segment] = []

    def make(prefix: str = ALLOWED, uid: int | None = None, data: bytes = bytes(64)) -> Segment:
        segment = Segment(f"{prefix}{uuid.uuid4().hex[:10]}", uid, data)
        made.append(segment)
        return segment

    yield make
    for segment in made:
        segment.remove()


SECRET = b"another user's secret bytes, 64 of them, readable by nobody else"[:64]


# --- item 8: system shared memory for remote callers -----------------------------------

def test_system_shared_memory_is_off_for_remote_callers(plain: Daemon, segments) -> None:
    """By default (Triton's --allow-client-shm=false) no remote caller may
    register a region: not another user's segment (the daemon, as root,
    could open it), not its own; the server does not claim the extension."""
    if os.getuid() != 0:
        pytest.skip("making another user's segment needs root")
    victim = segments("tpt-victim-", unused_uid(), SECRET)
    # Triton's UNSUPPORTED (HTTP 501, gRPC UNIMPLEMENTED) and words, for
    # register and unregister; status stays allowed (empty), as in Triton
    # (qa/L0_shared_memory test_client_shm_disabled_by_default)
    expected = "Client shared memory is disabled. Start the server with '--allow-client-shm=true' to enable."
    client = http_client(plain)
    try:
        exc = fails(client.register_system_shared_memory, "r", "/" + victim.key, 64)
        assert (exc.status(), exc.message()) == ("501", expected)
        for name in ("r", ""):
            exc = fails(client.unregister_system_shared_memory, name)
            assert (exc.status(), exc.message()) == ("501", expected)
        assert "system_shared_memory" not in client.get_server_metadata()["extensions"]
        assert client.get_system_shared_memory_status() == []
        # a request naming the region is refused by the daemon: nothing of that name here
        t = httpclient.InferInput("INPUT__0", [16], "FP32")
        t.set_shared_memory("r", 64)
        exc = fails(client.infer, "identity", [t])
        assert exc.status() == "404" and "'r'" in exc.message()
    finally:
        client.close()
    with grpc_client(plain) as g:
        exc = fails(g.register_system_shared_memory, "r", victim.key, 64)
        assert (exc.status(), exc.message()) == ("StatusCode.UNIMPLEMENTED", expected)
        for name in ("r", ""):
            exc = fails(g.unregister_system_shared_memory, name)
            assert (exc.status(), exc.message()) == ("StatusCode.UNIMPLEMENTED", expected)
        assert not g.get_system_shared_memory_status().regions
    assert victim.read() == SECRET


def test_cuda_shared_memory_calls_follow_the_client_shm_policy(plain: Daemon) -> None:
    """With client shared memory off, registering and unregistering CUDA
    regions is UNSUPPORTED in Triton's words, in both protocols; status
    lists nothing."""
    expected = "Client shared memory is disabled. Start the server with '--allow-client-shm=true' to enable."
    client = http_client(plain)
    try:
        exc = fails(client.register_cuda_shared_memory, "gpu", base64.b64encode(b"\0" * 64), 0, 64)
        assert (exc.status(), exc.message()) == ("501", expected)
        for name in ("gpu", ""):
            exc = fails(client.unregister_cuda_shared_memory, name)
            assert (exc.status(), exc.message()) == ("501", expected)
        assert client.get_cuda_shared_memory_status() == []
    finally:
        client.close()
    with grpc_client(plain) as g:
        exc = fails(g.register_cuda_shared_memory, "gpu", base64.b64encode(b"\0" * 64), 0, 64)
        assert (exc.status(), exc.message()) == ("StatusCode.UNIMPLEMENTED", expected)
        for name in ("gpu", ""):
            exc = fails(g.unregister_cuda_shared_memory, name)
            assert (exc.status(), exc.message()) == ("StatusCode.UNIMPLEMENTED", expected)
        assert not g.get_cuda_shared_memory_status().regions


def test_only_allowed_key_prefixes_are_registered(shm_on: Daemon, segments) -> None:
    """With --allow-client-shm=true and --allow-client-shm-prefix, a key
    outside the prefixes is refused (leading slashes do not get round it),
    one inside works both ways."""
    if os.getuid() != 0:
        pytest.skip("making another user's segment needs root")
    victim = segments("tpt-victim-", unused_uid(), SECRET)
    refused = ("failed to register system shared memory region 'r': its key does not begin with a "
               "prefix this server allows (--allow-client-shm-prefix)")
    client = http_client(shm_on)
    try:
        for key in (victim.key, "/" + victim.key, "///" + victim.key):
            exc = fails(client.register_system_shared_memory, "r", key, 64)
            assert (exc.status(), exc.message()) == ("400", refused)
        assert "system_shared_memory" in client.get_server_metadata()["extensions"]
        mine = segments()
        mine.write(X.tobytes()[:64])
        client.register_system_shared_memory("mine", "/" + mine.key, 64)
        t = httpclient.InferInput("INPUT__0", [16], "FP32")
        t.set_shared_memory("mine", 64)
        np.testing.assert_array_equal(client.infer("identity", [t]).as_numpy("OUTPUT__0"), X)
        client.unregister_system_shared_memory()
    finally:
        client.close()
    with grpc_client(shm_on) as g:
        exc = fails(g.register_system_shared_memory, "r", "//" + victim.key, 64)
        assert exc.status() == "StatusCode.INVALID_ARGUMENT" and exc.message() == refused
    assert victim.read() == SECRET


# Triton's text for a region out of its segment's bounds, torchpool's for every
# segment the daemon cannot use
UNUSABLE = "failed to register shared memory region 'r': invalid args"


def test_a_remote_caller_learns_nothing_of_dev_shm_from_why_a_key_failed(shm_on: Daemon, segments) -> None:
    """The gateway opens a region's segment with the daemon's rights. It
    used to say why that failed ("No shared memory exists", "Permission
    denied", "Too many levels of symbolic links", "does not fit the segment's
    8 bytes"): a remote caller could map /dev/shm under the allowed prefixes.
    Now every key the daemon cannot use gets one answer (Triton's words)."""
    small = segments(data=bytes(8))                      # exists, but is smaller than the region
    link = Path("/dev/shm") / f"{ALLOWED}link{uuid.uuid4().hex[:8]}"
    link.symlink_to("/etc/hostname")
    folder = Path("/dev/shm") / f"{ALLOWED}dir{uuid.uuid4().hex[:8]}"
    folder.mkdir()
    keys = [f"{ALLOWED}missing{uuid.uuid4().hex[:8]}", link.name, folder.name, small.key]
    try:
        client = http_client(shm_on)
        try:
            for key in keys:
                exc = fails(client.register_system_shared_memory, "r", key, 64)
                assert (exc.status(), exc.message()) == ("400", UNUSABLE), key
            assert client.get_system_shared_memory_status() == []
        finally:
            client.close()
        with grpc_client(shm_on) as g:
            for key in keys:
                exc = fails(g.register_system_shared_memory, "r", key, 64)
                assert (exc.status(), exc.message()) == ("StatusCode.INVALID_ARGUMENT", UNUSABLE), key
            mine = segments()                          # a key it can use still registers
            g.register_system_shared_memory("mine", mine.key, 64)
            assert list(g.get_system_shared_memory_status().regions) == ["mine"]
            g.unregister_system_shared_memory()
    finally:
        link.unlink()
        folder.rmdir()


# --- item 7: regions and turns per caller ------------------------------------------------

def as_user(uid: int, work: Callable[[], Any]) -> Any:
    """`work()` in a child process running as `uid` (a real second user of
    this host); its JSON-able result. The child speaks HTTP with the
    standard library only: a fork inherits tritonclient's gevent hub and
    grpc's threads, neither of which works in it (and this interpreter is
    not one another user may start)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(read)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            try:
                out = {"result": work()}
            except Exception:
                out = {"failed": traceback.format_exc()}
            os.write(write, json.dumps(out).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    with os.fdopen(read, "rb") as f:
        out = json.loads(f.read())
    assert os.waitpid(pid, 0)[1] == 0
    assert "failed" not in out, out["failed"]
    return out["result"]


class JsonConnection:
    """One kept-alive HTTP connection speaking KServe v2 JSON (no tritonclient)."""

    def __init__(self, port: int) -> None:
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)

    def post(self, path: str, doc: Any = None, method: str = "POST") -> tuple[int, Any]:
        self.conn.request(method, path, body=b"" if doc is None else json.dumps(doc).encode(),
                          headers={"Content-Type": "application/json"})
        r = self.conn.getresponse()
        body = r.read()
        return r.status, json.loads(body) if body else None

    def infer_region(self, region: str) -> tuple[int, Any]:
        return self.post("/v2/models/identity/infer", {"inputs": [{
            "name": "INPUT__0", "shape": [16], "datatype": "FP32",
            "parameters": {"shared_memory_region": region, "shared_memory_byte_size": 64}}]})

    def close(self) -> None:
        self.conn.close()


def identity_input(region: str, client: Any = httpclient) -> Any:
    t = client.InferInput("INPUT__0", [16], "FP32")
    t.set_shared_memory(region, 64)
    return t


def test_one_users_connections_share_its_regions_and_another_user_cannot_touch_them(shm_on: Daemon,
                                                                                   segments) -> None:
    """perf_analyzer registers its regions on one connection and infers from
    others: the connections of one user (uid, from the kernel's socket
    table) share its regions, its region limit and "unregister all"; another
    user's connections see, use and unregister none of them."""
    other = unused_uid()
    theirs = segments(uid=other, data=(X * 2).tobytes())
    a, b = http_client(shm_on), http_client(shm_on)
    try:
        mine = segments()
        mine.write(X.tobytes())
        a.register_system_shared_memory("shared", mine.key, 64)
        assert [r["name"] for r in b.get_system_shared_memory_status()] == ["shared"]
        np.testing.assert_array_equal(b.infer("identity", [identity_input("shared")]).as_numpy("OUTPUT__0"), X)
        for i in range(3):
            b.register_system_shared_memory(f"b{i}", segments().key, 64)
        exc = fails(a.register_system_shared_memory, "a4", segments().key, 64)      # one limit for both
        assert exc.status() == "429" and "--max-regions-per-session" in exc.message()

        def second_user() -> dict:
            c = JsonConnection(shm_on.http)
            try:
                registered = c.post("/v2/systemsharedmemory/region/c0/register",
                                    {"key": theirs.key, "offset": 0, "byte_size": 64})[0]   # room: its own
                seen = c.post("/v2/systemsharedmemory/status", method="GET")[1]
                own = c.infer_region("c0")[1]["outputs"][0]["data"]
                used = c.infer_region("shared")
                unregistered = c.post("/v2/systemsharedmemory/unregister")[0]       # all of its own
                return {"registered": registered, "seen": [r["name"] for r in seen], "own": own,
                        "used": [used[0], used[1].get("error", "")], "unregistered": unregistered}
            finally:
                c.close()

        got = as_user(other, second_user)
        assert got["registered"] == 200 and got["unregistered"] == 200
        assert got["seen"] == ["c0"] and got["own"] == (X * 2).tolist()
        assert got["used"][0] == 404 and "'shared'" in got["used"][1]
        assert sorted(r["name"] for r in a.get_system_shared_memory_status()) == ["b0", "b1", "b2", "shared"]
        b.unregister_system_shared_memory()                                           # all of the user's
        assert a.get_system_shared_memory_status() == []
    finally:
        a.close()
        b.close()


def test_one_users_grpc_connections_share_its_regions_and_another_user_cannot_touch_them(shm_on: Daemon,
                                                                                        segments) -> None:
    other = unused_uid()
    with grpc_client(shm_on) as a, grpc_client(shm_on) as b:
        mine = segments()
        mine.write(X.tobytes())
        a.register_system_shared_memory("shared", mine.key, 64)
        assert list(b.get_system_shared_memory_status().regions) == ["shared"]
        got = b.infer("identity", [identity_input("shared", grpcclient)])
        np.testing.assert_array_equal(got.as_numpy("OUTPUT__0"), X)

        def second_user() -> dict:
            # over HTTP: a user's regions are the same on both gateways
            c = JsonConnection(shm_on.http)
            try:
                seen = c.post("/v2/systemsharedmemory/status", method="GET")[1]
                unregistered = c.post("/v2/systemsharedmemory/unregister")[0]
                used = c.infer_region("shared")
                return {"seen": seen, "unregistered": unregistered, "used": [used[0], used[1].get("error", "")]}
            finally:
                c.close()

        got = as_user(other, second_user)
        assert got["seen"] == [] and got["unregistered"] == 200
        assert got["used"][0] == 404 and "'shared'" in got["used"][1]
        assert list(a.get_system_shared_memory_status().regions) == ["shared"]
        b.unregister_system_shared_memory()
        assert not a.get_system_shared_memory_status().regions


@pytest.fixture(scope="module")
def kept(small_repository: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """As shm_on, with a lease of 2 s: a session not renewed ends soon. For
    one test: the gateway's own session says hello at its first infer, and
    would then end whenever idle."""
    d = start(small_repository, tmp_path_factory.mktemp("gateway_kept"), "--allow-client-shm=true",
              "--allow-client-shm-prefix", ALLOWED, "--max-regions-per-session", "4",
              "--max-sessions-per-peer", "8", "--client-lease", "2")
    yield d
    assert gateway_pid(d) == d.gateway, "the gateway was restarted"
    assert d.stop() == 0, d.log()


STAY = "regions stay until unregistered"


def once(port: int, path: str, doc: Any = None, method: str = "POST") -> tuple[int, Any]:
    """One request on a connection of its own that the gateway is told to
    close after it (`Connection: close`), as perf_analyzer's registering one."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request(method, path, body=b"" if doc is None else json.dumps(doc).encode(),
                     headers={"Content-Type": "application/json", "Connection": "close"})
        r = conn.getresponse()
        body = r.read()
        return r.status, json.loads(body) if body else None
    finally:
        conn.close()


def register_once(d: Daemon, name: str, key: str) -> tuple[int, Any]:
    return once(d.http, f"/v2/systemsharedmemory/region/{name}/register", {"key": key, "offset": 0,
                                                                          "byte_size": 64})


def test_a_users_regions_stay_after_its_last_connection_closes_until_unregistered(kept: Daemon,
                                                                                 segments) -> None:
    """perf_analyzer --shared-memory system -i http registers its regions on
    a connection it closes, then infers on others (issue 41, item 1). A
    user's regions stay, as Triton's do, until they are unregistered: past
    its last connection and leases without a request (the gateway renews the
    session that holds them: the daemon ends none), at most
    --max-regions-per-session of them; another user still cannot see, use
    or unregister them."""
    other = unused_uid()
    mine = segments(data=X.tobytes())
    before = kept.log().count(STAY)
    assert register_once(kept, "kept", mine.key)[0] == 200
    wait_for(lambda: kept.log().count(STAY) > before, 10, "the gateway to see the registering connection closed")
    time.sleep(5)               # 2.5 leases with no connection of the user
    assert "releasing its shared memory" not in kept.log()
    c = JsonConnection(kept.http)
    try:
        status, body = c.infer_region("kept")
        assert status == 200, body
        assert body["outputs"][0]["data"] == X.tolist()
        assert [r["name"] for r in c.post("/v2/systemsharedmemory/status", method="GET")[1]] == ["kept"]
    finally:
        c.close()

    def second_user() -> dict:
        c = JsonConnection(kept.http)
        try:
            seen = c.post("/v2/systemsharedmemory/status", method="GET")[1]
            used = c.infer_region("kept")
            unregistered = [c.post("/v2/systemsharedmemory/region/kept/unregister")[0],
                            c.post("/v2/systemsharedmemory/unregister")[0]]
            return {"seen": seen, "used": [used[0], used[1].get("error", "")], "unregistered": unregistered}
        finally:
            c.close()

    got = as_user(other, second_user)
    assert got["seen"] == [] and got["unregistered"] == [200, 200]
    assert got["used"][0] == 404 and "'kept'" in got["used"][1]
    status, body = once(kept.http, IDENTITY, {"inputs": [{
        "name": "INPUT__0", "shape": [16], "datatype": "FP32",
        "parameters": {"shared_memory_region": "kept", "shared_memory_byte_size": 64}}]})
    assert status == 200 and body["outputs"][0]["data"] == X.tolist()

    # one limit for all of the user's connections, open or closed
    for i in range(1, 4):
        assert register_once(kept, f"r{i}", segments().key)[0] == 200
    status, body = register_once(kept, "r4", segments().key)
    assert status == 429 and "--max-regions-per-session" in body["error"]
    assert once(kept.http, "/v2/systemsharedmemory/region/kept/unregister")[0] == 200
    status, body = once(kept.http, IDENTITY, {"inputs": [{
        "name": "INPUT__0", "shape": [16], "datatype": "FP32",
        "parameters": {"shared_memory_region": "kept", "shared_memory_byte_size": 64}}]})
    assert status == 404 and "'kept'" in body["error"]
    assert [r["name"] for r in once(kept.http, "/v2/systemsharedmemory/status", method="GET")[1]] == \
        ["r1", "r2", "r3"]
    assert once(kept.http, "/v2/systemsharedmemory/unregister")[0] == 200
    assert once(kept.http, "/v2/systemsharedmemory/status", method="GET")[1] == []
    for i in range(4):                          # all four places free again
        assert register_once(kept, f"again{i}", segments().key)[0] == 200
    assert once(kept.http, "/v2/systemsharedmemory/unregister")[0] == 200


def test_a_users_regions_stay_after_its_grpc_connection_closes(shm_on: Daemon, segments) -> None:
    """The same over gRPC: registered on a connection that then closes (seen
    gone in the kernel's table), used and unregistered from another."""
    other = unused_uid()
    mine = segments(data=(X * 3).tobytes())
    before = shm_on.log().count(STAY)
    with grpc_client(shm_on) as a:
        a.register_system_shared_memory("g", mine.key, 64)
    wait_for(lambda: shm_on.log().count(STAY) > before, 10, "the gateway to see the gRPC peer gone")
    with grpc_client(shm_on) as b:
        np.testing.assert_array_equal(
            b.infer("identity", [identity_input("g", grpcclient)]).as_numpy("OUTPUT__0"), X * 3)

        def second_user() -> dict:
            c = JsonConnection(shm_on.http)
            try:
                seen = c.post("/v2/systemsharedmemory/status", method="GET")[1]
                unregistered = c.post("/v2/systemsharedmemory/region/g/unregister")[0]
                used = c.infer_region("g")
                return {"seen": seen, "unregistered": unregistered, "used": used[0]}
            finally:
                c.close()

        assert as_user(other, second_user) == {"seen": [], "unregistered": 200, "used": 404}
        assert list(b.get_system_shared_memory_status().regions) == ["g"]
        b.unregister_system_shared_memory("g")
        assert not b.get_system_shared_memory_status().regions
        exc = fails(b.infer, "identity", [identity_input("g", grpcclient)])
        assert exc.status() == "StatusCode.NOT_FOUND" and "'g'" in exc.message()


def pending(d: Daemon, model: str) -> int:
    """The daemon's nv_inference_pending_request_count of `model`: requests
    it holds that no instance runs yet."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{d.metrics}/metrics", timeout=10).read().decode()
    m = re.search(r'^nv_inference_pending_request_count\{model="%s",version="1"\} (\S+)$' % re.escape(model),
                  text, re.M)
    assert m, text
    return int(float(m.group(1)))


@pytest.fixture
def queued(small_repository: Path, tmp_path: Path) -> Iterator[Daemon]:
    """A daemon whose gateway's requests all go through its queue (no direct
    paths): the queue is what the fairness test below reads. With direct
    paths (the default) the gateway's plain requests wait in its path to the
    worker instead, in the order sent (the worker reads a client's requests
    in turn), where no metric shows them."""
    metrics = free_tcp_port()
    d = start(small_repository, tmp_path, "--metrics-port", str(metrics), "--no-direct-paths")
    d.metrics = metrics
    yield d
    assert d.stop() == 0, d.log()


def test_one_callers_thousand_calls_do_not_hold_back_another(queued: Daemon) -> None:
    """A caller with 1,000 calls in flight to a model: before, they all
    went to the daemon's queue (960 at once) and another caller's call
    waited behind all of them. Now one caller has at most its share there
    (--gateway-max-in-flight-per-caller, 64) and the other's call goes to
    the daemon at once, behind that share only.

    The model's one worker is stopped (SIGSTOP) while the calls arrive, so
    what is queued where is the test's doing, not the machine's speed: the
    daemon's queue (nv_inference_pending_request_count) holds the
    offender's share and no more while the rest wait in the gateway; the
    other caller's call joins it there with nothing answered meanwhile
    (it used to wait in the gateway until one of the offender's calls
    finished: a lock-out behind a stopped model); then the worker runs
    again and every call is answered right."""
    from torchpool.client import Client
    from torchpool.gateway.defaults import MAX_IN_FLIGHT_PER_CALLER as SHARE

    n = np.array([1], dtype=np.int64)
    with Client(queued.url, timeout=30) as c:
        (row,) = c.statistics("slow")["model_stats"][0]["instances"]
    worker = row["pid"]
    order: list[str] = []                 # who was answered, in the order the answers came
    results: dict[str, list] = {"offender": [], "honest": []}

    def answered(who: str) -> Callable:
        def done(result: Any, error: Any) -> None:
            results[who].append(error if error is not None else result.as_numpy("OUTPUT__0").tolist())
            order.append(who)
        return done

    offender = grpc_client(queued)
    honest = grpc_client(queued)
    # connected first: streams opened before the server's SETTINGS arrive may
    # pass its max_concurrent_streams and be refused (RST_STREAM 7, UNAVAILABLE)
    assert offender.is_server_live() and honest.is_server_live()
    t = grpcclient.InferInput("INPUT__0", [1], "INT64")
    t.set_data_from_numpy(n)
    os.kill(worker, signal.SIGSTOP)
    try:
        for _ in range(1000):
            offender.async_infer("slow", [t], answered("offender"), client_timeout=300)
        # the daemon holds the offender's share: one given to the stopped worker, the rest queued
        wait_for(lambda: pending(queued, "slow") == SHARE - 1, 120, "the offender's share at the daemon")
        honest.async_infer("slow", [t], answered("honest"), client_timeout=300)
        wait_for(lambda: pending(queued, "slow") == SHARE, 60, "the other caller's call at the daemon")
        assert order == [], results          # nothing ran: the worker is stopped
    finally:
        os.kill(worker, signal.SIGCONT)
    try:
        wait_for(lambda: results["honest"], 120, "the other caller's answer")
        assert results["honest"] == [n.tolist()]
        print(f"the other caller's call was answered after {order.index('honest')} of the offender's "
              f"1,000 calls (answers as this process saw them)")
        wait_for(lambda: len(results["offender"]) == 1000, 300, "the offender's answers")
        bad = [str(r) for r in results["offender"] if r != n.tolist()]
        assert not bad, (len(bad), bad[:3])
    finally:
        offender.close()
        honest.close()
    wait_for(lambda: request(queued.http, "GET", "/v2/health/ready")[0] == 200, 30, "the gateway to serve")


def test_the_gateways_plain_calls_go_on_its_direct_paths(plain: Daemon) -> None:
    """Triton's clients send small inputs as binary data (HTTP) or raw
    contents (gRPC), or as JSON; the gateway passes them on as RawTensors,
    which take its direct paths to the model's instances, as arrays do (the
    AsyncClient's short way since issue 39, item 1: there the calls waiting
    for an instance take turns by caller; they went the long way, through
    the client's flow, onto the same paths in arrival order)."""
    from torchpool.client import Client

    def direct() -> int:
        with Client(plain.url, timeout=30, local=False) as c:
            return c.server_metadata()["transfer"].get("requests_direct", 0)

    g_in = grpcclient.InferInput("INPUT__0", [16], "FP32")
    g_in.set_data_from_numpy(X)
    binary, text = httpclient.InferInput("INPUT__0", [16], "FP32"), httpclient.InferInput("INPUT__0", [16], "FP32")
    binary.set_data_from_numpy(X, binary_data=True)
    text.set_data_from_numpy(X, binary_data=False)
    hc = http_client(plain)
    try:
        with grpc_client(plain) as g:
            calls = {"gRPC": lambda: g.infer("identity", [g_in]).as_numpy("OUTPUT__0"),
                     "HTTP binary": lambda: hc.infer("identity", [binary]).as_numpy("OUTPUT__0"),
                     "HTTP JSON": lambda: hc.infer("identity", [text]).as_numpy("OUTPUT__0")}

            def went_direct() -> bool:      # the gateway asks for its paths beside its first call
                before = direct()
                np.testing.assert_array_equal(calls["gRPC"](), X)
                return direct() > before
            wait_for(went_direct, 30, "a gRPC call on the gateway's direct path")
            for name, call in calls.items():
                before = direct()
                for _ in range(10):
                    np.testing.assert_array_equal(call(), X)
                assert direct() - before == 10, name
    finally:
        hc.close()


# --- item 9: low ----------------------------------------------------------------------------

def test_a_5000_digit_integer_is_a_clear_400(plain: Daemon) -> None:
    digits = "9" * 5000
    body = ('{"inputs":[{"name":"INPUT__0","datatype":"FP32","shape":[1],"data":[%s]}]}' % digits).encode()
    status, _, answer = request(plain.http, "POST", IDENTITY, body)
    assert (status, error_of(answer)) == (400, "failed to parse the request JSON buffer: a number has too "
                                               "many digits")
    big = str(1 << 200)                        # converts, but fits no shape, offset or tensor
    status, _, answer = request(plain.http, "POST", IDENTITY, json.dumps(
        {"inputs": [{"name": "INPUT__0", "datatype": "FP32", "shape": [int(big)], "data": [1.0]}]}).encode())
    assert (status, error_of(answer)) == (500, "Unable to parse 'shape': attempt to access JSON "
                                               "non-unsigned-integer as unsigned-integer")   # Triton's
    for doc, message in (
            ({"inputs": [{"name": "INPUT__0", "datatype": "INT64", "shape": [1], "data": [int(big)]}]},
             "unable to parse 'data' of input 'INPUT__0' for model 'identity' as INT64: a value is out "
             "of the datatype's range"),
            ({"inputs": [{"name": "INPUT__0", "datatype": "BYTES", "shape": [1], "data": [1 << 30]}]},
             "unable to parse 'data' of input 'INPUT__0' for model 'identity' as BYTES: expected strings")):
        status, _, answer = request(plain.http, "POST", IDENTITY, json.dumps(doc).encode())
        assert (status, error_of(answer)) == (400, message)


def test_extra_raw_input_contents_are_refused(plain: Daemon) -> None:
    from torchpool.gateway.proto import grpc_service_pb2 as pb

    message = pb.ModelInferRequest(model_name="identity")
    message.inputs.add(name="INPUT__0", datatype="FP32", shape=[16])
    message.raw_input_contents.extend([X.tobytes(), X.tobytes()])
    with grpc.insecure_channel(f"127.0.0.1:{plain.grpc}") as ch:
        call = ch.unary_unary("/inference.GRPCInferenceService/ModelInfer",
                              request_serializer=None, response_deserializer=None)
        with pytest.raises(grpc.RpcError) as info:
            call(message.SerializeToString(), timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details() == ("raw_input_contents has 2 entries but 1 of the inputs of the request "
                                    "for model 'identity' take raw data")


def test_a_transfer_coding_other_than_chunked_is_refused(plain: Daemon) -> None:
    body = json.dumps({"inputs": [{"name": "INPUT__0", "datatype": "FP32", "shape": [16],
                                   "data": X.tolist()}]}).encode()
    with connect(plain.http) as s:
        s.sendall(f"POST {IDENTITY} HTTP/1.1\r\nTransfer-Encoding: gzip, chunked\r\n\r\n"
                  f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n")
        status, headers, answer = ResponseReader(s).read()
    assert (status, headers["connection"]) == (501, "close")
    assert error_of(answer) == ("unsupported Transfer-Encoding 'gzip, chunked': only chunked is supported "
                                "(send compressed bodies with Content-Encoding)")
    assert request(plain.http, "GET", "/v2/health/live")[0] == 200


def test_honest_callers_are_served_throughout(plain: Daemon) -> None:
    """After all of the above the gateway is the one it started as and serves."""
    client = http_client(plain)
    try:
        t = httpclient.InferInput("INPUT__0", [16], "FP32")
        t.set_data_from_numpy(X)
        np.testing.assert_array_equal(client.infer("identity", [t]).as_numpy("OUTPUT__0"), X)
    finally:
        client.close()
    assert gateway_pid(plain) == plain.gateway
