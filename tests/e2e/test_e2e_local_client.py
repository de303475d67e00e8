"""End to end: the client library's local shared-memory path (docs/protocol.md,
"Shared memory") against a real daemon, through the public client API only.

The daemon's side, spoken by hand, is tested in test_e2e_shm_protocol.py; here
the client does the talking: automatic session and arena, outputs lent in
place and released by finalizer, `empty()`, registered regions, the inline
fallbacks, and what happens to a client's shared memory when it goes away.
"""
from __future__ import annotations

import base64

import asyncio
import gc
import mmap
import os
import re
import secrets
import subprocess
import sys
from pathlib import Path

import numpy as np
import posix_ipc
import pytest
import torch

from torchpool import AsyncClient, Client, InferenceError, OutputRef, RegionOutput, SharedMemoryRef
from torchpool.protocol import errors

from ..support.daemon import free_tcp_port
from ..support.daemon import ROOT, Daemon, cpu_ticks, daemon_segments, memfds, wait_for, worker_pids
from ..support.mappings import mapped_file
from ..support.models.slow import slow_iterations

MiB = 1 << 20
A = np.arange(16, dtype=np.float32).reshape(1, 16)
B = np.full((1, 16), 3, dtype=np.float32)
ADDSUB = {"INPUT0": A, "INPUT1": B}
CLOSED = 5.0          # seconds a closed client's goodbye may take to unlink its arena


@pytest.fixture(scope="module")
def local_daemon(small_repository: Path, tmp_path_factory: pytest.TempPathFactory):
    """A small per-client arena (8 MiB), so that big inputs make the client grow it; a
    lease (10 s) well above CLOSED, so that only a goodbye can release a closed client's
    arena in time."""
    d = Daemon(small_repository, tmp_path_factory.mktemp("local_client"), "--client-lease", "10",
               "--client-shm-size", "8M", tcp_port=free_tcp_port()).start()
    yield d
    assert d.stop() == 0, d.log()
    assert not daemon_segments(d.urls), "the daemon left shared memory behind"


@pytest.fixture(scope="module")
def short_lease_daemon(small_repository: Path, tmp_path_factory: pytest.TempPathFactory):
    """Sessions expire after 1 s without a request (ten leases while outputs are lent)."""
    d = Daemon(small_repository, tmp_path_factory.mktemp("short_lease"), "--client-lease", "1",
               "--client-shm-size", "4M", "--log-level", "debug").start()
    yield d
    assert d.stop() == 0, d.log()
    assert not daemon_segments(d.urls), "the daemon left shared memory behind"


# --- helpers -----------------------------------------------------------------------------

def client_arenas(d: Daemon) -> set[str]:
    """The daemon's client arena segments (memfds `torchpool.<id>.<pid>.c<n>` the broker holds)."""
    return {n for n in memfds(d.proc.pid) if re.search(r"\.c\d+$", n)}


def worker_output_bytes(d: Daemon) -> int:
    """Bytes of all the workers' output segments (`torchpool.<id>.<pid>.w<serial>.<i>`)."""
    return sum(size for n, size in memfds(d.proc.pid).items() if re.search(r"\.w\d+\.\d+$", n))


def released_by(d: Daemon):
    """A predicate: the daemon no longer holds any of these segments."""
    return lambda names: not set(names) & set(memfds(d.proc.pid))


def backing(arr: np.ndarray) -> object:
    """The object at the end of an array's base chain (memoryviews unwrapped)."""
    obj: object = arr
    while isinstance(obj, np.ndarray):
        obj = obj.base
    return obj.obj if isinstance(obj, memoryview) else obj


def lent_total(c: Client) -> int:
    return c.server_metadata()["transfer"].get("output_bytes_lent", 0)


def daemon_transfer(c: Client) -> dict:
    t = c.server_metadata()["transfer"]
    return {k: t.get(k, 0) for k in ("input_bytes_copied", "input_bytes_in_place", "output_bytes_lent",
                                     "output_bytes_sent")}


def delta(after: dict, before: dict) -> dict:
    return {k: after[k] - before[k] for k in after}


@pytest.fixture
def region_segment():
    """A client-owned POSIX segment (1 MiB) mapped read-write; the test unlinks it."""
    key = f"tp-test-client-region-{os.getpid()}-{secrets.token_hex(4)}"
    shm = posix_ipc.SharedMemory("/" + key, posix_ipc.O_CREX, mode=0o600, size=MiB)
    mm = mmap.mmap(shm.fd, MiB)
    shm.close_fd()
    try:
        yield key, mm
        mm.close()          # fails if the test still exports views of it
    finally:
        posix_ipc.unlink_shared_memory("/" + key)
    assert not os.path.exists(f"/dev/shm/{key}")


# --- 1. the automatic local path -----------------------------------------------------------

def test_local_round_trip_copies_in_once_and_lends_the_output(local_daemon: Daemon) -> None:
    x = np.random.default_rng(1).standard_normal(4 * MiB // 4, dtype=np.float32)     # 16 MiB
    with Client(local_daemon.url, timeout=30) as c:
        lent0 = lent_total(c)
        out = c.infer("clone", {"INPUT__0": x})
        assert c.is_local and c.session
        y = out["OUTPUT__0"]
        np.testing.assert_array_equal(y, x)
        # the input went through the arena (grown for it: the first segment is 8 MiB)
        assert c.transfer_stats() == {"bytes_copied": x.nbytes, "bytes_zero_copy": 0, "bytes_inline": 0}
        # the output is the worker's shared memory, viewed read-only in place
        assert y.flags.writeable is False
        with pytest.raises(ValueError):
            y[0] = 1.0
        assert isinstance(backing(y), mmap.mmap)
        # a worker's memory (a sealed memfd handed to us read-only), not a file in /dev/shm
        # (this session's lending area in the worker: worker/lending.py)
        assert re.fullmatch(r"/memfd:torchpool\.[0-9a-f]{8}\.\d+\.w\d+\.l\d+ \(deleted\)",
                            mapped_file(y)), mapped_file(y)
        assert lent_total(c) - lent0 == x.nbytes
        # copy=True: an ordinary writable array, nothing of the daemon's kept
        z = c.infer("clone", {"INPUT__0": x}, copy=True)["OUTPUT__0"]
        assert z.flags.writeable and z.flags.owndata and not mapped_file(z).startswith("/dev/shm")
        z[0] = 42.0
        np.testing.assert_array_equal(z[1:], x[1:])
        small = c.infer("addsub", ADDSUB, copy=True)["OUTPUT0"]          # came inline: still writable
        assert small.flags.writeable
        np.testing.assert_array_equal(small, A + B)
        np.testing.assert_array_equal(y, x)          # the first output is untouched by all this


def test_small_tensors_travel_inline_even_when_local(local_daemon: Daemon) -> None:
    limit = 16 * 1024 // 4                                     # 16 KiB of FP32
    with Client(local_daemon.url, timeout=30) as c:
        c.infer("addsub", ADDSUB)
        assert c.is_local
        s0, t0 = c.transfer_stats(), daemon_transfer(c)
        at = np.arange(limit, dtype=np.float32)
        np.testing.assert_array_equal(c.infer("clone", {"INPUT__0": at})["OUTPUT__0"], at)
        s1, t1 = c.transfer_stats(), daemon_transfer(c)
        assert delta(s1, s0) == {"bytes_copied": 0, "bytes_zero_copy": 0, "bytes_inline": at.nbytes}
        assert t1["output_bytes_lent"] == t0["output_bytes_lent"]          # 16 KiB back inline too
        above = np.arange(limit + 1, dtype=np.float32)
        np.testing.assert_array_equal(c.infer("clone", {"INPUT__0": above})["OUTPUT__0"], above)
        s2, t2 = c.transfer_stats(), daemon_transfer(c)
        assert delta(s2, s1) == {"bytes_copied": above.nbytes, "bytes_zero_copy": 0, "bytes_inline": 0}
        assert t2["output_bytes_lent"] - t1["output_bytes_lent"] == above.nbytes


def test_released_outputs_are_reused_and_held_ones_never(local_daemon: Daemon) -> None:
    n = MiB // 4                                                 # 1 MiB outputs: lent
    x = np.arange(n, dtype=np.float32)
    with Client(local_daemon.url, timeout=30) as c:
        out = c.infer("clone", {"INPUT__0": x})
        del out
        gc.collect()
        before = worker_output_bytes(local_daemon)
        # dropped results: each release rides on a later request; the worker reuses the blocks
        for i in range(100):
            out = c.infer("clone", {"INPUT__0": x})
            assert out["OUTPUT__0"][i] == i
            del out                          # refcounting frees it: no gc.collect() needed
        gc.collect()
        assert worker_output_bytes(local_daemon) - before <= 4 * MiB     # not 100 MiB
        # `with`: released on exit when nothing else holds the arrays, even though the
        # result objects themselves are kept
        exited = []
        for i in range(100):
            with c.infer("clone", {"INPUT__0": x}) as out:
                assert out["OUTPUT__0"][-1 - i] == n - 1 - i
            exited.append(out)
        assert not any(exited)
        assert worker_output_bytes(local_daemon) - before <= 4 * MiB
        # copy=True: private copies, the daemon's blocks handed back at once
        copies = [c.infer("clone", {"INPUT__0": x + i}, copy=True)["OUTPUT__0"] for i in range(50)]
        assert all(a[0] == i and a.flags.writeable for i, a in enumerate(copies))
        assert worker_output_bytes(local_daemon) - before <= 4 * MiB
        del copies, exited
        # an array kept beyond the `with` stays valid and unchanged while others come and go
        first = x * 2
        with c.infer("clone", {"INPUT__0": first}) as out:
            kept = out["OUTPUT__0"]
        assert not out
        held = []
        for i in range(12):
            held.append(c.infer("clone", {"INPUT__0": np.full(n, i, np.float32)})["OUTPUT__0"])
        for i in range(50):
            c.infer("clone", {"INPUT__0": np.full(n, -i, np.float32)})
        np.testing.assert_array_equal(kept, first)
        for i, h in enumerate(held):
            assert h.min() == h.max() == i
        addresses = {a.__array_interface__["data"][0] for a in [kept, *held]}
        assert len(addresses) == 13                           # never two lent outputs in one block
        del kept, held
        gc.collect()
        # released again: a further round fits in what the worker has already
        grown = worker_output_bytes(local_daemon)
        for _ in range(20):
            with c.infer("clone", {"INPUT__0": x}) as out:
                assert out["OUTPUT__0"][5] == 5
        assert worker_output_bytes(local_daemon) == grown


def test_outputs_that_are_views_of_the_input_come_back_in_its_block(daemon: Daemon) -> None:
    n = MiB // 4
    x = np.arange(n, dtype=np.float32)                              # 1 MiB: copied into the arena
    ipc = next(u for u in daemon.urls if u.startswith("ipc"))
    with Client(ipc, timeout=30) as c:
        c.infer("input_views", {"INPUT__0": x})                     # session and arena exist
        before_arena = sum(size for n, size in memfds(daemon.proc.pid).items() if n in client_arenas(daemon))
        t0 = c.server_metadata()["transfer"]
        out = c.infer("input_views", {"INPUT__0": x})
        whole, tail, strided = out["OUTPUT__0"], out["OUTPUT__1"], out["OUTPUT__2"]
        np.testing.assert_array_equal(whole, x)
        np.testing.assert_array_equal(tail, x[8:])
        np.testing.assert_array_equal(strided, x[::2])
        t1 = c.server_metadata()["transfer"]
        # the input itself and the slice of it: the client's own arena block, no output copy
        assert re.fullmatch(r"/memfd:torchpool\.[0-9a-f]{8}\.\d+\.c\d+ \(deleted\)", mapped_file(whole))
        assert tail.__array_interface__["data"][0] == whole.__array_interface__["data"][0] + 32
        assert t1.get("output_bytes_reused", 0) - t0.get("output_bytes_reused", 0) == x.nbytes + tail.nbytes
        # the strided view is not contiguous memory: written out by the worker and lent
        assert re.search(r"\.w\d+\.l\d+ \(deleted\)$", mapped_file(strided))
        assert t1.get("output_bytes_lent", 0) - t0.get("output_bytes_lent", 0) == strided.nbytes
        assert not whole.flags.writeable and not tail.flags.writeable
        with pytest.raises(ValueError):
            whole[0] = 1.0
        # the block stays the outputs' while they live: later requests never write into it
        for i in range(30):
            again = c.infer("input_views", {"INPUT__0": np.full(n, -i, np.float32)})
            assert again["OUTPUT__0"][0] == -i
            del again
        np.testing.assert_array_equal(whole, x)
        np.testing.assert_array_equal(tail, x[8:])
        # copy=True: a private writable copy, the block freed with the request
        mine = c.infer("input_views", {"INPUT__0": x}, copy=True)["OUTPUT__0"]
        assert mine.flags.writeable and mine.flags.owndata
        np.testing.assert_array_equal(mine, x)
        # dropped outputs free their blocks: a hundred more requests fit in the arena as it is
        del out, whole, tail, strided
        for _ in range(100):
            with c.infer("input_views", {"INPUT__0": x}) as res:
                assert res["OUTPUT__1"][0] == 8
        assert sum(size for n, size in memfds(daemon.proc.pid).items() if n in client_arenas(daemon)) == before_arena


# --- 2. allocate in place ------------------------------------------------------------------

def test_empty_buffers_are_sent_without_a_copy(local_daemon: Daemon) -> None:
    with Client(local_daemon.url, timeout=30) as c:
        buf = c.empty((4, 1024, 1024), "FP32")                       # 16 MiB: grows the arena
        assert c.is_local
        assert buf.shape == (4, 1024, 1024) and buf.dtype == np.float32
        assert buf.flags.writeable and buf.flags.c_contiguous
        assert re.fullmatch(r"/memfd:torchpool\.[0-9a-f]{8}\.\d+\.c\d+ \(deleted\)", mapped_file(buf)), mapped_file(buf)
        buf[:] = np.random.default_rng(2).standard_normal(buf.shape, dtype=np.float32)
        flat = buf.reshape(-1)
        assert flat.__array_interface__["data"][0] == buf.__array_interface__["data"][0]
        s0, t0 = c.transfer_stats(), daemon_transfer(c)
        out = c.infer("identity", {"INPUT__0": flat})
        np.testing.assert_array_equal(out["OUTPUT__0"], flat)
        s1, t1 = c.transfer_stats(), daemon_transfer(c)
        assert delta(s1, s0) == {"bytes_copied": 0, "bytes_zero_copy": 16 * MiB, "bytes_inline": 0}
        assert t1["input_bytes_copied"] == t0["input_bytes_copied"]
        assert t1["input_bytes_in_place"] - t0["input_bytes_in_place"] == 16 * MiB
        # refilled and sent again: the new contents, the earlier output untouched
        first = np.array(out["OUTPUT__0"])
        buf *= -1
        again = c.infer("identity", {"INPUT__0": flat})["OUTPUT__0"]
        np.testing.assert_array_equal(again, -first)
        np.testing.assert_array_equal(out["OUTPUT__0"], first)
        # a torch view of it is sent with no copy as well
        t = torch.from_numpy(buf).view(-1)
        res = c.infer("identity", {"INPUT__0": t})["OUTPUT__0"]
        np.testing.assert_array_equal(res, t.numpy())
        s2 = c.transfer_stats()
        assert delta(s2, s1) == {"bytes_copied": 0, "bytes_zero_copy": 32 * MiB, "bytes_inline": 0}
        # views that do not start at the block start, or are strided, are copied (correctly)
        for view in (flat[1:], flat[4096:8192 + 4096], flat[::2]):
            s_before = c.transfer_stats()
            np.testing.assert_array_equal(c.infer("identity", {"INPUT__0": view})["OUTPUT__0"], view)
            assert delta(c.transfer_stats(), s_before) == {"bytes_copied": view.nbytes, "bytes_zero_copy": 0,
                                                           "bytes_inline": 0}
        # a view at the block start that is shorter than the block: no copy
        head = flat[:MiB]
        s_before = c.transfer_stats()
        np.testing.assert_array_equal(c.infer("identity", {"INPUT__0": head})["OUTPUT__0"], head)
        assert delta(c.transfer_stats(), s_before)["bytes_zero_copy"] == head.nbytes


def test_empty_blocks_come_back_when_their_arrays_are_garbage(local_daemon: Daemon) -> None:
    before = client_arenas(local_daemon)
    with Client(local_daemon.url, timeout=30) as c:
        for i in range(20):
            buf = c.empty((6 * MiB // 4,), "FP32")                  # 6 MiB of an 8 MiB arena
            buf[:] = i
            assert c.infer("identity", {"INPUT__0": buf})["OUTPUT__0"][-1] == i
            del buf
        assert c.transfer_stats()["bytes_zero_copy"] == 20 * 6 * MiB
        # a leaked block would have made every allocation grow the arena
        assert len(client_arenas(local_daemon) - before) == 1


# --- 3. registered regions through the client API --------------------------------------------

def test_regions_as_inputs_and_outputs(local_daemon: Daemon, region_segment) -> None:
    key, mm = region_segment
    base = 4096                                       # the region starts at this offset of the segment
    size = MiB - base
    region = memoryview(mm)[base:]
    x = np.random.default_rng(3).standard_normal(16384, dtype=np.float32)          # 64 KiB
    np.frombuffer(region, np.float32, x.size, 0)[:] = x
    np.frombuffer(region, np.float32, 16, 256 * 1024)[:] = A.reshape(-1)
    np.frombuffer(region, np.float32, 16, 256 * 1024 + 64)[:] = B.reshape(-1)
    arenas_before = client_arenas(local_daemon)
    c = Client(local_daemon.url, timeout=30)
    try:
        c.register_system_shared_memory("r", key, size, base)
        status = c.get_system_shared_memory_status()
        assert [(s["name"], s["key"], s["offset"], s["byte_size"], s["in_use"]) for s in status] == \
            [("r", key, base, size, 0)]
        assert c.get_system_shared_memory_status("r") == status
        s0 = c.transfer_stats()
        out = c.infer("identity", {"INPUT__0": SharedMemoryRef("r", x.nbytes, 0, "FP32", x.shape)},
                      outputs=[OutputRef("OUTPUT__0", "r", x.nbytes, 128 * 1024)])
        ro = out["OUTPUT__0"]
        assert isinstance(ro, RegionOutput)
        assert (ro.region, ro.offset, ro.nbytes, ro.datatype, ro.shape) == ("r", 128 * 1024, x.nbytes, "FP32",
                                                                            x.shape)
        np.testing.assert_array_equal(ro.as_array(region), x)
        np.testing.assert_array_equal(np.frombuffer(mm, np.float32, x.size, base + 128 * 1024), x)
        assert delta(c.transfer_stats(), s0) == {"bytes_copied": 0, "bytes_zero_copy": x.nbytes, "bytes_inline": 0}
        # mixed: region inputs, one output into the region, one the usual way
        out = c.infer("addsub", {"INPUT0": SharedMemoryRef("r", 64, 256 * 1024, "FP32", (1, 16)),
                                 "INPUT1": SharedMemoryRef("r", 64, 256 * 1024 + 64, "FP32", (1, 16))},
                      outputs=[OutputRef("OUTPUT0", "r", 64, 512 * 1024), "OUTPUT1"])
        np.testing.assert_array_equal(out["OUTPUT0"].as_array(region), A + B)
        np.testing.assert_array_equal(out["OUTPUT1"], A - B)

        def rejected(call, *args, **kwargs) -> str:
            with pytest.raises(InferenceError) as exc:
                call(*args, **kwargs)
            assert exc.value.code == errors.INVALID_ARG, exc.value
            assert key not in exc.value.message
            return exc.value.message

        # out of bounds, every way
        rejected(c.infer, "addsub", {"INPUT0": SharedMemoryRef("r", 64, size - 32, "FP32", (1, 16)),
                                     "INPUT1": B})
        rejected(c.infer, "addsub", ADDSUB, outputs=[OutputRef("OUTPUT0", "r", 64, size - 32)])
        rejected(c.infer, "addsub", ADDSUB, outputs=[OutputRef("OUTPUT0", "r", 32, 0)])       # too small
        rejected(c.register_system_shared_memory, "big", key, size + 1, base)
        rejected(c.register_system_shared_memory, "far", key, 64, MiB)
        # the daemon's own namespace is refused, with or without a leading slash
        reserved = f"torchpool.test-client-{os.getpid()}-{secrets.token_hex(4)}"
        posix_ipc.SharedMemory("/" + reserved, posix_ipc.O_CREX, mode=0o600, size=4096).close_fd()
        try:
            for k in (reserved, "/" + reserved):
                msg = rejected(c.register_system_shared_memory, "mine", k, 4096)
                assert reserved not in msg and "reserved" in msg
        finally:
            posix_ipc.unlink_shared_memory("/" + reserved)
        assert not os.path.exists(f"/dev/shm/{reserved}")
        assert [s["name"] for s in c.get_system_shared_memory_status()] == ["r"]
        # unregistering removes it; the segment is the caller's and stays
        c.unregister_system_shared_memory("r")
        assert c.get_system_shared_memory_status() == []
        assert os.path.exists(f"/dev/shm/{key}")
        with pytest.raises(InferenceError) as exc:
            c.infer("addsub", {"INPUT0": SharedMemoryRef("r", 64, 0, "FP32", (1, 16)), "INPUT1": B})
        assert exc.value.code == errors.NOT_FOUND       # Triton's code and text
        assert "Unable to find shared memory region: 'r'" in exc.value.message
        # registered again and left registered when the client closes
        c.register_system_shared_memory("again", key, size, base)
        np.testing.assert_array_equal(c.infer("addsub", ADDSUB)["OUTPUT0"], A + B)
        mine = client_arenas(local_daemon) - arenas_before
        assert len(mine) == 1
    finally:
        c.close()
        region.release()
    wait_for(lambda: released_by(local_daemon)(mine), CLOSED, "the closed client's arena to be unlinked")
    assert os.path.exists(f"/dev/shm/{key}")           # the daemon never unlinks a client's segment
    np.testing.assert_array_equal(np.frombuffer(mm, np.float32, x.size, base + 128 * 1024), x)


def test_regions_work_without_the_local_path(local_daemon: Daemon, region_segment) -> None:
    key, mm = region_segment
    np.frombuffer(mm, np.float32, 16, 0)[:] = A.reshape(-1)
    with Client(local_daemon.url, timeout=30, local=False) as c:
        c.register_system_shared_memory("r", key, 4096)
        assert c.session and not c.is_local
        out = c.infer("addsub", {"INPUT0": SharedMemoryRef("r", 64, 0, "FP32", (1, 16)), "INPUT1": B},
                      outputs=[OutputRef("OUTPUT0", "r", 64, 1024), "OUTPUT1"])
        np.testing.assert_array_equal(out["OUTPUT0"].as_array(mm), A + B)
        np.testing.assert_array_equal(out["OUTPUT1"], A - B)
        c.unregister_system_shared_memory()
        assert c.get_system_shared_memory_status() == []


def test_cuda_regions_on_a_host_without_gpus(local_daemon: Daemon, region_segment) -> None:
    """Triton's CUDA shared memory through the ZeroMQ client: one namespace
    with system regions (a name taken is ALREADY_EXISTS whichever kind), a
    handle that is not 64 bytes refused, and a host without GPUs refusing
    in Triton's words (tests/gpu runs the rest on a GPU)."""
    key, _mm = region_segment
    handle = bytes(range(64))
    with Client(local_daemon.url, timeout=30) as c:
        meta = c.server_metadata()
        assert "cuda_shared_memory" not in meta["extensions"]        # no GPU here
        c.register_system_shared_memory("taken", key, 4096)
        with pytest.raises(InferenceError) as e:
            c.register_cuda_shared_memory("taken", handle, 0, 4096)
        assert e.value.code == "ALREADY_EXISTS"
        for raw, text in ((b"short", "'raw_handle' must be a valid base64 encoded cudaIpcMemHandle_t"),
                          (handle, "failed to register CUDA shared memory region: 'gpu', GPUs not supported"),
                          (base64.b64encode(handle), "failed to register CUDA shared memory region: 'gpu', "
                                                     "GPUs not supported")):
            with pytest.raises(InferenceError) as e:
                c.register_cuda_shared_memory("gpu", raw, 0, 4096)
            assert (e.value.code, e.value.message) == ("INVALID_ARG", text)
        assert c.get_cuda_shared_memory_status() == []
        with pytest.raises(InferenceError) as e:
            c.get_cuda_shared_memory_status("taken")            # a system region, not a CUDA one
        assert e.value.code == "NOT_FOUND"
        c.unregister_cuda_shared_memory()                       # CUDA regions only: "taken" stays
        assert [r["name"] for r in c.get_system_shared_memory_status()] == ["taken"]
        c.unregister_system_shared_memory()


# --- 4. the inline fallbacks -------------------------------------------------------------------

def test_inline_fallbacks_give_the_same_results(local_daemon: Daemon, monkeypatch: pytest.MonkeyPatch) -> None:
    ipc, tcp = local_daemon.urls
    x = np.random.default_rng(4).standard_normal(MiB, dtype=np.float32)              # 4 MiB
    with Client(ipc, timeout=30) as c:
        expected = c.infer("identity", {"INPUT__0": x}, copy=True)["OUTPUT__0"]
        sums = c.infer("addsub", ADDSUB, copy=True)
        assert c.is_local
    np.testing.assert_array_equal(expected, x)

    def inline_client(url: str, **kwargs) -> None:
        with Client(url, timeout=30, **kwargs) as c:
            lent0 = lent_total(c)
            out = c.infer("identity", {"INPUT__0": x})
            assert not c.is_local and c.session is None
            np.testing.assert_array_equal(out["OUTPUT__0"], expected)
            assert not isinstance(backing(out["OUTPUT__0"]), mmap.mmap)
            small = c.infer("addsub", ADDSUB)
            assert all(np.array_equal(small[k], sums[k]) for k in sums)
            assert c.transfer_stats() == {"bytes_copied": 0, "bytes_zero_copy": 0,
                                          "bytes_inline": x.nbytes + A.nbytes + B.nbytes}
            assert lent_total(c) == lent0
            buf = c.empty((16,), "FP32")                       # an ordinary array without a session
            assert buf.flags.writeable and not mapped_file(buf).startswith("/dev/shm")
            buf[:] = 7
            np.testing.assert_array_equal(c.infer("identity", {"INPUT__0": buf})["OUTPUT__0"], buf)

    inline_client(ipc, local=False)
    inline_client(tcp, local=False)
    monkeypatch.setenv("TORCHPOOL_LOCAL", "0")
    inline_client(ipc)
    monkeypatch.delenv("TORCHPOOL_LOCAL")
    # the transport does not matter: over tcp:// on the same host the client is local too
    with Client(tcp, timeout=30) as c:
        np.testing.assert_array_equal(c.infer("identity", {"INPUT__0": x})["OUTPUT__0"], expected)
        assert c.is_local and c.transfer_stats()["bytes_copied"] == x.nbytes


# --- 5. lifetime ---------------------------------------------------------------------------------

def test_closing_a_client_unlinks_its_arena(local_daemon: Daemon) -> None:
    def opened(make) -> tuple[object, set]:
        before = client_arenas(local_daemon)
        client = make()
        mine = client_arenas(local_daemon) - before
        assert len(mine) == 1
        return client, mine

    def sync_client() -> Client:
        c = Client(local_daemon.url, timeout=30)
        np.testing.assert_array_equal(c.infer("addsub", ADDSUB)["OUTPUT0"], A + B)
        assert c.is_local
        return c

    c, mine = opened(sync_client)
    c.close()
    wait_for(lambda: released_by(local_daemon)(mine), CLOSED, "close() to unlink the arena")
    c, mine = opened(sync_client)
    del c                                   # forgotten, never closed
    gc.collect()
    wait_for(lambda: released_by(local_daemon)(mine), CLOSED, "a forgotten client's arena to be unlinked")

    async def main() -> None:
        async def async_client() -> AsyncClient:
            ac = AsyncClient(local_daemon.url, timeout=30)
            np.testing.assert_array_equal((await ac.infer("addsub", ADDSUB))["OUTPUT0"], A + B)
            assert ac.is_local
            return ac

        for how in ("aclose", "close"):
            before = client_arenas(local_daemon)
            ac = await async_client()
            mine = client_arenas(local_daemon) - before
            assert len(mine) == 1
            if how == "aclose":
                await ac.aclose()
            else:
                ac.close()
            wait_for(lambda: released_by(local_daemon)(mine), CLOSED, f"AsyncClient.{how}() to unlink the arena")

    asyncio.run(main())


KILLED_CLIENT = r"""
import sys
import numpy as np
sys.path.insert(0, {root!r})
from torchpool import Client
c = Client({url!r}, timeout=60)
held = c.infer("identity", {{"INPUT__0": np.arange(1 << 18, dtype=np.float32)}})     # 1 MiB, lent
assert c.is_local and held["OUTPUT__0"][7] == 7
print("holding", flush=True)
# with a priority: through the daemon (a model without batching ignores it), which
# holds the session while it runs (a direct path to the worker would end the
# session with the client at once)
c.infer("slow", {{"INPUT__0": np.array([{n}], np.int64)}}, priority=1)
print("finished", flush=True)
"""


def test_killed_client_has_its_arena_released(short_lease_daemon: Daemon) -> None:
    d = short_lease_daemon
    slow_worker = worker_pids(d.log(), "slow")[0]
    before = client_arenas(d)
    proc = subprocess.Popen([sys.executable, "-c", KILLED_CLIENT.format(root=str(ROOT), url=d.url,
                                                                        n=slow_iterations(1.5))],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "holding"
        mine = client_arenas(d) - before
        assert len(mine) == 1
        ticks = cpu_ticks(slow_worker)
        wait_for(lambda: cpu_ticks(slow_worker) >= ticks + 10, 15, "the client's slow request to run")
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
    assert proc.returncode == -9
    served = []

    def serve_once() -> bool:
        out = c.infer("identity", {"INPUT__0": np.full(MiB // 4, len(served), np.float32)})
        assert out["OUTPUT__0"].min() == out["OUTPUT__0"].max() == len(served)
        served.append(1)
        return True

    with Client(d.url, timeout=30) as c:
        # its request finishes for nobody; it held a lent output, so the session lasts ten
        # leases (1 s here), then the daemon unlinks the arena; others are served meanwhile
        wait_for(lambda: serve_once() and released_by(short_lease_daemon)(mine), 40,
                 "the killed client's arena to be released", interval=0.1)
        assert len(served) > 5 and c.is_local
        np.testing.assert_array_equal(c.infer("addsub", ADDSUB)["OUTPUT0"], A + B)


def test_an_expired_session_is_renewed_transparently(short_lease_daemon: Daemon, region_segment) -> None:
    d = short_lease_daemon
    key, mm = region_segment
    np.frombuffer(mm, np.float32, 16, 0)[:] = A.reshape(-1)
    before = client_arenas(d)
    with Client(d.url, timeout=30) as c:
        np.testing.assert_array_equal(c.infer("addsub", ADDSUB)["OUTPUT0"], A + B)   # inline: nothing lent
        first = c.session
        mine = client_arenas(d) - before
        assert c.is_local and len(mine) == 1
        buf = c.empty((MiB // 4,), "FP32")                         # an empty() buffer held across it
        buf[:] = np.arange(buf.size, dtype=np.float32)
        c.register_system_shared_memory("r", key, 4096)
        # idle past the lease: the daemon closes the session and unlinks its arena
        wait_for(lambda: released_by(short_lease_daemon)(mine), 15, "the idle session to expire")
        out = c.infer("identity", {"INPUT__0": buf})
        np.testing.assert_array_equal(out["OUTPUT__0"], np.arange(buf.size, dtype=np.float32))
        assert c.session not in (None, first) and c.is_local
        assert len(client_arenas(d) - before - mine) == 1
        # the region came along to the new session
        assert [s["name"] for s in c.get_system_shared_memory_status()] == ["r"]
        res = c.infer("addsub", {"INPUT0": SharedMemoryRef("r", 64, 0, "FP32", (1, 16)), "INPUT1": B})
        np.testing.assert_array_equal(res["OUTPUT0"], A + B)
        del out
        # the new arena serves empty() and copies again
        buf2 = c.empty((MiB // 4,), "FP32")
        buf2[:] = 5
        s0 = c.transfer_stats()
        assert c.infer("identity", {"INPUT__0": buf2})["OUTPUT__0"][9] == 5
        assert delta(c.transfer_stats(), s0)["bytes_zero_copy"] == MiB


# --- 6. AsyncClient ---------------------------------------------------------------------------

def test_async_client_concurrent_local_infers(local_daemon: Daemon) -> None:
    before = client_arenas(local_daemon)
    n = MiB // 4

    async def main() -> set:
        async with AsyncClient(local_daemon.url, timeout=30) as c:
            xs = [np.arange(n, dtype=np.float32) + i * n for i in range(32)]        # 1 MiB each, distinct
            t0 = (await c.server_metadata())["transfer"]
            outs = await asyncio.gather(*(c.infer("identity", {"INPUT__0": x}) for x in xs))
            assert c.is_local
            for x, out in zip(xs, outs):
                np.testing.assert_array_equal(out["OUTPUT__0"], x)
            assert len({o["OUTPUT__0"].__array_interface__["data"][0] for o in outs}) == 32
            stats = c.transfer_stats()
            assert stats["bytes_copied"] + stats["bytes_inline"] == 32 * MiB and stats["bytes_copied"] > 0
            t1 = (await c.server_metadata())["transfer"]
            moved = {k: t1.get(k, 0) - t0.get(k, 0) for k in ("output_bytes_lent", "output_bytes_reused",
                                                              "output_bytes_sent")}
            # every output is its input: what went through the arena came back in
            # the same block, the rest (inline while the arena was full) was sent
            # back from the block the broker had copied it into; no output copy
            assert moved == {"output_bytes_lent": 0, "output_bytes_reused": 32 * MiB,
                             "output_bytes_sent": stats["bytes_inline"]}
            mine = client_arenas(local_daemon) - before
            # the arena (8 MiB at first) grows for what is in flight, not once per waiting request
            assert sum(size for n, size in memfds(local_daemon.proc.pid).items() if n in mine) <= 8 * MiB + 32 * MiB
            # empty() as a coroutine: sent with no copy
            buf = await c.empty((n,), "FP32")
            buf[:] = -1
            s0 = c.transfer_stats()
            out = await c.infer("identity", {"INPUT__0": buf})
            assert out["OUTPUT__0"].min() == out["OUTPUT__0"].max() == -1
            assert delta(c.transfer_stats(), s0) == {"bytes_copied": 0, "bytes_zero_copy": MiB, "bytes_inline": 0}
            # the 32 outputs are still intact
            for x, o in zip(xs, outs):
                np.testing.assert_array_equal(o["OUTPUT__0"], x)
            return mine

    mine = asyncio.run(main())
    assert mine
    wait_for(lambda: released_by(local_daemon)(mine), CLOSED, "`async with` to unlink the arena")
