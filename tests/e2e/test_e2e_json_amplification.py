"""End to end: JSON documents that amplify in memory (issue 39, item 3).

60 MiB of `[],` in a request's JSON is 20M empty lists once json.loads has
made them (about 72 bytes each, all tracked by the garbage collector): it
took the gateway's parsing helper from 40 to 1,603 MiB and 44 s before a
400. Now the arrays and objects are counted, and their nesting measured, by
one walk in C before anything is made of the document: it is refused at
once, with a 400 that names the limit; JSON nested deeper than 100 levels is
refused too (Triton's limit). What honest callers send still passes.

Memory is read from /proc/<pid>/status (VmHWM) of the gateway and of its
helper process; the gateway is the same process at the end and serves.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest

from ..support.daemon import Daemon, descendants, free_tcp_port, wait_for
from ..support.http_gateway import error_of, gateway_pid, memory, request, reset_peak

httpclient = pytest.importorskip("tritonclient.http")

MiB = 1 << 20
IDENTITY = "/v2/models/identity/infer"
BODY = 60 * MiB
MAX_CONTAINERS = 1 << 20
MAX_DEPTH = 100


@pytest.fixture(scope="module")
def served(small_repository: Path, tmp_path_factory: pytest.TempPathFactory):
    http = free_tcp_port()
    d = Daemon(small_repository, tmp_path_factory.mktemp("json_amplification"), "--http-port", str(http)).start()
    d.http = http
    d.gateway = wait_for(lambda: gateway_pid(d), 30, "the gateway process")
    # a JSON document over the helper's threshold (64 KiB): the helper starts
    x = np.arange(40000, dtype=np.float32)
    assert_identity(d, x)
    d.helper = wait_for(lambda: helper_pid(d.gateway), 30, "the gateway's parsing helper")
    yield d
    assert gateway_pid(d) == d.gateway, "the gateway was restarted"
    assert d.stop() == 0, d.log()


def helper_pid(gateway: int) -> int:
    for pid in descendants(gateway):
        try:
            if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes():
                return pid
        except OSError:
            continue
    return 0


def infer_body(data: bytes, shape: str = "[1]") -> bytes:
    return (b'{"inputs":[{"name":"INPUT__0","datatype":"FP32","shape":' + shape.encode()
            + b',"data":' + data + b'}]}')


def assert_identity(d: Daemon, x: np.ndarray) -> None:
    """x through the identity model (1-D) as a JSON request (raw HTTP), its
    data nested as x's shape."""
    body = infer_body(json.dumps(x.tolist()).encode(), json.dumps([x.size]))
    status, _, answer = request(d.http, "POST", IDENTITY, body)
    assert status == 200, answer[:300]
    out = json.loads(answer)["outputs"][0]
    assert out["shape"] == [x.size]
    np.testing.assert_array_equal(np.array(out["data"], np.float32), x.ravel())


def assert_tritonclient_serves(d: Daemon) -> None:
    x = np.arange(16, dtype=np.float32)
    with httpclient.InferenceServerClient(f"127.0.0.1:{d.http}") as c:
        t = httpclient.InferInput("INPUT__0", [16], "FP32")
        t.set_data_from_numpy(x, binary_data=False)
        np.testing.assert_array_equal(c.infer("identity", [t]).as_numpy("OUTPUT__0"), x)


def test_sixty_mib_of_empty_lists_is_refused_at_once_within_4x_the_body(served: Daemon) -> None:
    """Before: a 400 (for the data's shape) after 25.8 s, the helper at
    +1,564 MiB. Now a 400 naming the limit in about 0.4 s, the helper at
    +120 MiB and the gateway at +180 MiB (its body, the copy for the helper,
    pickled), each within 4x the body."""
    body = infer_body(b"[" + b"[]," * ((BODY - 100) // 3) + b"[]]")
    assert BODY - 200 < len(body) <= BODY
    gateway, helper = served.gateway, served.helper
    reset_peak(gateway)
    reset_peak(helper)
    base_gateway, base_helper = memory(gateway), memory(helper)
    started = time.perf_counter()
    status, _, answer = request(served.http, "POST", IDENTITY, body, timeout=120)
    took = time.perf_counter() - started
    grew_gateway = memory(gateway, "VmHWM") - base_gateway
    grew_helper = memory(helper, "VmHWM") - base_helper
    print(f"{len(body) / MiB:.0f} MiB of '[],': {status} in {took:.2f} s; peak RSS gateway "
          f"+{grew_gateway / MiB:.0f} MiB, helper +{grew_helper / MiB:.0f} MiB")
    assert (status, error_of(answer)) == (400, (
        f"the request JSON has more than {MAX_CONTAINERS} arrays and objects (the limit: each "
        f"takes about 80 bytes as a Python object): send tensor data as flat arrays, or as "
        f"binary data"))
    assert grew_gateway < 4 * len(body)
    assert grew_helper < 4 * len(body)
    assert helper_pid(gateway) == helper, "the helper died"
    assert_tritonclient_serves(served)


@pytest.mark.parametrize("padding", [0, 100 * 1024], ids=["in the loop", "in the helper"])
def test_nesting_deeper_than_100_is_refused(served: Daemon, padding: int) -> None:
    """Triton's limit on nesting; the same answer for a small document (parsed
    in the gateway's loop) and a large one (parsed in the helper)."""
    pad = b' ' * padding
    deep = b"[" * (MAX_DEPTH - 3) + b"1.0" + b"]" * (MAX_DEPTH - 3)       # 3 levels above "data"
    status, _, answer = request(served.http, "POST", IDENTITY, infer_body(deep + pad))
    assert status == 200, answer[:300]                # 100 levels: taken (nested data is flattened)
    assert json.loads(answer)["outputs"][0]["data"] == [1.0]
    status, _, answer = request(served.http, "POST", IDENTITY, infer_body(b"[" + deep + b"]" + pad))
    assert (status, error_of(answer)) == (400, (
        f"JSON nesting depth exceeds maximum allowed limit ({MAX_DEPTH}): the request JSON nests deeper "
        f"at byte {len(infer_body(b'')) - 3 + MAX_DEPTH - 3}"))
    assert_tritonclient_serves(served)


def test_honest_json_documents_still_pass(served: Daemon) -> None:
    """Flat data of 2M floats (about 20 MiB of JSON), and nested data of
    100,000 rows (100,001 arrays) still pass."""
    assert_identity(served, np.arange(2_000_000, dtype=np.float32) / 7)
    assert_identity(served, np.arange(200_000, dtype=np.float32).reshape(100_000, 2))
    assert_tritonclient_serves(served)
