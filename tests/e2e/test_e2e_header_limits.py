"""Attack: huge request headers that stall the broker's loop (issue 32, item 6).

Decoding a header runs on the broker's one thread: 12 MiB of msgpack empty
maps took it 1.7 s on the development VM, and one client sending 5 of them
stalled every remote caller for seconds. Now a header over --max-header-bytes
(1 MiB by default: 16 tensors at the inline limit) is refused with
RESOURCE_EXHAUSTED naming the limit before any of it is decoded.

The honest callers go through the broker (remote, no shared memory or direct
path) and measure their latency alone, then beside an offender process that
sends five 12 MiB headers at a time, again and again; their p99 must stay
within 3x of alone (pooled over alternating phases, as the stress test does).
"""
from __future__ import annotations

import gc
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator, Optional

import numpy as np
import pytest

from torchpool.client import Client
from torchpool.protocol import errors, messages

from ..support.daemon import Daemon, RawConnection, free_tcp_port, wait_for
from ..support.models.basic import write_plus_one
from ..support.threads import in_threads

HONEST = 2
REQUESTS = 150                   # per honest caller and phase
PAIRS = 2                        # alternating phases alone / beside the offender, pooled
HUGE = 12 << 20                  # the offender's header: 12 MiB of empty maps
READ_ALLOWANCE_S = 0.020         # what reading two such headers off a socket may add
X = np.arange(64, dtype=np.float32)

# The offender, in a process of its own (no interpreter lock shared with the
# honest callers) and niced, as the stress test's: on a 2-core machine its own
# loop (60 MiB sent a round) would take a core from the honest callers
# whatever the daemon did; what it makes the daemon do runs at the daemon's
# priority and is measured. Niced, it sends slowly: each honest phase lasts
# until it has had one whole round answered (`.round` beside the stop file;
# `.started` once it runs, `.answers`, their count, at the end).
OFFENDER = r"""
import os, sys, msgpack, zmq
url, stop, size = sys.argv[1], sys.argv[2], int(sys.argv[3])
os.nice(19)
header = msgpack.packb({"v": 1, "op": "infer", "id": 1, "model": "plus_one", "version": "",
                        "inputs": [{}] * (size - 64), "outputs": None})
s = zmq.Context.instance().socket(zmq.DEALER)
s.connect(url)
answers = 0
open(stop + ".started", "w").close()
while not os.path.exists(stop):
    for _ in range(5):
        s.send(header)
    for _ in range(5):
        if s.poll(60000):
            s.recv()
            answers += 1
    open(stop + ".round", "w").close()
open(stop + ".answers", "w").write(str(answers))
"""


@pytest.fixture(scope="module")
def header_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    root = tmp_path_factory.mktemp("header_repo")
    write_plus_one(root)
    d = Daemon(root, tmp_path_factory.mktemp("header"), tcp_port=free_tcp_port()).start()
    yield d
    assert d.stop() == 0, d.log()


def test_a_header_over_the_limit_is_refused_unread(header_daemon: Daemon) -> None:
    limit = messages.MAX_HEADER_BYTES
    with RawConnection(header_daemon.url) as raw:
        reply, frames = raw.call(RawConnection.pack({"v": 1, "op": "server_live", "id": 1, "pad": b"p" * limit}))
        assert reply["ok"] is False and frames == []
        assert reply["error"]["code"] == errors.RESOURCE_EXHAUSTED
        assert f"({limit} bytes: --max-header-bytes)" in reply["error"]["message"]
        # at the limit: decoded (and answered for what it is)
        padding = limit - len(RawConnection.pack({"v": 1, "op": "server_live", "id": 2, "pad": b""})) - 4
        reply, _ = raw.call(RawConnection.pack({"v": 1, "op": "server_live", "id": 2, "pad": b"p" * padding}))
        assert reply == {"v": 1, "id": 2, "ok": True, "result": True}
    # a tensor at the inline limit travels in the header, as clients send it
    with Client(header_daemon.urls[1], timeout=30, local=False) as c:
        big = np.ones(messages.INLINE_LIMIT // 4, np.float32)
        assert c.infer("plus_one", {"INPUT__0": big})["OUTPUT__0"][0] == 2.0


def _honest_run(url: str, until: Optional[Path] = None) -> tuple[list[float], int]:
    """Every honest caller's latencies (s) and its wrong answers: REQUESTS
    each, and on until the file `until` exists. A call that gets no answer in
    30 s (the loop stalled that long) fails the test."""
    def caller(i: int) -> tuple[list[float], int]:
        latencies, wrong = [], 0
        with Client(url, timeout=30, local=False) as c:
            while len(latencies) < REQUESTS or (until is not None and not until.exists()):
                start = time.perf_counter()
                y = c.infer("plus_one", {"INPUT__0": X})["OUTPUT__0"]
                latencies.append(time.perf_counter() - start)
                wrong += not bool(np.all(y == X + 1))
        return latencies, wrong
    gc.disable()                 # this process's collections are not the daemon's doing
    try:
        results = in_threads(HONEST, caller)
    finally:
        gc.enable()
    failed = [repr(r) for r in results if isinstance(r, BaseException)]
    assert not failed, failed
    return [v for latencies, _ in results for v in latencies], sum(wrong for _, wrong in results)


def test_huge_headers_do_not_stall_honest_callers(header_daemon: Daemon, tmp_path: Path) -> None:
    url = header_daemon.urls[1]                         # tcp: remote callers, through the broker
    pid = header_daemon.pid()
    _honest_run(url)                                    # warm-up
    alone: list[float] = []
    beside: list[float] = []
    answers = 0
    for pair in range(PAIRS):
        latencies, wrong = _honest_run(url)
        assert wrong == 0
        alone += latencies
        stop = tmp_path / f"stop{pair}"
        offender = subprocess.Popen([sys.executable, "-c", OFFENDER, url, str(stop), str(HUGE)])
        try:
            wait_for(lambda: os.path.exists(f"{stop}.started") or offender.poll() is not None, 60,
                     "the offender to start")
            latencies, wrong = _honest_run(url, until=Path(f"{stop}.round"))   # a whole round beside it
            assert wrong == 0
            beside += latencies
        finally:
            stop.touch()
            assert offender.wait(120) == 0
        answers += int(Path(f"{stop}.answers").read_text())
    p99_alone, p99_beside = np.percentile(alone, 99), np.percentile(beside, 99)
    print(f"honest p99 alone {p99_alone * 1e3:.2f} ms, beside 12 MiB headers {p99_beside * 1e3:.2f} ms "
          f"(max {max(beside) * 1e3:.1f} ms); the offender got {answers} answers")
    assert answers > 0
    # refused unread, but read off the socket all the same: ~10 ms a 12 MiB header here,
    # which a call arriving meanwhile waits for, however small p99 alone is
    assert p99_beside <= 3 * p99_alone + READ_ALLOWANCE_S, (p99_alone, p99_beside)
    assert header_daemon.pid() == pid and header_daemon.proc.poll() is None
