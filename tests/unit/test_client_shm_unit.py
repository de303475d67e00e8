"""The client package without a daemon: block headers, the client arena,
release-by-finalizer of lent outputs, zero-copy detection of `empty()` arrays,
and the flows driven by a scripted fake daemon (which serves a real unix
side channel: attach, arena fds, grown and lent segments pushed as fds)."""
from __future__ import annotations

import fcntl
import gc
import os
import secrets
import select
import socket
import struct
import threading
import uuid

import numpy as np
import posix_ipc
import pytest

from torchpool.client import Client, OutputRef, RegionOutput, SharedMemoryRef
from torchpool.client import arena as ca
from torchpool.client import flows
from torchpool.client.outputs import EncodedInputs
from torchpool.protocol import errors, messages, tensors
from torchpool.protocol.errors import InferenceError
from torchpool.shm import NamedSegment, Segment

from ..support.daemon import wait_for

KiB = 1024


@pytest.fixture(autouse=True)
def arena_for_small_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests drive the arena path with small tensors; by default tensors
    of at most LOCAL_MIN_BYTES travel inline (test_small_inputs_stay_inline)."""
    monkeypatch.setattr(tensors, "LOCAL_MIN_BYTES", 0)


@pytest.fixture
def daemon_segments(prefix):
    """Segments as a daemon would create them for a client: sealed memfds
    (we own them here, and keep their fds to hand on)."""
    made: list[Segment] = []

    def make(size: int) -> Segment:
        seg = Segment.create(f"{prefix}c{len(made)}", size, prefault=False)
        made.append(seg)
        return seg
    yield make
    for seg in made:
        seg.close()


@pytest.fixture
def arena(daemon_segments):
    a = ca.ClientArena()
    seg = daemon_segments(64 * KiB)
    a.map_segment(seg.name, os.dup(seg.fd))       # as handed over the side channel
    yield a
    a.close()


# ------------------------------------------------------------------ headers

def test_block_header_layout() -> None:
    assert tensors.BLOCK_HEADER_BYTES == 64 and tensors.BLOCK_HEADER_LAYOUT.size == 24
    buf = bytearray(128)
    tensors.write_block_header(buf, 0, generation=0x0102030405060708, nbytes=4096)
    assert bytes(buf[:4]) == b"TPB1"                           # magic 0x31425054, little-endian
    assert struct.unpack_from("<IIQQ", buf, 0) == (0x31425054, 0, 0x0102030405060708, 4096)
    assert tensors.read_block_header(buf, 0) == (tensors.BLOCK_MAGIC, 0x0102030405060708, 4096)
    assert ca.block_size(0) == 64 and ca.block_size(1) == 128 and ca.block_size(64) == 128


def test_header_matches_the_daemon_definition() -> None:
    regions = pytest.importorskip("torchpool.shm.regions")
    assert regions.HEADER_BYTES == tensors.BLOCK_HEADER_BYTES
    assert regions.BLOCK_MAGIC == tensors.BLOCK_MAGIC
    assert regions.BLOCK_HEADER.format == tensors.BLOCK_HEADER_LAYOUT.format


# ------------------------------------------------------------------ arena

def test_arena_allocates_aligned_blocks_and_frees_them(arena) -> None:
    seg = next(iter(arena.segments.values()))
    a = arena.alloc(100)
    b = arena.alloc(1)
    assert a.start % 64 == 0 and b.start % 64 == 0 and a.data_offset == a.start + 64
    assert a.capacity >= 100 and b.start >= a.start + a.size       # no overlap
    assert a.address % 64 == 0
    desc = arena.hand_out(a, 100)
    assert (desc.segment, desc.offset, desc.nbytes) == (seg.name, a.data_offset, 100)
    assert tensors.read_block_header(seg.buf, a.start) == (tensors.BLOCK_MAGIC, desc[3], 100)
    desc2 = arena.hand_out(a, 80)
    assert desc2[3] != desc[3]                                     # a fresh generation each time
    arena.free(a)
    assert tensors.read_block_header(seg.buf, a.start)[0] == 0                # a stale descriptor cannot match
    arena.free(b)
    assert arena.free_bytes == arena.mapped_bytes


def test_arena_full_returns_none_and_grows_with_a_segment(arena, daemon_segments) -> None:
    big = arena.alloc(60 * KiB)
    assert big is not None
    assert arena.alloc(8 * KiB) is None
    seg = daemon_segments(32 * KiB)
    arena.map_segment(seg.name, os.dup(seg.fd))
    other = arena.alloc(8 * KiB)
    assert other is not None and other.segment != big.segment
    assert arena.mapped_bytes == 96 * KiB


def test_arena_data_is_shared_with_the_daemon_mapping(daemon_segments) -> None:
    seg = daemon_segments(64 * KiB)
    arena = ca.ClientArena()
    arena.map_segment(seg.name, os.dup(seg.fd))
    worker_view = Segment.from_fd(seg.name, os.dup(seg.fd))     # a worker's mapping of the same memfd
    try:
        assert arena.segments[seg.name].fd == -1                   # the client keeps no fd it does not need
        block = arena.alloc(16)
        arena.data(block, 16)[:] = b"0123456789abcdef"
        desc = arena.hand_out(block, 16)
        for view in (worker_view.buf, seg.buf):
            magic, _, gen, n = struct.unpack_from("<IIQQ", view, desc[1] - 64)
            assert (magic, gen, n) == (tensors.BLOCK_MAGIC, desc[3], 16)
            assert bytes(view[desc[1]:desc[1] + 16]) == b"0123456789abcdef"
    finally:
        worker_view.close()
        arena.close()


def test_arena_maps_only_memory_sealed_against_shrinking(daemon_segments) -> None:
    """A daemon (or anyone on the socket) handing an fd whose size can change
    would let the memory shrink under the client's mapping: refused."""
    arena = ca.ClientArena()
    fd = os.memfd_create("torchpool.unsealed", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, 64 * KiB)
    with pytest.raises(ValueError, match="not sealed against shrinking"):
        arena.map_segment("unsealed", fd)
    with pytest.raises(OSError):                 # map_segment took the fd, even when refusing it
        fcntl.fcntl(fd, fcntl.F_GETFD)
    assert arena.segments == {} and arena.mapped_bytes == 0
    seg = daemon_segments(8 * KiB)
    arena.map_segment(seg.name, os.dup(seg.fd))
    assert arena.mapped_bytes == 8 * KiB and arena.alloc(4 * KiB) is not None
    arena.close()


# ------------------------------------------------------------------ empty()

def test_empty_is_an_arena_block_freed_when_garbage(arena) -> None:
    free0 = arena.free_bytes
    buf = arena.empty((4, 16), np.float32)
    assert buf.shape == (4, 16) and buf.dtype == np.float32 and buf.flags.writeable
    assert arena.free_bytes < free0
    view = buf[1:]
    del buf
    gc.collect()
    assert arena.free_bytes < free0          # a view keeps the block
    del view
    gc.collect()
    assert arena.free_bytes == free0


def test_zero_copy_detection(arena) -> None:
    buf = arena.empty((8, 16), np.float32)
    block = arena.lookup(buf)
    assert block is not None and block.user
    assert arena.lookup(buf.reshape(-1)) is block                  # same start, contiguous
    assert arena.lookup(buf[:4]) is block                          # a prefix: fewer bytes
    assert arena.lookup(buf.view(np.int32)) is block
    assert arena.lookup(buf[1:]) is None                           # does not start at the data
    assert arena.lookup(buf[:, ::2]) is None                       # not contiguous
    assert arena.lookup(buf.T) is None
    assert arena.lookup(np.zeros((8, 16), np.float32)) is None     # not in the arena
    torch = pytest.importorskip("torch")
    t = torch.from_numpy(buf)
    assert arena.lookup(t.numpy()) is block


def test_encode_sends_empty_buffers_without_a_copy(arena) -> None:
    st = flows.ClientState("ipc:///nowhere", local=False)
    st.session, st.local, st.arena = "s1", True, arena
    buf = arena.empty((2, 16), np.float32)
    buf[:] = 3.0
    plain = np.ones((2, 16), np.float32)
    enc = st.encoder.encode({"A": buf, "B": plain, "C": buf[1:], "S": ["ab", "c"]}, arena, st.session)
    a, b, c, s = enc.entries
    seg = arena.segments[a["shm"][0]]
    assert a["shm"][1] == arena.lookup(buf).data_offset and a["shm"][2] == buf.nbytes
    assert tensors.read_block_header(seg.buf, a["shm"][1] - 64) == (tensors.BLOCK_MAGIC, a["shm"][3], buf.nbytes)
    assert "shm" in b and "shm" in c and "shm" in s and "data" not in b
    assert enc.stats == [plain.nbytes + buf[1:].nbytes + 4 + 2 + 4 + 1, buf.nbytes, 0]
    got = np.frombuffer(seg.buf, np.float32, count=32, offset=b["shm"][1])
    assert np.array_equal(got, plain.reshape(-1))
    # the same buffer in flight twice: the second use is copied
    enc2 = st.encoder.encode({"A": buf}, arena, st.session)
    assert enc2.stats == [buf.nbytes, 0, 0]
    st.encoder.finish(enc, arena, answered=True)
    st.encoder.finish(enc2, arena, answered=True)
    enc3 = st.encoder.encode({"A": buf}, arena, st.session)
    assert enc3.stats == [0, buf.nbytes, 0]
    st.encoder.finish(enc3, arena, answered=True)


def test_encode_copies_odd_arrays_once_in_native_order(arena) -> None:
    st = flows.ClientState("ipc:///nowhere", local=False)
    x = np.arange(32, dtype=">i4").reshape(4, 8)[:, ::2]      # big-endian and strided
    enc = st.encoder.encode({"X": x}, arena, st.session)
    (e,) = enc.entries
    assert e["datatype"] == "INT32" and e["shape"] == [4, 4]
    seg = arena.segments[e["shm"][0]]
    got = np.frombuffer(seg.buf, "<i4", count=16, offset=e["shm"][1]).reshape(4, 4)
    assert np.array_equal(got, x)
    st.encoder.finish(enc, arena, answered=True)


def test_encode_reports_need_room_and_frees_what_it_took(arena) -> None:
    st = flows.ClientState("ipc:///nowhere", local=False)
    free0 = arena.free_bytes
    with pytest.raises(flows.NeedRoom) as room:
        st.encoder.encode({"A": np.zeros(8 * KiB, np.float32), "B": np.zeros(16 * KiB, np.float32)}, arena, st.session)
    assert room.value.nbytes >= 64 * KiB
    assert arena.free_bytes == free0


def test_garbage_empty_block_in_flight_is_freed_when_the_flight_ends(arena) -> None:
    st = flows.ClientState("ipc:///nowhere", local=False)
    free0 = arena.free_bytes
    buf = arena.empty((16,), np.float32)
    enc = st.encoder.encode({"A": buf}, arena, st.session)
    del buf
    gc.collect()
    assert arena.free_bytes < free0                       # garbage, but the daemon may read it
    st.encoder.finish(enc, arena, answered=False, rid=7)          # no answer: quarantined
    assert 7 in st.quarantine and arena.free_bytes < free0
    st.arena = arena
    st.late_reply({"id": 7, "ok": True, "outputs": []})   # the late answer frees it
    assert 7 not in st.quarantine and arena.free_bytes == free0


# ------------------------------------------------------------------ lent outputs

def test_lent_outputs_are_released_when_the_last_view_is_gone(fake_daemon, prefix) -> None:
    d = fake_daemon()
    st = local_state()
    run(st.hello_flow(5), d)
    assert st.outputs.link is st.link is not None
    worker = Segment.create(f"{prefix}w0.0", 64 * KiB, prefault=False)     # a worker's output memory
    try:
        np.frombuffer(worker.buf, np.float32, count=16, offset=128)[:] = np.arange(16)
        name = worker.name
        d.push(st.session, [worker], writable=False)     # before the answer that lends in it
        header = {"outputs": [{"name": "OUT", "datatype": "FP32", "shape": [4, 4],
                               "shm": [name, 128, 64, 99]}]}
        with st.decoder.decode(header, [], False, st.session) as out:
            arr = out["OUT"]
            assert arr.shape == (4, 4) and not arr.flags.writeable
            assert np.array_equal(arr.reshape(-1), np.arange(16))
            with pytest.raises(ValueError):
                arr[0, 0] = 1
            row = arr[2]
        assert out == {}
        # the client mapped the fd it was handed: it sees the worker's memory, not a copy
        worker.buf[128 + 8 * 4:128 + 9 * 4] = np.float32(80).tobytes()
        assert row[0] == 80.0
        worker.buf[128 + 8 * 4:128 + 9 * 4] = np.float32(8).tobytes()
        del arr
        gc.collect()
        assert not st.releases                    # `row` still views it
        assert row[0] == 8.0
        del row
        gc.collect()
        assert list(st.releases) == [(st.session, [name, 128, 99])]
        assert st.session_fields() == {"session": st.session, "release": [[name, 128, 99]]}
        assert st.session_fields() == {"session": st.session}
        # copy=True: an ordinary array, released at once
        out = st.decoder.decode(header, [], True, st.session)
        assert out["OUT"].flags.writeable and out["OUT"].flags.owndata
        assert list(st.releases) == [(st.session, [name, 128, 99])]
        # releases of another session are dropped
        st.releases.append(("old", [name, 0, 1]))
        assert st.session_fields()["release"] == [[name, 128, 99]]
        # BYTES are decoded and released at once
        worker.buf[1024:1024 + 9] = b"\x05\x00\x00\x00hello"
        out = st.decoder.decode({"outputs": [{"name": "T", "datatype": "BYTES", "shape": [1],
                                              "shm": [name, 1024, 9, 5]}]}, [], False, st.session)
        assert out["T"].tolist() == [b"hello"]
        assert st.session_fields()["release"] == [[name, 1024, 5]]
        # the handed fd was read-only: the client's mapping cannot write the worker's memory
        mm = st.outputs.get(name, 0)
        with pytest.raises(TypeError):
            mm[0] = 1
        # beyond the segment: refused (and still released)
        with pytest.raises(InferenceError) as exc:
            st.decoder.decode({"outputs": [{"name": "O", "datatype": "FP32", "shape": [16],
                                            "shm": [name, 64 * KiB - 32, 64, 6]}]}, [], False, st.session)
        assert exc.value.code == errors.INTERNAL and "beyond" in str(exc.value)
        assert st.session_fields()["release"] == [[name, 64 * KiB - 32, 6]]
    finally:
        st.close()
        worker.close()


def test_an_output_in_memory_never_handed_is_refused(fake_daemon, prefix) -> None:
    """The client maps only fds it was handed over its side channel; a name
    alone (say, of a segment in /dev/shm) gets nothing mapped."""
    d = fake_daemon()
    st = local_state()
    run(st.hello_flow(5), d)
    named = NamedSegment.create(f"{prefix}w1.0", 4 * KiB, prefault=False)
    try:
        header = {"outputs": [{"name": "O", "datatype": "FP32", "shape": [4], "shm": [named.name, 0, 16, 3]}]}
        with pytest.raises(InferenceError) as exc:
            st.decoder.decode(header, [], False, st.session)
        assert exc.value.code == errors.INTERNAL and "did not hand to this client" in str(exc.value)
        assert st.session_fields()["release"] == [[named.name, 0, 3]]        # handed back all the same
        st.outputs.clear()                     # a session that is not local: nothing can be mapped
        with pytest.raises(InferenceError) as exc:
            st.decoder.decode(header, [], False, st.session)
        assert exc.value.code == errors.INTERNAL and "without a local session" in str(exc.value)
    finally:
        st.close()
        named.close()
        named.unlink()


def test_late_reply_releases_lent_outputs() -> None:
    st = flows.ClientState("ipc:///nowhere", local=False)
    st.session = "tok"
    st.encoder.finish(EncodedInputs(), None, answered=False, rid=3, token="tok")      # timed out
    st.late_reply({"id": 4, "ok": True, "outputs": [{"name": "O", "shm": ["seg", 0, 8, 1]}]})
    assert st.session_fields() == {"session": "tok"}                      # not a request of ours
    st.late_reply({"id": 3, "ok": True, "outputs": [{"name": "O", "shm": ["seg", 64, 8, 2]}]})
    assert st.session_fields()["release"] == [["seg", 64, 2]]


def test_session_error_detection_is_by_code() -> None:
    assert flows.is_session_error(InferenceError(errors.SESSION_LOST, "any text"))
    # the English text alone no longer counts: only the code does
    assert not flows.is_session_error(InferenceError(errors.NOT_FOUND, "unknown session (its lease expired)"))
    assert not flows.is_session_error(InferenceError(errors.NOT_FOUND, "Request for unknown model: 'x'"))
    assert not flows.is_session_error(InferenceError(errors.INTERNAL, "model failed"))


def test_refs_validate() -> None:
    ref = SharedMemoryRef("r", 64, datatype="FP32", shape=[1, 16])
    assert ref.shape == (1, 16) and ref.wire() == ["r", 64, 0]
    with pytest.raises(ValueError):
        SharedMemoryRef("r", 64, datatype="FLOAT", shape=[1])
    assert OutputRef("OUT", "r", 128, 64).wire() == {"name": "OUT", "region": ["r", 128, 64]}
    ro = RegionOutput("OUT", "r", 8, 16, "FP32", (2, 2))
    buf = bytearray(32)
    np.frombuffer(buf, np.float32)[2:6] = [1, 2, 3, 4]
    assert ro.as_array(buf).tolist() == [[1, 2], [3, 4]]


def test_local_can_be_turned_off(monkeypatch) -> None:
    monkeypatch.setenv("TORCHPOOL_LOCAL", "0")
    assert not ca.local_wanted(None)
    monkeypatch.setenv("TORCHPOOL_LOCAL", "1")
    # asked for whatever the host: the side channel, not a boot id, says who gets it
    assert ca.local_wanted(None) is True
    assert not ca.local_wanted(False)


# ------------------------------------------------------------------ flows against a fake daemon

class FakeDaemon:
    """Answers calls in-process, like the daemon would (enough for the flows),
    and serves a real side channel: an AF_UNIX SOCK_SEQPACKET listener whose
    thread answers `attach` with the arena's fds (the flow's attach blocks on
    that answer). Later segments are pushed from the calling thread, before
    the answer that names them, as the daemon does.

    `channel`: "ok"; "missing" (hello names a socket that does not exist);
    "refuse" (attach answered with an error); "unsealed" (the arena fd is a
    memfd whose size can change); "no-memory" (an arena named without its fd).
    """

    def __init__(self, make_segment, directory, hello: str = "ok", channel: str = "ok") -> None:
        self.make_segment = make_segment
        self.hello = hello
        self.channel = channel
        self.sessions: set[str] = set()
        self.seen: list[dict] = []
        self.attaches: list[dict] = []
        self.segments: dict[str, Segment] = {}          # client arenas, by name
        self.channels: dict[str, socket.socket] = {}    # attached side channels, by session
        self.handed: dict[str, set] = {}                # session -> segment names handed to it
        self.pushes: list[tuple[str, list, bool]] = []  # (session, segment names, writable) pushed
        self.worker: Segment | None = None              # where outputs are lent (lend=True)
        self.lend = False
        self.pending: dict[tuple[str, str], tuple[str, int, bytes]] = {}   # register challenges
        self.proved: dict[str, bytes] = {}
        self.errors: list[BaseException] = []
        self.path = str(directory / "fake.local")
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.listener.bind(self.path)
        self.listener.listen(8)
        self._stop_r, self._stop_w = os.pipe()
        self._thread = threading.Thread(target=self._serve, name="fake-side-channel", daemon=True)
        self._thread.start()

    # -- the side channel
    def _serve(self) -> None:
        while True:
            ready, _, _ = select.select([self.listener, self._stop_r], [], [])
            if self._stop_r in ready:
                return
            conn, _ = self.listener.accept()
            try:
                self._attach(conn)
            except BaseException as exc:        # shows in close()
                self.errors.append(exc)
                conn.close()

    def _attach(self, conn: socket.socket) -> None:
        conn.settimeout(10)
        req = messages.unpack(conn.recv(4096))
        self.attaches.append(req)
        token = req.get("session")
        if self.channel == "refuse" or token not in self.sessions:
            code = errors.UNAVAILABLE if self.channel == "refuse" else errors.SESSION_LOST
            conn.send(messages.pack({"ok": False, "error": {"code": code, "message": "refused"}}))
            conn.close()
            return
        arena, fds, close_after = [], [], []
        if req.get("arena", True):
            if self.channel == "unsealed":
                fd = os.memfd_create("torchpool.unsealed", os.MFD_CLOEXEC)
                os.ftruncate(fd, 4 * KiB)
                arena, fds, close_after = [{"segment": "unsealed", "size": 4 * KiB}], [fd], [fd]
            else:
                seg = self.make_segment(4 * KiB)
                self.segments[seg.name] = seg
                arena = [{"segment": seg.name, "size": seg.size}]
                fds = [] if self.channel == "no-memory" else [seg.fd]
        conn.setblocking(False)                      # channel_closed() peeks without waiting
        self.channels[token] = conn                 # before the answer: the flow goes on once it has it
        self.handed[token] = {a["segment"] for a in arena}
        answer = messages.pack({"ok": True, "arena": arena, "block_header": 64})
        if fds:
            socket.send_fds(conn, [answer], fds)
        else:
            conn.send(answer)
        for fd in close_after:
            os.close(fd)

    def push(self, token: str, segments: list[Segment], writable: bool) -> None:
        """Hand a session's client segment fds (read-only ones for worker memory)."""
        fds = [s.fd if writable else os.open(f"/proc/self/fd/{s.fd}", os.O_RDONLY) for s in segments]
        try:
            body = messages.pack({"segments": [{"segment": s.name, "size": s.size} for s in segments]})
            socket.send_fds(self.channels[token], [body], fds)
        finally:
            if not writable:
                for fd in fds:
                    os.close(fd)
        self.handed[token].update(s.name for s in segments)
        self.pushes.append((token, [s.name for s in segments], writable))

    def channel_closed(self, token: str) -> bool:
        """The client closed its side channel (which ends a session)."""
        try:
            return self.channels[token].recv(1, socket.MSG_DONTWAIT | socket.MSG_PEEK) == b""
        except BlockingIOError:
            return False

    # -- the zmq side
    def __call__(self, call: flows.Call):
        h = messages.unpack(call.frames[0])
        self.seen.append(h)
        op = h["op"]
        if op == "hello":
            if self.hello == "unsupported":
                raise InferenceError(errors.UNSUPPORTED, "unknown operation 'hello'")
            tok = uuid.uuid4().hex
            self.sessions.add(tok)
            path = self.path + ".missing" if self.channel == "missing" else self.path
            return {"id": h["id"], "ok": True, "result": {
                "session": tok, "local": False, "lease_s": 60, "local_socket": path,
                "block_header": 64}}, []
        token = h.get("session")
        if token is not None and token not in self.sessions:
            raise InferenceError(errors.SESSION_LOST, "unknown session (its lease expired or the daemon "
                                                      "restarted); say hello again")
        if op == "goodbye":
            self.sessions.discard(token)
        if op == "arena_grow":
            seg = self.make_segment(max(h["size"], 4 * KiB))
            self.segments[seg.name] = seg
            self.push(token, [seg], writable=True)              # before the answer names it
            return {"id": h["id"], "ok": True, "result": {"segment": seg.name, "size": seg.size}}, []
        if op == "register_system_shared_memory":
            return {"id": h["id"], "ok": True, "result": self._register(token, h)}, []
        if op == "infer":
            outs = []
            for e in h["inputs"]:
                if "shm" in e:
                    seg, off, n, gen = e["shm"]
                    assert seg in self.handed[token], "a segment not handed to this session"
                    magic, g, nb = tensors.read_block_header(self.segments[seg].buf, off - 64)
                    assert (magic, g, nb) == (tensors.BLOCK_MAGIC, gen, n), "stale descriptor"
                    data = bytes(self.segments[seg].buf[off:off + n])
                else:
                    data = e["data"] if isinstance(e["data"], bytes) else bytes(call.frames[e["data"]])
                out = {"name": e["name"], "datatype": e["datatype"], "shape": e["shape"]}
                if self.lend and h.get("output_shm"):
                    out["shm"] = self._lend(token, data, len(outs))
                else:
                    out["data"] = data
                outs.append(out)
            return {"id": h["id"], "ok": True, "outputs": outs}, []
        return {"id": h["id"], "ok": True, "result": True}, []

    def _lend(self, token: str, data: bytes, i: int) -> list:
        """Write an output into the worker's memory and lend it: [segment, offset, nbytes, gen]."""
        if self.worker is None:
            self.worker = Segment.create(f"torchpool.fake.{uuid.uuid4().hex[:8]}.w0.0", 64 * KiB,
                                         prefault=False)
        if self.worker.name not in self.handed[token]:
            self.push(token, [self.worker], writable=False)      # once, before the first answer lending in it
        off = 64 + i * 16 * KiB
        self.worker.buf[off:off + len(data)] = data
        return [self.worker.name, off, len(data), 1000 + i]

    def _register(self, token: str, h: dict):
        """The challenge: a nonce the client must write at the region's offset."""
        if token not in self.channels:
            raise InferenceError(errors.INVALID_ARG, "registered regions need a local session")
        name = h["name"]
        if "challenge" not in h:
            if self.hello == "short-challenge":
                return {"challenge": b"4 B!"}              # shorter than any nonce the daemon makes
            nonce = secrets.token_bytes(16)
            self.pending[(token, name)] = (h["key"], h["offset"], nonce)
            return {"challenge": nonce}
        key, offset, nonce = self.pending.pop((token, name))
        shm = posix_ipc.SharedMemory("/" + key)
        try:
            written = os.pread(shm.fd, 16, offset)
        finally:
            shm.close_fd()
        if h["challenge"] != nonce or written != nonce:
            raise InferenceError(errors.INVALID_ARG, "ownership proof failed")
        self.proved[name] = written
        return True

    def close(self) -> None:
        os.write(self._stop_w, b"x")
        self._thread.join(10)
        assert not self._thread.is_alive()
        for conn in self.channels.values():
            conn.close()
        self.listener.close()
        os.close(self._stop_r)
        os.close(self._stop_w)
        if self.worker is not None:
            self.worker.close()
        assert not self.errors, self.errors


@pytest.fixture
def fake_daemon(daemon_segments, tmp_path):
    made: list[FakeDaemon] = []

    def make(**kw) -> FakeDaemon:
        made.append(FakeDaemon(daemon_segments, tmp_path, **kw))
        return made[-1]
    yield make
    for d in made:
        d.close()


def run(flow, daemon):
    return flows.run_sync(flow, daemon)


def local_state() -> flows.ClientState:
    st = flows.ClientState("ipc:///nowhere", local=False)
    st.want_local = True
    return st


def test_hello_then_arena_inputs_then_grow(fake_daemon) -> None:
    d = fake_daemon()
    st = local_state()
    try:
        assert st.needs_hello()
        run(st.hello_flow(5), d)
        assert d.seen[0]["local"] is True and "boot_id" not in d.seen[0]
        assert d.attaches == [{"op": "attach", "session": st.session, "arena": True}]
        assert st.local and st.session in d.sessions and st.arena.mapped_bytes == 4 * KiB
        assert set(st.arena.segments) == d.handed[st.session] and st.link.arena == []   # fds taken
        (first_segment,) = st.arena.segments
        x = np.arange(16, dtype=np.float32)
        out = run(st.infer_flow("m", {"X": x}, None, None, 5, copy=True), d)
        assert np.array_equal(out["X"], x)
        assert d.seen[-1]["session"] == st.session and d.seen[-1]["output_shm"] is True
        assert st.stats == {"bytes_copied": 64, "bytes_zero_copy": 0, "bytes_inline": 0}
        assert st.arena.free_bytes == st.arena.mapped_bytes          # freed on the answer
        big = np.ones(3 * KiB, np.float32)                           # 12 KiB: needs arena_grow
        out = run(st.infer_flow("m", {"X": big}, None, None, 5, copy=True), d)
        assert d.seen[-2]["op"] == "arena_grow" and np.array_equal(out["X"], big)
        assert len(st.arena.segments) == 2 and "shm" in d.seen[-1]["inputs"][0]
        (grown,) = set(st.arena.segments) - {first_segment}
        assert d.pushes == [(st.session, [grown], True)]             # the pushed fd was mapped
        huge = np.ones(2 * 1024 * KiB, np.uint8)                     # above the client's cap: inline
        st.arena.cap = 1024 * KiB
        run(st.infer_flow("m", {"X": huge}, None, None, 5, copy=True), d)
        assert "data" in d.seen[-1]["inputs"][0]
        assert st.stats["bytes_inline"] == huge.nbytes
        token = st.session
    finally:
        st.close()
    # closing the client closes its side channel: that is what ends the session daemon-side
    wait_for(lambda: d.channel_closed(token), 5, "the client to close its side channel")


def test_outputs_lent_in_place_arrive_as_fds_before_the_answer(fake_daemon) -> None:
    d = fake_daemon()
    d.lend = True
    st = local_state()
    try:
        run(st.hello_flow(5), d)
        x = np.arange(64, dtype=np.float32)
        y = np.full(32, 7, np.int32)
        out = run(st.infer_flow("m", {"X": x, "Y": y}, None, None, 5, copy=False), d)
        assert d.pushes == [(st.session, [d.worker.name], False)]         # before the answer, read-only
        assert np.array_equal(out["X"], x) and np.array_equal(out["Y"], y)
        assert not out["X"].flags.writeable
        d.worker.buf[64:68] = np.float32(-1).tobytes()                   # a view of the worker's memory
        assert out["X"][0] == -1.0
        del out
        gc.collect()
        assert sorted(item for _, item in st.releases) == [[d.worker.name, 64, 1000],
                                                          [d.worker.name, 64 + 16 * KiB, 1001]]
        # the next answer lending in the same memory needs no new fd: the mapping is reused
        again = run(st.infer_flow("m", {"X": x}, None, None, 5, copy=True), d)
        assert np.array_equal(again["X"], x) and again["X"].flags.writeable
        assert len(d.pushes) == 1
        assert d.seen[-1]["release"]                                     # the releases rode along
    finally:
        st.close()


def test_session_lost_rehello_and_retry(fake_daemon) -> None:
    d = fake_daemon()

    class FakeClient(Client):
        def __init__(self) -> None:   # no socket: the fake daemon answers
            self.url, self.timeout = "ipc:///nowhere", 5
            self._state = local_state()
            self._ids = self._state.ids

        def _send(self, call):
            return d(call)

        def close(self, wait: float = 0) -> None:
            self._state.close()

    c = FakeClient()
    try:
        x = np.ones((1, 16), np.float32)
        c.infer("m", {"X": x})
        first = c.session
        d.sessions.clear()                                           # the lease expired
        out = c.infer("m", {"X": x})
        assert np.array_equal(out["X"], x) and c.session != first
        assert [h["op"] for h in d.seen] == ["hello", "infer", "infer", "hello", "infer"]
        # the new session attached over a new side channel; the old one was closed
        assert [a["session"] for a in d.attaches] == [first, c.session]
        wait_for(lambda: d.channel_closed(first), 5, "the lost session's side channel to close")
        buf = c.empty((1, 16))
        buf[:] = 2
        out = c.infer("m", {"X": buf})
        assert np.array_equal(out["X"], buf)
        assert c.transfer_stats()["bytes_zero_copy"] == 64
    finally:
        c.close()


def test_hello_refused_falls_back_to_inline(fake_daemon) -> None:
    d = fake_daemon(hello="unsupported")
    st = local_state()
    run(st.hello_flow(5), d)
    assert st.session is None and st.unsupported and not st.needs_hello()
    out = run(st.infer_flow("m", {"X": np.ones(4, np.float32)}, None, None, 5, copy=False), d)
    assert np.array_equal(out["X"], np.ones(4)) and "session" not in d.seen[-1]
    assert "output_shm" not in d.seen[-1] and "data" in d.seen[-1]["inputs"][0]
    with pytest.raises(InferenceError) as exc:
        st.require_session()
    assert exc.value.code == errors.UNSUPPORTED
    assert isinstance(run(st.empty_flow((2, 2), "FP32", 5), d), np.ndarray)
    assert d.attaches == []


@pytest.mark.parametrize("channel", ["missing", "refuse", "unsealed", "no-memory"])
def test_no_side_channel_falls_back_to_a_remote_session(fake_daemon, channel: str) -> None:
    """Another host or container (the socket is not there), a refusal, or memory
    the client must not map: goodbye, and hello again as a remote client."""
    d = fake_daemon(channel=channel)
    st = local_state()
    try:
        run(st.hello_flow(5), d)
        assert [h["op"] for h in d.seen] == ["hello", "goodbye", "hello"]
        first = d.seen[0]
        assert d.seen[1]["session"] != st.session and d.seen[2]["local"] is False
        assert st.session is not None and not st.local and st.arena is None and st.link is None
        assert st.outputs.link is None
        assert [a["session"] for a in d.attaches] == ([] if channel == "missing" else [d.seen[1]["session"]])
        assert first["local"] is True
        if channel in ("unsealed", "no-memory"):
            # the client gave the attached channel up (the daemon ends that session)
            wait_for(lambda: d.channel_closed(d.seen[1]["session"]), 5, "the refused channel to close")
        # requests go inline, with no arena descriptors
        out = run(st.infer_flow("m", {"X": np.ones(16, np.float32)}, None, None, 5, copy=True), d)
        assert np.array_equal(out["X"], np.ones(16)) and "data" in d.seen[-1]["inputs"][0]
        assert "output_shm" not in d.seen[-1]
    finally:
        st.close()


def test_register_proves_access_with_the_daemons_challenge(fake_daemon, prefix) -> None:
    """A session without the local path attaches (no arena) so the daemon knows
    who registers; the daemon's nonce is written at the region's offset while
    it checks, and the client's bytes there are put back afterwards."""
    d = fake_daemon()
    st = flows.ClientState("ipc:///nowhere", local=False)
    region = NamedSegment.create(f"{prefix}region", 4 * KiB, prefault=False)
    try:
        run(st.hello_flow(5), d)
        assert st.session is not None and st.link is None and not st.local
        region.buf[256:272] = b"user data: 16 B."
        assert run(st.regions.register_flow("r", region.name, 1024, 256, 5), d) is True
        assert d.attaches == [{"op": "attach", "session": st.session, "arena": False}]
        assert st.link is not None and not st.local and st.arena is None
        first, second = [h for h in d.seen if h["op"] == "register_system_shared_memory"]
        assert {k: first[k] for k in ("name", "key", "byte_size", "offset")} == \
            {"name": "r", "key": region.name, "byte_size": 1024, "offset": 256}
        assert "challenge" not in first and "token" not in first
        assert len(d.proved["r"]) == 16 and second["challenge"] == d.proved["r"]   # read back from the segment
        assert bytes(region.buf[256:272]) == b"user data: 16 B."                  # put back
        assert st.regions.known == {"r": (region.name, 1024, 256)}
        # a daemon whose challenge is under 8 bytes: nothing registered, the bytes untouched
        d.hello = "short-challenge"
        with pytest.raises(InferenceError) as exc:
            run(st.regions.register_flow("r2", region.name, 1024, 512, 5), d)
        assert exc.value.code == errors.INTERNAL and "no challenge" in str(exc.value)
        assert "r2" not in st.regions.known and bytes(region.buf[512:528]) == bytes(16)
        # a region that does not fit its segment is refused before asking the daemon
        asked = len(d.seen)
        with pytest.raises(InferenceError) as exc:
            run(st.regions.register_flow("r3", region.name, 4 * KiB, 8, 5), d)
        assert exc.value.code == errors.INVALID_ARG and len(d.seen) == asked
    finally:
        st.close()
        region.close()
        region.unlink()


def test_releases_ride_once_on_the_next_request_and_errors_are_not_retried(fake_daemon) -> None:
    d = fake_daemon()
    st = local_state()
    run(st.hello_flow(5), d)
    st.releases.append((st.session, ["worker-segment", 0, 1]))
    st.releases.append(("an-older-session", ["worker-segment", 64, 2]))   # not this session's
    x = np.ones(4, np.float32)
    run(st.infer_flow("m", {"X": x}, None, None, 5, copy=True), d)
    run(st.infer_flow("m", {"X": x}, None, None, 5, copy=True), d)
    assert d.seen[-2]["release"] == [["worker-segment", 0, 1]] and "release" not in d.seen[-1]

    st.releases.append((st.session, ["worker-segment", 128, 3]))
    sent: list[dict] = []

    def refuse(call):
        sent.append(messages.unpack(call.frames[0]))
        raise InferenceError(errors.INVALID_ARG, "unexpected shape for input 'X'")
    with pytest.raises(InferenceError) as exc:
        run(st.infer_flow("m", {"X": x}, None, None, 5, copy=True), refuse)
    assert exc.value.code == errors.INVALID_ARG
    assert len(sent) == 1 and sent[0]["release"] == [["worker-segment", 128, 3]]   # asked once
    assert st.arena.free_bytes == st.arena.mapped_bytes
    st.close()


def test_small_inputs_stay_inline_by_default(arena, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tensors, "LOCAL_MIN_BYTES", 16 * 1024)
    st = flows.ClientState("ipc:///nowhere", local=False)
    st.session, st.local, st.arena = "s1", True, arena
    small = np.ones((2, 16), np.float32)
    big = np.ones(8192, np.float32)                  # 32 KiB
    in_place = arena.empty((2, 16), np.float32)      # built in the arena: never copied, whatever its size
    enc = st.encoder.encode({"S": small, "B": big, "P": in_place}, arena, st.session)
    s_, b, p = enc.entries
    assert "data" in s_ and "shm" in b and "shm" in p
    assert enc.stats == [big.nbytes, in_place.nbytes, small.nbytes]
    st.encoder.finish(enc, arena, answered=True)


def test_concurrent_requests_grow_the_arena_once(fake_daemon) -> None:
    """Two flows interleaved (as AsyncClient runs them) that both find the arena
    full: one asks for a segment; the other goes inline instead of adding one more."""
    d = fake_daemon()
    st = local_state()
    try:
        run(st.hello_flow(5), d)
        a, b = np.ones(2 * KiB, np.float32), np.full(2 * KiB, 2, np.float32)   # 8 KiB each: no room
        f1 = st.infer_flow("m", {"X": a}, None, None, 5, copy=True)
        f2 = st.infer_flow("m", {"X": b}, None, None, 5, copy=True)
        grow = next(f1)
        assert messages.unpack(grow.frames[0])["op"] == "arena_grow"
        inline = next(f2)                                    # while the grow is in flight
        h2 = messages.unpack(inline.frames[0])
        assert h2["op"] == "infer" and "data" in h2["inputs"][0]
        infer1 = f1.send(d(grow))
        assert "shm" in messages.unpack(infer1.frames[0])["inputs"][0]
        for flow, call, x in ((f1, infer1, a), (f2, inline, b)):
            with pytest.raises(StopIteration) as done:
                flow.send(d(call))
            assert np.array_equal(done.value.value["X"], x)
        assert [h["op"] for h in d.seen].count("arena_grow") == 1 and len(st.arena.segments) == 2
        # the grow is over: the next request that finds no room may grow again
        assert not st.arena.growing
    finally:
        st.close()


def test_a_forgotten_client_closes_its_socket(tmp_path) -> None:
    """weakref.finalize, not __del__: a client that is garbage closes its socket;
    close() runs once and a closed client refuses calls."""
    from torchpool.client import AsyncClient

    url = f"ipc://{tmp_path}/nobody.sock"
    for cls in (Client, AsyncClient):
        c = cls(url, local=False)
        sock = c._sock
        assert not sock.closed
        del c
        gc.collect()
        assert sock.closed, cls.__name__
    c = Client(url, local=False)
    c.close()
    c.close()                                             # idempotent
    assert c._sock.closed
    with pytest.raises(InferenceError) as exc:
        c.server_live()
    assert exc.value.code == errors.CANCELLED


def test_many_small_inputs_go_as_frames_past_the_inline_budget() -> None:
    """A header holds at most --max-header-bytes (1 MiB) and inline tensors
    of up to 64 KiB each: 30 of those inline would make the daemon refuse the
    request. Past INLINE_BUDGET the client sends the rest as payload frames."""
    st = flows.ClientState("ipc:///nowhere", local=False)
    inputs = {f"X{i}": np.full(tensors.INLINE_LIMIT // 4, i, np.float32) for i in range(30)}
    enc = st.encoder.encode_inline(inputs, st.session)
    inline = [e for e in enc.entries if isinstance(e[tensors.DATA], bytes)]
    framed = [e for e in enc.entries if isinstance(e[tensors.DATA], int)]
    assert len(inline) * tensors.INLINE_LIMIT <= messages.INLINE_BUDGET < (len(inline) + 1) * tensors.INLINE_LIMIT
    assert len(framed) == 30 - len(inline) == len(enc.frames)
    header = messages.pack({"v": 1, "op": "infer", "id": 1, "model": "m", "inputs": enc.entries})
    assert len(header) < messages.MAX_HEADER_BYTES
    # every value is there, in order, inline or in its frame
    for i, e in enumerate(enc.entries):
        data = e[tensors.DATA] if isinstance(e[tensors.DATA], bytes) else bytes(enc.frames[e[tensors.DATA] - 1])
        assert np.frombuffer(data, np.float32)[0] == i
