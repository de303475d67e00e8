"""The client package without a daemon: block headers, the client arena,
release-by-finalizer of lent outputs, zero-copy detection of `empty()` arrays,
and the flows driven by a scripted fake daemon."""
from __future__ import annotations

import gc
import os
import struct
import uuid

import numpy as np
import pytest

from torchpool.client import Client, OutputRef, RegionOutput, SharedMemoryRef
from torchpool.client import arena as ca
from torchpool.client import flows
from torchpool.protocol import errors, messages, tensors
from torchpool.protocol.errors import InferenceError
from torchpool.shm import Segment
from torchpool.shm.naming import boot_id

KiB = 1024


@pytest.fixture(autouse=True)
def arena_for_small_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests drive the arena path with small tensors; by default tensors
    of at most LOCAL_MIN_BYTES travel inline (test_small_inputs_stay_inline)."""
    monkeypatch.setattr(tensors, "LOCAL_MIN_BYTES", 0)


@pytest.fixture
def daemon_segments(prefix):
    """Segments as a daemon would create them for a client (we own them here)."""
    made: list[Segment] = []

    def make(size: int) -> str:
        seg = Segment.create(f"{prefix}c{len(made)}", size, prefault=False)
        made.append(seg)
        return seg.name
    yield make
    for seg in made:
        seg.unlink()
        seg.close()


@pytest.fixture
def arena(daemon_segments):
    a = ca.ClientArena()
    a.map_segment(daemon_segments(64 * KiB))
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
    arena.map_segment(daemon_segments(32 * KiB))
    other = arena.alloc(8 * KiB)
    assert other is not None and other.segment != big.segment
    assert arena.mapped_bytes == 96 * KiB


def test_arena_data_is_shared_with_the_daemon_mapping(arena) -> None:
    name = next(iter(arena.segments))
    daemon_view = Segment.attach(name)
    try:
        block = arena.alloc(16)
        arena.data(block, 16)[:] = b"0123456789abcdef"
        desc = arena.hand_out(block, 16)
        magic, _, gen, n = struct.unpack_from("<IIQQ", daemon_view.buf, desc[1] - 64)
        assert (magic, gen, n) == (tensors.BLOCK_MAGIC, desc[3], 16)
        assert bytes(daemon_view.buf[desc[1]:desc[1] + 16]) == b"0123456789abcdef"
    finally:
        daemon_view.close()


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
    enc = st.encode_inputs({"A": buf, "B": plain, "C": buf[1:], "S": ["ab", "c"]}, arena)
    a, b, c, s = enc.entries
    seg = arena.segments[a["shm"][0]]
    assert a["shm"][1] == arena.lookup(buf).data_offset and a["shm"][2] == buf.nbytes
    assert tensors.read_block_header(seg.buf, a["shm"][1] - 64) == (tensors.BLOCK_MAGIC, a["shm"][3], buf.nbytes)
    assert "shm" in b and "shm" in c and "shm" in s and "data" not in b
    assert enc.stats == [plain.nbytes + buf[1:].nbytes + 4 + 2 + 4 + 1, buf.nbytes, 0]
    got = np.frombuffer(seg.buf, np.float32, count=32, offset=b["shm"][1])
    assert np.array_equal(got, plain.reshape(-1))
    # the same buffer in flight twice: the second use is copied
    enc2 = st.encode_inputs({"A": buf}, arena)
    assert enc2.stats == [buf.nbytes, 0, 0]
    st.finish(enc, arena, answered=True)
    st.finish(enc2, arena, answered=True)
    enc3 = st.encode_inputs({"A": buf}, arena)
    assert enc3.stats == [0, buf.nbytes, 0]
    st.finish(enc3, arena, answered=True)


def test_encode_copies_odd_arrays_once_in_native_order(arena) -> None:
    st = flows.ClientState("ipc:///nowhere", local=False)
    x = np.arange(32, dtype=">i4").reshape(4, 8)[:, ::2]      # big-endian and strided
    enc = st.encode_inputs({"X": x}, arena)
    (e,) = enc.entries
    assert e["datatype"] == "INT32" and e["shape"] == [4, 4]
    seg = arena.segments[e["shm"][0]]
    got = np.frombuffer(seg.buf, "<i4", count=16, offset=e["shm"][1]).reshape(4, 4)
    assert np.array_equal(got, x)
    st.finish(enc, arena, answered=True)


def test_encode_reports_need_room_and_frees_what_it_took(arena) -> None:
    st = flows.ClientState("ipc:///nowhere", local=False)
    free0 = arena.free_bytes
    with pytest.raises(flows._NeedRoom) as room:
        st.encode_inputs({"A": np.zeros(8 * KiB, np.float32), "B": np.zeros(16 * KiB, np.float32)}, arena)
    assert room.value.nbytes >= 64 * KiB
    assert arena.free_bytes == free0


def test_garbage_empty_block_in_flight_is_freed_when_the_flight_ends(arena) -> None:
    st = flows.ClientState("ipc:///nowhere", local=False)
    free0 = arena.free_bytes
    buf = arena.empty((16,), np.float32)
    enc = st.encode_inputs({"A": buf}, arena)
    del buf
    gc.collect()
    assert arena.free_bytes < free0                       # garbage, but the daemon may read it
    st.finish(enc, arena, answered=False, rid=7)          # no answer: quarantined
    assert 7 in st.quarantine and arena.free_bytes < free0
    st.arena = arena
    st.late_reply({"id": 7, "ok": True, "outputs": []})   # the late answer frees it
    assert 7 not in st.quarantine and arena.free_bytes == free0


# ------------------------------------------------------------------ lent outputs

def test_lent_outputs_are_released_when_the_last_view_is_gone(daemon_segments) -> None:
    name = daemon_segments(64 * KiB)
    worker = Segment.attach(name)
    try:
        np.frombuffer(worker.buf, np.float32, count=16, offset=128)[:] = np.arange(16)
        st = flows.ClientState("ipc:///nowhere", local=False)
        st.session, st.local = "tok", True
        header = {"outputs": [{"name": "OUT", "datatype": "FP32", "shape": [4, 4],
                               "shm": [name, 128, 64, 99]}]}
        with st.decode_outputs(header, [], copy=False) as out:
            arr = out["OUT"]
            assert arr.shape == (4, 4) and not arr.flags.writeable
            assert np.array_equal(arr.reshape(-1), np.arange(16))
            with pytest.raises(ValueError):
                arr[0, 0] = 1
            row = arr[2]
        assert out == {}
        del arr
        gc.collect()
        assert not st.releases                    # `row` still views it
        assert row[0] == 8.0
        del row
        gc.collect()
        assert list(st.releases) == [("tok", [name, 128, 99])]
        assert st.session_fields() == {"session": "tok", "release": [[name, 128, 99]]}
        assert st.session_fields() == {"session": "tok"}
        # copy=True: an ordinary array, released at once
        out = st.decode_outputs(header, [], copy=True)
        assert out["OUT"].flags.writeable and out["OUT"].flags.owndata
        assert list(st.releases) == [("tok", [name, 128, 99])]
        # releases of another session are dropped
        st.releases.append(("old", [name, 0, 1]))
        assert st.session_fields()["release"] == [[name, 128, 99]]
        # BYTES are decoded and released at once
        worker.buf[1024:1024 + 9] = b"\x05\x00\x00\x00hello"
        out = st.decode_outputs({"outputs": [{"name": "T", "datatype": "BYTES", "shape": [1],
                                              "shm": [name, 1024, 9, 5]}]}, [], copy=False)
        assert out["T"].tolist() == [b"hello"]
        assert st.session_fields()["release"] == [[name, 1024, 5]]
        st.outputs.clear()
    finally:
        worker.close()


def test_late_reply_releases_lent_outputs() -> None:
    st = flows.ClientState("ipc:///nowhere", local=False)
    st.session = "tok"
    st.finish(flows._Encoded(), None, answered=False, rid=3, token="tok")      # timed out
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
    assert ca.local_wanted(None) == (os.access("/dev/shm", os.W_OK) and bool(boot_id()))
    assert not ca.local_wanted(False)


# ------------------------------------------------------------------ flows against a fake daemon

class FakeDaemon:
    """Answers calls in-process, like the daemon would (enough for the flows)."""

    def __init__(self, make_segment, hello: str = "ok") -> None:
        self.make_segment = make_segment
        self.hello = hello
        self.sessions: set[str] = set()
        self.seen: list[dict] = []
        self.segments: dict[str, Segment] = {}

    def __call__(self, call: flows.Call):
        h = messages.unpack(call.frames[0])
        self.seen.append(h)
        op = h["op"]
        if op == "hello":
            if self.hello == "unsupported":
                raise InferenceError(errors.UNSUPPORTED, "unknown operation 'hello'")
            tok = uuid.uuid4().hex
            self.sessions.add(tok)
            name = self.make_segment(4 * KiB)
            if os.path.exists(f"/dev/shm/{name}"):
                self.segments[name] = Segment.attach(name)
            return {"id": h["id"], "ok": True, "result": {
                "session": tok, "local": h["local"], "lease_s": 60, "block_header": 64,
                "arena": [{"segment": name, "size": 4 * KiB}]}}, []
        if h.get("session") is not None and h["session"] not in self.sessions:
            raise InferenceError(errors.SESSION_LOST, "unknown session (its lease expired or the daemon "
                                                      "restarted); say hello again")
        if op == "arena_grow":
            name = self.make_segment(max(h["size"], 4 * KiB))
            self.segments[name] = Segment.attach(name)
            return {"id": h["id"], "ok": True, "result": {"segment": name, "size": h["size"]}}, []
        if op == "infer":
            outs = []
            for e in h["inputs"]:
                if "shm" in e:
                    seg, off, n, gen = e["shm"]
                    magic, g, nb = tensors.read_block_header(self.segments[seg].buf, off - 64)
                    assert (magic, g, nb) == (tensors.BLOCK_MAGIC, gen, n), "stale descriptor"
                    data = bytes(self.segments[seg].buf[off:off + n])
                else:
                    data = e["data"] if isinstance(e["data"], bytes) else bytes(call.frames[e["data"]])
                outs.append({"name": e["name"], "datatype": e["datatype"], "shape": e["shape"],
                             "data": data})
            return {"id": h["id"], "ok": True, "outputs": outs}, []
        return {"id": h["id"], "ok": True, "result": True}, []

    def close(self) -> None:
        for s in self.segments.values():
            s.close()


def run(flow, daemon):
    return flows.run_sync(flow, daemon)


def local_state() -> flows.ClientState:
    st = flows.ClientState("ipc:///nowhere", local=False)
    st.want_local = True
    return st


def test_hello_then_arena_inputs_then_grow(daemon_segments) -> None:
    d = FakeDaemon(daemon_segments)
    st = local_state()
    try:
        assert st.needs_hello()
        run(st.hello_flow(5), d)
        assert st.local and st.session in d.sessions and st.arena.mapped_bytes == 4 * KiB
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
        huge = np.ones(2 * 1024 * KiB, np.uint8)                     # above the client's cap: inline
        st.arena.cap = 1024 * KiB
        run(st.infer_flow("m", {"X": huge}, None, None, 5, copy=True), d)
        assert "data" in d.seen[-1]["inputs"][0]
        assert st.stats["bytes_inline"] == huge.nbytes
    finally:
        st.close()
        d.close()


def test_session_lost_rehello_and_retry(daemon_segments) -> None:
    d = FakeDaemon(daemon_segments)

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
        buf = c.empty((1, 16))
        buf[:] = 2
        out = c.infer("m", {"X": buf})
        assert np.array_equal(out["X"], buf)
        assert c.transfer_stats()["bytes_zero_copy"] == 64
    finally:
        c.close()
        d.close()


def test_hello_refused_falls_back_to_inline(daemon_segments) -> None:
    d = FakeDaemon(daemon_segments, hello="unsupported")
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


def test_unmappable_arena_falls_back_to_a_remote_session(daemon_segments) -> None:
    """Same boot id but another /dev/shm (e.g. another container): goodbye, hello as remote."""
    d = FakeDaemon(lambda size: "torchpool.no-such-segment-" + uuid.uuid4().hex)
    st = local_state()
    run(st.hello_flow(5), d)
    assert [h["op"] for h in d.seen] == ["hello", "goodbye", "hello"]
    assert d.seen[-1]["local"] is False
    assert st.session is not None and not st.local and st.arena is None


def test_releases_ride_once_on_the_next_request_and_errors_are_not_retried(daemon_segments) -> None:
    d = FakeDaemon(daemon_segments)
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
    d.close()


def test_small_inputs_stay_inline_by_default(arena, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tensors, "LOCAL_MIN_BYTES", 16 * 1024)
    st = flows.ClientState("ipc:///nowhere", local=False)
    st.session, st.local, st.arena = "s1", True, arena
    small = np.ones((2, 16), np.float32)
    big = np.ones(8192, np.float32)                  # 32 KiB
    in_place = arena.empty((2, 16), np.float32)      # built in the arena: never copied, whatever its size
    enc = st.encode_inputs({"S": small, "B": big, "P": in_place}, arena)
    s_, b, p = enc.entries
    assert "data" in s_ and "shm" in b and "shm" in p
    assert enc.stats == [big.nbytes, in_place.nbytes, small.nbytes]
    st.finish(enc, arena, answered=True)


def test_concurrent_requests_grow_the_arena_once(daemon_segments) -> None:
    """Two flows interleaved (as AsyncClient runs them) that both find the arena
    full: one asks for a segment; the other goes inline instead of adding one more."""
    d = FakeDaemon(daemon_segments)
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
        d.close()


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
