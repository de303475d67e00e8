"""The answer path without a daemon: a real frontend socket, a real worker
output arena, and a client socket that reads what the answers say."""
from __future__ import annotations

import os
import socket
import time
import uuid
from collections import Counter

import numpy as np
import pytest
import zmq

from torchpool.broker.answers import Answers, Executed
from torchpool.broker.batch import Batch
from torchpool.broker.frontend import Frontend
from torchpool.broker.options import ServerOptions
from torchpool.broker.registry import ModelVersion
from torchpool.broker.requests import InferRequest
from torchpool.broker.sessions import SessionManager
from torchpool.broker.supervisor import WorkerHandle
from torchpool.config import ModelConfig
from torchpool.config.pbtxt import parse_pbtxt
from torchpool.protocol import errors, messages
from torchpool.protocol.errors import TorchpoolError
from torchpool.protocol.internal import OutputDescriptor
from torchpool.shm.arena import Arena


def version(extra: str = "") -> ModelVersion:
    text = ('name: "m"\nplatform: "pytorch_libtorch"\nmax_batch_size: 8\n'
            'input [ { name: "INPUT__0" data_type: TYPE_FP32 dims: [ 2 ] } ]\n'
            'output [ { name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ 2 ] } ]\n' + extra)
    return ModelVersion("m", 1, ModelConfig.from_json({**parse_pbtxt(text), "name": "m"}), "/nowhere/1/model.pt")


class Rig:
    """A frontend, the client connected to it, a worker's output arena."""

    def __init__(self, tmp_path) -> None:
        tag = f"torchpool.unit{os.getpid()}.{uuid.uuid4().hex[:6]}"
        self.ctx = zmq.Context()
        self.frontend = Frontend(self.ctx, [f"ipc://{tmp_path}/answers.sock"])
        self.client = self.ctx.socket(zmq.DEALER)
        self.client.setsockopt(zmq.IDENTITY, b"client-1")
        self.client.connect(f"ipc://{tmp_path}/answers.sock")
        # a ROUTER drops messages to peers it does not know yet: wait until it knows this one
        self.client.send(b"hello")
        assert self.frontend.sockets[0].poll(5000)
        assert self.frontend.sockets[0].recv_multipart() == [b"client-1", b"hello"]
        self.broker_arena = Arena(lambda i: f"{tag}in{i}", 1 << 20, 4 << 20)
        options = ServerOptions("repo", [], client_shm_size=1 << 20, client_shm_limit=4 << 20)
        # the sessions give back what was lent to a session that closes (the server's wiring)
        self.sessions = SessionManager(tag, options, lambda session: self.answers.end_loans(session),
                                       lambda refs: None)
        self.answers = Answers(self.frontend, self.broker_arena, Counter(), self.sessions)
        # a worker hands its output segments' fds to the broker; here the arena does it directly
        self.worker_arena = Arena(lambda i: f"{tag}w0.{i}", 1 << 20, 4 << 20, announce=lambda seg:
                                  self.answers.worker_segments.add(seg.name, os.dup(seg.fd), writable=False,
                                                                   keep_fd=True))
        self.worker = WorkerHandle(0, None, None, None, None)

    def request(self, mv: ModelVersion, rid: int, rows: int = 1) -> InferRequest:
        return InferRequest(self.frontend.sockets[0], b"client-1", rid, mv, [], ["OUTPUT__0"], rows=rows,
                            batch_size=rows)

    def outputs(self, rows: np.ndarray) -> list:
        """A worker's output descriptor for `rows`, written into its arena."""
        block = self.worker_arena.alloc(rows.nbytes)
        self.worker_arena.view(block)[:] = rows.tobytes()
        return [OutputDescriptor("OUTPUT__0", "FP32", list(rows.shape), block.segment, block.offset, rows.nbytes)]

    def receive(self) -> dict:
        assert self.client.poll(5000), "no answer within 5 s"
        header, *frames = self.client.recv_multipart()
        return messages.decode_header(header)

    def close(self) -> None:
        self.sessions.close_all()
        self.answers.close()
        self.client.close(linger=0)
        self.frontend.close()
        self.ctx.term()
        self.broker_arena.close()
        self.worker_arena.close()


@pytest.fixture
def rig(tmp_path):
    r = Rig(tmp_path)
    yield r
    r.close()


def values(answer: dict) -> list:
    out = answer["outputs"][0]
    return [out["name"], out["shape"], np.frombuffer(out["data"], np.float32).tolist()]


def test_a_batch_is_split_into_one_answer_per_request_and_the_block_goes_back(rig: Rig) -> None:
    mv = version()
    a, b = rig.request(mv, 1, rows=1), rig.request(mv, 2, rows=2)
    batch = Batch([a, b], 3, 3, [], ["OUTPUT__0"])
    outputs = rig.outputs(np.arange(6, dtype=np.float32).reshape(3, 2))
    rig.answers.complete(mv, batch, Executed(outputs, rig.worker))
    first, second = rig.receive(), rig.receive()
    assert (first["id"], first["ok"], values(first)) == (1, True, ["OUTPUT__0", [1, 2], [0, 1]])
    assert (second["id"], values(second)) == (2, ["OUTPUT__0", [2, 2], [2, 3, 4, 5]])
    # small outputs travel inline: the worker's block is free again at once
    assert rig.worker.releases == [list(outputs[0][3:6])]
    assert mv.stats.success.count == 2


def test_a_failed_batch_fails_each_request_with_its_error(rig: Rig) -> None:
    mv = version()
    batch = Batch([rig.request(mv, 7), rig.request(mv, 8)], 2, 2, [], ["OUTPUT__0"])
    rig.answers.complete(mv, batch, TorchpoolError(errors.INTERNAL, "instance 'm_0' was killed"))
    got = [rig.receive() for _ in range(2)]
    assert [(g["id"], g["ok"], g["error"]["code"], g["error"]["message"]) for g in got] == [
        (7, False, "INTERNAL", "instance 'm_0' was killed"), (8, False, "INTERNAL", "instance 'm_0' was killed")]
    assert mv.stats.fail.count == 2


def test_outputs_that_cannot_be_split_fail_the_batch_not_the_broker(rig: Rig) -> None:
    mv = version()
    batch = Batch([rig.request(mv, 1), rig.request(mv, 2)], 2, 2, [], ["OUTPUT__0"])
    outputs = rig.outputs(np.zeros((3, 2), np.float32))       # 3 rows for a batch of 2
    rig.answers.complete(mv, batch, Executed(outputs, rig.worker))
    got = [rig.receive() for _ in range(2)]
    assert all(not g["ok"] and "has 3 rows for a batch of 2 rows" in g["error"]["message"] for g in got)
    assert rig.worker.releases == [list(outputs[0][3:6])]


def test_preserve_ordering_answers_in_the_order_batches_were_sent(rig: Rig) -> None:
    mv = version("dynamic_batching { preserve_ordering: true }")
    first, second = (Batch([rig.request(mv, i)], 1, 1, [], ["OUTPUT__0"]) for i in (1, 2))
    rig.answers.dispatched(mv, first)
    rig.answers.dispatched(mv, second)
    rig.answers.complete(mv, second, Executed(rig.outputs(np.ones((1, 2), np.float32)), rig.worker))
    assert not rig.client.poll(100)          # the second waits for the first
    rig.answers.complete(mv, first, Executed(rig.outputs(np.zeros((1, 2), np.float32)), rig.worker))
    got = [rig.receive(), rig.receive()]
    assert [(g["id"], values(g)[2]) for g in got] == [(1, [0, 0]), (2, [1, 1])]


def test_held_answers_of_a_dead_worker_keep_their_bytes(rig: Rig) -> None:
    mv = version("dynamic_batching { preserve_ordering: true }")
    rig.worker.mv = mv
    rig.worker.spec = type("Spec", (), {"segment_prefix": "none-of-these."})()
    first, second = (Batch([rig.request(mv, i)], 1, 1, [], ["OUTPUT__0"]) for i in (1, 2))
    rig.answers.dispatched(mv, first)
    rig.answers.dispatched(mv, second)
    outputs = rig.outputs(np.full((1, 2), 5, np.float32))
    rig.answers.complete(mv, second, Executed(outputs, rig.worker))
    rig.answers.worker_gone(rig.worker)                  # copied out before its memory goes
    rig.answers.complete(mv, first, TorchpoolError(errors.INTERNAL, "crashed"))
    got = [rig.receive(), rig.receive()]
    assert (got[0]["id"], got[0]["ok"]) == (1, False)
    assert (got[1]["id"], values(got[1])[2]) == (2, [5, 5])


def test_a_client_cannot_release_what_was_lent_to_another_session(rig: Rig) -> None:
    """One map holds every lent output: a release names the range and its
    generation, and only the session it was lent to can give it back."""
    sessions = rig.sessions
    victim = sessions.sessions[sessions.hello({})["session"]]
    attacker = sessions.sessions[sessions.hello({})["session"]]
    # the victim is local: attached over a side channel (here a socket pair)
    victim.channel, client_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    mv = version()
    req = rig.request(mv, 1)
    req.session, req.output_shm = victim, True
    victim.in_flight = 1
    rows = np.arange(8192, dtype=np.float32).reshape(1, 8192)      # 32 KiB: lent, not inline
    # memory that is not the victim's own lending area is never lent: it goes as bytes
    outputs = rig.outputs(rows)
    rig.answers.complete(mv, Batch([req], 1, 1, [], ["OUTPUT__0"]), Executed(outputs, rig.worker))
    assert "shm" not in rig.receive()["outputs"][0] and victim.loans == 0
    deadline = time.monotonic() + 5              # its block goes back once the send is done
    while not rig.worker.releases and time.monotonic() < deadline:
        rig.answers.collect_finished_sends()
    assert rig.worker.releases == [list(outputs[0][3:6])]
    rig.worker.releases.clear()
    # the worker announced this segment as the victim's area (worker/lending.py)
    req = rig.request(mv, 2)
    req.session, req.output_shm = victim, True
    victim.in_flight = 1
    outputs = rig.outputs(rows)
    rig.answers.area_owner[outputs[0][3]] = victim.lend_id
    rig.answers.complete(mv, Batch([req], 1, 1, [], ["OUTPUT__0"]), Executed(outputs, rig.worker))
    segment, offset, nbytes, generation = rig.receive()["outputs"][0]["shm"]
    assert (segment, offset, nbytes) == tuple(outputs[0][3:6]) and victim.loans == 1
    # the attacker read the descriptor somehow: its releases free nothing
    assert rig.answers.release_lent(attacker, [[segment, offset, generation]]) == 1
    assert rig.answers.release_lent(attacker, [[segment, offset, generation + 1]]) == 1
    with pytest.raises(TorchpoolError) as bad:
        rig.answers.release_lent(attacker, [[segment, offset]])
    assert bad.value.code == errors.INVALID_ARG
    sessions.close(attacker)                        # its session closing gives back nothing of the victim's
    assert rig.worker.releases == [] and victim.loans == 1
    view = np.frombuffer(rig.worker_arena.segments[segment].buf, np.float32, 8192, offset)
    assert view[:3].tolist() == [0, 1, 2]
    assert rig.answers.release_lent(victim, [[segment, offset, generation]]) == 0
    assert rig.worker.releases == [list(outputs[0][3:6])] and victim.loans == 0
    # the victim's client got the (read-only) fd of that segment before the answer
    data, fds, _, _ = socket.recv_fds(client_end, 4096, 4)
    assert messages.unpack(data)["segments"][0]["segment"] == segment and len(fds) == 1
    assert os.fstat(fds[0]).st_size == rig.worker_arena.segments[segment].size
    for fd in fds:
        os.close(fd)
    sessions.close_all()
    client_end.close()
