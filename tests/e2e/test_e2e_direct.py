"""Direct paths (broker/direct.py, worker/direct.py) against a real daemon: a
local sync client's plain requests go straight to the model's worker, are
answered and counted as the daemon's own, and a client that abuses its path
gets a clear error, or loses the path, without harming the worker or anyone
else.

Attacks, each on a path asked for by hand over a lane: datagrams that are
not requests, cut-short frames, a header that is not msgpack, a datagram
over the size limit, requests the path does not take (another model, an
input in shared memory, an output into a region, a timeout), inputs of the
wrong type, shape or size, file descriptors sent along (the worker must not
keep them), a client that sends and never reads, and its session ending.
"""
from __future__ import annotations

import os
import select
import signal
import socket
import time
from pathlib import Path

import numpy as np
import pytest

from torchpool import Client
from torchpool.broker.options import ServerOptions
from torchpool.protocol import errors, lane, messages
from torchpool.protocol.errors import InferenceError
from torchpool.worker.direct import STALL_S

from ..support.daemon import Daemon, cpu_ticks, daemon_segments, wait_for
from .test_e2e_lane import A, RawLane, served



@pytest.fixture(scope="module")
def direct_daemon(small_repository: Path, tmp_path_factory: pytest.TempPathFactory):
    d = Daemon(small_repository, tmp_path_factory.mktemp("direct"), "--log-level", "debug").start()
    yield d
    assert d.stop() == 0, d.log()
    assert "Traceback" not in d.log(), d.log()
    assert not daemon_segments(d.urls), "the daemon left shared memory behind"


def transfer(c: Client) -> dict:
    return c.server_metadata()["transfer"]


def stats(c: Client, model: str) -> dict:
    return c.statistics(model)["model_stats"][0]


def worker_pid(d: Daemon, model: str) -> int:
    for line in d.log().splitlines():
        if f"model '{model}' version 1 instance" in line and "ready (pid" in line:
            return int(line.split("ready (pid ")[1].split(",")[0])
    raise AssertionError(f"no worker of {model} in the log")


class RawPath(RawLane):
    """A direct path asked for by hand on a lane, and spoken by hand."""

    def __init__(self, url: str, model: str = "addsub") -> None:
        super().__init__(url)
        self.send({"v": 1, "op": "direct", "id": 1, "model": model, "version": "", "session": self.token})
        self.sock.settimeout(10)
        data, fds, _, _ = socket.recv_fds(self.sock, lane.MAX_DATAGRAM, 4)
        name = messages.unpack(data)["segments"][0]["segment"]
        assert len(fds) == 1 and name.startswith("direct-")
        answer = self.answer()
        assert answer["ok"] and answer["result"]["direct"] == name, answer
        self.result = answer["result"]
        self.path = socket.socket(fileno=fds[0])
        self.path.settimeout(10)

    def send_path(self, data: bytes, fds: tuple = ()) -> None:
        self.send_raw(data, fds, sock=self.path)

    def request(self, header: dict, *payload: bytes) -> None:
        self.send(header, *payload, sock=self.path)

    def path_answer(self) -> dict:
        data = self.path.recv(lane.MAX_DATAGRAM + 1)
        assert data, "the worker closed the path"
        assert data[0] == lane.LAST
        return messages.unpack(lane.decode(memoryview(data)[1:])[0])

    def close(self) -> None:
        self.path.close()
        super().close()


def test_plain_requests_go_to_the_worker_and_are_counted(direct_daemon: Daemon) -> None:
    with Client(direct_daemon.url, timeout=30) as c:
        before, counted = transfer(c), stats(c, "addsub")
        for i in range(20):
            x = A + i
            out = c.infer("addsub", {"INPUT0": x, "INPUT1": A})
            np.testing.assert_array_equal(out["OUTPUT0"], x + A)
            np.testing.assert_array_equal(out["OUTPUT1"], x - A)
            # counted before the answer came: read at once, it is there
            assert stats(c, "addsub")["inference_count"] == counted["inference_count"] + i + 1
        after = transfer(c)
        assert after.get("requests_direct", 0) - before.get("requests_direct", 0) == 20
        # the lane carried only the ask for the path
        assert after.get("requests_on_lane", 0) - before.get("requests_on_lane", 0) == 1
        s = stats(c, "addsub")
        assert s["execution_count"] == counted["execution_count"] + 20
        assert s["inference_stats"]["success"]["count"] == counted["inference_stats"]["success"]["count"] + 20
        strings = c.infer("strings", {"INPUT__0": ["a", "bc"]})["OUTPUT__0"]      # BYTES both ways
        assert [s.decode() if isinstance(s, bytes) else s for s in strings] == ["A", "BC"]
        assert transfer(c)["requests_direct"] - after["requests_direct"] == 1


def test_both_ends_spin_as_long_as_the_daemon_says_and_not_when_idle(direct_daemon: Daemon) -> None:
    raw = RawPath(direct_daemon.url)
    try:
        assert raw.result["spin_us"] == ServerOptions.direct_spin_us > 0     # the default
    finally:
        raw.close()
    with Client(direct_daemon.url, timeout=30) as c:
        for i in range(200):
            np.testing.assert_array_equal(c.infer("addsub", {"INPUT0": A + i, "INPUT1": A})["OUTPUT1"], A + i - A)
        assert c._state.direct._paths[("addsub", "")]._spin.window_ns == ServerOptions.direct_spin_us * 1000
        # nothing comes: the worker sleeps again (each wait spins the window at most)
        pid = worker_pid(direct_daemon, "addsub")
        ticks = cpu_ticks(pid)
        time.sleep(1.0)                            # a measuring window, not a synchronisation
        assert cpu_ticks(pid) - ticks < 20, "the worker spun with no requests coming"


def test_a_daemon_without_spinning_serves_its_paths_asleep(small_repository: Path, tmp_path: Path) -> None:
    d = Daemon(small_repository, tmp_path, "--direct-spin-us", "0").start()
    try:
        raw = RawPath(d.url)
        try:
            assert raw.result["spin_us"] == 0
        finally:
            raw.close()
        with Client(d.url, timeout=30) as c:
            for i in range(20):
                np.testing.assert_array_equal(c.infer("addsub", {"INPUT0": A + i, "INPUT1": A})["OUTPUT0"], A + i + A)
            assert c._state.direct._paths[("addsub", "")]._spin is None
            assert transfer(c)["requests_direct"] >= 20
    finally:
        assert d.stop() == 0, d.log()


def test_a_direct_call_past_the_clients_timeout_leaves_no_trace(direct_daemon: Daemon) -> None:
    """A plain call goes the short way (no flow) on its open path; one that
    outlives the client's timeout fails DEADLINE_EXCEEDED, its late answer
    is dropped, and the calls after it get their own answers."""
    from ..support.models.slow import slow_iterations
    n = slow_iterations(0.5)
    with Client(direct_daemon.url, timeout=30) as c:
        assert int(c.infer("slow", {"INPUT__0": np.array([5])})["OUTPUT__0"][0]) == 5     # the path opens
        before = transfer(c)
        c.timeout = 0.05
        with pytest.raises(Exception) as exc:
            c.infer("slow", {"INPUT__0": np.array([n])})
        assert exc.value.code == errors.DEADLINE_EXCEEDED
        assert c._state.quarantine, "its id is kept for the late answer"
        c.timeout = 30
        for i in range(3):       # the late answer arrives meanwhile: each call gets its own
            assert int(c.infer("slow", {"INPUT__0": np.array([i + 1])})["OUTPUT__0"][0]) == i + 1
        wait_for(lambda: not c._state.quarantine, 10, "the late answer to be taken")
        after = transfer(c)
        assert after["requests_direct"] - before["requests_direct"] == 4
        assert after.get("requests_on_lane", 0) == before.get("requests_on_lane", 0)


def test_requests_a_direct_path_does_not_take_keep_the_lane(direct_daemon: Daemon) -> None:
    with Client(direct_daemon.url, timeout=30) as c:
        c.infer("addsub", {"INPUT0": A, "INPUT1": A})                # the path is open
        before = transfer(c)
        out = c.infer("addsub", {"INPUT0": A, "INPUT1": A}, priority=1)        # a priority
        np.testing.assert_array_equal(out["OUTPUT0"], A + A)
        big = np.arange(1 << 16, dtype=np.float32)                   # 256 KiB: in the arena
        np.testing.assert_array_equal(c.infer("identity", {"INPUT__0": big})["OUTPUT__0"], big)
        after = transfer(c)
        assert after.get("requests_direct", 0) == before.get("requests_direct", 0)
        assert after["requests_on_lane"] - before["requests_on_lane"] == 2     # no path asked for either


def test_a_call_with_a_timeout_takes_the_direct_path(direct_daemon: Daemon) -> None:
    """A per-call timeout no longer sends a call the long way round: it
    travels with the request, on the short way and through the flow."""
    with Client(direct_daemon.url, timeout=30) as c:
        c.infer("addsub", {"INPUT0": A, "INPUT1": A})                # the path is open
        before, counted = transfer(c), stats(c, "addsub")
        for i in range(5):
            out = c.infer("addsub", {"INPUT0": A + i, "INPUT1": A}, timeout=20)
            np.testing.assert_array_equal(out["OUTPUT0"], A + i + A)
        after = transfer(c)
        assert after["requests_direct"] - before["requests_direct"] == 5
        assert after.get("requests_on_lane", 0) == before.get("requests_on_lane", 0)
        assert stats(c, "addsub")["inference_count"] == counted["inference_count"] + 5


def test_a_direct_request_whose_deadline_passed_before_it_started_is_not_run(direct_daemon: Daemon) -> None:
    """Triton's semantics on the direct path: the worker drops a request
    whose timeout passed before it could start (counted from when the
    client sent it), answers "Request timeout expired" and counts a
    rejected request; nothing runs. Shown two ways: a request that says it
    was sent a second ago with a 1 ms timeout, and a real client's call
    with a 0.3 s timeout to a worker stopped (SIGSTOP) until the client has
    given up on it."""
    raw = RawPath(direct_daemon.url)
    try:
        with Client(direct_daemon.url, timeout=30) as c:
            counted = stats(c, "addsub")
            raw.request(_with(raw, 7, timeout_us=1000, sent_ns=time.monotonic_ns() - 10**9))
            answer = raw.path_answer()
            assert (answer["id"], answer["ok"], answer["error"]) == (
                7, False, {"code": errors.UNAVAILABLE, "message": "Request timeout expired"})
            raw.request(_with(raw, 8, timeout_us=10**7, sent_ns=time.monotonic_ns()))   # in time: runs
            assert raw.path_answer()["ok"]
            s = stats(c, "addsub")
            assert s["inference_count"] == counted["inference_count"] + 1
            assert s["inference_stats"]["fail"]["count"] == counted["inference_stats"]["fail"]["count"] + 1
    finally:
        raw.close()
    with Client(direct_daemon.url, timeout=30) as c:
        c.infer("addsub", {"INPUT0": A, "INPUT1": A})                # the path is open
        counted, before = stats(c, "addsub"), transfer(c)
        pid = worker_pid(direct_daemon, "addsub")
        os.kill(pid, signal.SIGSTOP)
        try:
            with pytest.raises(InferenceError) as late:
                c.infer("addsub", {"INPUT0": A, "INPUT1": A}, timeout=0.3)
            assert late.value.code == errors.DEADLINE_EXCEEDED
        finally:
            os.kill(pid, signal.SIGCONT)
        wait_for(lambda: stats(c, "addsub")["inference_stats"]["fail"]["count"]
                 == counted["inference_stats"]["fail"]["count"] + 1, 30, "the expired request to be counted")
        s = stats(c, "addsub")
        assert s["inference_count"] == counted["inference_count"]            # it never ran
        # the late answer (the error) comes before the next call's own: that call gets its own
        np.testing.assert_array_equal(c.infer("addsub", {"INPUT0": A, "INPUT1": A}, timeout=20)["OUTPUT0"], A + A)
        assert not c._state.quarantine
        assert transfer(c)["requests_direct"] - before["requests_direct"] == 2


@pytest.mark.parametrize("model, version, code, expected", [
    ("addsub", "7", errors.NOT_FOUND, "addsub"),
    ("nothing", "", errors.NOT_FOUND, "nothing"),
])
def test_a_path_is_refused_with_the_reason(direct_daemon: Daemon, model: str, version: str, code: str,
                                           expected: str) -> None:
    raw = RawLane(direct_daemon.url)
    try:
        raw.send({"v": 1, "op": "direct", "id": 5, "model": model, "version": version, "session": raw.token})
        answer = raw.answer()
        assert not answer["ok"] and answer["error"]["code"] == code, answer
        assert expected in answer["error"]["message"], answer
        assert _nothing_waits(raw.sock)            # no fd was pushed
    finally:
        raw.close()


def _nothing_waits(sock: socket.socket) -> bool:
    sock.setblocking(False)
    try:
        sock.recv(1, socket.MSG_PEEK)
    except BlockingIOError:
        return True
    finally:
        sock.settimeout(10)
    return False


@pytest.mark.parametrize("data, expected", [
    (b"\x07" + bytes(20), "one datagram"),
    (bytes([lane.MORE]) + bytes(20), "one datagram"),
    (bytes([lane.LAST]) + b"\x10\x00", "cut short"),
    (bytes([lane.LAST]) + b"\x00\x00\x00\x00", "malformed request header"),
    (bytes([lane.LAST]) + b"\x03\x00\x00\x00\xc1\xc1\xc1", "malformed request header"),
    (bytes([lane.LAST]) + bytes(lane.MAX_DATAGRAM + 10), "one datagram"),
])
def test_malformed_datagrams_get_an_error_and_the_path_serves_on(direct_daemon: Daemon, data: bytes,
                                                                 expected: str) -> None:
    raw = RawPath(direct_daemon.url)
    try:
        raw.send_path(data)
        answer = raw.path_answer()
        assert not answer["ok"] and answer["error"]["code"] == errors.INVALID_ARG, answer
        assert expected in answer["error"]["message"], answer
        raw.request(raw.infer(9))
        answer = raw.path_answer()
        assert answer["ok"] and answer["id"] == 9, answer
    finally:
        raw.close()
    served(direct_daemon)


def _with(raw: RawPath, rid: int, **fields: object) -> dict:
    header = raw.infer(rid)
    header.update(fields)
    return header


@pytest.mark.parametrize("change, code, expected", [
    ({"op": "unload"}, errors.UNSUPPORTED, "the direct path of model 'addsub' takes only infer"),
    ({"model": "identity"}, errors.INVALID_ARG, "serves model 'addsub'"),
    ({"priority": 1}, errors.UNSUPPORTED, "goes to the daemon"),
    ({"outputs": [{"name": "OUTPUT0", "region": "r"}]}, errors.UNSUPPORTED, "by name only"),
    ({"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 16], "shm": ["x", 0, 64, 1]},
                 {"name": "INPUT1", "datatype": "FP32", "shape": [1, 16], "data": A.tobytes()}]},
     errors.UNSUPPORTED, "inline inputs only"),
    ({"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 16], "data": A.tobytes()},
                 {"name": "INPUT1", "datatype": "FP32", "shape": [1, 16], "data": A.tobytes()[:60]}]},
     errors.INVALID_ARG, "input byte size mismatch for input 'INPUT1' for model 'addsub'"),
    ({"inputs": [{"name": "INPUT0", "datatype": "INT32", "shape": [1, 16], "data": A.tobytes()},
                 {"name": "INPUT1", "datatype": "FP32", "shape": [1, 16], "data": A.tobytes()}]},
     errors.INVALID_ARG, "inference input 'INPUT0' data-type is 'INT32', but model 'addsub' expects"),
    ({"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 16], "data": 7}]},
     errors.INVALID_ARG, "expected 2 inputs"),
])
def test_requests_the_path_does_not_take_are_refused_clearly(direct_daemon: Daemon, change: dict, code: str,
                                                             expected: str) -> None:
    raw = RawPath(direct_daemon.url)
    try:
        raw.request(_with(raw, 3, **change))
        answer = raw.path_answer()
        assert not answer["ok"] and answer["id"] == 3, answer
        assert answer["error"]["code"] == code and expected in answer["error"]["message"], answer
        raw.request(raw.infer(4))
        assert raw.path_answer()["ok"]
    finally:
        raw.close()


def test_fds_sent_on_a_path_are_not_kept(direct_daemon: Daemon) -> None:
    pid = worker_pid(direct_daemon, "addsub")
    raw = RawPath(direct_daemon.url)
    try:
        raw.request(raw.infer(1))
        assert raw.path_answer()["ok"]
        before = len(os.listdir(f"/proc/{pid}/fd"))
        r, w = os.pipe()
        try:
            for i in range(10):
                header = messages.pack(raw.infer(10 + i))
                raw.send_path(b"".join([bytes([lane.LAST]), *lane.encode([header])]), (r, w))
                assert raw.path_answer()["ok"]
        finally:
            os.close(r)
            os.close(w)
        assert len(os.listdir(f"/proc/{pid}/fd")) <= before
    finally:
        raw.close()


def flood(path: socket.socket, header: dict) -> int:
    """Send `header` as a request on `path` until the worker stops reading
    it (no room for 2 s), never reading an answer; how many were sent."""
    path.setblocking(False)
    datagram = b"".join([bytes([lane.LAST]), *lane.encode([messages.pack(header)])])
    sent, deadline = 0, time.monotonic() + 60
    while time.monotonic() < deadline:
        if not select.select([], [path], [], 2.0)[1]:
            break
        try:
            path.send(datagram)
            sent += 1
        except BlockingIOError:
            pass
    return sent


def test_a_client_that_never_reads_its_path_loses_it_and_others_are_served(direct_daemon: Daemon) -> None:
    raw = RawPath(direct_daemon.url)
    try:
        assert flood(raw.path, raw.infer(1)) > 1
        served(direct_daemon)                      # meanwhile the worker serves everyone else
        with Client(direct_daemon.url, timeout=30) as c:
            for _ in range(5):
                np.testing.assert_array_equal(c.infer("addsub", {"INPUT0": A, "INPUT1": A})["OUTPUT0"], A + A)
        # and waits for the stalled client without spinning on its unread requests
        pid = worker_pid(direct_daemon, "addsub")
        ticks = cpu_ticks(pid)
        time.sleep(1.0)                            # a measuring window, not a synchronisation
        assert cpu_ticks(pid) - ticks < 20, "the worker spun while a client did not read"
        # and closes the path of the client that does not read its answer
        raw.path.setblocking(True)
        raw.path.settimeout(STALL_S + 20)
        wait_for(lambda: "left an answer unread" in direct_daemon.log(), STALL_S + 20,
                 "the worker to close the path of a client that does not read")
        try:
            while raw.path.recv(lane.MAX_DATAGRAM + 1):
                pass                               # what was sent before it closed, then EOF
        except ConnectionResetError:
            pass                                   # closed with our requests unread: a reset
    finally:
        raw.close()
    served(direct_daemon)


def test_a_session_that_ends_closes_its_path(direct_daemon: Daemon) -> None:
    raw = RawPath(direct_daemon.url)
    try:
        raw.request(raw.infer(1))
        assert raw.path_answer()["ok"]
        raw.dealer.send(messages.pack({"v": 1, "op": "goodbye", "id": 2, "session": raw.token}))
        assert raw.dealer.poll(10000) and messages.unpack(raw.dealer.recv())["ok"]
        raw.path.settimeout(10)
        assert raw.path.recv(lane.MAX_DATAGRAM + 1) == b""     # EOF: the worker closed it
    finally:
        raw.close()
    served(direct_daemon)


def test_a_path_whose_worker_dies_fails_fast_and_the_client_goes_on(direct_daemon: Daemon) -> None:
    with Client(direct_daemon.url, timeout=60) as c:
        c.infer("slow", {"INPUT__0": np.array([1], dtype=np.int64)})        # the path is open
        pid = worker_pid(direct_daemon, "slow")
        before = _ready_lines(direct_daemon, "slow")
        failed = stats(c, "slow")["inference_stats"]["fail"]["count"]
        from ..support.models.slow import slow_iterations
        import threading
        outcome: dict = {}

        def call() -> None:
            started = time.monotonic()
            try:
                c.infer("slow", {"INPUT__0": np.array([slow_iterations(30)], dtype=np.int64)})
            except Exception as exc:   # noqa: BLE001 - the test reads it
                outcome["error"] = exc
            outcome["took"] = time.monotonic() - started

        t = threading.Thread(target=call)
        t.start()
        wait_for(lambda: _busy(pid), 20, "the slow request to run")
        os.kill(pid, 9)
        t.join(30)
        assert not t.is_alive()
        err = outcome.get("error")
        # worded as the daemon words its own: the instance, how it died
        assert err is not None and err.code == errors.INTERNAL, outcome
        assert "'slow'" in err.message and "SIGKILL" in err.message, outcome
        assert outcome["took"] < 20
        assert stats(c, "slow")["inference_stats"]["fail"]["count"] == failed + 1   # the model's failure
        wait_for(lambda: _ready_lines(direct_daemon, "slow") > before, 30, "a new instance of slow")
        out = c.infer("slow", {"INPUT__0": np.array([3], dtype=np.int64)})        # a new path, or the lane
        assert out["OUTPUT__0"].tolist() == [3]


def _ready_lines(d: Daemon, model: str) -> int:
    return sum(1 for line in d.log().splitlines()
               if f"model '{model}' version 1 instance" in line and "ready (pid" in line)


def _busy(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[1].split()[0] == "R"


def test_an_unloaded_model_closes_its_paths_and_a_reload_opens_new_ones(small_repository: Path,
                                                                       tmp_path: Path) -> None:
    d = Daemon(small_repository, tmp_path, "--model-control-mode", "explicit", "--load-model", "addsub").start()
    try:
        with Client(d.url, timeout=30) as c:
            np.testing.assert_array_equal(c.infer("addsub", {"INPUT0": A, "INPUT1": A})["OUTPUT0"], A + A)
            assert c._state.direct._paths[("addsub", "")].__class__.__name__ == "DirectSocket"
            c.unload("addsub")
            with pytest.raises(Exception) as exc:        # the closed path's call goes to the daemon
                c.infer("addsub", {"INPUT0": A, "INPUT1": A})
            assert exc.value.code in (errors.UNAVAILABLE, errors.NOT_FOUND) and "addsub" in exc.value.message
            c.load("addsub")
            direct = transfer(c).get("requests_direct", 0)
            np.testing.assert_array_equal(c.infer("addsub", {"INPUT0": A, "INPUT1": A})["OUTPUT1"], A - A)
            assert transfer(c)["requests_direct"] == direct + 1          # on a new path
    finally:
        assert d.stop() == 0, d.log()
    assert "Traceback" not in d.log(), d.log()


def test_direct_requests_keep_their_session_alive(small_repository: Path, tmp_path: Path) -> None:
    """The broker never sees a direct request; the worker's report of it
    renews the session's lease, as a request to the broker would."""
    d = Daemon(small_repository, tmp_path, "--client-lease", "0.5").start()
    try:
        with Client(d.url, timeout=30) as c:
            c.infer("addsub", {"INPUT0": A, "INPUT1": A})
            token, lane = c._state.session, transfer(c)["requests_on_lane"]
            end = time.monotonic() + 2.0                  # four leases of direct requests only
            while time.monotonic() < end:
                np.testing.assert_array_equal(c.infer("addsub", {"INPUT0": A, "INPUT1": A})["OUTPUT0"], A + A)
            assert c._state.session == token              # never lost, never said hello again
            assert transfer(c)["requests_on_lane"] == lane
    finally:
        assert d.stop() == 0, d.log()
    assert "idle for" not in d.log(), d.log()
