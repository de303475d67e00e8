"""End to end: a gRPC client that opens many ModelStreamInfer streams, writes
requests on them and never reads an answer (issue 39, item 1) does not
lock out another gRPC caller, and what its connections hold is bounded.

The offender (tests/support/grpc_unread_streams.py) is a process of its
own; the new caller is tritonclient.grpc on a connection of its own. Each
HTTP/2 connection is one caller of the gateway (gateway/callers.py): the
gateway lets it open 2 × --gateway-max-in-flight-per-caller streams
(grpc.max_concurrent_streams), reads its streams' requests at most its
share ahead of their answers (callers.ReadAhead), and gives it its share
of the daemon (callers.FairShare).

With large answers (1 MiB) the offender's unread answers fill each
connection's HTTP/2 flow-control window, the gateway's writes on its
streams block and it stops reading their requests: a new caller on a
connection of its own is still answered.
"""
from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest

grpcclient = pytest.importorskip("tritonclient.grpc")

from ..support.daemon import ROOT, Daemon, free_tcp_port, wait_for  # noqa: E402

X = np.arange(16, dtype=np.float32)
PER_CALLER = 8                  # --gateway-max-in-flight-per-caller: 16 streams a connection
LARGE = 1 << 18                 # FP32 values of the offender's large requests (and answers): 1 MiB


@pytest.fixture
def daemon(small_repository: Path, tmp_path: Path) -> Iterator[Daemon]:
    http, grpc_port = free_tcp_port(), free_tcp_port()
    d = Daemon(small_repository, tmp_path, "--http-port", str(http), "--grpc-port", str(grpc_port),
               "--gateway-max-in-flight-per-caller", str(PER_CALLER)).start()
    d.http, d.grpc = http, grpc_port
    wait_for(lambda: _answered(d, 5.0) is not None, 30, "the gRPC endpoint")
    yield d
    assert d.stop() == 0, d.log()


def _count(d: Daemon) -> int:
    """Requests `identity` has run (the daemon's statistics, over HTTP)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{d.http}/v2/models/identity/stats", timeout=30) as r:
        return json.load(r)["model_stats"][0]["inference_count"]


def _answered(d: Daemon, timeout: float) -> "float | None":
    """A new caller's call, on a connection of its own: its seconds, or None
    if it failed."""
    t = grpcclient.InferInput("INPUT__0", [16], "FP32")
    t.set_data_from_numpy(X)
    with grpcclient.InferenceServerClient(f"127.0.0.1:{d.grpc}",
                                          channel_args=[("grpc.use_local_subchannel_pool", 1)]) as c:
        started = time.perf_counter()
        try:
            result = c.infer("identity", [t], client_timeout=timeout)
        except grpcclient.InferenceServerException:
            return None
        took = time.perf_counter() - started
    assert result.as_numpy("OUTPUT__0").tolist() == X.tolist()
    return took


class Offender:
    """tests/support/grpc_unread_streams.py, running until closed."""

    def __init__(self, d: Daemon, connections: int, streams: int, requests: int, elements: int = 16) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.grpc_unread_streams", str(d.grpc), str(connections),
             str(streams), str(requests), str(elements)],
            cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.refused = 0            # streams the gateway refused, as the offender saw them
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.strip() == "refused":
                self.refused += 1

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        self.proc.stdin.close()                     # it cancels its streams and exits
        assert self.proc.wait(30) == 0
        self._reader.join(30)


def test_a_new_caller_is_answered_beside_streams_never_read(daemon: Daemon) -> None:
    """4 connections × 50 streams × 10 requests, no answer read: each
    connection gets 2 × per-caller streams (16) and the others wait in the
    offender's client; a new caller is answered while the gateway works
    through the open streams' requests and once it is done, with the
    offender's streams still open."""
    base = _count(daemon)
    offender = Offender(daemon, 4, 50, 10)
    opened = 4 * 2 * PER_CALLER
    try:
        # under way: the gateway has read and run a good part of them
        wait_for(lambda: _count(daemon) - base >= opened * 10 // 4, 60, "the offender's first requests")
        during = _answered(daemon, 10.0)
        assert during is not None, "a new caller got no answer beside the offender's streams"
        # the answers are small: grpc takes them all into the offender's
        # buffers, so the gateway runs every request of the open streams
        wait_for(lambda: _count(daemon) - base >= opened * 10 + 1, 60, "the open streams' requests")
        after = _answered(daemon, 10.0)
        assert after is not None, "a new caller got no answer once the offender's requests had run"
        assert offender.alive()
        # the streams past each connection's limit never started
        assert _count(daemon) - base == opened * 10 + 2
        print(f"a new caller beside {opened} open streams never read: {during * 1e3:.1f} ms while "
              f"their requests ran, {after * 1e3:.1f} ms after")
    finally:
        offender.close()


def test_a_new_caller_is_answered_beside_unread_streams_whose_answers_fill_the_window(daemon: Daemon) -> None:
    """4 connections × 40 streams × 10 requests of 1 MiB, no answer read:
    the answers fill each connection's flow-control window, the gateway's
    writes block, and it holds at most its read-ahead (per-caller + one of
    each open stream) per connection, read and run, unwritten. A new caller
    on a connection of its own is answered, 20 s allowed, while the
    offender's requests run and once the gateway holds all it will read,
    the offender's streams open all along."""
    base = _count(daemon)
    opened = 4 * 2 * PER_CALLER                 # streams the gateway opens: 16 a connection
    held = 4 * (PER_CALLER + 2 * PER_CALLER)    # what its read-ahead lets it hold unwritten
    offender = Offender(daemon, 4, 40, 10, LARGE)
    try:
        wait_for(lambda: _count(daemon) - base >= 4 * PER_CALLER, 120, "the offender's first requests")
        during = _answered(daemon, 20.0)
        assert during is not None, "a new caller got no answer beside the offender's large unread answers"
        wait_for(lambda: _count(daemon) - base - 1 >= held, 120, "the requests the gateway holds unwritten")
        after = _answered(daemon, 20.0)
        assert after is not None, "a new caller got no answer once the gateway held the unwritten answers"
        assert offender.alive()
        ran = _count(daemon) - base - 2
        # not every request of the open streams ran: their answers were not
        # all written (their writes blocked), so the gateway stopped reading
        assert ran < opened * 10, f"all {ran} of the open streams' requests ran: no write blocked"
        print(f"a new caller beside {opened} open streams of 1 MiB answers never read: "
              f"{during * 1e3:.1f} ms while their requests ran, {after * 1e3:.1f} ms with "
              f"{ran} of their {opened * 10} requests run")
    finally:
        offender.close()


def test_one_connection_opens_at_most_its_streams(daemon: Daemon) -> None:
    """4 channels of one process with the same options are one connection
    (grpc shares it): of their 4 × 50 streams the gateway opens
    2 × per-caller (16), and a new caller on a connection of its own is
    answered."""
    base = _count(daemon)
    offender = Offender(daemon, -4, 50, 10)
    opened = 2 * PER_CALLER
    try:
        wait_for(lambda: _count(daemon) - base >= opened * 10, 60, "the open streams' requests")
        assert _answered(daemon, 10.0) is not None
        assert offender.alive()
        assert _count(daemon) - base == opened * 10 + 1
    finally:
        offender.close()


@pytest.fixture
def capped(small_repository: Path, tmp_path: Path) -> Iterator[Daemon]:
    http, grpc_port = free_tcp_port(), free_tcp_port()
    d = Daemon(small_repository, tmp_path, "--http-port", str(http), "--grpc-port", str(grpc_port),
               "--gateway-max-in-flight-per-caller", str(PER_CALLER),
               "--grpc-max-streams-per-peer", str(PER_PEER)).start()
    d.http, d.grpc = http, grpc_port
    wait_for(lambda: _answered(d, 5.0) is not None, 30, "the gRPC endpoint")
    yield d
    assert d.stop() == 0, d.log()


# --grpc-max-streams-per-peer in `capped`: fewer than one connection may open
# (16), so no connection fills with streams kept open, and each of the
# offender's other streams gets its answer (a refusal) instead of waiting in
# its client for a place on its connection
PER_PEER = 12


def test_a_peers_streams_on_all_its_connections_are_capped(capped: Daemon) -> None:
    """4 connections × 50 streams × 10 requests from one user (a uid on this
    host): each connection may open 16 streams, but the user holds at most
    12 open on all four; the others are refused RESOURCE_EXHAUSTED as they
    open (not queued), so only the 12 streams' requests run. A unary call of the
    same user is still answered, and a stream opened once the offender
    ends is served."""
    base = _count(capped)
    offender = Offender(capped, 4, 50, 10)
    try:
        wait_for(lambda: _count(capped) - base >= PER_PEER * 10, 60, "the open streams' requests")
        # the streams past the cap are refused (how many the offender's client
        # has opened by now is its own affair: grpc queues them per connection)
        wait_for(lambda: offender.refused >= 1, 60, "a refusal of a stream past the cap")
        assert _answered(capped, 10.0) is not None
        assert offender.alive()
        assert _count(capped) - base == PER_PEER * 10 + 1
        assert offender.refused <= 4 * 50 - PER_PEER
    finally:
        offender.close()
    with grpcclient.InferenceServerClient(f"127.0.0.1:{capped.grpc}") as c:
        answers: list[object] = []
        c.start_stream(callback=lambda result, error: answers.append(error or result))
        t = grpcclient.InferInput("INPUT__0", [16], "FP32")
        t.set_data_from_numpy(X)
        c.async_stream_infer("identity", [t])
        wait_for(lambda: answers, 30, "the stream's answer")
        c.stop_stream()
    assert answers[0].as_numpy("OUTPUT__0").tolist() == X.tolist()
