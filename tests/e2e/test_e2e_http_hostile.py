"""End to end: hostile and broken HTTP clients against the HTTP endpoint.

Bodies over the limit, lengths that lie, binary sizes that do not add up,
malformed HTTP and JSON, decompression bombs, pipelining floods, clients
that disconnect mid-request, stop sending (slowloris) or stop reading: each
gets its error or its connection closed, and the gateway keeps serving
everyone else (the same gateway process from start to end, nothing in its
log). Raw sockets and http.client only: tritonclient would not send these.
"""
from __future__ import annotations

import gzip
import json
import socket
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from ..support.daemon import Daemon, free_tcp_port, wait_for
from ..support.http_gateway import (InProcessGateway, ResponseReader, closed_by_server, connect, error_of,
                                    gateway_pid, request)
from ..support.models.slow import slow_iterations
from torchpool.gateway.defaults import MAX_INPUT_BYTES

IDENTITY = "/v2/models/identity/infer"


@pytest.fixture(scope="module")
def gateway(small_repository: Path, tmp_path_factory: pytest.TempPathFactory):
    port = free_tcp_port()
    d = Daemon(small_repository, tmp_path_factory.mktemp("http_hostile"), "--http-port", str(port)).start()
    try:
        pid = wait_for(lambda: gateway_pid(d), 30, "the gateway process")
    except AssertionError:
        d.stop()
        raise
    yield d, port
    # the same gateway served the whole module: nothing crashed it (the daemon restarts a dead one)
    assert gateway_pid(d) == pid
    assert "Traceback" not in d.log(), d.log()
    assert d.stop() == 0, d.log()


@pytest.fixture
def port(gateway) -> int:
    return gateway[1]


@pytest.fixture
def url(gateway) -> str:
    return gateway[0].url


def binary_body(inputs: list[tuple[str, str, list, int, bytes]]) -> tuple[bytes, dict]:
    """A binary-extension body: (name, datatype, shape, declared size, bytes) per input."""
    doc = {"inputs": [{"name": n, "datatype": dt, "shape": s, "parameters": {"binary_data_size": size}}
                      for n, dt, s, size, _ in inputs],
           "parameters": {"binary_data_output": True}}
    head = json.dumps(doc).encode()
    return head + b"".join(data for *_, data in inputs), {"Inference-Header-Content-Length": str(len(head))}


def identity_request(values: np.ndarray, extra: str = "") -> bytes:
    body, headers = binary_body([("INPUT__0", "FP32", [values.size], values.nbytes, values.tobytes())])
    head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    return (f"POST {IDENTITY} HTTP/1.1\r\nHost: t\r\nContent-Length: {len(body)}\r\n{head}{extra}\r\n"
            ).encode() + body


def identity_output(response: tuple[int, dict, bytes]) -> np.ndarray:
    status, headers, body = response
    assert status == 200, body
    start = int(headers["inference-header-content-length"])
    return np.frombuffer(body[start:], np.float32)


def assert_serves(port: int) -> None:
    x = np.arange(4, dtype=np.float32)
    body, headers = binary_body([("INPUT__0", "FP32", [4], 16, x.tobytes())])
    np.testing.assert_array_equal(identity_output(request(port, "POST", IDENTITY, body, headers)), x)


# --- sizes and lengths that lie ------------------------------------------------------

def test_a_body_over_the_limit_is_refused_before_it_is_sent(port: int) -> None:
    with connect(port) as s:
        s.sendall(f"POST {IDENTITY} HTTP/1.1\r\nHost: t\r\nContent-Length: {3 << 30}\r\n\r\n".encode())
        status, _, body = ResponseReader(s).read()
        assert status == 413
        assert error_of(body) == (f"request body of {3 << 30} bytes exceeds the limit of {MAX_INPUT_BYTES} "
                                  f"bytes (--http-max-input-size)")
        assert closed_by_server(s, 10)
    assert_serves(port)


@pytest.mark.parametrize("value, message", [
    ("999", "inference header size should be in range (0, 80), got: 999"),
    ("-1", "inference header size should be in range (0, 80), got: -1"),
    ("ten", "Unable to parse Inference-Header-Content-Length, got: ten"),
])
def test_inference_header_length_that_lies(port: int, value: str, message: str) -> None:
    body = b"{" + b" " * 78 + b"}"
    status, _, answer = request(port, "POST", IDENTITY, body, {"Inference-Header-Content-Length": value})
    assert (status, error_of(answer)) == (400, message)
    assert_serves(port)


def test_binary_sizes_that_do_not_add_up(port: int) -> None:
    data = np.ones(4, np.float32).tobytes()
    cases = [
        ([("INPUT__0", "FP32", [4], -16, data)],
         "Unable to parse 'binary_data_size' of 'INPUT__0': expected an unsigned integer, got -16"),
        ([("INPUT__0", "FP32", [4], 32, data)],
         "unexpected size for input 'INPUT__0', expecting 16 additional bytes for model 'identity'"),
        ([("INPUT__0", "FP32", [4], 8, data)], "unexpected additional input data for model 'identity'"),
        ([("INPUT__0", "FP32", [4], 12, data[:12])],
         "input byte size mismatch for input 'INPUT__0' for model 'identity'. Expected 16, got 12"),
        ([("INPUT__0", "FP32", [4], 1 << 62, data)], "unexpected size for input 'INPUT__0', expecting"),
    ]
    for inputs, message in cases:
        body, headers = binary_body(inputs)
        status, _, answer = request(port, "POST", IDENTITY, body, headers)
        assert status == 400 and error_of(answer).startswith(message), (message, answer)
    # binary data without the header that says where the JSON ends
    body, _ = binary_body([("INPUT__0", "FP32", [4], 16, b"")])
    status, _, answer = request(port, "POST", IDENTITY, body)
    assert status == 400 and "Infer-Header-Content-Length" in error_of(answer)
    assert_serves(port)


def test_malformed_json(port: int) -> None:
    for body, message in ((b"{", "failed to parse the request JSON buffer: "),
                          (b"[" * 100000 + b"]" * 100000, "JSON nesting depth exceeds maximum allowed limit "
                                                          "(100): "),
                          (b"\xff\xfe", "failed to parse the request JSON buffer: "),
                          (b"[1, 2]", "Unable to parse 'request': expected an object"),
                          (b'{"inputs": [{"name": 5}]}', "Unable to parse 'name': expected a string, got 5"),
                          (b'{"inputs": [], "id": {}}', "Unable to parse 'id': expected a string")):
        status, _, answer = request(port, "POST", IDENTITY, body)
        assert status == 400 and error_of(answer).startswith(message), (body[:20], answer)
    assert_serves(port)


def test_json_over_its_limit(url: str) -> None:
    from torchpool.gateway.http_binary import MAX_JSON_BYTES

    body = b"{" + b" " * MAX_JSON_BYTES + b"}"
    with InProcessGateway(url, max_body=len(body)) as gw:      # a body limit above the JSON's
        status, _, answer = request(gw.port, "POST", IDENTITY, body)
        assert (status, error_of(answer)) == (400, f"request JSON size of {len(body)} bytes exceeds the "
                                                   f"maximum allowed input size of {MAX_JSON_BYTES} bytes")
        assert_serves(gw.port)


# --- malformed HTTP ------------------------------------------------------------------

@pytest.mark.parametrize("raw, status", [
    (b"GARBAGE\r\n\r\n", 400),
    (b"POST /v2 HTTP/1.1\r\nContent-Length: -5\r\n\r\n", 400),
    (b"POST /v2 HTTP/1.1\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n", 400),
    (b"GET /v2 HTTP/1.1\r\n" + b"X-Filler: " + b"a" * (70 << 10) + b"\r\n\r\n", 431),
    (b"GET /" + b"a" * (70 << 10) + b" HTTP/1.1\r\n\r\n", 431),
])
def test_malformed_http_is_answered_and_closed(port: int, raw: bytes, status: int) -> None:
    with connect(port) as s:
        s.sendall(raw)
        got, headers, body = ResponseReader(s).read()
        assert got == status and headers["connection"] == "close" and error_of(body)
        assert closed_by_server(s, 10)
    assert_serves(port)


def test_upgrade_is_ignored(port: int) -> None:
    with connect(port) as s:
        s.sendall(b"GET /v2/health/live HTTP/1.1\r\nConnection: Upgrade\r\nUpgrade: h2c\r\n\r\n"
                  b"GET /v2/health/ready HTTP/1.1\r\n\r\n")
        reader = ResponseReader(s)
        assert reader.read()[0] == 200 and reader.read()[0] == 200
        # with a body (curl --http2 -d ... asks for h2c so), in one piece and in two
        x = np.arange(3, dtype=np.float32)
        upgrade = identity_request(x, "Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\n"
                                      "HTTP2-Settings: AAMAAABkAAQAoAAAAAIAAAAA\r\n")
        s.sendall(upgrade + upgrade[:-5])
        np.testing.assert_array_equal(identity_output(reader.read()), x)
        s.sendall(upgrade[-5:])
        np.testing.assert_array_equal(identity_output(reader.read()), x)
    assert_serves(port)


def test_unsupported_content_encoding(port: int) -> None:
    status, headers, body = request(port, "POST", IDENTITY, b"{}", {"Content-Encoding": "br"})
    assert (status, error_of(body)) == (501, "Unsupported compression type")
    assert headers["accept-encoding"] == "gzip, deflate"
    status, _, body = request(port, "POST", IDENTITY, b"not gzip", {"Content-Encoding": "gzip"})
    assert status == 400 and "unable to decompress the gzip request body" in error_of(body)


# --- pipelining, chunked bodies, Expect ---------------------------------------------------

def test_pipelined_requests_are_answered_in_order(port: int) -> None:
    n = slow_iterations(0.3)
    slow_doc = json.dumps({"inputs": [{"name": "INPUT__0", "datatype": "INT64", "shape": [1], "data": [n]}]})
    slow = (f"POST /v2/models/slow/infer HTTP/1.1\r\nHost: t\r\nContent-Length: {len(slow_doc)}\r\n\r\n"
            f"{slow_doc}").encode()
    live = b"GET /v2/health/live HTTP/1.1\r\nHost: t\r\n\r\n"
    values = [np.full(3, i, np.float32) for i in range(60)]
    with connect(port) as s:
        # one send: a slow request first, then 60 quick ones and health checks
        s.sendall(slow + b"".join(identity_request(v) + live for v in values))
        reader = ResponseReader(s)
        status, _, body = reader.read()
        assert status == 200 and json.loads(body)["outputs"][0]["data"] == [n]
        for v in values:
            np.testing.assert_array_equal(identity_output(reader.read()), v)
            assert reader.read()[0] == 200


def test_chunked_body_and_expect_100_continue(port: int) -> None:
    x = np.arange(1000, dtype=np.float32)
    request_bytes = identity_request(x)
    head, body = request_bytes.split(b"\r\n\r\n", 1)
    head = head.replace(f"Content-Length: {len(body)}".encode(), b"Transfer-Encoding: chunked")
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(body[i:i + 999]), body[i:i + 999]) for i in range(0, len(body), 999))
    with connect(port) as s:
        s.sendall(head + b"\r\n\r\n" + chunks + b"0\r\n\r\n")
        np.testing.assert_array_equal(identity_output(ResponseReader(s).read()), x)
    with connect(port) as s:
        head, body = identity_request(x, "Expect: 100-continue\r\n").split(b"\r\n\r\n", 1)
        s.sendall(head + b"\r\n\r\n")
        assert s.recv(100) == b"HTTP/1.1 100 Continue\r\n\r\n"
        s.sendall(body)
        np.testing.assert_array_equal(identity_output(ResponseReader(s).read()), x)


def chunked(request_bytes: bytes, size: int) -> bytes:
    head, body = request_bytes.split(b"\r\n\r\n", 1)
    head = head.replace(f"Content-Length: {len(body)}".encode(), b"Transfer-Encoding: chunked")
    return head + b"\r\n\r\n" + b"".join(b"%x\r\n%s\r\n" % (len(body[i:i + size]), body[i:i + size])
                                        for i in range(0, len(body), size)) + b"0\r\n\r\n"


def test_requests_cut_anywhere(url: str) -> None:
    """A request arriving in two reads, cut in its headers, its JSON, its
    binary data, a chunk header; small bodies and one larger than a read."""
    small, large = np.arange(1000, dtype=np.float32), np.arange(100_000, dtype=np.float32)
    with InProcessGateway(url) as gw, connect(gw.port) as s:
        def begun() -> bool:
            return gw.call(lambda: any(c.cur is not None for c in gw.server.connections))

        reader = ResponseReader(s)
        for values in (small, large):
            for whole in (identity_request(values), chunked(identity_request(values), 999)):
                head_end = whole.index(b"\r\n\r\n") + 4
                for cut in (7, head_end - 1, head_end, head_end + 30, len(whole) // 2, len(whole) - 3):
                    s.sendall(whole[:cut])
                    wait_for(begun, 10, "the first piece to be read")
                    s.sendall(whole[cut:])
                    np.testing.assert_array_equal(identity_output(reader.read()), values)


# --- clients that go away -------------------------------------------------------------------

def slow_successes(port: int) -> int:
    status, _, body = request(port, "GET", "/v2/models/slow/stats")
    assert status == 200
    return json.loads(body)["model_stats"][0]["inference_stats"]["success"]["count"]


def test_a_client_that_disconnects_mid_request(port: int) -> None:
    before = slow_successes(port)
    n = slow_iterations(0.3)
    doc = json.dumps({"inputs": [{"name": "INPUT__0", "datatype": "INT64", "shape": [1], "data": [n]}]})
    with connect(port) as s:
        s.sendall((f"POST /v2/models/slow/infer HTTP/1.1\r\nContent-Length: {len(doc)}\r\n\r\n{doc}").encode())
    # the request runs to its end, its answer is dropped, the gateway serves on
    wait_for(lambda: slow_successes(port) == before + 1, 30, "the abandoned slow request to finish")
    # ... and one that goes away halfway through its body
    with connect(port) as s:
        s.sendall(f"POST {IDENTITY} HTTP/1.1\r\nContent-Length: {10 << 20}\r\n\r\n".encode() + bytes(1 << 20))
    assert_serves(port)


def test_decompression_bomb_stops_at_the_limit(url: str) -> None:
    bomb = gzip.compress(bytes(8 << 20))                    # 8 MiB of zeros in a few KiB
    with InProcessGateway(url, max_body=1 << 20) as gw:
        status, _, body = request(gw.port, "POST", IDENTITY, bomb, {"Content-Encoding": "gzip"})
        assert (status, error_of(body)) == (400, f"the decompressed request body exceeds the limit of {1 << 20} "
                                                 f"bytes (--http-max-input-size)")
        status, _, body = request(gw.port, "POST", IDENTITY, bytes(2 << 20))
        assert status == 413
        assert_serves(gw.port)


def test_a_chunked_body_over_the_limit(url: str) -> None:
    with InProcessGateway(url, max_body=1 << 20) as gw, connect(gw.port) as s:
        s.sendall(f"POST {IDENTITY} HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n".encode())
        chunk = b"%x\r\n%s\r\n" % (256 << 10, bytes(256 << 10))
        for _ in range(6):                  # the gateway reads on (and drops) after refusing
            s.sendall(chunk)
        status, headers, body = ResponseReader(s).read()
        assert status == 413 and headers["connection"] == "close"
        assert error_of(body) == f"request body exceeds the limit of {1 << 20} bytes (--http-max-input-size)"
        assert closed_by_server(s, 10)
        assert_serves(gw.port)


# --- clients that stall -----------------------------------------------------------------

def trickle(sock: socket.socket, stop: threading.Event, data: bytes = b"X-A: b\r\n") -> None:
    """The slowloris attack: a few header bytes at a time, never the end."""
    while not stop.is_set():
        try:
            sock.send(data)
        except OSError:
            return
        stop.wait(0.05)


def test_slowloris_and_stalled_bodies_are_closed(url: str) -> None:
    with InProcessGateway(url, header_timeout=0.5, io_timeout=0.5, idle_timeout=1.0) as gw:
        stop = threading.Event()
        with connect(gw.port) as loris, connect(gw.port) as stalled, connect(gw.port) as idle:
            loris.sendall(b"GET /v2/health/live HTTP/1.1\r\n")
            sender = threading.Thread(target=trickle, args=(loris, stop))
            sender.start()
            stalled.sendall(f"POST {IDENTITY} HTTP/1.1\r\nContent-Length: 1000\r\n\r\n".encode() + bytes(10))
            idle.sendall(b"GET /v2/health/live HTTP/1.1\r\n\r\n")
            assert ResponseReader(idle).read()[0] == 200
            started = time.monotonic()
            try:
                assert closed_by_server(loris, 10)
                assert closed_by_server(stalled, 10)
                assert closed_by_server(idle, 10)
            finally:
                stop.set()
                sender.join()
            assert time.monotonic() - started >= 0.4        # closed by the deadlines, not at once
        wait_for(lambda: gw.connections() == 0, 10, "the gateway to drop the stalled connections")
        # a request that takes longer than every timeout is still answered
        n = slow_iterations(1.5)
        doc = json.dumps({"inputs": [{"name": "INPUT__0", "datatype": "INT64", "shape": [1], "data": [n]}]})
        status, _, body = request(gw.port, "POST", "/v2/models/slow/infer", doc.encode())
        assert status == 200 and json.loads(body)["outputs"][0]["data"] == [n]


def test_a_client_that_does_not_read_its_answers(url: str) -> None:
    big = np.ones(1 << 20, np.float32)                     # 4 MiB out per request
    with InProcessGateway(url, io_timeout=0.5) as gw:
        s = connect(gw.port)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        try:
            s.sendall(identity_request(big) * 8)
            # answers pile up unread: the gateway gives up on the connection
            wait_for(lambda: gw.connections() == 0, 20, "the gateway to drop a client that does not read")
        finally:
            s.close()
        assert_serves(gw.port)


def test_a_pipelining_flood_is_held_back(url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Requests sent far faster than they are answered: the gateway parses a
    bounded number ahead (what one read holds, plus MAX_PIPELINED), then
    stops reading until it catches up; every one is answered, in order."""
    from torchpool.gateway import http_protocol

    deepest = [0]
    kick = http_protocol.HttpConnection._kick

    def watched(conn: http_protocol.HttpConnection) -> None:
        deepest[0] = max(deepest[0], len(conn.queue))
        kick(conn)

    monkeypatch.setattr(http_protocol.HttpConnection, "_kick", watched)
    one = b"GET /v2/health/live HTTP/1.1\r\n\r\n"
    count = 5000
    with InProcessGateway(url) as gw, connect(gw.port) as s:
        sender = threading.Thread(target=s.sendall, args=(one * count,))
        sender.start()
        reader = ResponseReader(s)
        for _ in range(count):
            assert reader.read()[:2] == (200, {"content-length": "0"})
        sender.join()
    assert 0 < deepest[0] <= http_protocol.MAX_PIPELINED + http_protocol.SCRATCH_BYTES // len(one) + 1


def test_close_answers_the_requests_in_flight(url: str) -> None:
    """Shutdown: the gateway stops listening and reading, and answers what it
    received (the daemon drains meanwhile)."""
    n = slow_iterations(0.5)
    doc = json.dumps({"inputs": [{"name": "INPUT__0", "datatype": "INT64", "shape": [1], "data": [n]}]})
    with InProcessGateway(url) as gw, connect(gw.port) as busy, connect(gw.port) as idle:
        busy.sendall((f"POST /v2/models/slow/infer HTTP/1.1\r\nContent-Length: {len(doc)}\r\n\r\n{doc}").encode())
        wait_for(lambda: gw.call(lambda: any(c.task for c in gw.server.connections)), 10, "the request in flight")
        gw.close()
        status, headers, body = ResponseReader(busy).read()
        assert status == 200 and json.loads(body)["outputs"][0]["data"] == [n]
        assert headers["connection"] == "close" and closed_by_server(busy, 10)
        assert closed_by_server(idle, 10)
        with pytest.raises(ConnectionRefusedError):
            connect(gw.port, timeout=5)
