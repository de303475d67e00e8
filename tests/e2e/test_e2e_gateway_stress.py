"""One offender beside honest HTTP and gRPC callers of the gateway (issue 32,
item 6): the honest callers' p99 latency with the offender must stay within
3x of their p99 alone.

The gateway serves every HTTP connection and gRPC call on one event loop;
before, a 30 MiB JSON body held that loop for 2.6 s and 4M empty BYTES
elements for 1.4 s, and every other caller waited. The offender
(support/gateway_offender.py, its own niced process) sends those over and
over: their parsing is the helper process's (offload.py), their answers are
made a chunk per turn of the loop (chunks.py). Measured as the hostile
stress test is (test_e2e_stress_hostile.py): phases alone and beside the
offender alternate, each side's p99 pooled over them, a 1 ms floor, and a
ratio over the bound measured once more.
"""
from __future__ import annotations

import gc
import http.client
import json
import multiprocessing
import os
import time
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest

grpcclient = pytest.importorskip("tritonclient.grpc")

from ..support.daemon import Daemon, free_tcp_port, wait_for  # noqa: E402
from ..support.gateway_offender import ELEMENTS, offend_gateway, payloads  # noqa: E402
from ..support.http_gateway import gateway_pid  # noqa: E402
from ..support.threads import in_threads  # noqa: E402

REQUESTS = 150                   # per honest caller and phase
PAIRS = 2
BOUND = 3.0


@pytest.fixture(scope="module")
def served(small_repository: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    http, grpc_port = free_tcp_port(), free_tcp_port()
    d = Daemon(small_repository, tmp_path_factory.mktemp("gateway_stress"), "--http-port", str(http),
               "--grpc-port", str(grpc_port)).start()
    d.http, d.grpc = http, grpc_port
    d.gateway = wait_for(lambda: gateway_pid(d), 30, "the gateway process")
    yield d
    assert gateway_pid(d) == d.gateway, "the gateway was restarted"
    assert d.stop() == 0, d.log()


def honest_run(d: Daemon) -> tuple[list[float], int]:
    """Two HTTP and two gRPC callers, each on its own connection: every
    latency (seconds) and the number of wrong answers."""

    def http_caller(i: int) -> tuple[list[float], int]:
        x = np.full(ELEMENTS, float(i), np.float32)
        body = json.dumps({"inputs": [{"name": "INPUT__0", "datatype": "FP32", "shape": [ELEMENTS],
                                       "data": x.tolist()}]}).encode()
        latencies, wrong = [], 0
        conn = http.client.HTTPConnection("127.0.0.1", d.http, timeout=60)
        try:
            for _ in range(REQUESTS):
                start = time.perf_counter()
                conn.request("POST", "/v2/models/identity/infer", body=body)
                answer = conn.getresponse()
                doc = json.loads(answer.read())
                latencies.append(time.perf_counter() - start)
                wrong += answer.status != 200 or doc["outputs"][0]["data"] != x.tolist()
        finally:
            conn.close()
        return latencies, wrong

    def grpc_caller(i: int) -> tuple[list[float], int]:
        x = np.full(ELEMENTS, float(i), np.float32)
        latencies, wrong = [], 0
        with grpcclient.InferenceServerClient(f"127.0.0.1:{d.grpc}",
                                              channel_args=[("grpc.use_local_subchannel_pool", 1)]) as c:
            t = grpcclient.InferInput("INPUT__0", [ELEMENTS], "FP32")
            t.set_data_from_numpy(x)
            for _ in range(REQUESTS):
                start = time.perf_counter()
                y = c.infer("identity", [t]).as_numpy("OUTPUT__0")
                latencies.append(time.perf_counter() - start)
                wrong += not np.array_equal(y, x)
        return latencies, wrong

    gc.disable()                    # this process's collections are not the gateway's doing
    try:
        results = in_threads(4, lambda i: (http_caller if i < 2 else grpc_caller)(i))
    finally:
        gc.enable()
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return [v for latencies, _ in results for v in latencies], sum(wrong for _, wrong in results)


def p99(values: list[float]) -> float:
    return float(np.percentile(values, 99))


def test_honest_callers_keep_their_latency_beside_a_heavy_offender(served: Daemon, tmp_path: Path) -> None:
    honest_run(served)                                  # warm-up: connections, caches
    ctx = multiprocessing.get_context("spawn")
    manager = ctx.Manager()
    counts = manager.dict()
    stop = str(tmp_path / "stop")
    offender = ctx.Process(target=offend_gateway, args=(served.http, served.grpc, payloads(), stop, counts))
    offender.start()
    try:
        # its first answer: the payloads are made, the helper process is up
        wait_for(lambda: any(k.startswith("http") for k in counts.keys()) or not offender.is_alive(), 180,
                 "the offender's first answer")
        assert offender.is_alive(), "the offender died"
        ratios = []
        for _ in range(2):
            alone: list[float] = []
            beside: list[float] = []
            for _ in range(PAIRS):
                # alone: the offender pauses once its request in hand is answered
                Path(stop + ".pause").touch()
                wait_for(lambda: counts.get("idle"), 120, "the offender to pause")
                a, lost_a = honest_run(served)
                os.unlink(stop + ".pause")
                wait_for(lambda: counts.get("idle") is False, 30, "the offender to go on")
                b, lost_b = honest_run(served)
                assert lost_a == lost_b == 0
                alone += a
                beside += b
            ratios.append(p99(beside) / max(p99(alone), 1e-3))
            print(f"p99 alone {p99(alone) * 1e3:.2f} ms, beside the offender {p99(beside) * 1e3:.2f} ms "
                  f"({ratios[-1]:.2f}x); offender: {dict(counts)}")
            if ratios[-1] <= BOUND:
                break
        assert min(ratios) <= BOUND, f"honest p99 grew {ratios} x beside the offender"
        seen = dict(counts)
    finally:
        offender.kill()                 # in the middle of a request: the gateway copes with that too
        offender.join(30)
        manager.shutdown()
    # its 30 MiB JSON answered (as JSON), its strings refused by the daemon (identity takes FP32)
    assert seen.get("http 200", 0) >= 1 and seen.get("http 400", 0) >= 1, seen
    assert served.proc.poll() is None
