"""MultiClient's choices, against real ZeroMQ peers the test runs (ROUTERs
that answer every request, or none): sequences stay on one daemon, requests
alternate, a daemon with no socket file is skipped whatever `retries` says,
a call past its deadline is not sent elsewhere, and errors name the daemons."""
from __future__ import annotations

import threading
from pathlib import Path
from typing import Iterator

import msgpack
import numpy as np
import pytest

from torchpool.client import Client, MultiClient, NoAnswer
from torchpool.protocol import errors
from torchpool.protocol.errors import InferenceError

from .test_client_channel import Peer

X = {"INPUT0": np.zeros((1, 16), np.float32)}


class AnsweringPeer(Peer):
    """A peer that answers every request at once (infer: no outputs;
    control calls: True), and remembers what it was asked."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.seen: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self.sock.poll(20):
                continue
            ident, raw, *_ = self.sock.recv_multipart()
            header = msgpack.unpackb(raw, raw=False)
            self.seen.append(header)
            reply = {"v": 1, "id": header["id"], "ok": True, "outputs": [], "result": True}
            self.sock.send_multipart([ident, msgpack.packb(reply, use_bin_type=True)])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        super().close()


@pytest.fixture
def answering(tmp_path: Path) -> Iterator[list[AnsweringPeer]]:
    peers = [AnsweringPeer(f"ipc://{tmp_path / name}.sock") for name in ("one", "two")]
    yield peers
    for p in peers:
        p.close()


def infers(peer: AnsweringPeer) -> list[dict]:
    return [h for h in peer.seen if h["op"] == "infer"]


def test_a_list_of_urls_makes_a_multiclient_and_requests_alternate(answering, tmp_path: Path) -> None:
    addresses = [f"ipc://{tmp_path / 'one'}.sock", f"ipc://{tmp_path / 'two'}.sock"]
    with Client(addresses, timeout=10, local=False) as c:
        assert isinstance(c, MultiClient) and list(c.clients) == addresses
        for _ in range(6):
            assert c.infer("m", X) == {}
        assert [len(infers(p)) for p in answering] == [3, 3]
        assert c.server_ready() and c.model_ready("m")


def test_a_sequence_stays_on_the_daemon_that_saw_its_start(answering, tmp_path: Path) -> None:
    addresses = [f"ipc://{tmp_path / 'one'}.sock", f"ipc://{tmp_path / 'two'}.sock"]
    with Client(addresses, timeout=10, local=False) as c:
        for step in range(4):                       # two sequences and plain calls, interleaved
            for seq in (11, "twelve"):
                c.infer("m", X, sequence_id=seq, sequence_start=step == 0, sequence_end=step == 3)
            c.infer("m", X)
    for seq in (11, "twelve"):
        where = [i for i, p in enumerate(answering) for h in infers(p)
                 if (h.get("sequence") or {}).get("id") == seq]
        assert len(where) == 4 and len(set(where)) == 1, (seq, where)


def test_a_missing_socket_file_is_skipped_even_without_retries(answering, tmp_path: Path) -> None:
    missing = f"ipc://{tmp_path / 'nobody'}.sock"
    with Client([missing, f"ipc://{tmp_path / 'one'}.sock"], timeout=10, local=False) as c:
        for _ in range(4):
            assert c.infer("m", X) == {}           # never sent to the missing one: moved freely
        down = next(d for d in c.daemons() if d["url"] == missing)
        assert not down["up"] and "the socket file does not exist" in down["why"]
    assert len(infers(answering[0])) == 4


def test_no_daemon_at_all_names_them_all(tmp_path: Path) -> None:
    addresses = [f"ipc://{tmp_path / 'a'}.sock", f"ipc://{tmp_path / 'b'}.sock"]
    with Client(addresses, timeout=10, local=False) as c:
        with pytest.raises(InferenceError) as exc:
            c.infer("m", X)
    assert exc.value.code == errors.UNAVAILABLE
    assert all(a in exc.value.message for a in addresses), exc.value.message


def test_a_call_past_its_deadline_is_not_sent_elsewhere(answering, tmp_path: Path) -> None:
    silent_url = f"ipc://{tmp_path / 'silent'}.sock"
    silent = Peer(silent_url)
    try:
        with Client([silent_url, f"ipc://{tmp_path / 'one'}.sock"], timeout=0.3, retries=3,
                    local=False) as c:
            with pytest.raises(NoAnswer) as exc:
                c.infer("m", X)                     # the first pick: the silent one
            assert exc.value.code == errors.DEADLINE_EXCEEDED
            assert infers(answering[0]) == []      # it may still run there: not repeated
    finally:
        silent.close()


def test_bad_arguments_are_refused(tmp_path: Path) -> None:
    url = f"ipc://{tmp_path / 'a'}.sock"
    with pytest.raises(ValueError, match="each daemon once"):
        MultiClient([url, url])
    with pytest.raises(ValueError, match="non-empty list"):
        MultiClient([])
    with pytest.raises(ValueError, match="retries"):
        MultiClient([url], retries=-1)
    with pytest.raises(ValueError, match="expected a ZeroMQ address"):
        Client(["not a url"])
