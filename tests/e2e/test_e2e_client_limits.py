"""What one client connection may take, and what it may do over tcp://
(ARCHITECTURE.md, "Trust boundaries"), against a real daemon.

- in flight: a connection with --max-in-flight-per-client unanswered
  requests gets its next one refused at once (RESOURCE_EXHAUSTED); other
  connections are not affected, and the count never leaks (2,000 requests
  over every answer path later, the connection still has all its room);
- unread replies: a connection that sends thousands of requests and never
  reads does not grow the daemon (its replies are dropped past
  --max-unread-replies), the others are served, its session is released;
- model control (load/unload) is taken over ipc:// only;
- an answer to a header with an unsupported protocol version echoes its id.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import msgpack
import numpy as np
import pytest
import torch
import zmq
from torch import Tensor, nn

from torchpool.client import Client
from torchpool.examples import ADDSUB_CONFIG, IDENTITY_CONFIG, AddSub, Identity, write_model
from torchpool.protocol import errors

from ..support.daemon import Daemon, RawConnection, free_tcp_port, wait_for
from ..support.models.core import config, serialize, tensor, write_model_dir
from ..support.models.execution_errors import RaiseOnNegative
from ..support.models.slow import Slow, slow_iterations

IN_FLIGHT = 64
UNREAD = 16
A = np.arange(16, dtype=np.float32).reshape(1, 16)
REPLY_FLOATS = 16000          # `zeros` answers 64,000 bytes to an 8-byte request


class Zeros(nn.Module):
    """A small request, a large answer: INPUT__0 = n -> n zeros."""

    def forward(self, n: Tensor) -> Tensor:
        return torch.zeros([int(n.reshape([-1])[0])])


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    repository = tmp_path_factory.mktemp("limits") / "repository"
    write_model(repository, "addsub", ADDSUB_CONFIG.format(name="addsub", extra=""), serialize(AddSub()))
    write_model(repository, "identity", IDENTITY_CONFIG, serialize(Identity()))
    write_model(repository, "clone", IDENTITY_CONFIG.replace('"identity"', '"clone"'), serialize(Identity()))
    i64 = tensor("INPUT__0", "INT64", [1]), tensor("OUTPUT__0", "INT64", [1])
    write_model_dir(repository, "slow", model=serialize(Slow()),
                    config_text=config("slow", inputs=[i64[0]], outputs=[i64[1]], max_batch_size=0))
    write_model_dir(repository, "zeros", model=serialize(Zeros()),
                    config_text=config("zeros", inputs=[i64[0]], outputs=[tensor("OUTPUT__0", "FP32", [-1])],
                                       max_batch_size=0))
    f4 = tensor("INPUT__0", "FP32", [4]), tensor("OUTPUT__0", "FP32", [4])
    write_model_dir(repository, "raise", model=serialize(RaiseOnNegative()),
                    config_text=config("raise", inputs=[f4[0]], outputs=[f4[1]], max_batch_size=8))
    return repository


def start(repository: Path, root: Path, *limits: str) -> Daemon:
    return Daemon(repository, root, "--max-in-flight-per-client", str(IN_FLIGHT), *limits,
                  "--model-control-mode", "explicit", "--load-model", "*", "--log-level", "debug",
                  tcp_port=free_tcp_port()).start()


@pytest.fixture(scope="module")
def daemon(repository: Path, tmp_path_factory: pytest.TempPathFactory):
    """Both limits small: a connection is cut off after UNREAD unread replies."""
    d = start(repository, tmp_path_factory.mktemp("limits_daemon"), "--max-unread-replies", str(UNREAD))
    yield d
    assert d.stop() == 0, d.log()


@pytest.fixture(scope="module")
def in_flight_daemon(repository: Path, tmp_path_factory: pytest.TempPathFactory):
    """The in-flight limit with the default unread limit (1024 >= IN_FLIGHT, as
    by default): IN_FLIGHT answers come in a burst, and a client that reads
    them as they come may still find more than UNREAD waiting for it."""
    d = start(repository, tmp_path_factory.mktemp("in_flight_daemon"))
    yield d
    assert d.stop() == 0, d.log()


def tcp(d: Daemon) -> str:
    return next(u for u in d.urls if u.startswith("tcp://"))


def pack(header: dict) -> bytes:
    return msgpack.packb({"v": 1, **header}, use_bin_type=True)


def infer(rid: int, model: str, name: str, array: np.ndarray, **extra) -> bytes:
    datatype = {np.dtype(np.float32): "FP32", np.dtype(np.int64): "INT64"}[array.dtype]
    return pack({"op": "infer", "id": rid, "model": model, "version": "", "outputs": None,
                 "inputs": [{"name": name, "datatype": datatype, "shape": list(array.shape),
                             "data": array.tobytes()}], **extra})


def slow(rid: int, iterations: int, **extra) -> bytes:
    return infer(rid, "slow", "INPUT__0", np.array([iterations], np.int64), **extra)


def zeros(rid: int) -> bytes:
    return infer(rid, "zeros", "INPUT__0", np.array([REPLY_FLOATS], np.int64))


def successes(conn: RawConnection, model: str) -> int:
    header, _ = conn.call(pack({"op": "statistics", "id": "stats", "model": model, "version": ""}))
    return header["result"]["model_stats"][0]["inference_stats"]["success"]["count"]


def stalls(d: Daemon) -> int:
    return d.log().count("does not read its replies")


def non_reader(url: str) -> zmq.Socket:
    """A DEALER that keeps (almost) nothing of what it is sent."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, 1)
    sock.setsockopt(zmq.RCVBUF, 4096)
    sock.setsockopt(zmq.SNDTIMEO, 30000)    # a stuck send fails the test instead of hanging it
    sock.connect(url)
    return sock


def addsub(rid: int) -> bytes:
    header = msgpack.unpackb(infer(rid, "addsub", "INPUT0", A))
    header["inputs"].append({**header["inputs"][0], "name": "INPUT1"})
    return msgpack.packb(header, use_bin_type=True)


def replies(conn: RawConnection, count: int, timeout: float = 30.0) -> dict:
    """The next `count` answers, by id."""
    got = {}
    for _ in range(count):
        header, _frames = conn.recv(timeout)
        got[header["id"]] = header
    return got


def code(header: dict) -> str:
    return "ok" if header["ok"] else header["error"]["code"]


def vm_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def fill_to_the_limit(conn: RawConnection, first_id: int) -> list[int]:
    """IN_FLIGHT requests in flight on `conn`: a slow one, the others queued behind it."""
    ids = list(range(first_id, first_id + IN_FLIGHT))
    conn.send(slow(ids[0], slow_iterations(0.4)))
    for rid in ids[1:]:
        conn.send(slow(rid, 1))
    return ids


# --- in flight --------------------------------------------------------------------------

def test_in_flight_limit_per_client(in_flight_daemon: Daemon) -> None:
    daemon = in_flight_daemon
    with RawConnection(daemon.url) as busy, RawConnection(tcp(daemon)) as other:
        ids = fill_to_the_limit(busy, 1)
        started = time.monotonic()
        header, _ = busy.call(addsub(99), timeout=10)
        assert time.monotonic() - started < 0.35          # refused at once, not queued
        assert header["id"] == 99 and code(header) == errors.RESOURCE_EXHAUSTED, header
        refusal = (f"this client (process {os.getpid()}) has {IN_FLIGHT} requests in flight; this "
                   f"server accepts at most {IN_FLIGHT} per client process or tcp connection "
                   f"(--max-in-flight-per-client)")
        assert header["error"]["message"] == refusal
        # a new connection of the same process is the same client: reconnecting
        # does not buy another IN_FLIGHT requests
        with RawConnection(daemon.url) as again:
            header, _ = again.call(addsub(98), timeout=10)
            assert code(header) == errors.RESOURCE_EXHAUSTED and header["error"]["message"] == refusal
        # a tcp connection is a client of its own: it runs addsub and queues behind the same slow model
        header, _ = other.call(addsub(1), timeout=10)
        assert code(header) == "ok"
        other.send(slow(2, 1))
        # every accepted request is answered; then the connection has its room again
        try:
            answered = replies(busy, IN_FLIGHT)
        except AssertionError as exc:     # which answer is missing, and why: the daemon says
            raise AssertionError(f"{exc}; the daemon's log ends:\n{daemon.log()[-4000:]}") from None
        assert sorted(answered) == ids and all(code(h) == "ok" for h in answered.values()), answered
        assert code(other.recv(30)[0]) == "ok"
        header, _ = busy.call(addsub(100), timeout=10)
        assert code(header) == "ok"


def test_a_gone_connections_queued_requests_are_not_run(in_flight_daemon: Daemon) -> None:
    """A client sends a slow request and 20 more behind it, then closes its
    connection: once the slow one's answer finds it gone, the ones still
    queued are failed (CANCELLED), not run, and the count they held goes back.
    The worker holds one request sent ahead while the slow one runs, and the
    next is sent ahead as it starts, before the cancel: at most 3 run."""
    daemon = in_flight_daemon
    with RawConnection(tcp(daemon)) as observer:
        def stats() -> dict:
            header, _ = observer.call(pack({"op": "statistics", "id": "s", "model": "slow", "version": ""}))
            return header["result"]["model_stats"][0]["inference_stats"]
        before = stats()
        with RawConnection(daemon.url) as gone:
            gone.send(slow(1, slow_iterations(0.3)))
            for rid in range(2, 22):
                gone.send(slow(rid, 1))
            # answered after the daemon has read the 21 before it (one pipe keeps
            # their order): closing with linger 0 before that could drop some unsent
            header, _ = gone.call(pack({"op": "statistics", "id": "read", "model": "slow", "version": ""}))
            assert header["id"] == "read"
        wait_for(lambda: stats()["success"]["count"] + stats()["fail"]["count"]
                 - before["success"]["count"] - before["fail"]["count"] == 21, 30,
                 "the gone connection's 21 requests to be run or failed")
        after = stats()
        assert after["success"]["count"] - before["success"]["count"] <= 3, (before, after)
        assert after["fail"]["count"] - before["fail"]["count"] >= 18, (before, after)
    with RawConnection(daemon.url) as again:          # this process's in-flight count is back to 0
        ids = fill_to_the_limit(again, 100)
        answered = replies(again, IN_FLIGHT)
        assert sorted(answered) == ids and all(code(h) == "ok" for h in answered.values())


def test_the_in_flight_count_never_leaks(in_flight_daemon: Daemon) -> None:
    """2,000 requests through every answer path (outputs, a model error,
    refused at validation, unknown model, timed out in the queue), pipelined;
    then IN_FLIGHT requests are all accepted at once again and one more is
    refused: the connection's count went back to exactly 0."""
    negative = -np.ones((1, 4), np.float32)
    with RawConnection(in_flight_daemon.url) as conn:
        rid = 0
        for round_ in range(240):
            want = {rid + 1: "ok", rid + 2: "ok", rid + 3: errors.INVALID_ARG, rid + 4: errors.NOT_FOUND,
                    rid + 5: "ok", rid + 6: "ok", rid + 7: "ok", rid + 8: "ok"}
            conn.send(addsub(rid + 1))
            if round_ % 10 == 0:     # the model raises (its traceback goes to the log: not every round)
                conn.send(infer(rid + 2, "raise", "INPUT__0", negative))
                want[rid + 2] = errors.INTERNAL
            else:
                conn.send(infer(rid + 2, "raise", "INPUT__0", -negative))
            conn.send(infer(rid + 3, "addsub", "INPUT0", np.ones((1, 3), np.float32)))
            conn.send(infer(rid + 4, "no_such_model", "INPUT__0", negative))
            for i in range(5, 9):
                conn.send(addsub(rid + i))
            got = replies(conn, len(want))
            assert {i: code(h) for i, h in got.items()} == want, got
            rid += len(want)
        for _ in range(20):     # queued behind a slow one past their timeout: answered UNAVAILABLE
            conn.send(slow(rid + 1, slow_iterations(0.01)))
            for i in range(2, 5):
                conn.send(slow(rid + i, 1, timeout_us=1))
            got = replies(conn, 4)
            assert code(got.pop(rid + 1)) == "ok"
            assert all(code(h) == errors.UNAVAILABLE and "timeout" in h["error"]["message"].lower()
                       for h in got.values()), got
            rid += 4
        assert rid == 2000
        ids = fill_to_the_limit(conn, rid + 1)
        header, _ = conn.call(addsub(9999), timeout=10)
        assert header["id"] == 9999 and code(header) == errors.RESOURCE_EXHAUSTED, header
        answered = replies(conn, IN_FLIGHT)
        assert sorted(answered) == ids and all(code(h) == "ok" for h in answered.values()), answered


# --- unread replies ---------------------------------------------------------------------

def send_until_it_stalls(flood: zmq.Socket, observer: RawConnection, daemon: Daemon, total: int) -> int:
    """Send `zeros` requests that are all accepted and answered (IN_FLIGHT at
    a time, each group waited for), until the daemon says `flood` does not
    read; then the rest of `total` at once. Returns the number sent paced."""
    marks, done, rid = stalls(daemon), successes(observer, "zeros"), 0
    while rid < total and stalls(daemon) == marks:
        for _ in range(min(IN_FLIGHT, total - rid)):
            rid += 1
            flood.send(zeros(rid))
        target = done + rid
        wait_for(lambda: successes(observer, "zeros") >= target, 30, f"{rid} zeros answered")
    paced = rid
    while rid < total:
        rid += 1
        flood.send(zeros(rid))
    return paced


def test_a_connection_that_never_reads_is_cut_off_not_buffered(daemon: Daemon) -> None:
    """5,000 requests of 8 bytes, each answered with 64,000 (320 MB if the
    daemon kept them for a client that never reads)."""
    flood = non_reader(daemon.url)
    try:
        flood.send(pack({"op": "hello", "id": 0}))
        assert flood.poll(10000)
        token = msgpack.unpackb(flood.recv())["result"]["session"]
        status = pack({"op": "get_system_shared_memory_status", "id": "status", "session": token})
        flood.send(status)
        assert flood.poll(10000) and msgpack.unpackb(flood.recv())["ok"] is True     # its session
        with Client(daemon.url, timeout=30, local=False) as client, RawConnection(daemon.url) as observer:
            for _ in range(IN_FLIGHT):                    # the daemon at its working size first
                assert client.infer("zeros", {"INPUT__0": np.array([REPLY_FLOATS])})["OUTPUT__0"].shape == \
                    (REPLY_FLOATS,)
            before = vm_rss(daemon.pid())
            marks = stalls(daemon)
            paced = send_until_it_stalls(flood, observer, daemon, 5000)
            assert paced < 5 * IN_FLIGHT, paced               # it stalled within a few groups
            # the others are served all along, and correctly
            x = np.arange(8192, dtype=np.float32)
            for _ in range(5):
                assert np.array_equal(client.infer("identity", {"INPUT__0": x})["OUTPUT__0"], x)
                np.testing.assert_array_equal(client.infer("addsub", {"INPUT0": A, "INPUT1": A})["OUTPUT0"], A + A)
            observer.call(pack({"op": "server_live", "id": 1}))   # the daemon read what came before
            grown = vm_rss(daemon.pid()) - before
            # its session was released when it stopped reading (its lease is 60 s): the
            # daemon no longer knows the token
            header, _ = observer.call(status)
            assert code(header) == errors.SESSION_LOST, header
        assert grown < 32 << 20, f"the daemon grew by {grown >> 20} MiB"
        assert daemon.proc.poll() is None
        assert stalls(daemon) == marks + 1, daemon.log()   # one line for the connection, not one per reply
    finally:
        flood.close(0)


def test_a_stalled_connection_is_served_again_once_it_reads(daemon: Daemon) -> None:
    conn = non_reader(daemon.url)
    try:
        marks = stalls(daemon)
        with RawConnection(daemon.url) as observer:
            # one group, all answered: more than UNREAD answers wait for it, so it stalls
            assert send_until_it_stalls(conn, observer, daemon, IN_FLIGHT) == IN_FLIGHT
        assert stalls(daemon) == marks + 1
        # it reads what was queued for it (answers to its first requests; the rest were dropped)
        seen = []
        while conn.poll(500):
            header = msgpack.unpackb(conn.recv_multipart()[0])
            assert code(header) == "ok", header
            seen.append(header["id"])
        assert UNREAD <= len(seen) < IN_FLIGHT and len(set(seen)) == len(seen), seen
        # its next request is refused (saying why), and then it is served again
        conn.send(zeros(1000))
        assert conn.poll(10000)
        first = msgpack.unpackb(conn.recv_multipart()[0])
        assert first["id"] == 1000 and code(first) == errors.RESOURCE_EXHAUSTED, first
        assert "--max-unread-replies" in first["error"]["message"], first
        conn.send(zeros(1001))
        assert conn.poll(10000)
        again = conn.recv_multipart()
        header = msgpack.unpackb(again[0])
        assert header["id"] == 1001 and code(header) == "ok", header
        wait_for(lambda: "reads its replies again" in daemon.log(), 10, "the recovery line")
    finally:
        conn.close(0)


# --- model control ----------------------------------------------------------------------

def test_model_control_only_over_ipc(daemon: Daemon) -> None:
    with RawConnection(tcp(daemon)) as remote:
        for rid, op in ((1, "load"), (2, "unload")):
            header, _ = remote.call(pack({"op": op, "id": rid, "model": "clone"}), timeout=10)
            assert header["id"] == rid and code(header) == errors.UNSUPPORTED, header
            assert header["error"]["message"] == (
                "model control (load/unload) is accepted only over ipc:// on this server "
                "(--remote-model-control allows tcp)")
        header, _ = remote.call(pack({"op": "model_ready", "id": 3, "model": "clone", "version": ""}))
        assert header["result"] is True                   # nothing was unloaded
    with RawConnection(daemon.url) as local:
        header, _ = local.call(pack({"op": "unload", "id": 1, "model": "clone"}), timeout=30)
        assert code(header) == "ok", header
        header, _ = local.call(pack({"op": "model_ready", "id": 2, "model": "clone", "version": ""}))
        assert header["result"] is False
        header, _ = local.call(pack({"op": "load", "id": 3, "model": "clone"}), timeout=60)
        assert code(header) == "ok", header
        header, _ = local.call(pack({"op": "model_ready", "id": 4, "model": "clone", "version": ""}))
        assert header["result"] is True


# --- ids --------------------------------------------------------------------------------

@pytest.mark.parametrize("transport", ["ipc", "tcp"])
def test_a_bad_protocol_version_is_answered_with_the_id(daemon: Daemon, transport: str) -> None:
    url = daemon.url if transport == "ipc" else tcp(daemon)
    with RawConnection(url) as conn:
        for rid, v in ((41, 2), (42, None), (43, "1"), (44, True)):
            header = {"op": "server_live", "id": rid} | ({} if v is None else {"v": v})
            reply, _ = conn.call(msgpack.packb(header, use_bin_type=True), timeout=10)
            assert reply["id"] == rid and code(reply) == errors.INVALID_ARG, reply
            assert reply["error"]["message"] == (f"unsupported protocol version {v!r}; this server speaks 1")
        reply, _ = conn.call(msgpack.packb([1, 2], use_bin_type=True), timeout=10)
        assert reply["id"] is None and code(reply) == errors.INVALID_ARG      # no header: no id to echo
        reply, _ = conn.call(pack({"op": "server_live", "id": 45}), timeout=10)
        assert reply == {"v": 1, "id": 45, "ok": True, "result": True}
