"""The daemon's side of the local shared-memory path, spoken by hand
(docs/protocol.md, "Shared memory"): every rejection the issue lists, with a
real daemon, real segments and a short client lease."""
from __future__ import annotations

import mmap
import os
import secrets
import signal
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import posix_ipc
import pytest

from ..support.daemon import Daemon, RawConnection, wait_for

BLOCK = struct.Struct("<IIQQ")
MAGIC = 0x31425054
BOOT_ID = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
A = np.arange(16, dtype=np.float32).reshape(1, 16)
B = np.full((1, 16), 3, dtype=np.float32)


@pytest.fixture(scope="module")
def shm_daemon(small_repository: Path, tmp_path_factory: pytest.TempPathFactory):
    d = Daemon(small_repository, tmp_path_factory.mktemp("shm"), "--client-lease", "3",
               "--client-shm-size", "1M").start()
    yield d
    assert d.stop() == 0, d.log()


class Session:
    """A hand-made local session: the arena mapped, blocks written by hand."""

    def __init__(self, url: str, boot_id: str = BOOT_ID) -> None:
        self.rc = RawConnection(url)
        self.ids = iter(range(1, 1 << 30))
        self.result = self.call("hello", boot_id=boot_id, local=True)["result"]
        self.token = self.result["session"]
        self.maps = {}
        for a in self.result["arena"]:
            shm = posix_ipc.SharedMemory("/" + a["segment"])
            self.maps[a["segment"]] = mmap.mmap(shm.fd, shm.size)
            shm.close_fd()
        self.segment = next(iter(self.maps), None)

    def call(self, op: str, **fields) -> dict:
        header = {"v": 1, "op": op, "id": next(self.ids), **fields}
        if getattr(self, "token", None) and "session" not in fields:
            header["session"] = self.token
        return self.rc.call(self.rc.pack(header))[0]

    def put(self, offset: int, arr: np.ndarray, generation: int) -> list:
        mm = self.maps[self.segment]
        BLOCK.pack_into(mm, offset, MAGIC, 0, generation, arr.nbytes)
        mm[offset + 64:offset + 64 + arr.nbytes] = arr.tobytes()
        return [self.segment, offset + 64, arr.nbytes, generation]

    def infer(self, model: str, inputs: list, **fields) -> dict:
        return self.call("infer", model=model, version="", inputs=inputs, **fields)

    def close(self) -> None:
        for mm in self.maps.values():
            mm.close()
        self.rc.close()


def tensor(name: str, ref_key: str, ref, arr=A, datatype="FP32") -> dict:
    return {"name": name, "datatype": datatype, "shape": list(arr.shape), ref_key: ref}


@pytest.fixture
def session(shm_daemon: Daemon):
    s = Session(shm_daemon.url)
    yield s
    s.call("goodbye")
    s.close()


@pytest.fixture
def region(session: Session):
    """A client-owned segment registered as 'r' (the test unlinks it)."""
    key = f"tp-test-region-{os.getpid()}-{secrets.token_hex(4)}"
    shm = posix_ipc.SharedMemory("/" + key, posix_ipc.O_CREX, mode=0o600, size=8192)
    mm = mmap.mmap(shm.fd, 8192)
    shm.close_fd()
    token = secrets.token_bytes(16)
    mm[0:16] = token
    answer = session.call("register_system_shared_memory", name="r", key=key, byte_size=8192, offset=0,
                          token=token)
    assert answer["ok"], answer
    yield key, mm
    session.call("unregister_system_shared_memory", name=None)
    mm.close()
    posix_ipc.unlink_shared_memory("/" + key)


def transfer(s: Session) -> dict:
    return s.call("server_metadata")["result"]["transfer"]


# --- sessions and the automatic local path -------------------------------------

def test_hello_gives_a_private_daemon_owned_arena(session: Session) -> None:
    r = session.result
    assert r["local"] is True and r["block_header"] == 64 and len(r["session"]) == 32
    seg = Path("/dev/shm") / session.segment
    assert seg.stat().st_mode & 0o777 == 0o600
    assert seg.stat().st_size == r["arena"][0]["size"] == 1 << 20


def test_another_host_gets_no_arena(shm_daemon: Daemon) -> None:
    s = Session(shm_daemon.url, boot_id="not-this-host")
    try:
        assert s.result["local"] is False and s.result["arena"] == []
        bad = s.infer("addsub", [tensor("INPUT0", "shm", ["x", 64, 64, 1]), tensor("INPUT1", "data", B.tobytes())])
        assert bad["error"]["code"] == "INVALID_ARG" and "local session" in bad["error"]["message"]
    finally:
        s.call("goodbye")
        s.close()


def test_descriptor_inputs_are_used_in_place(session: Session) -> None:
    before = transfer(session)
    ans = session.infer("addsub", [tensor("INPUT0", "shm", session.put(0, A, 1)),
                                   tensor("INPUT1", "shm", session.put(256, B, 2))], output_shm=True)
    assert ans["ok"], ans
    after = transfer(session)
    assert after.get("input_bytes_copied", 0) == before.get("input_bytes_copied", 0)   # no copy in
    assert after["input_bytes_in_place"] - before.get("input_bytes_in_place", 0) == 128
    outs = {o["name"]: o for o in ans["outputs"]}
    # outputs this small come back inline even to a local client (cheaper than lending)
    np.testing.assert_array_equal(np.frombuffer(outs["OUTPUT0"]["data"], np.float32).reshape(1, 16), A + B)


BIG = np.arange(8192, dtype=np.float32)          # 32 KiB: lent in place


def test_large_outputs_are_lent_in_place_until_released(session: Session) -> None:
    ans = session.infer("identity", [tensor("INPUT__0", "shm", session.put(0, BIG, 1), BIG)], output_shm=True)
    assert ans["ok"], ans
    seg, off, n, gen = ans["outputs"][0]["shm"]
    shm = posix_ipc.SharedMemory("/" + seg, posix_ipc.O_RDONLY)
    mm = mmap.mmap(shm.fd, shm.size, prot=mmap.PROT_READ)
    shm.close_fd()
    np.testing.assert_array_equal(np.frombuffer(mm, np.float32, count=n // 4, offset=off), BIG)
    # while lent, the block is never reused: another request gets other memory
    again = session.infer("identity", [tensor("INPUT__0", "shm", session.put(0, BIG * 2, 2), BIG)],
                          output_shm=True)
    assert again["outputs"][0]["shm"][:2] != [seg, off]
    np.testing.assert_array_equal(np.frombuffer(mm, np.float32, count=n // 4, offset=off), BIG)
    # a release that matches nothing lent (wrong generation) frees nothing and is ignored
    assert session.call("server_live", release=[[seg, off, gen + 1000]])["ok"]
    o2 = again["outputs"][0]["shm"]
    assert session.call("server_live", release=[[seg, off, gen], [o2[0], o2[1], o2[3]]])["ok"]
    # released: the worker may reuse the block now
    third = session.infer("identity", [tensor("INPUT__0", "shm", session.put(0, BIG, 3), BIG)], output_shm=True)
    assert third["outputs"][0]["shm"][:2] in ([seg, off], o2[:2])
    session.call("server_live", release=[[x for i, x in enumerate(third["outputs"][0]["shm"]) if i != 2]])
    del mm


def test_an_output_that_is_its_reusable_input_points_back_into_the_block(session: Session) -> None:
    before = transfer(session)
    ref = session.put(0, BIG, 11)
    entry = tensor("INPUT__0", "shm", ref, BIG)
    ans = session.infer("identity", [{**entry, "reuse": True}], output_shm=True)
    assert ans["ok"], ans
    out = ans["outputs"][0]
    # identity returned its input: the answer is the client's own range, nothing to release
    assert out["own"] == ref[:3] and "shm" not in out and "data" not in out
    after = transfer(session)
    assert after["output_bytes_reused"] - before.get("output_bytes_reused", 0) == BIG.nbytes
    assert after.get("output_bytes_lent", 0) == before.get("output_bytes_lent", 0)
    # without `reuse` (e.g. an empty() block the caller keeps writing) it is lent from the worker
    plain = session.infer("identity", [tensor("INPUT__0", "shm", session.put(0, BIG, 12), BIG)],
                          output_shm=True)["outputs"][0]
    assert "own" not in plain and plain["shm"][0] != session.segment
    session.call("server_live", release=[[x for i, x in enumerate(plain["shm"]) if i != 2]])
    # a model that makes a new tensor writes it out, whatever the flag says
    cloned = session.infer("clone", [{**tensor("INPUT__0", "shm", session.put(0, BIG, 13), BIG), "reuse": True}],
                           output_shm=True)["outputs"][0]
    assert "own" not in cloned and cloned["shm"][0] != session.segment
    session.call("server_live", release=[[x for i, x in enumerate(cloned["shm"]) if i != 2]])


def test_stale_block_generation_is_an_error_never_wrong_data(session: Session) -> None:
    ref = session.put(0, A, 7)
    session.put(0, A, 8)                                 # the client reused the block
    ans = session.infer("addsub", [tensor("INPUT0", "shm", ref), tensor("INPUT1", "data", B.tobytes())])
    assert ans["error"]["code"] == "INVALID_ARG" and "stale descriptor" in ans["error"]["message"]


@pytest.mark.parametrize("offset,nbytes", [(1 << 20, 64), ((1 << 20) - 32, 64), (2**63, 64),
                                           (2**64 - 1, 64), (64, 2**64 - 1), (-64, 64), (8, 64)])
def test_out_of_bounds_and_overflowing_descriptors_are_refused(session: Session, offset: int, nbytes: int) -> None:
    ans = session.infer("addsub", [tensor("INPUT0", "shm", [session.segment, offset, nbytes, 1]),
                                   tensor("INPUT1", "data", B.tobytes())])
    assert ans["error"]["code"] == "INVALID_ARG", ans
    assert session.infer("addsub", [tensor("INPUT0", "data", A.tobytes()),
                                    tensor("INPUT1", "data", B.tobytes())])["ok"]


def test_a_segment_of_another_session_is_refused(shm_daemon: Daemon, session: Session) -> None:
    other = Session(shm_daemon.url)
    try:
        ref = other.put(0, A, 1)
        ans = session.infer("addsub", [tensor("INPUT0", "shm", ref), tensor("INPUT1", "data", B.tobytes())])
        assert ans["error"]["code"] == "INVALID_ARG" and "not part of this session" in ans["error"]["message"]
        no_session = RawConnection(shm_daemon.url)
        h = no_session.call(no_session.pack({"v": 1, "op": "infer", "id": 1, "model": "addsub", "version": "",
                                             "inputs": [tensor("INPUT0", "shm", ref),
                                                        tensor("INPUT1", "data", B.tobytes())]}))[0]
        no_session.close()
        assert "need a local session" in h["error"]["message"]
    finally:
        other.call("goodbye")
        other.close()


def test_unknown_session_is_session_lost(shm_daemon: Daemon) -> None:
    with RawConnection(shm_daemon.url) as rc:
        h = rc.call(rc.pack({"v": 1, "op": "server_live", "id": 1, "session": "0" * 32}))[0]
    assert h["error"]["code"] == "SESSION_LOST" and "hello again" in h["error"]["message"]


# --- registered regions ---------------------------------------------------------------

def test_region_inputs_and_outputs(session: Session, region) -> None:
    _key, mm = region
    mm[64:128] = A.tobytes()
    mm[128:192] = B.tobytes()
    ans = session.infer("addsub", [tensor("INPUT0", "region", ["r", 64, 64]),
                                   tensor("INPUT1", "region", ["r", 64, 128])],
                        outputs=[{"name": "OUTPUT0", "region": ["r", 64, 4096]}, "OUTPUT1"])
    assert ans["ok"], ans
    outs = {o["name"]: o for o in ans["outputs"]}
    assert outs["OUTPUT0"]["region"] == ["r", 64, 4096] and "data" not in outs["OUTPUT0"]
    np.testing.assert_array_equal(np.frombuffer(mm, np.float32, 16, 4096), (A + B).reshape(-1))
    np.testing.assert_array_equal(np.frombuffer(outs["OUTPUT1"]["data"], np.float32), (A - B).reshape(-1))
    status = session.call("get_system_shared_memory_status", name="r")["result"]
    assert status[0]["byte_size"] == 8192 and status[0]["in_use"] == 0


def test_region_output_too_small(session: Session, region) -> None:
    ans = session.infer("addsub", [tensor("INPUT0", "data", A.tobytes()), tensor("INPUT1", "data", B.tobytes())],
                        outputs=[{"name": "OUTPUT0", "region": ["r", 32, 0]}])
    assert ans["error"]["code"] == "INVALID_ARG" and "needs 64 bytes" in ans["error"]["message"]


@pytest.mark.parametrize("nbytes,offset", [(64, 8190), (64, 2**63), (2**64 - 1, 0), (64, -1)])
def test_region_bounds_on_every_request(session: Session, region, nbytes: int, offset: int) -> None:
    ans = session.infer("addsub", [tensor("INPUT0", "region", ["r", nbytes, offset]),
                                   tensor("INPUT1", "data", B.tobytes())])
    assert ans["error"]["code"] == "INVALID_ARG", ans
    assert region[0] not in ans["error"]["message"]


def test_shrunk_segment_is_an_error_not_a_crash(session: Session, region) -> None:
    key, _mm = region
    fd = posix_ipc.SharedMemory("/" + key).fd
    os.ftruncate(fd, 4096)
    os.close(fd)
    ans = session.infer("addsub", [tensor("INPUT0", "region", ["r", 64, 6000]),
                                   tensor("INPUT1", "data", B.tobytes())])
    assert ans["error"]["code"] == "INVALID_ARG" and "smaller than registered" in ans["error"]["message"]
    assert session.call("server_live")["result"] is True


def _make_segment(size: int = 4096) -> tuple[str, mmap.mmap]:
    key = f"tp-test-foreign-{os.getpid()}-{secrets.token_hex(4)}"
    shm = posix_ipc.SharedMemory("/" + key, posix_ipc.O_CREX, mode=0o600, size=size)
    mm = mmap.mmap(shm.fd, size)
    shm.close_fd()
    return key, mm


def test_registration_rejections_never_echo_the_key(session: Session) -> None:
    key, mm = _make_segment()
    try:
        token = secrets.token_bytes(16)
        cases = {
            "no proof": dict(key=key, byte_size=4096, offset=0, token=token),       # token not written
            "reserved": dict(key="torchpool.deadbeef.1.in0", byte_size=4096, offset=0, token=token),
            "missing": dict(key=key + "-missing", byte_size=4096, offset=0, token=token),
            "too big": dict(key=key, byte_size=4097, offset=0, token=token),
            "overflow": dict(key=key, byte_size=2**64 - 1, offset=1, token=token),
            "negative": dict(key=key, byte_size=64, offset=-1, token=token),
        }
        for what, fields in cases.items():
            ans = session.call("register_system_shared_memory", name="x", **fields)
            assert ans["error"]["code"] == "INVALID_ARG", (what, ans)
            assert key not in ans["error"]["message"], (what, ans)
        mm[0:16] = token
        assert session.call("register_system_shared_memory", name="x", key=key, byte_size=4096, offset=0,
                            token=token)["ok"]
        dup = session.call("register_system_shared_memory", name="x", key=key, byte_size=4096, offset=0,
                           token=token)
        assert dup["error"]["code"] == "ALREADY_EXISTS"
        assert session.call("unregister_system_shared_memory", name="x")["ok"]
    finally:
        mm.close()
        posix_ipc.unlink_shared_memory("/" + key)
    assert not (Path("/dev/shm") / key).exists()     # the test unlinked it, not the daemon


def test_regions_belong_to_their_session(shm_daemon: Daemon, session: Session, region) -> None:
    other = Session(shm_daemon.url)
    try:
        ans = other.infer("addsub", [tensor("INPUT0", "region", ["r", 64, 0]), tensor("INPUT1", "data", B.tobytes())])
        assert ans["error"]["code"] == "INVALID_ARG" and "no region 'r'" in ans["error"]["message"]
        assert other.call("get_system_shared_memory_status", name=None)["result"] == []
    finally:
        other.call("goodbye")
        other.close()


def test_unregister_in_flight_is_deferred(session: Session, region) -> None:
    from ..support.model_repository import slow_iterations

    _key, mm = region
    mm[64:72] = np.array([slow_iterations(0.5)], np.int64).tobytes()
    session.rc.send(session.rc.pack({"v": 1, "op": "infer", "id": 999, "session": session.token, "model": "slow",
                                     "version": "", "inputs": [{"name": "INPUT__0", "datatype": "INT64",
                                                                "shape": [1], "region": ["r", 8, 64]}],
                                     "outputs": [{"name": "OUTPUT__0", "region": ["r", 8, 256]}]}))
    wait_for(lambda: session.call("get_system_shared_memory_status", name="r")["result"][0]["in_use"] == 2,
             10, "the slow request to hold the region")
    assert session.call("unregister_system_shared_memory", name="r")["ok"]
    status = session.call("get_system_shared_memory_status", name=None)["result"]
    assert status and status[0]["unregistering"] is True
    answers = {}
    wait_for(lambda: answers.setdefault("x", session.rc.recv(30)[0]), 30, "the slow answer")
    assert answers["x"]["id"] == 999 and answers["x"]["ok"], answers
    # the model wrote its output straight into the region
    assert np.frombuffer(mm, np.int64, 1, 256)[0] == np.frombuffer(mm, np.int64, 1, 64)[0]
    assert session.call("get_system_shared_memory_status", name=None)["result"] == []


# --- clients that vanish -----------------------------------------------------------------

CLIENT = r"""
import signal, sys
sys.path.insert(0, {root!r})
from tests.e2e.test_e2e_shm_protocol import Session, tensor
import numpy as np
s = Session({url!r})
print(s.segment, flush=True)
s.rc.send(s.rc.pack({{"v": 1, "op": "infer", "id": 1, "session": s.token, "model": "slow", "version": "",
                      "inputs": [tensor("INPUT__0", "shm", s.put(0, np.array([{n}], np.int64), 1),
                                        np.array([{n}], np.int64), "INT64")]}}))
signal.pause()   # until the test kills us
"""


def test_client_killed_mid_request_has_its_arena_released(shm_daemon: Daemon) -> None:
    from ..support.model_repository import slow_iterations

    root = str(Path(__file__).resolve().parent.parent)
    proc = subprocess.Popen([sys.executable, "-c", CLIENT.format(root=root, url=shm_daemon.url,
                                                                 n=slow_iterations(0.3))],
                            stdout=subprocess.PIPE, text=True)
    segment = proc.stdout.readline().strip()
    assert segment and (Path("/dev/shm") / segment).exists()
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    proc.stdout.close()
    # the request finishes for nobody; the lease (3 s) runs out; the daemon unlinks the arena
    wait_for(lambda: not (Path("/dev/shm") / segment).exists(), 20, "the dead client's arena to be released")
    fresh = Session(shm_daemon.url)
    try:
        ans = fresh.infer("addsub", [tensor("INPUT0", "shm", fresh.put(0, A, 1)),
                                     tensor("INPUT1", "data", B.tobytes())])
        np.testing.assert_array_equal(np.frombuffer(ans["outputs"][0]["data"], np.float32).reshape(1, 16), A + B)
    finally:
        fresh.call("goodbye")
        fresh.close()
