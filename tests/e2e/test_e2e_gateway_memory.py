"""End to end: what a remote caller can make the gateway process hold (issue
32, items 2 and 5), read from its /proc/<pid>/status (VmRSS, VmHWM).

- HTTP bodies declared and not sent cost nothing; bodies being sent are
  held within one budget across connections; what a connection held is
  given back when it goes.
- A gzip body decompresses to at most the body limit, in a thread: other
  callers are answered meanwhile.
- A gRPC message of millions of tiny fields is refused before anything is
  made of it; a message over the default limit is refused by size.

Each test checks the gateway is the same process afterwards and serves.
"""
from __future__ import annotations

import gzip
import socket
import struct
import threading
import time
import zlib
from pathlib import Path

import numpy as np
import pytest

from ..support.daemon import Daemon, free_tcp_port, wait_for
from ..support.http_gateway import InProcessGateway, connect, error_of, gateway_pid, memory, request, reset_peak

grpcclient = pytest.importorskip("tritonclient.grpc")

import grpc  # noqa: E402

from torchpool.gateway.defaults import MAX_INPUT_BYTES  # noqa: E402

MiB = 1 << 20
IDENTITY = "/v2/models/identity/infer"
# What the gateway's interpreter may add while the tests run (allocator
# arenas, grpc's buffers): far below what each attack took before.
SLACK = 48 * MiB


@pytest.fixture(scope="module")
def served(small_repository: Path, tmp_path_factory: pytest.TempPathFactory):
    http, grpc_port = free_tcp_port(), free_tcp_port()
    d = Daemon(small_repository, tmp_path_factory.mktemp("gateway_memory"), "--http-port", str(http),
               "--grpc-port", str(grpc_port)).start()
    d.http, d.grpc = http, grpc_port
    d.gateway = wait_for(lambda: gateway_pid(d), 30, "the gateway process")
    assert_serves(d)
    yield d
    assert gateway_pid(d) == d.gateway, "the gateway was restarted"
    assert d.stop() == 0, d.log()


def assert_serves(d: Daemon) -> float:
    """One HTTP and one gRPC identity request answered correctly; the time they took."""
    start = time.perf_counter()
    x = np.arange(16, dtype=np.float32)
    body = ('{"inputs":[{"name":"INPUT__0","datatype":"FP32","shape":[16],"data":%s}]}' % x.tolist()).encode()
    status, _, answer = request(d.http, "POST", IDENTITY, body)
    assert status == 200 and b'"data":[0.0,1.0' in answer, answer[:200]
    with grpcclient.InferenceServerClient(f"127.0.0.1:{d.grpc}") as c:
        t = grpcclient.InferInput("INPUT__0", [16], "FP32")
        t.set_data_from_numpy(x)
        np.testing.assert_array_equal(c.infer("identity", [t]).as_numpy("OUTPUT__0"), x)
    return time.perf_counter() - start


def settled_rss(pid: int) -> int:
    """VmRSS once it stops falling (freed memory goes back at once; this
    only waits out a collection under way)."""
    last = memory(pid)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        time.sleep(0.2)
        now = memory(pid)
        if now >= last:
            return now
        last = now
    return last


# --- item 2: HTTP bodies ------------------------------------------------------------------

def test_bodies_declared_and_not_sent_cost_nothing(served: Daemon) -> None:
    """16 requests that declare bodies of nearly the limit and send none,
    then go away: before, each took a zero-filled buffer of its size at
    once (4 took the gateway from 57 MiB to 4.1 GiB) and kept it after."""
    pid = served.gateway
    before = settled_rss(pid)
    reset_peak(pid)
    length = MAX_INPUT_BYTES - MiB
    socks = [connect(served.http) for _ in range(16)]
    try:
        for s in socks:
            s.sendall(f"POST {IDENTITY} HTTP/1.1\r\nContent-Length: {length}\r\n"
                      f"Expect: 100-continue\r\n\r\n".encode())
        for s in socks:       # the gateway has read each one's headers: it says go on
            assert s.recv(100) == b"HTTP/1.1 100 Continue\r\n\r\n"
        held = memory(pid) - before
    finally:
        for s in socks:
            s.close()
    print(f"16 declared bodies of {length >> 20} MiB: gateway RSS +{held / MiB:.1f} MiB")
    assert held < SLACK
    assert_serves(served)
    assert memory(pid, "VmHWM") - before < SLACK


def _send_body(port: int, length: int, data: memoryview, sent: list, i: int,
               timeout: float = 3) -> socket.socket:
    s = connect(port, timeout=timeout)
    # closed with a reset: a close would queue its FIN behind the bytes the
    # gateway is not reading (see the next test)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    s.sendall(f"POST {IDENTITY} HTTP/1.1\r\nContent-Length: {length}\r\n\r\n".encode())
    try:
        s.sendall(data)
        sent[i] = len(data)
    except (socket.timeout, OSError):
        pass                    # paused by the gateway: its budget is spent
    return s


def test_bodies_being_sent_are_held_within_one_budget(served: Daemon) -> None:
    """10 connections each send 60 MiB of a 63 MiB body and stop there. The
    gateway holds at most its budget (4 bodies of the limit) of them,
    whatever the number of connections; the others wait; an honest request
    is still answered; once they go, what they held is given back."""
    pid = served.gateway
    before = settled_rss(pid)
    reset_peak(pid)
    length, part = MAX_INPUT_BYTES - MiB, MAX_INPUT_BYTES - 4 * MiB
    data = memoryview(bytes(part))
    sent = [0] * 10
    socks: list = [None] * 10

    def attack(i: int) -> None:
        socks[i] = _send_body(served.http, length, data, sent, i)

    threads = [threading.Thread(target=attack, args=(i,)) for i in range(10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    try:
        peak = memory(pid, "VmHWM") - before
        print(f"10 bodies of {part >> 20} MiB sent at once: {sum(1 for n in sent if n)} taken whole, "
              f"gateway peak RSS +{peak / MiB:.0f} MiB")
        assert peak < 4 * MAX_INPUT_BYTES + SLACK
        assert_serves(served)               # a small body is taken, budget or not
    finally:
        for s in socks:
            if s is not None:
                s.close()
    wait_for(lambda: memory(pid) - before < SLACK, 10, "the gateway to give back what the bodies held")
    print(f"after they went: RSS +{(memory(pid) - before) / MiB:.1f} MiB")


def test_a_paused_body_whose_client_left_goes_at_its_deadline(served: Daemon) -> None:
    """Clients that close (not reset) while the gateway is not reading them:
    their FIN waits behind their unsent bytes, so the gateway learns of it
    at the body's deadline (io_timeout), and gives back what they held."""
    mb = 4 * MiB
    with InProcessGateway(served.url, max_body=mb, io_timeout=2.0) as gw:
        data = memoryview(bytes(mb - 4096))
        sent = [0] * 8
        socks: list = [None] * 8

        def attack(i: int) -> None:
            socks[i] = _send_body(gw.port, mb, data, sent, i, timeout=1)

        threads = [threading.Thread(target=attack, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert gw.call(lambda: gw.server.budget.held) > 2 * mb
        for s in socks:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 0, 0))
            s.close()
        wait_for(lambda: gw.call(lambda: (gw.server.budget.held, len(gw.server.connections))) == (0, 0),
                 10, "the paused connections to reach their deadline")


def _gzip_bomb(size: int) -> bytes:
    """`size` zero bytes, gzipped (about size / 1000 bytes)."""
    c = zlib.compressobj(9, wbits=31)
    zeros = bytes(16 * MiB)
    parts = [c.compress(zeros) for _ in range(size // len(zeros))]
    return b"".join(parts) + c.flush()


def test_a_gzip_bomb_is_bounded_and_others_are_answered(served: Daemon) -> None:
    """A 1 MiB gzip body that inflates to 1 GiB: before, the gateway grew by
    1.76 GiB and others waited 3.2 s for it. Now it stops at the body limit,
    decompressed in a thread while the others are served."""
    pid = served.gateway
    bomb = _gzip_bomb(1 << 30)
    before = settled_rss(pid)
    reset_peak(pid)
    waits: list[float] = []
    stop = threading.Event()

    def honest() -> None:
        while not stop.is_set():
            waits.append(assert_serves(served))

    thread = threading.Thread(target=honest)
    thread.start()
    try:
        answers = [request(served.http, "POST", IDENTITY, bomb, {"Content-Encoding": "gzip"}) for _ in range(3)]
    finally:
        stop.set()
        thread.join(60)
    peak = memory(pid, "VmHWM") - before
    print(f"gzip bomb of {len(bomb) >> 10} KiB x3: gateway peak RSS +{peak / MiB:.0f} MiB, "
          f"honest requests (HTTP + gRPC) took at most {max(waits) * 1e3:.0f} ms over {len(waits)}")
    for status, _, body in answers:
        assert (status, error_of(body)) == (400, f"the decompressed request body exceeds the limit of "
                                                 f"{MAX_INPUT_BYTES} bytes (--http-max-input-size)")
    assert peak < MAX_INPUT_BYTES + SLACK
    assert waits and max(waits) < 1.0


# --- item 5: gRPC messages ------------------------------------------------------------------

def _raw_infer(port: int, message: bytes, timeout: float = 60) -> grpc.RpcError:
    """Send `message` as a ModelInferRequest's bytes; the error it gets."""
    options = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
    with grpc.insecure_channel(f"127.0.0.1:{port}", options=options) as ch:
        call = ch.unary_unary("/inference.GRPCInferenceService/ModelInfer",
                              request_serializer=None, response_deserializer=None)
        with pytest.raises(grpc.RpcError) as info:
            call(message, timeout=timeout)
        return info.value


def test_a_grpc_message_of_tiny_fields_is_refused_cheaply(served: Daemon) -> None:
    """16 MiB of two-byte fields (8M empty raw_input_contents): before, the
    split made a Python object per field (+2.27 GB, 8.8 s of a stopped
    loop). Now it is refused after a bounded walk."""
    from torchpool.gateway.proto import wire

    pid = served.gateway
    before = settled_rss(pid)
    reset_peak(pid)
    message = b"\x0a\x08identity" + b"\x3a\x00" * (8 << 20)
    started = time.perf_counter()
    error = _raw_infer(served.grpc, message)
    took = time.perf_counter() - started
    peak = memory(pid, "VmHWM") - before
    print(f"16 MiB of tiny fields: refused in {took * 1e3:.0f} ms, gateway peak RSS +{peak / MiB:.0f} MiB")
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details() == (f"unable to parse the inference request: the request has more than "
                               f"{wire.MAX_FIELDS} fields")
    assert peak < 3 * len(message) + SLACK         # grpc's copy and ours, not one object per field
    assert took < 2.0
    assert_serves(served)


def test_a_grpc_message_over_the_limit_is_refused(served: Daemon) -> None:
    """Messages up to 2 GiB were taken; the default limit is MAX_INPUT_BYTES."""
    from torchpool.gateway.proto import grpc_service_pb2 as pb

    n = MAX_INPUT_BYTES // 4 + 1024
    request_ = pb.ModelInferRequest(model_name="identity")
    request_.inputs.add(name="INPUT__0", datatype="FP32", shape=[n])
    request_.raw_input_contents.append(bytes(4 * n))
    error = _raw_infer(served.grpc, request_.SerializeToString())
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert f"larger than max ({len(request_.SerializeToString())} vs. {MAX_INPUT_BYTES})" in error.details()
    assert_serves(served)


def test_bodies_just_under_the_limits_pass(served: Daemon) -> None:
    """The limits refuse only what is over them: a tensor of nearly 64 MiB
    goes both ways, compressed too."""
    n = (MAX_INPUT_BYTES - MiB) // 4
    x = np.ones(n, np.float32)
    head = ('{"inputs":[{"name":"INPUT__0","datatype":"FP32","shape":[%d],'
            '"parameters":{"binary_data_size":%d}}],"parameters":{"binary_data_output":true}}' % (n, x.nbytes))
    body = head.encode() + x.tobytes()
    for extra, payload in (({}, body), ({"Content-Encoding": "gzip"}, gzip.compress(body, 1))):
        status, headers, answer = request(served.http, "POST", IDENTITY, payload,
                                          {"Inference-Header-Content-Length": str(len(head)), **extra})
        assert status == 200, answer[:200]
        start = int(headers["inference-header-content-length"])
        assert len(answer) - start == x.nbytes and answer[start:start + 8] == x[:2].tobytes()
    with grpcclient.InferenceServerClient(f"127.0.0.1:{served.grpc}") as c:
        t = grpcclient.InferInput("INPUT__0", [n], "FP32")
        t.set_data_from_numpy(x)
        assert c.infer("identity", [t]).as_numpy("OUTPUT__0").shape == (n,)
