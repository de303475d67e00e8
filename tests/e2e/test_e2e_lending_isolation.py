"""Two local users of one model instance: what one can see and change of the other's.

Client A is this process (root, the daemon's user). Client B is a forked
child that drops to another uid (in the daemon's group, so the side channel
lets it attach: the attacker of issues 31 and 32). Both call the same
instance of a model whose request makes an intermediate copy of its input
and returns a new tensor, with 1 MiB inputs that carry a secret pattern.

Before worker/lending.py, B was lent outputs in the worker's capture region,
which also held A's outputs and intermediates: B found A's pattern there.
And a memfd's inode has mode 0777, so B could reopen its read-only fd
through /proc writable and change A's answers. Now B is lent only its own
area, sealed against writes (F_SEAL_FUTURE_WRITE): whatever B maps, it finds
nothing of A's, and nothing it tries changes A's answers.
"""
from __future__ import annotations

import ctypes
import errno
import json
import mmap
import os
import re
import shutil
import tempfile
import traceback
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import pytest
from torch import Tensor, nn

from torchpool.client import Client
from torchpool.examples import IDENTITY_CONFIG, serialize, write_model

from ..support.daemon import Daemon, worker_pids
from ..support.mappings import mapped_file
from .test_e2e_shm_protocol import Session, tensor

pytest.importorskip("torchpool.worker._outcapture", reason="the _outcapture extension is not built")
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="switching to another uid needs root")

LIBC = ctypes.CDLL(None, use_errno=True)
LIBC.mmap.restype = ctypes.c_void_p
LIBC.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
LIBC.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
LIBC.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
OTHER_UID = 54321          # a uid nobody has: the kernel needs no account for it
MiB = 1 << 20
FLOATS = MiB // 4


class CopiesThenScales(nn.Module):
    """An intermediate copy of the input (freed in forward), and a new output."""

    def forward(self, x: Tensor) -> Tensor:
        kept = x.clone()
        return kept * 1


def secret_input(seed: int) -> tuple[np.ndarray, bytes]:
    """1 MiB of one 16-byte pattern (exact under x * 1: finite floats)."""
    pattern = np.random.default_rng(seed).uniform(1.0, 2.0, 4).astype(np.float32)
    return np.tile(pattern, FLOATS // 4), pattern.tobytes()


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    repo = tmp_path_factory.mktemp("isolation_repository")
    write_model(repo, "mix", IDENTITY_CONFIG.replace('"identity"', '"mix"'), serialize(CopiesThenScales()))
    # the socket must be reachable by the other uid: a directory it can enter
    workdir = Path(tempfile.mkdtemp(prefix="torchpool-isolation-", dir="/tmp"))
    workdir.chmod(0o755)
    d = Daemon(repo, workdir, "--log-level", "debug").start()
    try:
        yield d
    finally:
        code = d.stop()
        shutil.rmtree(workdir, ignore_errors=True)
        assert code == 0, d.log()


def as_other_uid(fn: Callable[..., Any], *args: Any) -> Any:
    """Run `fn(*args)` in a forked child as OTHER_UID (groups: the daemon's, 0)
    and return what it returns (JSON); its exception fails the test."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(read)
            os.setgroups([0])
            os.setgid(OTHER_UID)
            os.setuid(OTHER_UID)
            result = {"ok": fn(*args)}
        except BaseException:
            result = {"error": traceback.format_exc()}
        with os.fdopen(write, "w") as f:
            json.dump(result, f)
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        data = f.read()
    os.waitpid(pid, 0)
    result = json.loads(data)
    assert "error" not in result, result["error"]
    return result["ok"]


def attack(url: str, secret: bytes, worker: int) -> dict:
    """B's side: use the model as any client does, then map every fd the daemon
    handed over, look for A's pattern in all of it, and try to write it all."""
    assert os.geteuid() == OTHER_UID
    s = Session(url)
    seen: dict = {"lent": 0, "found": [], "writable": [], "fds": 0}
    own, own_pattern = secret_input(2)
    for i in range(3):
        ans = s.infer("mix", [tensor("INPUT__0", "shm", s.put(0, own, i + 1), own)], output_shm=True)
        assert ans["ok"], ans
        out = ans["outputs"][0]
        if "shm" in out:
            seen["lent"] += 1
            seg, off, n, _ = out["shm"]
            got = np.frombuffer(s.output(seg), np.float32, count=n // 4, offset=off)
            assert got.tobytes()[:16] == own_pattern
    s.receive_pushed()
    seen["fds"] = len(s.fds)
    for name, fd in s.fds.items():
        size = os.fstat(fd).st_size
        with mmap.mmap(fd, size, prot=mmap.PROT_READ) as mm:
            if mm.find(secret) >= 0:
                seen["found"].append(name)
        # writable, by any way there is: the fd itself, reopened through /proc, mprotect
        try:
            rw = os.open(f"/proc/self/fd/{fd}", os.O_RDWR)
        except OSError:
            rw = -1
        for target in ([fd, rw] if rw >= 0 else [fd]):
            try:
                mmap.mmap(target, size, prot=mmap.PROT_READ | mmap.PROT_WRITE).close()
                seen["writable"].append(f"{name}: mmap")
            except OSError:
                pass
            try:
                os.pwrite(target, b"x", 0)
                seen["writable"].append(f"{name}: pwrite")
            except OSError:
                pass
        if rw >= 0:
            os.close(rw)
    # the daemon's and the worker's own fds are not B's to open
    for pid in (os.getppid(), worker):
        try:
            os.listdir(f"/proc/{pid}/fd")
            seen["writable"].append(f"/proc/{pid}/fd listed")
        except OSError:
            pass
    s.call("goodbye")
    s.close()
    return seen


def test_another_uid_sees_nothing_of_a_clients_data_and_changes_none_of_it(shared: Daemon) -> None:
    x, secret = secret_input(1)
    worker = worker_pids(shared.log(), "mix")[0]
    with Client(shared.url, timeout=60) as a:
        held = [a.infer("mix", {"INPUT__0": x})["OUTPUT__0"] for _ in range(3)]   # A keeps its outputs
        assert all(mapped_file(h).endswith(" (deleted)") for h in held), "A's outputs were not lent"
        seen = as_other_uid(attack, shared.url, secret, worker)
        # B was lent its own outputs, and saw none of A's inputs, outputs or intermediates
        assert seen["lent"] == 3 and seen["fds"] >= 2, seen
        assert seen["found"] == [], f"B found A's data in {seen['found']}"
        # nothing B was handed could be written, its own arena aside (its inputs: its to write)
        others = [w for w in seen["writable"] if not re.search(r"\.c\d+: ", w)]
        assert others == [], seen["writable"]
        # A's answers are what they were, and A is served as before
        for h in held:
            np.testing.assert_array_equal(h, x)
        np.testing.assert_array_equal(a.infer("mix", {"INPUT__0": x * 2})["OUTPUT__0"], x * 2)
    assert worker_pids(shared.log(), "mix")[0] == worker


def test_a_lent_output_cannot_be_reopened_writable(shared: Daemon) -> None:
    """Even its own client cannot write an output lent to it: the fd of the
    area reopened through /proc is refused writable mappings and writes."""
    x, _ = secret_input(3)
    s = Session(shared.url)
    try:
        ans = s.infer("mix", [tensor("INPUT__0", "shm", s.put(0, x, 1), x)], output_shm=True)
        seg, off, n, _ = ans["outputs"][0]["shm"]
        mm = s.output(seg)
        fd = s.fds[seg]
        rw = os.open(f"/proc/self/fd/{fd}", os.O_RDWR)      # the inode's mode allows it...
        try:
            with pytest.raises(PermissionError):           # ...but the seal does not
                mmap.mmap(rw, os.fstat(rw).st_size, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            with pytest.raises(PermissionError):
                os.pwrite(rw, b"x", off)
            # nor can a read-only mapping of it be made writable afterwards
            size = os.fstat(rw).st_size
            address = LIBC.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, rw, 0)
            assert address not in (None, ctypes.c_void_p(-1).value)
            try:
                assert LIBC.mprotect(ctypes.c_void_p(address), size, mmap.PROT_READ | mmap.PROT_WRITE) == -1
                assert ctypes.get_errno() == errno.EACCES
            finally:
                LIBC.munmap(ctypes.c_void_p(address), size)
        finally:
            os.close(rw)
        np.testing.assert_array_equal(np.frombuffer(mm, np.float32, count=n // 4, offset=off), x)
    finally:
        s.call("goodbye")
        s.close()
