"""A client that sends control documents nested as deep as 1 MiB allows,
pipelined and without pause, beside a caller with plain requests.

Each such document is cut (its deep values read as wrong values, as Triton
reads them) and parsed: in C since the cut was moved there (0.1-0.2 s a
document as a Python regular expression in the gateway's event loop; about
10 ms now, in its helper process since documents of this size go there).
And a connection's pipelined requests answered without waiting (these
refusals are) were answered back to back, its whole queue in one go
while every other caller waited: now the loop serves other connections
between two of them. No time is measured here: the other caller's calls
are all answered while the offenders' documents are, and the documents
answered meanwhile are counted against what the loop's turns allow.
"""
from __future__ import annotations

import http.client
import json
import threading
import time
from pathlib import Path

import pytest

from ..support.daemon import Daemon, free_tcp_port, wait_for
from ..support.http_gateway import ResponseReader, connect, error_of
from torchpool.gateway.http_binary import DEEP_VALUES_BYTES

OFFENDERS = 2           # connections, each sending documents without pause
CALLS = 8               # by the other caller, one after the other (two requests each)
# The offenders' documents answered while the other caller's requests are:
# 9 per request on the development VM (a request takes a few turns of the
# loop, the daemon is asked; a turn answers one document of each offender).
# Before, a turn answered a connection's whole queue at once: 64 per request.
MOST_PER_REQUEST = 32

INDEX_ANSWER = "Invalid value for 'ready': expected a boolean"
LOAD_ANSWER = "Unable to parse load parameter 'config' for model 'identity': expected a string"


def deep(room: int) -> bytes:
    """`true` nested as deep as `room` bytes allow."""
    depth = (room - 4) // 2
    return b"[" * depth + b"true" + b"]" * depth


def post(path: str, body: bytes) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: t\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body


def documents() -> list[tuple[bytes, str]]:
    """(request, the error it gets): an index and a load request, each body
    1 MiB (DEEP_VALUES_BYTES: a larger one is refused for its nesting)."""
    index = b'{"ready": %s}'
    load = b'{"parameters": {"config": %s}}'
    out = []
    for path, template, answer in (("/v2/repository/index", index, INDEX_ANSWER),
                                   ("/v2/repository/models/identity/load", load, LOAD_ANSWER)):
        body = template % deep(DEEP_VALUES_BYTES - len(template % b""))
        assert DEEP_VALUES_BYTES - 1 <= len(body) <= DEEP_VALUES_BYTES
        out.append((post(path, body), answer))
    return out


@pytest.fixture(scope="module")
def port(small_repository: Path, tmp_path_factory: pytest.TempPathFactory):
    port = free_tcp_port()
    d = Daemon(small_repository, tmp_path_factory.mktemp("deep_values"), "--model-control-mode", "explicit",
               "--load-model", "addsub", "--http-port", str(port)).start()
    yield port
    assert d.stop() == 0, d.log()


class Offender:
    """One connection: deep documents sent one after the other, pipelined
    (a thread: the gateway's queue and TCP hold it back) until `stop`, then
    a health check; the answers read as they come (another thread)."""

    def __init__(self, port: int, kinds: list[tuple[bytes, str]], stop: threading.Event) -> None:
        self.sock = connect(port, timeout=120)
        self.kinds = kinds
        self.stop = stop
        self.expected: list[tuple[int, str]] = []
        self.answers: list[tuple[int, str]] = []
        self.failure: list[BaseException] = []
        self.threads = [threading.Thread(target=self._send, daemon=True),
                        threading.Thread(target=self._read, daemon=True)]
        for t in self.threads:
            t.start()

    def _send(self) -> None:
        try:
            while not self.stop.is_set():
                request, answer = self.kinds[len(self.expected) % len(self.kinds)]
                self.expected.append((400, answer))
                self.sock.sendall(request)
            self.expected.append((200, ""))
            self.sock.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: t\r\n\r\n")
        except OSError as exc:
            self.failure.append(exc)

    def _read(self) -> None:
        reader = ResponseReader(self.sock)
        try:
            while True:
                status, _, body = reader.read()
                if status == 200:               # the health check after the last document
                    self.answers.append((200, ""))
                    return
                self.answers.append((status, error_of(body)))
        except (OSError, ValueError, AssertionError) as exc:
            self.failure.append(exc)

    def join(self) -> None:
        for t in self.threads:
            t.join(300)
        self.sock.close()


def plain_call(conn: http.client.HTTPConnection, i: int) -> None:
    """A health check, then an inference: answered, and right."""
    conn.request("GET", "/v2/health/ready")
    r = conn.getresponse()
    assert (r.status, r.read()) == (200, b"")
    doc = {"inputs": [{"name": n, "datatype": "FP32", "shape": [1, 16], "data": [float(i)] * 16}
                      for n in ("INPUT0", "INPUT1")],
           "outputs": [{"name": "OUTPUT0"}]}
    conn.request("POST", "/v2/models/addsub/infer", json.dumps(doc), {"Content-Type": "application/json"})
    r = conn.getresponse()
    body = r.read()
    assert r.status == 200, body
    assert json.loads(body)["outputs"][0]["data"] == [2.0 * i] * 16


def test_a_caller_is_answered_while_deep_control_documents_are_pipelined(port: int) -> None:
    kinds = documents()
    stop = threading.Event()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    offenders: list[Offender] = []
    try:
        plain_call(conn, 0)                                 # connected, the model warm
        offenders = [Offender(port, kinds, stop) for _ in range(OFFENDERS)]
        wait_for(lambda: all(o.answers or o.failure for o in offenders), 120, "the offenders' first answers")

        def answered() -> int:
            return sum(len(o.answers) for o in offenders)

        # at least CALLS calls, and on until the offenders' documents were
        # answered meanwhile too (parsed in the gateway's helper process, a
        # document may take longer than several calls)
        before, requests, i = answered(), 0, 0
        deadline = time.monotonic() + 120
        while i < CALLS or answered() - before < OFFENDERS:
            assert time.monotonic() < deadline, "the offenders' documents were not answered meanwhile"
            i += 1
            plain_call(conn, i)
            requests += 2
            meanwhile = answered() - before
            assert meanwhile <= MOST_PER_REQUEST * requests, \
                f"{meanwhile} of the offenders' documents answered during {requests} requests of another caller"
        assert all(not o.failure for o in offenders), [o.failure for o in offenders]
    finally:
        stop.set()
        conn.close()
        for o in offenders:
            o.join()
    for o in offenders:
        assert not o.failure, o.failure
        assert o.answers == o.expected                  # Triton's texts, each in its turn
        assert len(o.answers) > 1
