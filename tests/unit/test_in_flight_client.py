"""Who a request counts against (--max-in-flight-per-client): a local process, or a tcp connection."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import zmq

from torchpool.broker.frontend import InFlight
from torchpool.protocol.errors import TorchpoolError


def received(url: str, bind: str) -> tuple[zmq.Socket, bytes, zmq.Frame, zmq.Context]:
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.bind(bind)
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(url if url else router.getsockopt(zmq.LAST_ENDPOINT).decode())
    dealer.send(b"header")
    assert router.poll(10000)
    identity, frame = router.recv_multipart(copy=False)
    dealer.close(0)
    return router, identity.bytes, frame, ctx


def test_an_ipc_peer_is_its_process(tmp_path: Path) -> None:
    url = f"ipc://{tmp_path}/s"
    sock, identity, frame, ctx = received(url, url)
    try:
        assert InFlight.client_of(sock, identity, frame, local=True) == ("pid", os.getpid())
    finally:
        sock.close(0)
        ctx.term()


def test_a_tcp_peer_is_its_connection() -> None:
    sock, identity, frame, ctx = received("", "tcp://127.0.0.1:*")
    try:
        assert InFlight.client_of(sock, identity, frame, local=False) == (sock, identity)
    finally:
        sock.close(0)
        ctx.term()


def test_the_limit_counts_a_process_once_over_its_connections() -> None:
    in_flight = InFlight(2)

    class Req:
        def __init__(self, client: object) -> None:
            self.client = client

    process = ("pid", 1234)
    first, second = Req(process), Req(process)
    in_flight.add(first)
    in_flight.add(second)
    with pytest.raises(TorchpoolError, match=r"this client \(process 1234\) has 2 requests in flight"):
        in_flight.check(process)
    in_flight.check(("sock", b"other"))                # another client is not affected
    in_flight.done(first)
    in_flight.done(first)                              # idempotent
    in_flight.check(process)
    assert len(in_flight) == 1
