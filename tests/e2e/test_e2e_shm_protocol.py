"""The daemon's side of the local shared-memory path, spoken by hand
(docs/protocol.md, "Shared memory"): every rejection the issue lists, with a
real daemon, real segments and a short client lease.

Nothing here uses the client library: `hello` over ZeroMQ, then `attach` over
the daemon's unix side channel with plain `socket` (SOCK_SEQPACKET datagrams,
fds with `socket.recv_fds`), the arena and the workers' memory mapped from
the fds handed over it. This is the proof that a client in another language
can implement the protocol."""
from __future__ import annotations

import fcntl
import mmap
import os
import secrets
import signal
import socket
import stat
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

import msgpack
import numpy as np
import posix_ipc
import pytest

from ..support.daemon import Daemon, RawConnection, memfds, wait_for

BLOCK = struct.Struct("<IIQQ")
MAGIC = 0x31425054
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
A = np.arange(16, dtype=np.float32).reshape(1, 16)
B = np.full((1, 16), 3, dtype=np.float32)
MAX_REGIONS = 3


@pytest.fixture(scope="module")
def shm_daemon(small_repository: Path, tmp_path_factory: pytest.TempPathFactory):
    d = Daemon(small_repository, tmp_path_factory.mktemp("shm"), "--client-lease", "3",
               "--client-shm-size", "1M", "--client-shm-limit", "3M",
               "--max-regions-per-session", str(MAX_REGIONS)).start()
    yield d
    assert d.stop() == 0, d.log()


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


def attach_channel(path: str, token: Any, arena: bool = True, raw: Optional[bytes] = None
                   ) -> tuple[socket.socket, Any, list[int]]:
    """Connect to the side channel and send `attach` (or `raw` bytes): the
    socket, the answer datagram and the fds that came with it."""
    ch = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    ch.settimeout(10)
    ch.connect(path)
    ch.send(raw if raw is not None else pack({"op": "attach", "session": token, "arena": arena}))
    data, fds, flags, _ = socket.recv_fds(ch, 65536, 16)
    assert not flags & socket.MSG_CTRUNC
    return ch, unpack(data), fds


def closed_by_peer(ch: socket.socket) -> bool:
    """The daemon closed its end (recv sees the end of the stream)."""
    ch.settimeout(10)
    return ch.recv(4096) == b""


class Session:
    """A hand-made local session: hello, attach, the arena mapped from its fds,
    blocks written by hand; segments the daemon pushes later are received on
    the side channel before reading the answers that name them."""

    def __init__(self, url: str, attach: bool = True) -> None:
        self.rc = RawConnection(url)
        self.ids = iter(range(1, 1 << 30))
        self.result = self.call("hello", local=True)["result"]
        self.token = self.result["session"]
        self.maps: dict[str, mmap.mmap] = {}      # arena segments, read-write
        self.outputs: dict[str, mmap.mmap] = {}   # workers' memory, read-only
        self.fds: dict[str, int] = {}             # every fd handed to us, by segment
        self.pushed: list[tuple[str, int]] = []   # (segment, size) pushed after attach, in order
        self.channel: Optional[socket.socket] = None
        self.attached: Optional[dict] = None
        self.segment: Optional[str] = None
        if attach:
            self.channel, self.attached, fds = attach_channel(self.result["local_socket"], self.token)
            assert self.attached["ok"] and len(fds) == len(self.attached["arena"]), self.attached
            self.channel.setblocking(False)
            for a, fd in zip(self.attached["arena"], fds):
                self.fds[a["segment"]] = fd
                self.maps[a["segment"]] = mmap.mmap(fd, a["size"])
            self.segment = next(iter(self.maps), None)

    def call(self, op: str, **fields) -> dict:
        header = {"v": 1, "op": op, "id": next(self.ids), **fields}
        if getattr(self, "token", None) and "session" not in fields:
            header["session"] = self.token
        return self.rc.call(self.rc.pack(header))[0]

    def receive_pushed(self) -> None:
        """Take what the daemon pushed on the side channel (it sends a segment's
        fd before the answer naming it: by the time we read that, it is here)."""
        while True:
            try:
                data, fds, flags, _ = socket.recv_fds(self.channel, 65536, 16, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return
            assert data, "the daemon closed the side channel"
            assert not flags & socket.MSG_CTRUNC
            msg = unpack(data)
            assert len(msg["segments"]) == len(fds), msg
            for s, fd in zip(msg["segments"], fds):
                assert s["segment"] not in self.fds, f"{s['segment']} handed twice"
                self.fds[s["segment"]] = fd
                self.pushed.append((s["segment"], s["size"]))

    def map_grown(self, name: str) -> None:
        self.receive_pushed()
        fd = self.fds[name]
        self.maps[name] = mmap.mmap(fd, os.fstat(fd).st_size)

    def output(self, name: str) -> mmap.mmap:
        """A read-only map of the worker memory an output was lent in."""
        if name not in self.outputs:
            self.receive_pushed()
            fd = self.fds[name]
            self.outputs[name] = mmap.mmap(fd, os.fstat(fd).st_size, prot=mmap.PROT_READ)
        return self.outputs[name]

    def put(self, offset: int, arr: np.ndarray, generation: int, segment: Optional[str] = None) -> list:
        segment = segment or self.segment
        mm = self.maps[segment]
        BLOCK.pack_into(mm, offset, MAGIC, 0, generation, arr.nbytes)
        mm[offset + 64:offset + 64 + arr.nbytes] = arr.tobytes()
        return [segment, offset + 64, arr.nbytes, generation]

    def infer(self, model: str, inputs: list, **fields) -> dict:
        return self.call("infer", model=model, version="", inputs=inputs, **fields)

    def close(self) -> None:
        for mm in [*self.maps.values(), *self.outputs.values()]:
            try:
                mm.close()
            except BufferError:           # an array of the test still views it
                pass
        for fd in self.fds.values():
            os.close(fd)
        if self.channel is not None:
            self.channel.close()
        self.rc.close()


def tensor(name: str, ref_key: str, ref, arr=A, datatype="FP32") -> dict:
    return {"name": name, "datatype": datatype, "shape": list(arr.shape), ref_key: ref}


def register(s: Session, name: str, key: str, mm: mmap.mmap, byte_size: int, offset: int = 0) -> dict:
    """Register a region the way a client must: ask, write the daemon's nonce
    at the region's offset, answer with it."""
    ask = s.call("register_system_shared_memory", name=name, key=key, byte_size=byte_size, offset=offset)
    assert ask["ok"], ask
    nonce = ask["result"]["challenge"]
    assert isinstance(nonce, bytes) and len(nonce) == min(16, len(mm) - offset)
    mm[offset:offset + len(nonce)] = nonce
    return s.call("register_system_shared_memory", name=name, key=key, byte_size=byte_size, offset=offset,
                  challenge=nonce)


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
    answer = register(session, "r", key, mm, 8192)
    assert answer["ok"] and answer["result"] is True, answer
    yield key, mm
    session.call("unregister_system_shared_memory", name=None)
    mm.close()
    posix_ipc.unlink_shared_memory("/" + key)


def transfer(s: Session) -> dict:
    return s.call("server_metadata")["result"]["transfer"]


def release_of(ref: list) -> list:
    """[segment, offset, nbytes, generation] -> the release [segment, offset, generation]."""
    return [ref[0], ref[1], ref[3]]


# --- sessions and the automatic local path -------------------------------------

def test_hello_gives_a_private_daemon_owned_arena(shm_daemon: Daemon, session: Session) -> None:
    r = session.result
    assert r["local"] is False and r["block_header"] == 64 and len(r["session"]) == 32 and r["lease_s"] == 3
    assert "arena" not in r                                   # memory comes only over the side channel
    path = r["local_socket"]
    assert path == f"{shm_daemon.socket_path}.local"
    st = os.stat(path)
    assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o660
    a = session.attached
    assert a["block_header"] == 64 and [x["size"] for x in a["arena"]] == [1 << 20]
    fd = session.fds[session.segment]
    # an unnamed memfd, sealed: the client can write it but never resize it
    assert os.readlink(f"/proc/self/fd/{fd}") == f"/memfd:{session.segment} (deleted)"
    assert os.fstat(fd).st_size == 1 << 20
    assert fcntl.fcntl(fd, fcntl.F_GET_SEALS) & SEALS == SEALS
    for size in (4096, 2 << 20):
        with pytest.raises(PermissionError):
            os.ftruncate(fd, size)
    assert not (Path("/dev/shm") / session.segment).exists()
    assert memfds(shm_daemon.proc.pid).get(session.segment) == 1 << 20


def test_a_session_that_never_attaches_gets_no_arena(shm_daemon: Daemon, session: Session) -> None:
    """A client that cannot reach the side channel (another host, another
    container) has a session, but not the local path."""
    s = Session(shm_daemon.url, attach=False)
    try:
        assert s.result["local"] is False and s.maps == {} and s.channel is None
        for ref in (["x", 64, 64, 1], session.put(0, A, 1)):   # a made-up name; a real arena segment
            bad = s.infer("addsub", [tensor("INPUT0", "shm", ref), tensor("INPUT1", "data", B.tobytes())])
            assert bad["error"]["code"] == "INVALID_ARG" and "local session" in bad["error"]["message"]
        grow = s.call("arena_grow", size=4096)
        assert grow["error"]["code"] == "INVALID_ARG" and "local session" in grow["error"]["message"]
        reg = s.call("register_system_shared_memory", name="r", key="tp-test-anything", byte_size=64, offset=0)
        assert reg["error"]["code"] == "INVALID_ARG" and "local session" in reg["error"]["message"]
        # output_shm is not for it: outputs come inline
        ans = s.infer("identity", [tensor("INPUT__0", "data", BIG.tobytes(), BIG)], output_shm=True)
        assert ans["ok"] and "shm" not in ans["outputs"][0], ans
        np.testing.assert_array_equal(np.frombuffer(ans["outputs"][0]["data"], np.float32), BIG)
        assert s.call("server_live")["result"] is True           # the session itself is fine
    finally:
        s.call("goodbye")
        s.close()


def test_attach_needs_a_live_session(shm_daemon: Daemon) -> None:
    path = f"{shm_daemon.socket_path}.local"
    gone = Session(shm_daemon.url, attach=False)
    assert gone.call("goodbye")["ok"]
    gone.close()
    for token in ("0" * 32, secrets.token_hex(16), gone.token, 12345, None, b"\x00" * 16):
        ch, ans, fds = attach_channel(path, token)
        try:
            assert fds == [] and ans["ok"] is False, (token, ans)
            assert ans["error"]["code"] == "SESSION_LOST" and "hello again" in ans["error"]["message"]
            assert closed_by_peer(ch)
        finally:
            ch.close()
    for raw in (b"\xc1 not msgpack", pack({"op": "hello", "session": "0" * 32}), pack([1, 2, 3]), b"\x00"):
        ch, ans, fds = attach_channel(path, None, raw=raw)
        try:
            assert fds == [] and ans["ok"] is False and ans["error"]["code"] == "INVALID_ARG", (raw, ans)
            assert closed_by_peer(ch)
        finally:
            ch.close()
    # the daemon is still fine
    fresh = Session(shm_daemon.url)
    try:
        ans = fresh.infer("addsub", [tensor("INPUT0", "shm", fresh.put(0, A, 1)),
                                     tensor("INPUT1", "data", B.tobytes())])
        assert ans["ok"], ans
    finally:
        fresh.call("goodbye")
        fresh.close()


def test_a_session_attaches_once(shm_daemon: Daemon, session: Session) -> None:
    """Knowing a session's token (it travels over ZeroMQ) does not give its memory."""
    before = set(memfds(shm_daemon.proc.pid))
    for arena in (True, False):
        ch, ans, fds = attach_channel(session.result["local_socket"], session.token, arena=arena)
        try:
            assert fds == [] and ans["ok"] is False, ans
            assert ans["error"]["code"] == "INVALID_ARG" and "already attached" in ans["error"]["message"]
            assert closed_by_peer(ch)
        finally:
            ch.close()
    assert set(memfds(shm_daemon.proc.pid)) <= before            # no arena was made for the intruder
    # the first attachment is untouched
    ans = session.infer("addsub", [tensor("INPUT0", "shm", session.put(0, A, 1)),
                                   tensor("INPUT1", "data", B.tobytes())])
    assert ans["ok"], ans
    session.receive_pushed()
    assert session.pushed == []


def test_closing_the_side_channel_ends_the_session(shm_daemon: Daemon) -> None:
    s = Session(shm_daemon.url)
    try:
        segment = s.segment
        assert segment in memfds(shm_daemon.proc.pid)
        s.channel.close()
        s.channel = None
        wait_for(lambda: segment not in memfds(shm_daemon.proc.pid), 10, "the daemon to release the arena")
        ans = s.call("server_live")
        assert ans["error"]["code"] == "SESSION_LOST", ans
    finally:
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


def test_arena_grow_hands_the_segment_before_answering(shm_daemon: Daemon) -> None:
    s = Session(shm_daemon.url)
    try:
        for size in (0, -1, 4 << 20, "1M", True):
            bad = s.call("arena_grow", size=size)
            assert bad["error"]["code"] == "INVALID_ARG", (size, bad)
        grown = s.call("arena_grow", size=4096)
        assert grown["ok"], grown
        name = grown["result"]["segment"]
        assert grown["result"]["size"] == 1 << 20 and name != s.segment       # at least a whole segment
        s.map_grown(name)                        # already on the side channel: no waiting
        assert s.pushed == [(name, 1 << 20)]
        fd = s.fds[name]
        assert fcntl.fcntl(fd, fcntl.F_GET_SEALS) & SEALS == SEALS
        ans = s.infer("addsub", [tensor("INPUT0", "shm", s.put(128, A, 5, segment=name)),
                                 tensor("INPUT1", "shm", s.put(0, B, 6))])
        assert ans["ok"], ans
        np.testing.assert_array_equal(np.frombuffer(ans["outputs"][0]["data"], np.float32).reshape(1, 16), A + B)
        # --client-shm-limit 3M: one more segment fits, then the session's limit is reached
        assert s.call("arena_grow", size=1)["ok"]
        over = s.call("arena_grow", size=1)
        assert over["error"]["code"] == "RESOURCE_EXHAUSTED" and "limit" in over["error"]["message"], over
        s.receive_pushed()
        assert len(s.pushed) == 2 and len(s.maps) == 1 + 1      # nothing was handed for the refused one
        assert sum(size for n, size in memfds(shm_daemon.proc.pid).items() if n in s.fds) == 3 << 20
    finally:
        s.call("goodbye")
        s.close()


BIG = np.arange(8192, dtype=np.float32)          # 32 KiB: lent in place


def test_large_outputs_are_lent_in_place_until_released(shm_daemon: Daemon, session: Session) -> None:
    ans = session.infer("identity", [tensor("INPUT__0", "shm", session.put(0, BIG, 1), BIG)], output_shm=True)
    assert ans["ok"], ans
    seg, off, n, gen = ans["outputs"][0]["shm"]
    mm = session.output(seg)                     # its fd came before the answer
    assert [name for name, _ in session.pushed] == [seg]
    assert seg in memfds(shm_daemon.proc.pid) and not (Path("/dev/shm") / seg).exists()
    np.testing.assert_array_equal(np.frombuffer(mm, np.float32, count=n // 4, offset=off), BIG)
    # handed read-only: the client can neither write the worker's memory nor resize it
    fd = session.fds[seg]
    with pytest.raises(PermissionError):
        mmap.mmap(fd, os.fstat(fd).st_size, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    with pytest.raises(OSError):
        os.ftruncate(fd, 4096)
    with pytest.raises(OSError):
        os.pwrite(fd, b"x", off)
    # while lent, the block is never reused: another request gets other memory
    again = session.infer("identity", [tensor("INPUT__0", "shm", session.put(0, BIG * 2, 2), BIG)],
                          output_shm=True)
    o2 = again["outputs"][0]["shm"]
    assert o2[:2] != [seg, off]
    np.testing.assert_array_equal(np.frombuffer(session.output(o2[0]), np.float32, count=n // 4, offset=o2[1]),
                                  BIG * 2)
    np.testing.assert_array_equal(np.frombuffer(mm, np.float32, count=n // 4, offset=off), BIG)
    session.receive_pushed()
    names = [name for name, _ in session.pushed]
    assert len(names) == len(set(names))          # each worker segment is handed once per session
    # a release that matches nothing lent (wrong generation) frees nothing and is ignored
    assert session.call("server_live", release=[[seg, off, gen + 1000]])["ok"]
    assert session.call("server_live", release=[[seg, off, gen], release_of(o2)])["ok"]
    # released: the worker may reuse the block now
    third = session.infer("identity", [tensor("INPUT__0", "shm", session.put(0, BIG, 3), BIG)], output_shm=True)
    assert third["outputs"][0]["shm"][:2] in ([seg, off], o2[:2])
    session.call("server_live", release=[release_of(third["outputs"][0]["shm"])])


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
    session.call("server_live", release=[release_of(plain["shm"])])
    # a model that makes a new tensor writes it out, whatever the flag says
    cloned = session.infer("clone", [{**tensor("INPUT__0", "shm", session.put(0, BIG, 13), BIG), "reuse": True}],
                           output_shm=True)["outputs"][0]
    assert "own" not in cloned and cloned["shm"][0] != session.segment
    np.testing.assert_array_equal(
        np.frombuffer(session.output(cloned["shm"][0]), np.float32, count=BIG.size, offset=cloned["shm"][1]), BIG)
    session.call("server_live", release=[release_of(cloned["shm"])])


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
        assert other.segment != session.segment
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


@pytest.mark.parametrize("nbytes,offset,text", [
    (64, 8190, "Invalid offset + byte size for shared memory region: 'r'"),
    (2**64 - 1, 0, "Invalid offset + byte size for shared memory region: 'r'"),
    (0, 8192, "Invalid offset for shared memory region: 'r'"),
    (64, 2**63, "Invalid offset for shared memory region: 'r'"),
    (64, 2**64 - 32, "Invalid offset for shared memory region: 'r'"),
    (2**64 - 32, 32, "Integer overflow detected: byte_size (18446744073709551584) + offset (32) exceeds "
                     "maximum value (18446744073709551615) for region 'r'"),
    (64, -1, "in region 'r': offset -1 is not an integer in [0, 2^64)"),
])
def test_region_bounds_on_every_request(session: Session, region, nbytes: int, offset: int, text: str) -> None:
    """Offsets and byte sizes are unsigned 64-bit (Triton's); a request out
    of its region is refused with Triton's checks, in its order and words
    (qa/L0_shared_memory test_infer_*_out_of_bound, test_infer_integer_overflow)."""
    ans = session.infer("addsub", [tensor("INPUT0", "region", ["r", nbytes, offset]),
                                   tensor("INPUT1", "data", B.tobytes())])
    assert ans["error"]["code"] == "INVALID_ARG", ans
    assert text in ans["error"]["message"], ans
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
    reg = "register_system_shared_memory"

    def refused(what: str, ans: dict, text: str) -> None:
        assert ans["ok"] is False and ans["error"]["code"] == "INVALID_ARG", (what, ans)
        assert text in ans["error"]["message"], (what, ans)
        assert key not in ans["error"]["message"], (what, ans)

    def ask(offset: int = 0) -> bytes:
        ans = session.call(reg, name="x", key=key, byte_size=64, offset=offset)
        assert ans["ok"], ans
        return ans["result"]["challenge"]

    def answer(nonce: Any, offset: int = 0) -> dict:
        return session.call(reg, name="x", key=key, byte_size=64, offset=offset, challenge=nonce)

    try:
        cases = {
            "reserved": (dict(key="torchpool.deadbeef.1.in0", byte_size=4096, offset=0), "reserved"),
            # one answer (Triton's) for every segment the daemon cannot use
            "missing": (dict(key=key + "-missing", byte_size=4096, offset=0),
                        "failed to register shared memory region 'x': invalid args"),
            "slash": (dict(key=key + "/../" + key, byte_size=4096, offset=0), "after the leading one"),
            "too big": (dict(key=key, byte_size=4097, offset=0),
                        "failed to register shared memory region 'x': invalid args"),
            "past the end": (dict(key=key, byte_size=0, offset=4097),
                             "failed to register shared memory region 'x': invalid args"),
            "overflow": (dict(key=key, byte_size=2**64 - 1, offset=1),
                         "failed to register shared memory region 'x': invalid args"),
            "negative": (dict(key=key, byte_size=64, offset=-1), "not an integer"),
            "no room for a nonce": (dict(key=key, byte_size=4, offset=4090),
                                    "the segment has 6 bytes from offset 4090; the daemon needs 8 there"),
            "no challenge pending": (dict(key=key, byte_size=4096, offset=0, challenge=secrets.token_bytes(16)),
                                     "no challenge is pending"),
        }
        for what, (fields, text) in cases.items():
            refused(what, session.call(reg, name="x", **fields), text)
        assert session.call("get_system_shared_memory_status", name=None)["result"] == []

        # the proof: the daemon's nonce, read back from the segment at the region's offset
        nonce = ask()
        mm[0:16] = nonce
        refused("wrong bytes", answer(secrets.token_bytes(16)), "ownership proof failed")
        refused("answered once", answer(nonce), "no challenge is pending")       # a failure ends it
        nonce = ask(64)
        mm[0:16] = nonce
        refused("at another offset", answer(nonce, 64), "ownership proof failed")

        # Registering without real access: a client that never wrote the nonce
        # cannot register a segment that merely holds bytes it can guess (zeros,
        # a token it chose before, an earlier nonce). Before issue 10 the client
        # chose the token, so any segment it could read was enough.
        mm[0:64] = bytes(64)
        nonce = ask()
        refused("zeros", answer(bytes(16)), "ownership proof failed")
        nonce = ask()
        refused("nonce not written", answer(nonce), "ownership proof failed")
        old_token = secrets.token_bytes(16)
        mm[0:16] = old_token
        first = session.call(reg, name="x", key=key, byte_size=64, offset=0, token=old_token)
        assert first["ok"] and set(first["result"]) == {"challenge"}, first    # the old way: only a challenge
        assert first["result"]["challenge"] != old_token
        refused("old token", answer(old_token), "ownership proof failed")
        earlier = ask()
        later = ask()                                  # asking again replaces the pending challenge
        assert later != earlier
        mm[0:16] = earlier
        refused("earlier nonce", answer(earlier), "ownership proof failed")
        assert session.call("get_system_shared_memory_status", name=None)["result"] == []

        ok = register(session, "x", key, mm, 4096)
        assert ok["ok"] and ok["result"] is True, ok
        dup = session.call(reg, name="x", key=key, byte_size=4096, offset=0)
        assert dup["error"]["code"] == "ALREADY_EXISTS"
        assert session.call("unregister_system_shared_memory", name="x")["ok"]
    finally:
        mm.close()
        posix_ipc.unlink_shared_memory("/" + key)
    assert not (Path("/dev/shm") / key).exists()     # the test unlinked it, not the daemon


def test_keys_with_tritons_reserved_prefix_are_refused(session: Session) -> None:
    """Triton refuses keys beginning with its Python backend's prefix,
    leading slashes or not (qa/L0_shared_memory test_register_reserved_names),
    with this text."""
    prefix = "triton_python_backend_shm_region_"
    for key in (f"{prefix}_my_test_shm_key", f"/{prefix}_my_test_shm_key", f"///{prefix}_my_test_shm_key"):
        ans = session.call("register_system_shared_memory", name="my_test_shm_name", key=key, byte_size=10000,
                           offset=0)
        assert (ans["ok"], ans["error"]) == (False, {"code": "INVALID_ARG", "message": (
            f"cannot register shared memory region 'my_test_shm_name' with key '{key}' as the key contains "
            f"the reserved prefix '{prefix}'")}), key


def test_keys_of_slashes_alone_are_refused_in_tritons_words(session: Session) -> None:
    """Triton's ValidateSharedMemoryKey (qa/L0_shared_memory test_register_invalid_shm_key)."""
    for key in ("/", "///"):
        ans = session.call("register_system_shared_memory", name="my_test_shm_name", key=key, byte_size=10000,
                           offset=0)
        assert (ans["ok"], ans["error"]) == (False, {"code": "INVALID_ARG", "message": (
            f"cannot register shared memory region 'my_test_shm_name' - invalid shm key '{key}'")}), key


def test_regions_smaller_than_the_nonce_register(session: Session, shm_daemon: Daemon) -> None:
    """Triton takes regions of any size (L0_shared_memory registers 8-byte
    ones); torchpool refused those under 16 bytes, falsely saying they did
    not fit their segment. The nonce is as long as the segment allows from
    the region's offset (at least 8 bytes), and the client puts back what it
    overwrote."""
    tiny, tiny_mm = _make_segment(8)                 # the whole segment is 8 bytes
    big, big_mm = _make_segment(4096)
    try:
        ok = register(session, "tiny", tiny, tiny_mm, 8)
        assert ok["ok"] and ok["result"] is True, ok
        ok = register(session, "four", big, big_mm, 4, offset=64)      # a 4-byte region: a 16-byte nonce
        assert ok["ok"] and ok["result"] is True, ok
        status = {r["name"]: r for r in session.call("get_system_shared_memory_status", name=None)["result"]}
        assert (status["tiny"]["byte_size"], status["four"]["byte_size"]) == (8, 4)
        assert session.call("unregister_system_shared_memory", name=None)["ok"]
        from torchpool.client import Client
        tiny_mm[:] = bytes(8)
        with Client(shm_daemon.url, timeout=30) as c:    # the client library puts back what the nonce overwrote
            c.register_system_shared_memory("tiny", tiny, 8)
            assert [r["byte_size"] for r in c.get_system_shared_memory_status()] == [8]
            assert bytes(tiny_mm) == bytes(8)
            c.unregister_system_shared_memory()
    finally:
        tiny_mm.close()
        big_mm.close()
        posix_ipc.unlink_shared_memory("/" + tiny)
        posix_ipc.unlink_shared_memory("/" + big)


def test_status_shows_the_key_as_registered(session: Session) -> None:
    """Triton's status shows a region's key as the client gave it: "/k" stays "/k"."""
    key, mm = _make_segment()
    try:
        for name, given in (("slash", "/" + key), ("bare", key)):
            assert register(session, name, given, mm, 4096)["ok"]
            status = session.call("get_system_shared_memory_status", name=name)["result"]
            assert [(s["name"], s["key"]) for s in status] == [(name, given)]
            assert session.call("unregister_system_shared_memory", name=name)["ok"]
    finally:
        mm.close()
        posix_ipc.unlink_shared_memory("/" + key)


def test_regions_per_session_are_limited(session: Session) -> None:
    """Pending challenges count: a client cannot pile them up either."""
    key, mm = _make_segment()
    reg = "register_system_shared_memory"
    try:
        nonces = []
        for i in range(MAX_REGIONS):
            ans = session.call(reg, name=f"r{i}", key=key, byte_size=64, offset=64 * i)
            assert ans["ok"], ans
            nonces.append(ans["result"]["challenge"])
        over = session.call(reg, name="more", key=key, byte_size=64, offset=1024)
        assert over["error"]["code"] == "RESOURCE_EXHAUSTED" and key not in over["error"]["message"], over
        mm[0:16] = nonces[0]
        assert session.call(reg, name="r0", key=key, byte_size=64, offset=0, challenge=nonces[0])["result"] is True
        over = session.call(reg, name="more", key=key, byte_size=64, offset=1024)
        assert over["error"]["code"] == "RESOURCE_EXHAUSTED", over
        assert session.call("unregister_system_shared_memory", name="r0")["ok"]
        assert register(session, "more", key, mm, 64, 1024)["ok"]
        status = session.call("get_system_shared_memory_status", name=None)["result"]
        assert [r["name"] for r in status] == ["more"]
    finally:
        session.call("unregister_system_shared_memory", name=None)
        mm.close()
        posix_ipc.unlink_shared_memory("/" + key)


def test_regions_belong_to_their_session(shm_daemon: Daemon, session: Session, region) -> None:
    other = Session(shm_daemon.url)
    try:
        ans = other.infer("addsub", [tensor("INPUT0", "region", ["r", 64, 0]), tensor("INPUT1", "data", B.tobytes())])
        assert ans["error"]["code"] == "NOT_FOUND", ans
        assert "Unable to find shared memory region: 'r'" in ans["error"]["message"]
        assert other.call("get_system_shared_memory_status", name=None)["result"] == []
    finally:
        other.call("goodbye")
        other.close()


def test_unregister_in_flight_is_deferred(session: Session, region) -> None:
    from ..support.models.slow import slow_iterations

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
    from ..support.models.slow import slow_iterations

    root = str(Path(__file__).resolve().parent.parent.parent)
    proc = subprocess.Popen([sys.executable, "-c", CLIENT.format(root=root, url=shm_daemon.url,
                                                                 n=slow_iterations(0.3))],
                            stdout=subprocess.PIPE, text=True)
    segment = proc.stdout.readline().strip()
    assert segment and segment in memfds(shm_daemon.proc.pid)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    proc.stdout.close()
    # its side channel closed with it; the request finishes for nobody; then the daemon
    # releases the arena (no name to unlink: it closes the memfd)
    wait_for(lambda: segment not in memfds(shm_daemon.proc.pid), 20, "the dead client's arena to be released")
    fresh = Session(shm_daemon.url)
    try:
        ans = fresh.infer("addsub", [tensor("INPUT0", "shm", fresh.put(0, A, 1)),
                                     tensor("INPUT1", "data", B.tobytes())])
        np.testing.assert_array_equal(np.frombuffer(ans["outputs"][0]["data"], np.float32).reshape(1, 16), A + B)
    finally:
        fresh.call("goodbye")
        fresh.close()
