"""Hostile and buggy clients against a real daemon (issue 10, docs/security.md).

Each attack ends with a clear error for the offender, the daemon alive, other
clients answered correctly, no model marked UNAVAILABLE, no worker restarted,
and nothing left in /dev/shm:

- the daemon's own memory cannot be resized by the client holding it (sealed
  memfds: the arena it writes, the worker memory lent to it read-only);
- a client region shrunk before a request, while the request waits in a
  forming dynamic batch, while the model reads it, while an output is
  written into it: the SIGBUS guard turns each into that request's error;
- a tcp peer gets no local session, whatever it claims;
- limits: sessions per connection, regions per session, arena bytes.
"""
from __future__ import annotations

import fcntl
import mmap
import os
import re
import secrets
import socket
import struct
import threading
import urllib.request
from pathlib import Path
from typing import Iterator, List

import numpy as np
import posix_ipc
import pytest
import torch
import zmq
from torch import Tensor, nn

from torchpool.client import Client, OutputRef, SharedMemoryRef
from torchpool.client.local import LocalLink
from torchpool.protocol import errors, messages
from torchpool.protocol.errors import InferenceError

from ..support.daemon import Daemon, cpu_ticks, free_tcp_port, memfds, wait_for, worker_pids
from ..support.models.core import config, serialize, tensor
from ..support.models.slow import slow_iterations

MiB = 1 << 20
N = 4096                                  # elements of the region tensors (16 KiB of FP32)


class SlowRead(nn.Module):
    """Works `n` iterations, then reads `x`: a shrink meanwhile hits the read."""

    def forward(self, x: Tensor, n: Tensor) -> Tensor:
        count = torch.zeros([1], dtype=torch.int64)
        for _ in range(int(n.reshape([-1])[0])):
            count = count + 1
        return x + (count * 0).to(torch.float32)


class SlowMake(nn.Module):
    """Works `n` iterations, then returns a new tensor of `x`'s shape (written out afterwards)."""

    def forward(self, x: Tensor, n: Tensor) -> Tensor:
        count = torch.zeros([1], dtype=torch.int64)
        for _ in range(int(n.reshape([-1])[0])):
            count = count + 1
        return torch.full(x.shape, 7.0) + (count * 0).to(torch.float32)


class PlusOne(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x + 1


class Count(nn.Module):
    def forward(self, text: List[str]) -> Tensor:
        return torch.tensor([len(text)], dtype=torch.int64)


def _write(root: Path, name: str, text: str, module: nn.Module) -> None:
    (root / name / "1").mkdir(parents=True)
    (root / name / "config.pbtxt").write_text(text)
    (root / name / "1" / "model.pt").write_bytes(serialize(module))


def build_repository(root: Path) -> None:
    slow_io = dict(inputs=[tensor("INPUT__0", "FP32", [-1]), tensor("INPUT__1", "INT64", [1])],
                   outputs=[tensor("OUTPUT__0", "FP32", [-1])], max_batch_size=0)
    _write(root, "slow_read", config("slow_read", **slow_io), SlowRead())
    _write(root, "slow_make", config("slow_make", **slow_io), SlowMake())
    batched = config("batched", inputs=[tensor("INPUT__0", "FP32", [N])],
                     outputs=[tensor("OUTPUT__0", "FP32", [N])], max_batch_size=8,
                     extra="dynamic_batching {\n  preferred_batch_size: [ 2 ]\n"
                           "  max_queue_delay_microseconds: 20000000\n}\n")
    _write(root, "batched", batched, PlusOne())
    _write(root, "count", config("count", inputs=[tensor("TEXT", "STRING", [-1])],
                                 outputs=[tensor("N", "INT64", [1])], max_batch_size=0), Count())
    _write(root, "plus_one", config("plus_one", inputs=[tensor("INPUT__0", "FP32", [-1])],
                                    outputs=[tensor("OUTPUT__0", "FP32", [-1])], max_batch_size=0),
           PlusOne())


@pytest.fixture(scope="module")
def hostile(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    root = tmp_path_factory.mktemp("hostile_repo")
    build_repository(root)
    work = tmp_path_factory.mktemp("hostile")
    metrics = free_tcp_port()
    d = Daemon(root, work, "--log-level", "debug", "--metrics-port", str(metrics),
               "--max-sessions-per-peer", "6", "--max-regions-per-session", "2",
               "--client-shm-size", "4M", "--client-shm-total", "16M",
               "--max-bytes-elements", "1000", "--max-bytes-tensor-bytes", "64K",
               tcp_port=free_tcp_port()).start()
    d.metrics = metrics
    yield d
    assert d.stop() == 0, d.log()
    assert "Traceback" not in d.log(), d.log()


@pytest.fixture
def region(hostile: Daemon) -> Iterator[tuple[str, int]]:
    """A client-owned POSIX segment of 1 MiB: (key, fd). The test may shrink it."""
    key = f"tp-test-hostile-{os.getpid()}-{secrets.token_hex(4)}"
    shm = posix_ipc.SharedMemory("/" + key, posix_ipc.O_CREX, mode=0o600, size=MiB)
    try:
        yield key, shm.fd
    finally:
        shm.close_fd()
        posix_ipc.unlink_shared_memory("/" + key)
    assert not os.path.exists(f"/dev/shm/{key}")


def queue_depth(d: Daemon, model: str) -> float:
    """Requests of `model` accepted and not yet handed to an instance."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{d.metrics}/metrics", timeout=5).read().decode()
    m = re.search(r'nv_inference_pending_request_count\{model="' + model + r'",version="1"\} (\S+)', text)
    return float(m.group(1)) if m else 0.0


def assert_unharmed(d: Daemon, model: str, pids_before: list[int]) -> None:
    """The daemon is up, the model READY, its worker the same process, others served."""
    assert d.proc.poll() is None, d.log()
    with Client(d.url, timeout=30) as c:
        assert c.model_ready(model)
        x = np.arange(8, dtype=np.float32)
        np.testing.assert_array_equal(c.infer("plus_one", {"INPUT__0": x})["OUTPUT__0"], x + 1)
    assert worker_pids(d.log(), model) == pids_before, "a worker was restarted"


def in_thread(fn) -> tuple[threading.Thread, dict]:
    result: dict = {}

    def run() -> None:
        try:
            result["value"] = fn()
        except BaseException as exc:       # noqa: BLE001 - handed to the test
            result["error"] = exc
    t = threading.Thread(target=run)
    t.start()
    return t, result


# --- the daemon's memory cannot be pulled away ------------------------------------------------

def raw_session(url: str) -> tuple[zmq.Context, zmq.Socket, dict]:
    """A session said hello to with a bare DEALER: (context, socket, hello result)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(url)
    sock.send(messages.pack({"v": 1, "op": "hello", "id": 1, "local": True}))
    assert sock.poll(10000)
    return ctx, sock, messages.unpack(sock.recv())["result"]


def test_daemon_memory_held_by_a_client_cannot_be_resized(hostile: Daemon) -> None:
    ctx, sock, hello = raw_session(hostile.url)
    link = LocalLink.attach(hello["local_socket"], hello["session"], 10)
    try:
        (name, fd), = link.arena
        size = os.fstat(fd).st_size
        # what a client holding its arena's fd would try: shrink, grow, lift the seals
        for attempt in (lambda: os.ftruncate(fd, 0), lambda: os.ftruncate(fd, 2 * size),
                        lambda: fcntl.fcntl(fd, fcntl.F_ADD_SEALS, 0)):
            with pytest.raises(PermissionError):
                attempt()
        assert os.fstat(fd).st_size == size
    finally:
        link.close()
        sock.close(0)
        ctx.term()
    with Client(hostile.url, timeout=30) as c:
        x = np.arange(64 * 1024, dtype=np.float32)                  # 256 KiB: lent, not inline
        out = c.infer("plus_one", {"INPUT__0": x})["OUTPUT__0"]
        np.testing.assert_array_equal(out, x + 1)
        assert c.is_local and not out.flags.writeable
        # the worker's memory it reads that output in: mapped from a read-only fd
        address = out.__array_interface__["data"][0]
        for line in open("/proc/self/maps"):
            lo, hi = (int(v, 16) for v in line.split()[0].split("-"))
            if lo <= address < hi:
                assert "/memfd:torchpool." in line and line.split()[1].startswith("r-")
                try:
                    mapped = os.open(f"/proc/self/map_files/{line.split()[0]}", os.O_RDONLY)
                except PermissionError:
                    break                                          # needs CAP_SYS_ADMIN here
                try:
                    with pytest.raises(OSError):
                        os.ftruncate(mapped, 0)
                finally:
                    os.close(mapped)
                break
        else:
            raise AssertionError("the output is not in a mapping of daemon memory")
        np.testing.assert_array_equal(c.infer("plus_one", {"INPUT__0": x})["OUTPUT__0"], x + 1)
    # no daemon memory has a name in /dev/shm to guess, open or truncate
    assert not [n for n in os.listdir("/dev/shm") if n.startswith("torchpool.")]


# --- client regions shrunk at each moment -----------------------------------------------------

def test_region_shrunk_before_the_request(hostile: Daemon, region) -> None:
    key, fd = region
    pids = worker_pids(hostile.log(), "plus_one")
    with Client(hostile.url, timeout=30) as c:
        c.register_system_shared_memory("r", key, N * 4)
        os.ftruncate(fd, 0)
        with pytest.raises(InferenceError) as exc:
            c.infer("plus_one", {"INPUT__0": SharedMemoryRef("r", N * 4, 0, "FP32", (N,))})
        assert exc.value.code == errors.INVALID_ARG
        assert "shrank" in exc.value.message and key not in exc.value.message
    assert_unharmed(hostile, "plus_one", pids)


def test_region_shrunk_while_queued_in_a_forming_batch(hostile: Daemon, region) -> None:
    key, fd = region
    mm = mmap.mmap(fd, MiB)
    np.frombuffer(mm, np.float32, N)[:] = 3.0
    pids = worker_pids(hostile.log(), "batched")
    offender = Client(hostile.url, timeout=60)
    try:
        offender.register_system_shared_memory("q", key, N * 4)
        t, result = in_thread(lambda: offender.infer(
            "batched", {"INPUT__0": SharedMemoryRef("q", N * 4, 0, "FP32", (1, N))}))
        wait_for(lambda: queue_depth(hostile, "batched") == 1, 30, "the offender's request to queue")
        os.ftruncate(fd, 0)                      # now the next request joins its batch
        with Client(hostile.url, timeout=60) as honest:
            x = np.full((1, N), 5.0, np.float32)
            np.testing.assert_array_equal(honest.infer("batched", {"INPUT__0": x})["OUTPUT__0"], x + 1)
        t.join(60)
        err = result.get("error")
        assert isinstance(err, InferenceError) and err.code == errors.INVALID_ARG, result
        assert "shrank" in err.message
    finally:
        offender.close()
        mm.close()
    assert_unharmed(hostile, "batched", pids)


@pytest.mark.parametrize("model, how", [("slow_read", "input"), ("slow_make", "output")])
def test_region_shrunk_while_the_model_uses_it(hostile: Daemon, region, model: str, how: str) -> None:
    key, fd = region
    mm = mmap.mmap(fd, MiB)
    np.frombuffer(mm, np.float32, N)[:] = 2.0
    pids = worker_pids(hostile.log(), model)
    assert len(pids) == 1
    offender = Client(hostile.url, timeout=60)
    try:
        offender.register_system_shared_memory("m", key, 2 * N * 4)
        n = np.array([slow_iterations(1.5)], np.int64)
        if how == "input":
            call = lambda: offender.infer(model, {"INPUT__0": SharedMemoryRef("m", N * 4, 0, "FP32", (N,)),
                                                  "INPUT__1": n})
        else:
            call = lambda: offender.infer(model, {"INPUT__0": np.zeros(N, np.float32), "INPUT__1": n},
                                          outputs=[OutputRef("OUTPUT__0", "m", N * 4, N * 4)])
        fast = n
        n = np.array([1], np.int64)
        call()                  # once quickly: the worker maps the region (and keeps it mapped)
        n = fast
        ticks = cpu_ticks(pids[0])
        t, result = in_thread(call)
        # the worker is computing: the model is in its loop, before it touches the region
        wait_for(lambda: cpu_ticks(pids[0]) >= ticks + 5, 30, "the model to start working")
        os.ftruncate(fd, 0)
        t.join(60)
        err = result.get("error")
        assert isinstance(err, InferenceError) and err.code == errors.INVALID_ARG, result
        assert "shrank" in err.message and f"'{model}'" in err.message and key not in err.message
    finally:
        offender.close()
        mm.close()
    assert_unharmed(hostile, model, pids)
    assert "killed by signal" not in hostile.log()


# --- who may have a local session -------------------------------------------------------------

def test_a_tcp_peer_gets_no_local_session_whatever_it_claims(hostile: Daemon) -> None:
    tcp = next(u for u in hostile.urls if u.startswith("tcp://"))
    boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(tcp)

    def call(**fields) -> dict:
        sock.send(messages.pack({"v": 1, "id": 1, **fields}))
        assert sock.poll(10000)
        return messages.unpack(sock.recv())
    try:
        res = call(op="hello", local=True, boot_id=boot_id)["result"]
        assert res["local"] is False and "arena" not in res
        token = res["session"]
        grow = call(op="arena_grow", session=token, size=MiB)
        assert not grow["ok"] and grow["error"]["code"] == errors.INVALID_ARG
        assert "local session" in grow["error"]["message"]
        bad = call(op="infer", session=token, model="plus_one", version="", outputs=None,
                   inputs=[{"name": "INPUT__0", "datatype": "FP32", "shape": [4],
                            "shm": ["torchpool.x.1.c0", 64, 16, 1]}])
        assert not bad["ok"] and "local session" in bad["error"]["message"]
        reg = call(op="register_system_shared_memory", session=token, name="r", key="anything",
                   byte_size=64, offset=0)
        assert not reg["ok"] and "local session" in reg["error"]["message"]
    finally:
        sock.close(0)
        ctx.term()


def test_attaching_needs_the_side_channel_and_a_real_session(hostile: Daemon) -> None:
    path = str(hostile.socket_path) + ".local"
    assert os.stat(path).st_mode & 0o777 == 0o660
    with pytest.raises(InferenceError) as exc:
        LocalLink.attach(path, "0" * 32, 5)
    assert exc.value.code == errors.SESSION_LOST
    with Client(hostile.url, timeout=30) as c:
        c.infer("plus_one", {"INPUT__0": np.zeros(4, np.float32)})
        with pytest.raises(InferenceError, match="already attached"):
            LocalLink.attach(path, c._state.session, 5)          # a second attach to a session
    # a connection that never attaches is closed by the daemon
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.connect(path)
    s.send(b"\xc1 not msgpack")
    s.settimeout(10)
    answer = messages.unpack(s.recv(4096))
    assert answer["ok"] is False and answer["error"]["code"] == errors.INVALID_ARG
    assert s.recv(4096) == b""
    s.close()


# --- limits ----------------------------------------------------------------------------------

def test_sessions_per_connection_are_limited(hostile: Daemon) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(hostile.url)
    try:
        answers = []
        for i in range(8):
            sock.send(messages.pack({"v": 1, "op": "hello", "id": i, "local": True}))
            assert sock.poll(10000)
            answers.append(messages.unpack(sock.recv()))
        assert [a["ok"] for a in answers] == [True] * 6 + [False] * 2
        assert answers[6]["id"] == 6 and answers[6]["error"]["code"] == errors.RESOURCE_EXHAUSTED
        assert "--max-sessions-per-peer" in answers[6]["error"]["message"]
        with Client(hostile.url, timeout=30) as other:        # another connection is unaffected
            assert other.infer("plus_one", {"INPUT__0": np.ones(2, np.float32)})["OUTPUT__0"].tolist() == [2, 2]
    finally:
        sock.close(0)
        ctx.term()


def test_regions_per_session_are_limited(hostile: Daemon, region) -> None:
    key, _ = region
    with Client(hostile.url, timeout=30) as c:
        c.register_system_shared_memory("a", key, 4096)
        c.register_system_shared_memory("b", key, 4096, offset=4096)
        with pytest.raises(InferenceError) as exc:
            c.register_system_shared_memory("c", key, 4096, offset=8192)
        assert exc.value.code == errors.RESOURCE_EXHAUSTED
        assert "--max-regions-per-session" in exc.value.message
        c.unregister_system_shared_memory("a")
        c.register_system_shared_memory("c", key, 4096, offset=8192)


def test_garbage_cuda_registrations_are_refused_and_others_served(hostile: Daemon) -> None:
    """A client sends CUDA registrations with every field wrong (types,
    sizes, a 64-byte handle as text, 4,096 of them in a row): each gets
    INVALID_ARG naming what is wrong, nothing is registered, the session
    keeps its room for regions, and the daemon serves the others."""
    pids = worker_pids(hostile.log(), "plus_one")
    handle = bytes(64)
    cases = [(("", handle, 0, 64), "'name' must be a non-empty string"),
             (("g", handle[:63], 0, 64), "'raw_handle' must be a valid base64 encoded cudaIpcMemHandle_t"),
             (("g", "x" * 64, 0, 64), "'raw_handle' must be bytes"),
             (("g", handle, "0", 64), "'device_id' must be an unsigned integer"),
             (("g", handle, -3, 64), "'device_id' must be an unsigned integer"),
             (("g", handle, 0, -1), "is not an integer in [0, 2^64)"),
             (("g", handle, 0, "64"), "is not an integer in [0, 2^64)"),
             (("g", handle, 7, (1 << 64) - 1), "GPUs not supported")]
    with Client(hostile.url, timeout=30) as c:
        for (name, raw, device, size), text in cases:
            with pytest.raises(InferenceError) as e:
                c.register_cuda_shared_memory(name, raw, device, size)
            assert e.value.code == errors.INVALID_ARG and text in e.value.message, (text, e.value.message)
        for i in range(4096):
            with pytest.raises(InferenceError):
                c.register_cuda_shared_memory(f"g{i}", handle, 0, 64)
        assert c.get_cuda_shared_memory_status() == []
    assert_unharmed(hostile, "plus_one", pids)


def test_arena_bytes_in_all_are_limited(hostile: Daemon) -> None:
    """16 MiB for every client's arena together (4 MiB each here): the clients
    beyond it are served over the socket instead, correctly."""
    clients = [Client(hostile.url, timeout=30) for _ in range(8)]
    try:
        x = np.arange(8192, dtype=np.float32)
        for c in clients:
            np.testing.assert_array_equal(c.infer("plus_one", {"INPUT__0": x})["OUTPUT__0"], x + 1)
        local = [c.is_local for c in clients]
        assert 1 <= local.count(True) <= 4 and not all(local)
        held = memfds(hostile.proc.pid)
        assert sum(size for n, size in held.items() if re.search(r"\.c\d+$", n)) <= 16 * MiB
    finally:
        for c in clients:
            c.close()


def test_bytes_tensors_are_limited_and_checked_without_stalling_others(hostile: Daemon) -> None:
    ctx, sock, _ = raw_session(hostile.url)

    def infer(shape: list, data: bytes) -> dict:
        sock.send_multipart([messages.pack({"v": 1, "op": "infer", "id": 7, "model": "count", "version": "",
                                            "inputs": [{"name": "TEXT", "datatype": "BYTES", "shape": shape,
                                                        "data": 1}], "outputs": None}), data])
        assert sock.poll(10000)
        return messages.unpack(sock.recv_multipart()[0])
    try:
        ok = infer([3], b"".join(struct.pack("<I", len(w)) + w for w in (b"a", b"bc", b"")))
        assert ok["ok"], ok
        # elements over the limit: refused before the payload is looked at
        many = infer([5_000_000], b"\0" * 16)
        assert many["id"] == 7 and many["error"]["code"] == errors.RESOURCE_EXHAUSTED
        assert many["error"]["message"] == ("input 'TEXT' for model 'count' has 5000000 BYTES elements; this "
                                            "server accepts at most 1000 per tensor (--max-bytes-elements)")
        big = infer([1], struct.pack("<I", 100_000) + b"x" * 100_000)
        assert big["error"]["code"] == errors.RESOURCE_EXHAUSTED
        assert "--max-bytes-tensor-bytes" in big["error"]["message"] and "'TEXT'" in big["error"]["message"]
        lying = infer([2], struct.pack("<I", 5) + b"abc")          # claims more than it sends
        assert lying["error"]["code"] == errors.INVALID_ARG and "'TEXT'" in lying["error"]["message"]
        # 1000 empty strings at the limit: a C walk, no Python loop per element
        at_limit = infer([1000], b"\0\0\0\0" * 1000)
        assert at_limit["ok"], at_limit
    finally:
        sock.close(0)
        ctx.term()
    assert_unharmed(hostile, "count", worker_pids(hostile.log(), "count"))


def test_connections_that_never_attach_cannot_lock_out_the_local_path(hostile: Daemon) -> None:
    """A user holding side-channel connections open without attaching gets
    RESOURCE_EXHAUSTED past its per-user limit (6 here); they are dropped after
    10 s, and once it lets go, clients attach again."""
    path = str(hostile.socket_path) + ".local"
    idle = []
    for _ in range(6):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.connect(path)
        idle.append(s)
    extra = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    extra.connect(path)
    extra.settimeout(10)
    answer = messages.unpack(extra.recv(4096))
    assert answer["ok"] is False and answer["error"]["code"] == errors.RESOURCE_EXHAUSTED
    assert "--max-sessions-per-peer" in answer["error"]["message"]
    assert extra.recv(4096) == b""                                  # and closed
    extra.close()
    # the daemon drops connections that never attach (10 s): wait for it, do not close them
    for s in idle:
        s.settimeout(20)
        assert s.recv(4096) == b""
        s.close()
    with Client(hostile.url, timeout=30) as c:
        x = np.arange(8192, dtype=np.float32)
        np.testing.assert_array_equal(c.infer("plus_one", {"INPUT__0": x})["OUTPUT__0"], x + 1)
        assert c.is_local
